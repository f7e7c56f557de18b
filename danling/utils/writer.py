"""[`BackgroundWriter`][danling.utils.BackgroundWriter]: [`save`][danling.utils.save] on a helper thread.

Files that a loop rewrites over and over (result summaries, run status) cost the loop an
encode, an open and a rename each time; on Linux the rename of a file over an existing one also
starts writeback of the new data. Handing them to one helper thread keeps that off the caller's
thread. Only the newest content of a path matters, so a path that is submitted again before it
was written is written once, with the newer object; a `linger` delay makes that coalescing
deliberate for files rewritten many times a second.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from .io import PathStr, _resolve, save

__all__ = ["BackgroundWriter"]


class BackgroundWriter:
    """Write files with [`save`][danling.utils.save] on one daemon thread, newest content first.

    `submit` returns at once; `flush` blocks until everything submitted so far is on disk (as
    far as `save` takes it: atomic rename, fsync only with `durable=True`). The objects passed to
    `submit` are written later, so they must not be changed afterwards: submit a snapshot.

    With `linger` > 0 a submitted path waits up to that many seconds before it is written, and
    submissions of the same path in the meantime only replace the content: a file rewritten every
    few milliseconds is written a few times per `linger` instead, and never lags more than
    `linger` seconds behind its first unwritten submission. `flush` does not wait for the
    delay: it writes whatever is pending right away, in the calling thread when the helper is
    idle (the caller waits anyway, so handing the work over would only add a thread switch).

    A failed write is not lost: the first error is raised by the next `submit` or `flush`
    (wrapped in an `OSError` naming the path when it is not one already), and later writes still
    go ahead.

    Args:
        name: Name of the helper thread (started on the first `submit`).
        linger: Seconds a submitted path may wait for newer content before it is written.

    Raises:
        ValueError: `linger` is negative.

    Examples:
        >>> import os, tempfile
        >>> from danling.utils import load
        >>> writer = BackgroundWriter(linger=60.0)
        >>> path = os.path.join(tempfile.mkdtemp(), "status.json")
        >>> for step in range(3):
        ...     writer.submit({"step": step}, path, durable=False)
        >>> writer.flush()  # written now, once, with the newest content
        >>> load(path)
        {'step': 2}
        >>> writer.close()
    """

    def __init__(self, name: str = "danling-writer", *, linger: float = 0.0) -> None:
        if not linger >= 0:
            raise ValueError(f"linger must be a non-negative number of seconds, got {linger!r}")
        self.name = name
        self.linger = float(linger)
        # path -> (object, save kwargs, time it is due); ordered by first submission.
        self._pending: dict[str, tuple[Any, dict[str, Any], float]] = {}
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None

    def submit(self, obj: Any, file: PathStr, **kwargs: Any) -> None:
        """Queue `save(obj, file, **kwargs)`; a queued write to the same path is replaced.

        Raises:
            ValueError: The extension has no format (checked here, not on the helper thread).
            OSError: An earlier background write failed (raised once).
            RuntimeError: The writer was closed.
        """
        path = os.path.abspath(_resolve(file, "save")[0])
        with self._condition:
            self._raise_pending_error()
            if self._closed:
                raise RuntimeError(f"{self.name} is closed; cannot write {path!r}")
            queued = self._pending.get(path)
            # A replaced submission keeps its due time: newer content never postpones the write.
            due = queued[2] if queued is not None else time.monotonic() + self.linger
            self._pending[path] = (obj, kwargs, due)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            # Only a first pending path can move the helper's wake-up earlier: every later one is due
            # no sooner (same linger), and a busy helper looks at the queue again when it is done.
            if queued is None and len(self._pending) == 1:
                self._condition.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        """Write everything submitted so far, without waiting for `linger`, and return when it is done.

        Args:
            timeout: Seconds to wait for a write the helper thread has already started.

        Raises:
            TimeoutError: The helper thread is still writing after `timeout` seconds.
            OSError: A write failed (raised once).
        """
        with self._condition:
            # The helper's batch holds older contents than anything still pending: it lands first.
            if not self._condition.wait_for(lambda: not self._busy, timeout):
                raise TimeoutError(f"{self.name}: a write is still running after {timeout} s")
            batch, self._pending = self._pending, {}
            self._busy = bool(batch)
        if batch:
            self._write(batch)
        with self._condition:
            self._raise_pending_error()

    def close(self, timeout: float | None = None) -> None:
        """Flush, then stop the helper thread. Closing twice is harmless."""
        try:
            self.flush(timeout)
        finally:
            with self._condition:
                self._closed = True
                self._condition.notify_all()
            thread, self._thread = self._thread, None
            if thread is not None:
                thread.join(timeout)

    @property
    def pending(self) -> int:
        """Files submitted but not yet written (including one being written)."""
        with self._condition:
            return len(self._pending) + int(self._busy)

    def _raise_pending_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _take_due(self) -> dict[str, tuple[Any, dict[str, Any], float]] | None:
        """Wait (holding the condition) until some path is due; None once closed and drained."""
        while True:
            if self._pending and not self._busy:
                if self._closed:
                    batch, self._pending = self._pending, {}
                    return batch
                now = time.monotonic()
                first_due = min(due for _, _, due in self._pending.values())
                if first_due <= now:
                    batch = {path: item for path, item in self._pending.items() if item[2] <= now}
                    for path in batch:
                        del self._pending[path]
                    return batch
                self._condition.wait(first_due - now)
            elif self._closed and not self._pending and not self._busy:
                return None
            else:
                self._condition.wait()

    def _run(self) -> None:
        while True:
            with self._condition:
                batch = self._take_due()
                if batch is None:
                    return
                self._busy = True
            self._write(batch)

    def _write(self, batch: dict[str, tuple[Any, dict[str, Any], float]]) -> None:
        """Write `batch` (taken with `_busy` set), record the first error, then clear `_busy`."""
        try:
            for path, (obj, kwargs, _) in batch.items():
                try:
                    save(obj, path, **kwargs)
                except Exception as error:  # reported to the submitting thread by submit/flush
                    if not isinstance(error, OSError):
                        wrapped = OSError(f"background write of {path!r} failed: {error!r}")
                        wrapped.__cause__ = error
                        error = wrapped
                    with self._condition:
                        if self._error is None:
                            self._error = error
        finally:
            with self._condition:
                self._busy = False
                self._condition.notify_all()
