"""On-disk integrity primitives shared by every checkpoint backend.

A checkpoint is a directory holding payload files plus `manifest.json`, which records the size
and a checksum of each payload file. This module writes and checks those manifests, publishes
files atomically (temporary name, `fsync`, `rename`) and defines the errors raised when a
checkpoint cannot be trusted.

The checksums themselves (XXH3-128 by default, SHA-256 optional) are computed by
[`danling.checkpoint.checksums`][].
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from stat import S_ISREG
from typing import Any, TypeVar

from .checksums import (
    CHECKSUMS,
    DEFAULT_CHECKSUM,
    BackgroundVerification,
    HashingReader,
    HashingWriter,
    _beside,
    _corrupt,
    _digests,
    _entry_checksum,
    _fsync_path,
    _torn,
    check_checksum,
    file_record,
    new_digest,
)

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_FORMAT",
    "CHECKSUMS",
    "DEFAULT_CHECKSUM",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointResizeError",
    "HashingWriter",
    "HashingReader",
    "check_checksum",
    "new_digest",
    "file_record",
    "fsync_dir",
    "atomic_write_text",
    "write_manifest",
    "read_manifest",
    "mark_verified",
    "streamed_verification",
    "take_streamed",
    "verification_scope",
    "parsed_once",
    "verify_directory",
    "verify_in_background",
    "vouch_for",
    "BackgroundVerification",
]

T = TypeVar("T")

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "danling-checkpoint"
MANIFEST_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint is missing, torn, corrupt or otherwise unusable; the message names the file."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint, alias or file matches the requested name or path."""


class CheckpointResizeError(CheckpointError):
    """A checkpoint holds per-rank state for a different number of data ranks than the loading run has.

    Raised on every rank alike (the decision only reads checkpoint metadata), so no rank is left
    waiting in a collective for ranks that failed.
    """


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory entry table so renames and creations inside it survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str, *, tmp: str | os.PathLike | None = None) -> None:
    """Replace `path` with `text` so readers see either the old or the new content, never a mix.

    `tmp` is the scratch file to write first (default: a hidden sibling with a random suffix).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}") if tmp is None else Path(tmp)
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_manifest(
    directory: str | os.PathLike,
    *,
    name: str,
    backend: str,
    files: Mapping[str, Mapping[str, Any]],
    history: bool,
    created_ns: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    fsync: bool = True,
) -> dict[str, Any]:
    """Write `manifest.json` into `directory` (fsynced unless `fsync=False`) and return its content."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "name": name,
        "backend": backend,
        "created_ns": time.time_ns() if created_ns is None else created_ns,
        "history": history,
        "files": {key: dict(value) for key, value in sorted(files.items())},
        "metadata": dict(metadata or {}),
    }
    path = Path(directory) / MANIFEST_NAME
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=2, sort_keys=True)
        handle.flush()
        if fsync:
            os.fsync(handle.fileno())
    return manifest


