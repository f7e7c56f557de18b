"""Directory layout shared by the checkpoint backends: names, pointers, publication, recovery.

Hidden entries in a checkpoint directory are transient: `.tmp-<name>-<token>/` (a payload being
written), `.old-<name>-<token>/` (a checkpoint being replaced), `.trash-<name>-<token>/` (one being
pruned) and `.<alias>.pointer.tmp-<token>` (a pointer being rewritten). The token,
`p<pid>.<host>.<hex>`, names the writing process. A process that dies leaves them behind;
[`recover_directory`][danling.checkpoint.layout.recover_directory] cleans them up and puts back a
checkpoint whose replacement was interrupted, but leaves alone the entries of a writer that still
runs (another process saving into the same directory) and of writers on other hosts. `.refused/`
is not transient: it keeps checkpoints that failed verification (see `set_aside`), and nothing
here removes it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .checksums import submit
from .manifest import (
    CheckpointError,
    CheckpointNotFoundError,
    atomic_write_text,
    fsync_dir,
    read_manifest,
    verify_directory,
)

__all__ = [
    "POINTER_SUFFIX",
    "check_name",
    "Discard",
    "in_flight",
    "publish",
    "temp_token",
    "write_pointer",
    "PendingPointers",
    "follow_pointer",
    "first_valid",
    "recover_directory",
    "set_aside",
    "scan_checkpoints",
]

POINTER_SUFFIX = ".pointer"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,199}$")
# Hidden entries that a manager in this process is still writing or swapping; recovery by
# another manager on the same directory must not mistake them for a dead writer's leftovers.
_IN_FLIGHT: set[Path] = set()
_IN_FLIGHT_LOCK = threading.Lock()


def check_name(value: Any, kind: str = "checkpoint name") -> str:
    """Return `value` if it is usable as a checkpoint or alias name, else raise `ValueError`.

    Examples:
        >>> check_name("epoch-000003")
        'epoch-000003'
        >>> check_name("../x")
        Traceback (most recent call last):
        ValueError: checkpoint name '../x' is not valid: ...
    """
    if not isinstance(value, str) or not NAME_PATTERN.match(value) or value.endswith(POINTER_SUFFIX):
        raise ValueError(
            f"{kind} {value!r} is not valid: use up to 200 letters, digits, '_', '.', '+', '=' or '-', "
            f"not starting with '.' or '-' and not ending with {POINTER_SUFFIX!r}"
        )
    return value


def check_count(value: Any, label: str, minimum: int) -> None:
    """Refuse a count that is not an integer >= `minimum` (or `None`), naming `label`."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        kind = "a positive" if minimum else "a non-negative"
        raise ValueError(f"{label} must be {kind} integer or None, got {value!r}")


@contextmanager
def in_flight(path: Path) -> Iterator[Path]:
    """Mark a hidden entry as in use by this process for the duration of the block."""
    key = path.absolute()
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT.add(key)
    try:
        yield path
    finally:
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT.discard(key)


def _is_in_flight(path: Path) -> bool:
    with _IN_FLIGHT_LOCK:
        return path.absolute() in _IN_FLIGHT


_HOST_TAG = hashlib.sha256(platform.node().encode()).hexdigest()[:8]
_TOKEN = re.compile(r"^p(?P<pid>\d+)\.(?P<host>[0-9a-f]{8})\.[0-9a-f]+$")


def temp_token() -> str:
    """Unique suffix of a transient entry that names the writer: `p<pid>.<host hash>.<random hex>`."""
    return f"p{os.getpid()}.{_HOST_TAG}.{uuid.uuid4().hex}"


def _writer_alive(name: str) -> bool:
    """Whether the process that made the transient entry `name` may still be writing it.

    Entries without a token (older versions) and entries of this process that are not in flight
    are leftovers. A writer on another host cannot be checked, so it counts as alive.
    """
    match = _TOKEN.match(name.rsplit("-", 1)[-1])
    if match is None:
        return False
    pid = int(match["pid"])
    if match["host"] != _HOST_TAG:
        return True
    if pid == os.getpid():
        return False  # this process's live entries are in _IN_FLIGHT
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def publish(tmp: Path, final: Path, discard: Discard | None = None, *, sync: bool = True) -> Path:
    """Rename the finished directory `tmp` to `final`, replacing an existing checkpoint safely.

    An existing `final` is first moved aside to `.old-<name>-<hex>`; if the process dies between
    the two renames, recovery moves it back, so the name never ends up pointing at nothing. Once
    `final` is in place the old one is renamed to `.trash-<name>-<hex>` and removed: by `discard`
    on its helper thread when given, here otherwise.

    `sync=False` leaves the sync of the parent directory, which makes a new name durable, to the
    caller (the alias pointers' commit syncs that same directory: one disk round trip for both).
    Replacing an existing checkpoint always syncs here, before the old one is retired.
    """
    directory = final.parent
    if not final.exists():
        os.rename(tmp, final)
        if sync:
            fsync_dir(directory)
        return final
    with in_flight(directory / f".old-{final.name}-{temp_token()}") as old:
        os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(directory)
        (discard or Discard(now=True)).retire(old, final.name)
    return final


