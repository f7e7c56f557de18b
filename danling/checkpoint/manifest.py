"""On-disk integrity primitives shared by every checkpoint backend.

A checkpoint is a directory holding payload files plus `manifest.json`, which records the size
and SHA-256 of each payload file. This module writes and checks those manifests, publishes
files atomically (temporary name, `fsync`, `rename`) and defines the errors raised when a
checkpoint cannot be trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_FORMAT",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointResizeError",
    "HashingWriter",
    "file_record",
    "fsync_dir",
    "atomic_write_text",
    "write_manifest",
    "read_manifest",
    "verification_scope",
    "verify_directory",
]

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "danling-checkpoint"
MANIFEST_VERSION = 1
_CHUNK = 8 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint is missing, torn, corrupt or otherwise unusable; the message names the file."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint, alias or file matches the requested name or path."""


class CheckpointResizeError(CheckpointError):
    """A checkpoint holds per-rank state for a different number of data ranks than the loading run has.

    Raised on every rank alike (the decision only reads checkpoint metadata), so no rank is left
    waiting in a collective for ranks that failed.
    """


class HashingWriter:
    """File-like wrapper that hashes and counts bytes on their way to `raw`.

    `torch.save` writes its archive strictly sequentially, so the digest of everything passed
    to `write` equals the digest of the finished file; that spares a second read at save time.
    Large chunks are hashed on a helper thread while the caller's thread writes them (both
    release the GIL), so hashing adds little to the save time.

    Examples:
        >>> import io
        >>> sink = HashingWriter(io.BytesIO())
        >>> sink.write(b"abc")
        3
        >>> sink.record()["size"], sink.record()["sha256"][:12]
        (3, 'ba7816bf8f01')
    """

    parallel_threshold = 1 << 20

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.size = 0
        self.error: OSError | None = None  # torch.save reports a failed write without its cause
        self._hash = hashlib.sha256()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        try:
            if view.nbytes >= self.parallel_threshold:
                # the buffer stays alive and unchanged until both the hash and the write finish
                hashed = _hash_pool().submit(self._hash.update, view)
                try:
                    self.raw.write(view)
                finally:
                    hashed.result()
            else:
                self._hash.update(view)
                self.raw.write(view)
        except OSError as err:
            self.error = err
            raise
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self.raw.flush()

    def record(self) -> dict[str, Any]:
        """Return the manifest entry (`size`, `sha256`) for the bytes written so far."""
        return {"size": self.size, "sha256": self._hash.hexdigest()}


_HASH_POOL: ThreadPoolExecutor | None = None
_HASH_POOL_LOCK = threading.Lock()


def _hash_pool() -> ThreadPoolExecutor:
    global _HASH_POOL
    with _HASH_POOL_LOCK:
        if _HASH_POOL is None:
            _HASH_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="danling-hash")
        return _HASH_POOL


def file_record(path: str | os.PathLike, *, fsync: bool = False) -> dict[str, Any]:
    """Hash `path` in chunks and return its manifest entry; optionally `fsync` it as well."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(handle.fileno())
    return {"size": size, "sha256": digest.hexdigest()}


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
) -> dict[str, Any]:
    """Write `manifest.json` (fsynced) into `directory` and return its content."""
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
        os.fsync(handle.fileno())
    return manifest


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
            or not isinstance(entry.get("sha256"), str)
        ):
            raise CheckpointError(f"manifest {path} has a malformed entry for {key!r}")
    return manifest


def verify_directory(directory: str | os.PathLike, files: list[str] | None = None) -> dict[str, Any]:
    """Check sizes and SHA-256 digests of a checkpoint directory against its manifest.

    Args:
        directory: The checkpoint directory.
        files: Only check these manifest entries (default: all of them).

    Returns:
        The parsed manifest.

    Raises:
        CheckpointError: Naming the first file that is missing, truncated or altered.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    entries = manifest["files"]
    names = sorted(entries if files is None else files)
    cache = getattr(_scope, "verified", None)
    signature = _signature(directory, names) if cache is not None else None
    if signature is not None and cache.get(directory) == signature:
        return manifest  # verified earlier in this scope and untouched since
    for key in names:
        if key not in entries:
            raise CheckpointError(f"{directory / key} is not listed in {directory / MANIFEST_NAME}")
        path = directory / key
        expected = entries[key]
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
        actual_size = path.stat().st_size
        if actual_size != expected["size"]:
            raise CheckpointError(
                f"checkpoint file {path} is torn: {actual_size} bytes on disk, manifest records {expected['size']}"
            )
        if file_record(path)["sha256"] != expected["sha256"]:
            raise CheckpointError(f"checkpoint file {path} is corrupt: its SHA-256 does not match the manifest")
    if signature is not None:
        cache[directory] = signature
    return manifest


_scope = threading.local()


@contextmanager
def verification_scope() -> Iterator[None]:
    """Within the block, a directory that verified is not hashed again while its files stay as they were.

    One restore reads a checkpoint directory more than once (the runner state, then the model and
    optimizer in place); hashing it once is enough as long as no file changed in between (same
    names, sizes, modification times and inodes). The memory lasts only for the block, so every
    new load verifies again. Scopes nest; threads have their own.

    Examples:
        >>> with verification_scope():
        ...     pass
    """
    previous = getattr(_scope, "verified", None)
    _scope.verified = {} if previous is None else previous
    try:
        yield
    finally:
        _scope.verified = previous


def _signature(directory: Path, names: list[str]) -> tuple | None:
    """What identifies the checked files' contents cheaply: name, size, mtime and inode of each."""
    try:
        stats = [(name, os.stat(directory / name)) for name in names]
    except OSError:
        return None  # a missing file: let the check name it
    return tuple((name, st.st_size, st.st_mtime_ns, st.st_ino) for name, st in stats)