def seal_directory(
    directory: Path, records: dict[str, Any], *, syncing: Collection[Future] = (), **fields: Any
) -> None:
    """Hash the files under `directory` that `records` lacks (adding them), write the manifest (`fields` as
    for `write_manifest`) and sync them and the directory: it is then ready to be published.

    The syncs run together rather than one after another (each waits on the disk, and all that
    matters is that every one is done before the directory is published); the directory's starts
    once the manifest exists, so it covers the manifest's entry too. `syncing` holds syncs the
    writer already started (of files it recorded); they are waited for with the others.
    """
    missing = [path for path in sorted(directory.rglob("*")) if path.is_file()]
    missing = [path for path in missing if path.relative_to(directory).as_posix() not in records]
    syncs = [*syncing, *(_beside(_fsync_path, path) for path in missing)]
    try:
        for path in missing:
            records[path.relative_to(directory).as_posix()] = file_record(path)
        write_manifest(directory, files=records, fsync=False, **fields)
        syncs.append(_beside(fsync_dir, directory))
        _fsync_path(Path(directory) / MANIFEST_NAME)
    finally:
        failures = [sync.exception() for sync in syncs]
    for failure in failures:
        if failure is not None:
            raise failure


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """Parse and sanity-check the manifest of `directory` without hashing any payload."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory} has no {MANIFEST_NAME}; it is incomplete or not a checkpoint")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"manifest {path} cannot be read: {err}") from err
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"manifest {path} is not a {MANIFEST_FORMAT} manifest")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"manifest {path} lists no payload files")
    for key, entry in files.items():
        if (
            Path(key).is_absolute()
            or ".." in Path(key).parts
            or not isinstance(entry, dict)
            or not isinstance(entry.get("size"), int)
            or not any(isinstance(entry.get(name), str) for name in CHECKSUMS)
        ):
            raise CheckpointError(f"manifest {path} has a malformed entry for {key!r}")
    return manifest


def verify_directory(
    directory: str | os.PathLike, files: list[str] | None = None, *, streamed: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Check sizes and checksums of a checkpoint directory against its manifest.

    Args:
        directory: The checkpoint directory.
        files: Only check these manifest entries (default: all of them).
        streamed: Entries whose checksum the caller verifies while reading them (with a
            [`HashingReader`][danling.checkpoint.checksums.HashingReader]): only their presence and
            size are checked here.

    Returns:
        The parsed manifest.

    Raises:
        CheckpointError: Naming the first file that is missing, truncated or altered.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    _check_now(_unverified(directory, manifest, files, streamed))
    return manifest


def verify_in_background(
    directory: str | os.PathLike,
    *,
    now: tuple[str, ...] = (),
    manifest: Mapping[str, Any] | None = None,
    share: Collection[str] | None = None,
) -> tuple[dict[str, Any], BackgroundVerification]:
    """Start checking a checkpoint directory against its manifest, to read it while it is checked.

    Presence and sizes are checked at once, and so are the checksums of the entries `now`; the
    other files are hashed on helper threads. The reader calls `wait` on the returned
    [`BackgroundVerification`][danling.checkpoint.checksums.BackgroundVerification] before it
    reads a byte range, and `finish` once done (or `stop` when it gives up).

    Args:
        directory: The checkpoint directory.
        now: Entries checked before this returns.
        manifest: The directory's manifest when the caller already read it.
        share: Hash only these of the other entries; the rest is left to other processes (see
            [`vouch_for`][danling.checkpoint.manifest.vouch_for]), and `wait` does not wait for it.

    Returns:
        The parsed manifest and the running verification.

    Raises:
        CheckpointError: Naming the first file that is missing, truncated, or (among `now`) altered.
    """
    directory = Path(directory)
    manifest = read_manifest(directory) if manifest is None else manifest
    pending = _unverified(directory, manifest, None, ())
    _check_now([job for job in pending if job[0] in now])
    rest = [job for job in pending if job[0] not in now and (share is None or job[0] in share)]
    jobs = [(key, path, expected) for key, path, _, expected, _ in rest]
    return manifest, BackgroundVerification(jobs, on_success=lambda: _remember(rest))


def vouch_for(directory: str | os.PathLike, manifest: Mapping[str, Any], keys: Collection[str]) -> None:
    """Record in the current verification scope that entries `keys` of `directory` verified elsewhere.

    For files another process hashed for this one (each rank of a group checks a share of a
    checkpoint and they agree on the verdict): a later check in the scope skips them while they
    stay as they are now. Outside a scope this does nothing.
    """
    if getattr(_scope, "verified", None) is None:
        return
    directory = Path(directory)
    _remember([job for job in _unverified(directory, manifest, sorted(keys), ()) if job[0] in keys])


def _unverified(
    directory: Path, manifest: Mapping[str, Any], files: list[str] | None, streamed: tuple[str, ...]
) -> list[tuple[str, Path, str, Mapping[str, Any], tuple]]:
    """Check presence and size of the entries; return those whose checksum is still to compare."""
    entries = manifest["files"]
    cache = getattr(_scope, "verified", None)
    pending = []
    for key in sorted(entries if files is None else files):
        if key not in entries:
            raise CheckpointError(f"{directory / key} is not listed in {directory / MANIFEST_NAME}")
        path, expected = directory / key, entries[key]
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {path} is missing") from None
        if not S_ISREG(stat.st_mode):  # a directory of the entry's name: missing too (no second stat)
            raise CheckpointError(f"checkpoint file {path} is missing")
        if stat.st_size != expected["size"]:
            raise _torn(path, stat.st_size, expected["size"])
        checksum = _entry_checksum(expected, path)
        signature = (stat.st_size, stat.st_mtime_ns, stat.st_ino, checksum)
        if cache is not None and cache.get(path) == signature:
            continue  # verified earlier in this scope and untouched since
        if key in streamed or key in getattr(_scope, "streamed", ()):
            _owed()[path] = expected  # the reader checks it (see take_streamed)
            continue
        pending.append((key, path, checksum, expected, signature))
    return pending


def _check_now(pending: list[tuple[str, Path, str, Mapping[str, Any], tuple]]) -> None:
    digests = _digests([(path, checksum) for _, path, checksum, _, _ in pending])
    for (_, path, checksum, expected, _), actual in zip(pending, digests):
        if actual != expected[checksum]:
            raise _corrupt(path, checksum)
    _remember(pending)


def _remember(verified: list[tuple[str, Path, str, Mapping[str, Any], tuple]]) -> None:
    cache = getattr(_scope, "verified", None)
    if cache is not None:
        cache.update({path: signature for _, path, _, _, signature in verified})


def mark_verified(path: str | os.PathLike, entry: Mapping[str, Any]) -> None:
    """Record in the current verification scope that `path` was checked (by a streaming read)."""
    cache = getattr(_scope, "verified", None)
    if cache is None:
        return
    with_stat = os.stat(path)
    cache[Path(path)] = (with_stat.st_size, with_stat.st_mtime_ns, with_stat.st_ino, _entry_checksum(entry, path))


_scope = threading.local()


def _owed() -> dict[Path, Mapping[str, Any]]:
    if getattr(_scope, "owed", None) is None:
        _scope.owed = {}
    return _scope.owed


@contextmanager
def streamed_verification(*names: str) -> Iterator[None]:
    """Within the block, `verify_directory` leaves the checksum of the entries `names` to the reader.

    It still checks that they exist with the recorded size; the reader claims each owed entry
    with `take_streamed` and checks it with a
    [`HashingReader`][danling.checkpoint.checksums.HashingReader]. Threads have their own.
    """
    previous, owed = getattr(_scope, "streamed", ()), dict(_owed())
    _scope.streamed = (*previous, *names)
    try:
        yield
    finally:
        _scope.streamed = previous
        _scope.owed = owed


def take_streamed(path: str | os.PathLike) -> Mapping[str, Any] | None:
    """The manifest entry `verify_directory` left to the reader of `path` (once), or `None`."""
    return _owed().pop(Path(path), None)


@contextmanager
def verification_scope() -> Iterator[None]:
    """Within the block, a file that verified is not hashed again while it stays as it was.

    One restore reads a checkpoint directory more than once (the runner state, then the model and
    optimizer in place); hashing it once is enough as long as no file changed in between (same
    size, modification time and inode). So is parsing a verified index once (see `parsed_once`).
    The memory lasts only for the block, so every new load verifies again. Scopes nest; threads
    have their own.

    Examples:
        >>> with verification_scope():
        ...     pass
    """
    previous, parsed = getattr(_scope, "verified", None), getattr(_scope, "parsed", None)
    if previous is None:
        _scope.verified, _scope.parsed = {}, {}
    try:
        yield
    finally:
        _scope.verified, _scope.parsed = previous, parsed


def parsed_once(path: str | os.PathLike, parse: Callable[[], T]) -> T:
    """`parse()` of file `path`, run once per [`verification_scope`][danling.checkpoint.manifest.verification_scope].

    Within a scope, the result is kept and handed out again while the file stays as it was (same
    size, modification time and inode); outside one, `parse()` runs every time. For read-only
    results (a DCP `.metadata` index that two reads of one restore both plan from).
    """
    cache = getattr(_scope, "parsed", None)
    if cache is None:
        return parse()
    stat = os.stat(path)
    key, signature = Path(path), (stat.st_size, stat.st_mtime_ns, stat.st_ino)
    if key in cache and cache[key][0] == signature:
        return cache[key][1]
    value = parse()
    cache[key] = (signature, value)
    return value