class Discard:
    """Removes retired checkpoint directories (`.trash-*`) on one helper thread, in the order given.

    Freeing the page cache of a large checkpoint takes tens of milliseconds of kernel time, and
    the file system's journal commits it with the next fsync. So a save only renames its replaced
    and pruned directories here (`retire`), and hands them to the thread once it has written
    everything it syncs (`flush`): the removal overlaps whatever the caller does next. `drain`
    waits for the removals still running. The entries count as in flight until removed, so
    recovery by another manager of this process leaves them alone; a process that dies first
    leaves `.trash-*` entries, which recovery always removes.
    """

    def __init__(self, *, now: bool = False) -> None:
        self.now = now  # remove in the caller's thread, at once
        self._retired: list[Path] = []
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._owner = os.getpid()
        self._lock = threading.Lock()

    def retire(self, path: Path, name: str) -> None:
        """Rename the checkpoint directory `path` (named `name` when live) to a `.trash-*` entry, to be removed."""
        trash = path.parent / f".trash-{name}-{temp_token()}"
        os.rename(path, trash)  # what recovery finds of it from here on is deleted, never restored
        if self.now:
            shutil.rmtree(trash, ignore_errors=True)
            return
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT.add(trash.absolute())
        with self._lock:
            self._retired.append(trash.absolute())

    def flush(self) -> None:
        """Start removing the directories retired so far, on the helper thread."""
        with self._lock:
            if self._owner != os.getpid():  # a forked child: the parent's thread and queue are not ours
                self._executor, self._pending, self._owner = None, [], os.getpid()
            retired, self._retired = self._retired, []
            if retired and self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="danling-discard")
            self._pending = [future for future in self._pending if not future.done()]
            self._pending.extend(submit(self._executor, _remove, path) for path in retired)

    def drain(self) -> None:
        """Remove every directory retired so far and wait until the removals are done."""
        self.flush()
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        """Drain, then end the helper thread (a later `flush` starts a new one): a closed manager leaves no thread."""
        self.drain()
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


def _remove(path: Path) -> None:
    try:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT.discard(path)


def write_pointer(directory: Path, alias: str, target: str) -> Path:
    """Atomically point `alias` at checkpoint `target` (a one-line `<alias>.pointer` file)."""
    pointer = directory / f"{alias}{POINTER_SUFFIX}"
    with in_flight(directory / f".{pointer.name}.tmp-{temp_token()}") as tmp:
        atomic_write_text(pointer, target + "\n", tmp=tmp)
    return pointer


class PendingPointers:
    """A save's new alias pointers, written and synced under temporary names on a helper thread while the
    checkpoint is sealed; `commit` renames them into place with one directory sync, `discard` drops them.

    This takes the pointers' file syncs off the save's path. A crash before `commit` leaves only
    `.<alias>.pointer.tmp-*` entries, which recovery removes.
    """

    def __init__(self, directory: Path, aliases: tuple[str, ...], target: str) -> None:
        self.directory = directory
        self.moves = []
        for alias in aliases:
            pointer = directory / f"{alias}{POINTER_SUFFIX}"
            self.moves.append(((directory / f".{pointer.name}.tmp-{temp_token()}").absolute(), pointer))
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT.update(tmp for tmp, _ in self.moves)
        if not _POINTER_WRITERS:
            _POINTER_WRITERS.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="danling-pointers"))
        self._written = submit(_POINTER_WRITERS[0], self._write, target + "\n")

    def _write(self, text: str) -> None:
        for tmp, _ in self.moves:
            with open(tmp, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())

    def commit(self, *, sync: bool = False) -> None:
        """Move every pointer into place (each rename is atomic), then sync the directory once.

        With `sync` the directory is synced even without pointers: the caller left a rename in it
        unsynced (see `publish(..., sync=False)`), and this one sync makes both durable.
        """
        try:
            self._written.result()
            for tmp, pointer in self.moves:
                os.replace(tmp, pointer)
            if self.moves or sync:
                fsync_dir(self.directory)
        finally:
            self.discard()

    def discard(self) -> None:
        """Remove the pointers not moved into place (after their writing ended)."""
        self._written.exception()
        for tmp, _ in self.moves:
            tmp.unlink(missing_ok=True)
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT.difference_update(tmp for tmp, _ in self.moves)


