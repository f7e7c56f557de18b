"""Process-level services for a training run: graceful signals, heartbeats and GC pacing.

[`RunnerSupervisor`][danling.runners.services.supervisor.RunnerSupervisor] never touches the model or the
loop itself. Its signal handlers only record the request; the training loop polls
`stop_requested` between steps, finishes the step it is in, saves a shutdown checkpoint, closes,
and exits with `exit_code` (128 + signal number, the shell convention).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import FrameType
from typing import Any

from danling.checkpoint.manifest import atomic_write_text

from .signal_watch import SignalWatch

__all__ = ["RunnerSupervisor", "StartupFreeze"]

_DEFAULT_HEARTBEAT_INTERVAL = 60.0


class StartupFreeze:
    """Objects alive at a runner's construction kept out of the garbage collector until `release`.

    Python's full collections walk every tracked object: right after `import torch` that is about
    a million of them, and setting up the optimizer, the model and torch's lazily imported parts
    (`torch._dynamo`, imported by the first optimizer) triggers several full collections, about
    0.4 s of a small script's start-up. `gc.freeze()` moves the objects alive now into a permanent
    generation those collections skip; they were going to live for the whole run anyway (modules,
    classes, functions). Only a reference cycle among them that becomes garbage before `release`
    waits until then to be collected. A process that froze objects itself is left as it is.

    Examples:
        >>> import gc
        >>> freeze = StartupFreeze(True)
        >>> freeze.active == (gc.get_freeze_count() > 0)
        True
        >>> freeze.release()
        >>> gc.get_freeze_count()
        0
    """

    def __init__(self, enabled: bool) -> None:
        self.active = bool(enabled) and gc.get_freeze_count() == 0
        if self.active:
            gc.freeze()

    def release(self) -> None:
        """Give the frozen objects back to the collector (once; a no-op when nothing was frozen here)."""
        if self.active:
            self.active = False
            gc.unfreeze()


class RunnerSupervisor:
    """Signal, heartbeat and garbage-collection helper owned by a runner.

    Args:
        heartbeat_dir: Directory for `heartbeat-rank{rank}.json`; `None` disables heartbeats.
        heartbeat_interval: Minimum seconds between heartbeat writes (`None`: 60 s).
        rank: Global rank, used in the heartbeat file name and content.
        gc_interval: Run `gc.collect(gc_generation)` every this many global steps; `None`
            leaves garbage collection to Python.
        gc_generation: Generation passed to `gc.collect` (0, 1 or 2).
        gc_disable_automatic: Turn automatic collection off while pacing is active (only when
            `gc_interval` is set); `close` turns it back on.
        signals: Signals turned into a stop request by `install_signal_handlers`.

    Examples:
        >>> import os, signal
        >>> supervisor = RunnerSupervisor()
        >>> supervisor.install_signal_handlers()
        True
        >>> os.kill(os.getpid(), signal.SIGTERM)
        >>> supervisor.stop_requested, supervisor.signum == signal.SIGTERM, supervisor.exit_code
        (True, True, 143)
        >>> supervisor.close()
    """

    def __init__(
        self,
        *,
        heartbeat_dir: str | os.PathLike | None = None,
        heartbeat_interval: float | None = None,
        rank: int = 0,
        gc_interval: int | None = None,
        gc_generation: int = 1,
        gc_disable_automatic: bool = False,
        signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT),
        logger: logging.Logger | None = None,
    ) -> None:
        if heartbeat_interval is not None and (
            not isinstance(heartbeat_interval, (int, float)) or heartbeat_interval < 0
        ):
            raise ValueError(f"heartbeat_interval must be a non-negative number of seconds, got {heartbeat_interval!r}")
        if gc_interval is not None and (
            isinstance(gc_interval, bool) or not isinstance(gc_interval, int) or gc_interval < 1
        ):
            raise ValueError(f"gc_interval must be a positive integer or None, got {gc_interval!r}")
        if gc_generation not in (0, 1, 2):
            raise ValueError(f"gc_generation must be 0, 1 or 2, got {gc_generation!r}")
        self.heartbeat_dir = Path(heartbeat_dir) if heartbeat_dir is not None else None
        self.heartbeat_interval = _DEFAULT_HEARTBEAT_INTERVAL if heartbeat_interval is None else heartbeat_interval
        self.rank = rank
        self.gc_interval = gc_interval
        self.gc_generation = gc_generation
        self.gc_disable_automatic = bool(gc_disable_automatic)
        self.signals = tuple(signal.Signals(sig) for sig in signals)
        self.logger = logger or logging.getLogger("danling.runners")
        self.stop_requested = False
        self.signum: int | None = None
        self._previous_handlers: dict[int, Any] = {}
        self._signal_watch: SignalWatch | None = None  # the second signal while the main thread is stuck in C
        self._repeatable: set[signal.Signals] = set()  # stop signals whose repetition does not escalate
        self.exiting_code: int | None = None  # set by the loops once a stop's checkpoint is saved
        self._last_beat: float | None = None
        self._last_progress: dict[str, Any] = {}
        self._last_gc_step: int | None = None
        self._gc_was_enabled: bool | None = None
        # The hang watchdog of a multi-process run (see `watchdog.py`), started by the training loop.
        self.watchdog: Any = None
        # The watchdog of a single-process run, which polls the runner's counters instead (same file).
        self.local_watchdog: Any = None
        if gc_interval is not None and self.gc_disable_automatic:
            self._gc_was_enabled = gc.isenabled()
            gc.disable()

    @property
    def exit_code(self) -> int:
        """Conventional exit status: 128 + the received signal number, 0 when no signal arrived."""
        return 0 if self.signum is None else 128 + int(self.signum)

    @property
    def heartbeat_file(self) -> Path | None:
        """Path of this rank's heartbeat file, or `None` when heartbeats are off."""
        if self.heartbeat_dir is None:
            return None
        return self.heartbeat_dir / f"heartbeat-rank{self.rank}.json"

    # signals ---------------------------------------------------------------------------------

    def install_signal_handlers(self) -> bool:
        """Route the configured signals to `request_stop`.

        Returns `False` (and changes nothing) off the main thread, where Python cannot install
        handlers. A second signal while a stop is already pending restores the original handler
        and re-delivers the signal, so pressing Ctrl-C twice still interrupts a stuck step; when
        the main thread is stuck in C code, where no Python handler runs, a
        `SignalWatch` thread (`danling.runners.services.signal_watch`) ends the process
        on the second signal instead (exit code 128 + its number).
        """
        if threading.current_thread() is not threading.main_thread():
            self.logger.warning("signal handlers can only be installed from the main thread; skipping")
            return False
        for sig in self.signals:
            if sig not in self._previous_handlers:
                self._previous_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        if self._signal_watch is None:
            escalating = [sig for sig in self.signals if sig not in self._repeatable]
            watch = SignalWatch(escalating, lambda: self.stop_requested, self.logger)
            self._signal_watch = watch if watch.start() else None
        return True

    def add_stop_signals(self, signals: Iterable[int], *, repeatable: bool = False) -> None:
        """Make `signals` stop signals too (Slurm's preemption signal, say); installed with the others.

        With `repeatable`, such a signal arriving again while the stop is under way is ignored
        instead of ending the process: a scheduler may deliver one notice twice (to a torchrun
        agent, which forwards it, and to its workers directly). A signal that already was a stop
        signal (SIGTERM, SIGINT) keeps its meaning: sent twice, it ends a stuck run.
        """
        for sig in signals:
            sig = signal.Signals(sig)
            if sig not in self.signals:
                self.signals += (sig,)
                if repeatable:
                    self._repeatable.add(sig)

    def restore_signal_handlers(self) -> None:
        """Put back the handlers that were active before `install_signal_handlers`.

        A process that is exiting after a graceful stop (`exiting_code` set) ignores them instead,
        until it has left with that status: under torchrun the first rank to exit makes the agent
        SIGTERM the others, which would otherwise die by the signal (-15) instead of reporting 143.
        An ignored signal, unlike a Python handler, stays in place while the interpreter shuts
        down; a process that hangs there is still ended by the agent's SIGKILL.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        if self._signal_watch is not None:
            self._signal_watch.stop()
            self._signal_watch = None
        for sig, handler in self._previous_handlers.items():
            if self.exiting_code is not None:
                handler = signal.SIG_IGN
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous_handlers.clear()

    def request_stop(self, signum: int | None = None) -> None:
        """Ask the loop to stop after the current step (what the signal handler does)."""
        self.stop_requested = True
        if signum is not None:
            self.signum = int(signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.stop_requested and signum in self._repeatable:
            self.logger.info("received %s again; the stop is already under way", signal.Signals(signum).name)
            return
        if self.stop_requested:
            self.logger.warning("received %s again; no longer waiting for a graceful stop", signal.Signals(signum).name)
            previous = self._previous_handlers.get(signum)
            self.restore_signal_handlers()
            if callable(previous):
                previous(signum, frame)
            else:
                signal.raise_signal(signum)
            return
        self.request_stop(signum)
        self.logger.warning(
            # not "saving a checkpoint": an evaluation or inference stops without one
            "received %s; finishing the current step, then stopping (a training run saves a shutdown checkpoint first)",
            signal.Signals(signum).name,
        )

    # heartbeat -------------------------------------------------------------------------------

    def beat(self, step: int, epoch: int, phase: str, *, force: bool = False) -> bool:
        """Record progress; write the heartbeat file if `heartbeat_interval` has elapsed.

        Cheap enough for every step: nothing touches the disk between writes. Returns whether
        the file was written.
        """
        self._last_progress = {"step": step, "epoch": epoch, "phase": phase}
        if self.heartbeat_dir is None:
            return False
        now = time.monotonic()
        if not force and self._last_beat is not None and now - self._last_beat < self.heartbeat_interval:
            return False
        self._write_heartbeat()
        self._last_beat = now
        return True

    def _write_heartbeat(self) -> None:
        record = {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "time": time.time(),
            "stop_requested": self.stop_requested,
            **self._last_progress,
        }
        self.heartbeat_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.heartbeat_file, json.dumps(record, sort_keys=True) + "\n")

    # garbage collection ----------------------------------------------------------------------

    def gc_step(self, global_step: int) -> bool:
        """Collect garbage when `global_step` is a positive multiple of `gc_interval`.

        Repeated calls for the same step (gradient accumulation) collect at most once. Returns
        whether a collection ran.
        """
        if self.gc_interval is None or global_step <= 0 or global_step % self.gc_interval:
            return False
        if global_step == self._last_gc_step:
            return False
        self._last_gc_step = global_step
        gc.collect(self.gc_generation)
        return True

    def close(self) -> None:
        """Stop the watchdog, write a final heartbeat, restore signal handlers and automatic GC."""
        for watchdog in (self.watchdog, self.local_watchdog):
            if watchdog is not None:
                watchdog.close()
        self.watchdog = self.local_watchdog = None
        if self.heartbeat_dir is not None and self._last_progress:
            self._last_progress["phase"] = "closed"
            self._write_heartbeat()
        self.restore_signal_handlers()
        if self._gc_was_enabled:
            gc.enable()
        self._gc_was_enabled = None
