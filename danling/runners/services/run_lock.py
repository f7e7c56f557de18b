"""An exclusive lock on a run directory, held by the main process of the run that trains in it.

The lock is the file `<run dir>/.lock`, locked with `flock` and holding the holder's pid, host and
start time. The kernel drops a `flock` when its process dies, however it dies, so a lock left by
a killed run is free again: the next run takes it over and logs who held it. The file is never
deleted (deleting a locked file lets two processes hold "the" lock on different inodes); a
released lock is an empty file.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, runs are not locked
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_NAME", "RunDirectoryLockedError", "RunLock", "held_here", "live_lock_holder", "read_lock_holder"]

LOCK_NAME = ".lock"

# flock conflicts between two descriptors of one process too: runners of the same process on
# the same directory share one lock (counted), and the last one to release it frees it.
_HELD: dict[str, list[Any]] = {}
_HELD_LOCK = threading.Lock()


class RunDirectoryLockedError(RuntimeError):
    """Another live process holds the lock of the run directory this run would write into."""


def read_lock_holder(directory: str | os.PathLike) -> dict[str, Any] | None:
    """What the lock file of `directory` says about its holder (pid, host, started), or None when empty."""
    try:
        text = (Path(directory) / LOCK_NAME).read_text(encoding="utf-8").strip()
        holder = json.loads(text) if text else None
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def live_lock_holder(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The record of another live process holding the lock of `directory`, else None.

    Only looks: the lock file is neither created nor written. The lock of this very process
    counts as free.
    """
    path = Path(directory) / LOCK_NAME
    if fcntl is None or not path.is_file():
        return None
    with _HELD_LOCK:
        if os.fspath(path.absolute()) in _HELD:
            return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return _read_fd(fd) or {}
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def held_here(directory: str | os.PathLike) -> bool:
    """Whether a runner of this process holds the lock of `directory`."""
    with _HELD_LOCK:
        return os.fspath((Path(directory) / LOCK_NAME).absolute()) in _HELD


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another process (its lock file names none)"
    return f"pid {holder.get('pid')} on host {holder.get('host')!r} (started {holder.get('started')})"


class RunLock:
    """Exclusive lock of one run directory for this process.

    Args:
        directory: The run directory (created when missing).

    Examples:
        >>> import tempfile
        >>> lock = RunLock(tempfile.mkdtemp())
        >>> lock.acquire()
        >>> lock.held, read_lock_holder(lock.directory)["pid"] == os.getpid()
        (True, True)
        >>> lock.release()
        >>> lock.held, read_lock_holder(lock.directory)
        (False, None)
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.held = False

    def acquire(self, logger: logging.Logger | None = None) -> None:
        """Take the lock, or raise `RunDirectoryLockedError` naming the live holder.

        A lock whose holder died is taken over with a warning on `logger` naming that holder.
        """
        if self.held:
            return
        key = os.fspath(self.path.absolute())
        with _HELD_LOCK:
            entry = _HELD.get(key)
            if entry is not None:
                entry[1] += 1
                self.held = True
                return
            fd = self._lock_file()
            _HELD[key] = [fd, 1]
        self.held = True
        previous = _read_fd(fd)
        if previous and logger is not None:
            logger.warning(
                "run directory %s: taking over the lock of %s, which is no longer running",
                self.directory,
                _describe(previous),
            )
        record = {"pid": os.getpid(), "host": platform.node(), "started": _now(), "argv": list(sys.argv)}
        _write_fd(fd, json.dumps(record) + "\n")

    def _lock_file(self) -> int:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is None:  # pragma: no cover
            return fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_fd(fd)
            os.close(fd)
            raise RunDirectoryLockedError(
                f"run directory {self.directory} is in use by {_describe(holder)}: a run trains there now. "
                "Wait for it to finish or stop it; to start a separate run, change `experiment` or "
                "`workspace_root`"
            ) from None
        return fd

    def release(self) -> None:
        """Give the lock up (the last holder of this process empties and unlocks the file); idempotent."""
        if not self.held:
            return
        self.held = False
        key = os.fspath(self.path.absolute())
        with _HELD_LOCK:
            entry = _HELD.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del _HELD[key]
            fd = entry[0]
            try:
                _write_fd(fd, "")  # an empty file: released cleanly, nothing to take over
            finally:
                if fcntl is not None:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({os.fspath(self.directory)!r}, held={self.held})"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _read_fd(fd: int) -> dict[str, Any] | None:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    try:
        holder = json.loads(b"".join(chunks).decode("utf-8") or "null")
    except ValueError:
        return {"pid": None, "host": None, "started": None}
    return holder if isinstance(holder, dict) else None


def _write_fd(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, text.encode("utf-8"))
    os.fsync(fd)