# A pool of its own: on the checksums' two-thread pool the pointer writes queue behind the seal's
# syncs, and a 2-rank runner save measured 0.97-1.10x of dcp.save instead of 0.95-0.98x.
_POINTER_WRITERS: list[ThreadPoolExecutor] = []
os.register_at_fork(after_in_child=_POINTER_WRITERS.clear)  # a forked child has no thread behind it


def follow_pointer(pointer: Path) -> Path:
    """The checkpoint a pointer file names; `CheckpointNotFoundError` when it names nothing."""
    try:
        target = pointer.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:  # garbage bytes (a torn or overwritten file): it names nothing
        raise CheckpointNotFoundError(f"alias file {pointer} holds bytes that are not a checkpoint name") from None
    path = pointer.parent / target
    if not target or not NAME_PATTERN.match(target) or not path.exists():
        raise CheckpointNotFoundError(f"alias file {pointer} points to {target!r}, which does not exist")
    return path


REFUSED_DIR = ".refused"
"""Where checkpoints that failed verification are kept, inside the checkpoint directory (see `set_aside`)."""


def set_aside(directory: Path, checkpoints: list[Path]) -> Path:
    """Move checkpoints that fail verification to `<directory>/.refused/<name>-<time>` and return that folder.

    A run that resumes from an older checkpoint saves the same names again, and a save replaces a
    checkpoint of its name: the refused ones are evidence of what went wrong, kept where no save,
    retention or recovery touches them.
    """
    refused = directory / REFUSED_DIR
    refused.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for checkpoint in checkpoints:
        os.rename(checkpoint, refused / f"{checkpoint.name}-{stamp}")
    fsync_dir(directory)
    return refused


def recover_directory(directory: Path, logger: logging.Logger) -> None:
    """Remove what dead writers left in `directory` and restore interrupted replacements.

    Entries of a writer that still runs (this process's in-flight saves, or another live process
    on this host) and of writers on other hosts are left alone.
    """
    for entry in sorted(directory.iterdir()):
        if not entry.name.startswith(".") or _is_in_flight(entry) or _writer_alive(entry.name):
            continue
        if entry.is_file() and f"{POINTER_SUFFIX}.tmp-" in entry.name:
            entry.unlink(missing_ok=True)
            continue
        kind, _, rest = entry.name.partition("-")
        if not entry.is_dir() or kind not in (".tmp", ".old", ".trash"):
            continue
        original = directory / rest.rsplit("-", 1)[0]
        if kind == ".old" and not original.exists():
            os.rename(entry, original)
            logger.warning("restored checkpoint %s from an interrupted replacement", original)
        else:
            shutil.rmtree(entry, ignore_errors=True)
            logger.info("removed leftover %s from an interrupted checkpoint write", entry)


def scan_checkpoints(directory: Path, history_pattern: re.Pattern) -> list[tuple[Path, dict[str, Any]]]:
    """Checkpoint directories under `directory`, newest first, with their manifests.

    A directory whose manifest cannot be read gets a stand-in `{"history": ...}` judged from its
    name by `history_pattern`, and is ordered by its modification time.
    """
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        try:
            manifest = read_manifest(entry)
        except CheckpointError:
            manifest = {"history": bool(history_pattern.match(entry.name))}
        created = manifest.get("created_ns", entry.stat().st_mtime_ns)
        found.append((created, entry.name, entry, manifest))
    found.sort(key=lambda item: (item[0], item[1]), reverse=True)
    return [(entry, manifest) for _, _, entry, manifest in found]


def first_valid(candidates: list[Path], logger: logging.Logger) -> Path | None:
    """The first of `candidates` that passes verification, logging every one it skips (and a fallback)."""
    rejected = 0
    for path in candidates:
        try:
            verify_directory(path)
        except CheckpointError as err:
            rejected += 1
            logger.warning("skipping checkpoint %s: %s", path, err)
            continue
        if rejected:
            logger.warning("falling back to checkpoint %s, the newest one that verifies", path)
        return path
    return None
