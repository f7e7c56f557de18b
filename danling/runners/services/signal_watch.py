"""A second stop signal ends the process even while the main thread is stuck outside Python code.

Python runs a signal handler on the main thread, between two bytecodes. A main thread blocked in
C code that does not return on a signal (a hung collective, a device synchronisation, a C++ wait)
runs none: the first SIGTERM (the graceful stop) and the second (which should end the run at
once) both wait for a call that may never return. The C-level handler still writes the number of
every signal it catches to the wakeup file descriptor (`signal.set_wakeup_fd`);
[`SignalWatch`][danling.runners.services.signal_watch.SignalWatch] reads it on a thread. When a
stop signal arrives for the second time and the main thread's handler has not put the handlers
back within `grace` seconds (it would, then end the process), the thread ends the process as a
watchdog does: the main thread's stack, one ERROR line, `os._exit(128 + signal number)`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterable

from .watchdog import end_run

__all__ = ["SignalWatch"]

# The write end of the watch's socket while it is the wakeup descriptor (-1: none): forked
# children (data-loader workers) drop it, or their signals would count as the parent's.
_active_fd = -1


def _forget_in_child() -> None:
    global _active_fd
    if _active_fd != -1:
        _active_fd = -1
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(-1)


os.register_at_fork(after_in_child=_forget_in_child)


class SignalWatch:
    """Thread that ends the process on the second stop signal when the main thread cannot.

    Args:
        signals: The stop signals (the supervisor's).
        handled: Whether the main thread has taken a stop request (said once the first signal
            was not taken within `grace`, so that the user knows a second one is needed).
        logger: Where the message goes.
        grace: Seconds the main thread's own handler is given to act on the second signal.
    """

    def __init__(
        self, signals: Iterable[int], handled: Callable[[], bool], logger: logging.Logger, grace: float = 2.0
    ) -> None:
        self.signals = frozenset(int(sig) for sig in signals)
        self.handled, self.logger, self.grace = handled, logger, grace
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._stopped = threading.Event()

    def start(self) -> bool:
        """Become the wakeup descriptor and start the thread (main thread only).

        Returns `False`, changing nothing, when another wakeup descriptor is in place (an asyncio
        loop's, say): replacing it would take its signals away.
        """
        global _active_fd
        reader, writer = socket.socketpair()
        writer.setblocking(False)  # the C handler must never block on a full buffer
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            reader.close()
            writer.close()
            return False
        self._sockets, _active_fd = (reader, writer), writer.fileno()
        threading.Thread(target=self._run, args=(reader,), name="danling-signal-watch", daemon=True).start()
        return True

    def stop(self) -> None:
        """Give the wakeup descriptor back and let the thread end (main thread only)."""
        global _active_fd
        self._stopped.set()
        if self._sockets is None:
            return
        reader, writer = self._sockets
        self._sockets = None
        current = signal.set_wakeup_fd(-1)
        if current != writer.fileno():  # someone replaced it since: leave theirs in place
            signal.set_wakeup_fd(current)
        _active_fd = -1
        writer.close()  # the thread reads end-of-file and closes the reader

    def _run(self, reader: socket.socket) -> None:
        count = 0
        try:
            while data := reader.recv(64):
                for signum in data:
                    if signum not in self.signals:
                        continue
                    count += 1
                    # The main thread's handler gets `grace` seconds to act: it takes the first
                    # signal (`handled`) and, on the second, puts the handlers back (`stop`).
                    if self._stopped.wait(self.grace):
                        return
                    name = signal.Signals(signum).name
                    if count == 1:
                        if not self.handled():
                            self.logger.warning(
                                "received %s, but the main thread is stuck outside Python code, where it runs "
                                "no signal handler; sending it again ends the process",
                                name,
                            )
                        continue
                    message = (
                        f"received {name} again while the main thread is stuck outside Python code, "
                        f"where it runs no signal handler; ending the process with exit code {128 + signum}"
                    )
                    end_run(message, 128 + signum, self.logger)
                    return
        except OSError:
            pass
        finally:
            reader.close()
