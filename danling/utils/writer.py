"""[`BackgroundWriter`][danling.utils.BackgroundWriter]: [`save`][danling.utils.save] on a helper thread.

Files that a loop rewrites over and over (result summaries, run status) cost the loop an
encode, an open and a rename each time; on Linux the rename of a file over an existing one also
starts writeback of the new data. Handing them to one helper thread keeps that off the caller's
thread. Only the newest content of a path matters, so a path that is submitted again before it
was written is written once, with the newer object.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from .io import PathStr, _resolve, save

__all__ = ["BackgroundWriter"]


class BackgroundWriter:
    """Write files with [`save`][danling.utils.save] on one daemon thread, newest content first.

    `submit` returns at once; `flush` blocks until everything submitted so far is on disk (as
    far as `save` takes it: atomic rename, fsync only with `durable=True`). The objects passed to
    `submit` are written later, so they must not be changed afterwards: submit a snapshot.

    A failed write is not lost: the first error is raised by the next `submit` or `flush`
    (wrapped in an `OSError` naming the path when it is not one already), and later writes still
    go ahead.

    Args:
        name: Name of the helper thread (started on the first `submit`).

    Examples:
        >>> import os, tempfile
        >>> from danling.utils import load
        >>> writer = BackgroundWriter()
        >>> path = os.path.join(tempfile.mkdtemp(), "status.json")
        >>> for step in range(3):
        ...     writer.submit({"step": step}, path, durable=False)
        >>> writer.flush()
        >>> load(path)
        {'step': 2}
        >>> writer.close()
    """

    def __init__(self, name: str = "danling-writer") -> None:
        self.name = name
        self._pending: dict[str, tuple[Any, dict[str, Any]]] = {}
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
            self._pending.pop(path, None)  # keep submission order: the re-submitted path goes last
            self._pending[path] = (obj, kwargs)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._condition.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        """Block until every submitted write is done.

        Raises:
            TimeoutError: Writes are still pending after `timeout` seconds.
            OSError: A background write failed (raised once).
        """
        with self._condition:
            done = self._condition.wait_for(lambda: not self._pending and not self._busy, timeout)
            self._raise_pending_error()
            if not done:
                raise TimeoutError(f"{self.name}: {len(self._pending)} file(s) still pending after {timeout} s")

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

    def _run(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._pending or self._closed)
                if not self._pending:  # closed and drained
                    return
                batch, self._pending = self._pending, {}
                self._busy = True
            try:
                for path, (obj, kwargs) in batch.items():
                    try:
                        save(obj, path, **kwargs)
                    except Exception as error:  # reported to the caller's thread by submit/flush
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
