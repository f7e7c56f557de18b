"""Checksums of checkpoint files: computed while files are written or read, or in one pass over them.

Checksums guard against torn and damaged files, not against tampering (the restricted unpickler
covers planted code). The default is XXH3-128 (the `xxhash` package), which hashes at memory
speed; SHA-256 stays available (``checksum="sha256"``), and a manifest entry recording either
verifies. Files are hashed through a memory map, so a check copies nothing out of the page cache.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

try:  # a small C extension; without it checkpoints fall back to SHA-256
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a dependency
    xxhash = None

__all__ = [
    "CHECKSUMS",
    "DEFAULT_CHECKSUM",
    "HashingWriter",
    "HashingReader",
    "check_checksum",
    "new_digest",
    "file_record",
    "BackgroundVerification",
]

CHUNK_BYTES = 4 * 1024 * 1024
"""Span of each per-chunk digest recorded by `file_record(..., chunked=True)`."""
CHECKSUMS = ("xxh3_128", "sha256")
"""Checksum algorithms a manifest entry may record, fastest first (verification uses the first present)."""
DEFAULT_CHECKSUM = "xxh3_128" if xxhash is not None else "sha256"


def check_checksum(name: Any) -> str:
    """Validate a checksum algorithm name (one of `CHECKSUMS`)."""
    if name not in CHECKSUMS:
        raise ValueError(f"checksum must be one of {CHECKSUMS}, got {name!r}")
    if name == "xxh3_128" and xxhash is None:
        raise ValueError("checksum 'xxh3_128' needs the xxhash package (pip install xxhash), or use 'sha256'")
    return name


def new_digest(name: str) -> Any:
    """A fresh incremental hash object for checksum algorithm `name`."""
    if name == "xxh3_128":
        if xxhash is None:
            from .manifest import CheckpointError

            raise CheckpointError("this checkpoint records XXH3-128 checksums; install xxhash to verify it")
        return xxhash.xxh3_128()
    return hashlib.sha256()


class HashingWriter:
    """File-like wrapper that checksums and counts bytes on their way to `raw`.

    `torch.save` writes its archive strictly sequentially, so the digest of everything passed
    to `write` equals the digest of the finished file; that spares a second read at save time.
    With `chunked` (XXH3-128 only) it also digests each `CHUNK_BYTES` piece of the stream, cut
    at the same offsets as `file_record(..., chunked=True)`, so `record` equals that entry.
    Plain XXH3 keeps up with memory and runs inline; SHA-256 is hashed on a helper thread while
    the caller's thread writes a large buffer, and with pieces the helper thread digests the
    pieces while the caller's thread hashes the whole and writes (the hashes release the GIL).

    Examples:
        >>> import io
        >>> sink = HashingWriter(io.BytesIO(), checksum="sha256")
        >>> sink.write(b"abc")
        3
        >>> sink.record()["size"], sink.record()["sha256"][:12]
        (3, 'ba7816bf8f01')
    """

    parallel_threshold = 1 << 20

    def __init__(self, raw: Any, checksum: str = DEFAULT_CHECKSUM, *, chunked: bool = False) -> None:
        self.raw = raw
        self.size = 0
        self.error: OSError | None = None  # torch.save reports a failed write without its cause
        self.checksum = check_checksum(checksum)
        self._hash = new_digest(checksum)
        self._pieces: list[str] | None = [] if chunked and checksum == "xxh3_128" else None
        self._piece = new_digest(checksum) if self._pieces is not None else None  # the piece being filled
        self._parallel = checksum == "sha256" or self._pieces is not None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data)  # torch.save writes many small records: this path stays short
        try:
            if self._parallel and view.nbytes >= self.parallel_threshold:
                # the buffer stays alive and unchanged until both the hash and the write finish; with
                # pieces, the whole-file XXH3 runs here and the pieces' beside it (two passes, two threads)
                pieces = self._pieces is not None
                hashed = _beside(self._absorb_pieces if pieces else self._absorb, view)
                try:
                    if pieces:
                        self._hash.update(view)
                    self.raw.write(view)
                finally:
                    hashed.result()
            else:
                self._absorb(view)
                self.raw.write(view)
        except OSError as err:
            self.error = err
            raise
        self.size += view.nbytes
        return view.nbytes

    def _absorb(self, view: memoryview) -> None:
        self._hash.update(view)
        self._absorb_pieces(view)

    def _absorb_pieces(self, view: memoryview) -> None:
        if self._piece is None:
            return
        filled = self.size % CHUNK_BYTES  # `size` counts the bytes before `view`
        if filled + view.nbytes < CHUNK_BYTES:
            self._piece.update(view)
            return
        view, start = view.cast("B") if view.format != "B" or view.ndim != 1 else view, 0
        while start < view.nbytes:
            stop = min(view.nbytes, start + CHUNK_BYTES - filled)
            self._piece.update(view[start:stop])
            if filled + stop - start == CHUNK_BYTES:  # a piece is complete: its digest, then a fresh one
                self._pieces.append(self._piece.hexdigest())
                self._piece.reset()
            start, filled = stop, 0

    def flush(self) -> None:
        self.raw.flush()

    def record(self) -> dict[str, Any]:
        """Return the manifest entry (`size`, the checksum, with `chunked` the pieces) of the bytes written so far."""
        chunks: list[str] = []
        if self._pieces is not None:  # and the last piece, if partial
            chunks = self._pieces + ([self._piece.hexdigest()] if self.size % CHUNK_BYTES else [])
        return _record(self.size, self.checksum, self._hash.hexdigest(), chunks if len(chunks) > 1 else [])


class HashingReader:
    """Read-only, seekable view of a file that checksums the whole file while a reader consumes it.

    `torch.load` reads a zip archive in place (`readinto` straight into tensor memory), mostly
    front to back, after a glance at the index at the end. Bytes are hashed as they arrive while
    they continue the hashed prefix; small skipped spans (zip headers) are read to fill the gap,
    larger jumps are left for `finish`, which hashes whatever is left. So the file is read about
    once, and `finish` proves the bytes match the manifest `entry` (raising
    [`CheckpointError`][danling.checkpoint.CheckpointError] otherwise).

    Examples:
        >>> import tempfile, torch
        >>> path = Path(tempfile.mkdtemp()) / "t.pt"
        >>> torch.save({"x": torch.arange(3)}, path)
        >>> entry = file_record(path)
        >>> with HashingReader(path, entry) as stream:
        ...     torch.load(stream)["x"]
        tensor([0, 1, 2])
    """

    gap_limit = 1 << 16

    def __init__(self, path: str | os.PathLike, entry: Mapping[str, Any]) -> None:
        self.path = Path(path)
        self.entry = entry
        self.checksum = _entry_checksum(entry, self.path)
        self._hash = new_digest(self.checksum)
        self._file = open(self.path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        self._size = os.fstat(self._file.fileno()).st_size
        self._hashed = 0  # bytes [0, _hashed) went into the digest

    def __enter__(self) -> HashingReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def readinto(self, buffer: Any) -> int:
        start = self._file.tell()
        count = self._file.readinto(buffer)
        if count:
            self._absorb(start, memoryview(buffer).cast("B")[:count])
        return count

    def read(self, size: int = -1) -> bytes:
        size = self._size - self._file.tell() if size is None or size < 0 else size
        buffer = bytearray(max(size, 0))
        return bytes(buffer[: self.readinto(buffer)])

    def _absorb(self, start: int, view: memoryview) -> None:
        end = start + view.nbytes
        if start > self._hashed:
            if start - self._hashed > self.gap_limit:
                return  # a jump ahead (the index at the end): hashed later, in order
            self._hash_span(self._hashed, start)
        if start <= self._hashed < end:
            self._hash.update(view[self._hashed - start :])
            self._hashed = end

    def _hash_span(self, start: int, stop: int) -> None:
        while start < stop:
            chunk = os.pread(self._file.fileno(), min(CHUNK_BYTES, stop - start), start)
            if not chunk:
                break
            self._hash.update(chunk)
            start += len(chunk)
        self._hashed = start

    def finish(self) -> None:
        """Hash what the reader skipped and compare size and digest with the manifest entry."""
        if self._size != self.entry["size"]:
            raise _torn(self.path, self._size, self.entry["size"])
        self._hash_span(self._hashed, self._size)
        if self._hash.hexdigest() != self.entry[self.checksum]:
            raise _corrupt(self.path, self.checksum)

    def close(self) -> None:
        self._file.close()


# One pool of two threads, made on first use, for hashing and fsyncs beside the caller's thread.
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _hash_pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="danling-hash")
        return _POOL


def submit(executor: Executor, fn: Callable[..., Any], *args: Any) -> Future:
    """`executor.submit(fn, *args)`, or `fn(*args)` run here when the executor takes no more work.

    At interpreter exit Python shuts every thread pool down before it joins the threads still
    running, so a background checkpoint write that outlives the script (the interpreter waits for
    it) finds its helper pools closed: it then does their work in its own thread instead of failing.
    """
    try:
        return executor.submit(fn, *args)
    except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # delivered through the future, as from a pool thread
            future.set_exception(err)
        return future


def _beside(fn: Callable[..., Any], *args: Any) -> Future:
    """Run `fn(*args)` on the helper pool, beside the caller's thread."""
    return submit(_hash_pool(), fn, *args)


def _entry_checksum(entry: Mapping[str, Any], path: Any) -> str:
    for name in CHECKSUMS:
        if isinstance(entry.get(name), str):
            return name
    from .manifest import CheckpointError

    raise CheckpointError(f"manifest entry of {path} records no checksum this version knows ({', '.join(CHECKSUMS)})")


def _torn(path: Path, actual: int, expected: int) -> Exception:
    from .manifest import CheckpointError  # the errors live with the manifest, which imports this module

    return CheckpointError(f"checkpoint file {path} is torn: {actual} bytes on disk, manifest records {expected}")


def _corrupt(path: Path, checksum: str, span: tuple[int, int] | None = None) -> Exception:
    from .manifest import CheckpointError

    label = {"xxh3_128": "XXH3-128", "sha256": "SHA-256"}[checksum]
    if span is None:
        return CheckpointError(f"checkpoint file {path} is corrupt: its {label} does not match the manifest")
    return CheckpointError(
        f"checkpoint file {path} is corrupt: its {label} of bytes {span[0]}-{span[1]} does not match the manifest"
    )


def _digest_file(path: str | os.PathLike, checksum: str, *, chunked: bool = False) -> tuple[int, str, list[str]]:
    """Size, hex digest and (with `chunked`, XXH3 only) per-chunk digests of a file.

    The file is hashed through a memory map (no copy out of the page cache), in `CHUNK_BYTES`
    pieces. The chunk digests are computed on a helper thread alongside the whole-file digest
    (both release the GIL), so recording them adds no time where a core is free.
    """
    digest = new_digest(checksum)
    chunks: list[str] = []
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size:
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                pieces = [view[start : start + CHUNK_BYTES] for start in range(0, size, CHUNK_BYTES)]
                split = None
                if chunked and checksum == "xxh3_128" and len(pieces) > 1:
                    split = _beside(lambda: [xxhash.xxh3_128_hexdigest(piece) for piece in pieces])
                try:
                    for piece in pieces:  # bounded pieces: SHA-256 holds the GIL less long
                        digest.update(piece)
                finally:
                    chunks = split.result() if split is not None else []  # the pieces stay mapped until then
                    for piece in pieces:
                        piece.release()
                    view.release()
    return size, digest.hexdigest(), chunks


def _record(size: int, checksum: str, digest: str, chunks: list[str]) -> dict[str, Any]:
    record: dict[str, Any] = {"size": size, checksum: digest}
    if chunks:
        record["chunks"] = {"bytes": CHUNK_BYTES, checksum: chunks}
    return record


def file_record(
    path: str | os.PathLike, *, fsync: bool = False, checksum: str = DEFAULT_CHECKSUM, chunked: bool = False
) -> dict[str, Any]:
    """Checksum `path` and return its manifest entry; optionally `fsync` it as well.

    With `chunked` (XXH3-128 only), a file larger than `CHUNK_BYTES` also records the digest of
    each `CHUNK_BYTES` piece under ``"chunks"``, so a reader can verify it piece by piece while it
    reads (see [`BackgroundVerification`][danling.checkpoint.checksums.BackgroundVerification]).
    The fsync runs on a helper thread while the file is hashed: the disk flush and the hashing
    overlap instead of adding up.
    """
    check_checksum(checksum)
    if not fsync:
        size, digest, chunks = _digest_file(path, checksum, chunked=chunked)
        return _record(size, checksum, digest, chunks)
    flushed = _beside(_fsync_path, path)
    try:
        size, digest, chunks = _digest_file(path, checksum, chunked=chunked)
    finally:
        flushed.result()
    return _record(size, checksum, digest, chunks)


def _forget_pools() -> None:
    # A forked child inherits the pools but not their threads: work submitted there would wait
    # forever (a run forked after its parent saved a checkpoint hung in its first save).
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


def _fsync_path(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digests(jobs: list[tuple[Path, str]]) -> list[str]:
    """Hex digests of several files, two at a time when there are several (the hashes release the GIL)."""
    if len(jobs) < 2:
        return [_digest_file(path, checksum)[1] for path, checksum in jobs]
    futures = [_beside(_digest_file, path, checksum) for path, checksum in jobs]
    return [future.result()[1] for future in futures]


class BackgroundVerification:
    """Checks files against their manifest entries on helper threads while the caller reads them.

    Each file is hashed front to back; an entry with ``"chunks"`` is checked one `CHUNK_BYTES`
    piece at a time, so its verified prefix grows while the rest is still being hashed (an entry
    without them, such as one written by an earlier version or with SHA-256, counts as verified
    once its whole-file digest matched). A reader calls `wait` before it touches a byte range and
    so only ever reads bytes that matched; `finish` waits for every file and raises the first
    failure. The failure names the file and, for a chunk, the byte range whose digest differed.

    Args:
        jobs: ``(key, path, entry)`` of each file to check; `key` is what `wait` is called with.
        on_success: Called (in the thread calling `finish`) once every file verified.
    """

    def __init__(
        self, jobs: Iterable[tuple[str, Path, Mapping[str, Any]]], on_success: Callable[[], None] | None = None
    ) -> None:
        self._ready = threading.Condition()
        self._verified: dict[str, int] = {}
        self._on_success = on_success
        self.failure: BaseException | None = None
        self._stopped = False
        jobs = list(jobs)
        for key, _, _ in jobs:
            self._verified[key] = 0
        self._futures = [_beside(self._check, *job) for job in jobs]

    def wait(self, key: str, end: int) -> None:
        """Block until bytes ``[0, end)`` of file `key` verified; raise the failure if any file failed."""
        with self._ready:
            while self.failure is None and self._verified.get(key, end) < end:
                self._ready.wait()
        if self.failure is not None:
            raise self.failure

    def finish(self) -> None:
        """Wait until every file is checked; raise the first failure."""
        for future in self._futures:
            future.result()
        if self.failure is not None:
            raise self.failure
        if self._on_success is not None:
            self._on_success()
            self._on_success = None

    def stop(self) -> None:
        """Abandon the checks still running (the caller gave up on the load); returns once they ended."""
        with self._ready:
            self._stopped = True
        for future in self._futures:
            future.result()

    def _advance(self, key: str, end: int) -> bool:
        with self._ready:
            self._verified[key] = end
            self._ready.notify_all()
            return not self._stopped

    def _check(self, key: str, path: Path, entry: Mapping[str, Any]) -> None:
        try:
            checksum = _entry_checksum(entry, path)
            chunks = entry.get("chunks")
            if checksum == "xxh3_128" and _valid_chunks(chunks, entry["size"]):
                self._check_chunks(key, path, chunks["bytes"], chunks[checksum])
            elif _digest_file(path, checksum)[1] != entry[checksum]:
                raise _corrupt(path, checksum)
            else:
                self._advance(key, entry["size"])
        except BaseException as err:  # handed to the reader, which raises it in its own thread
            with self._ready:
                self.failure = self.failure or err
                self._ready.notify_all()

    def _check_chunks(self, key: str, path: Path, span: int, expected: list[str]) -> None:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                for index, wanted in enumerate(expected):
                    piece = view[index * span : (index + 1) * span]
                    actual = xxhash.xxh3_128_hexdigest(piece)
                    end = index * span + piece.nbytes
                    piece.release()
                    if actual != wanted:
                        raise _corrupt(path, "xxh3_128", (index * span, end))
                    if not self._advance(key, end):
                        return
            finally:
                view.release()


def _valid_chunks(chunks: Any, size: int) -> bool:
    """Whether a ``"chunks"`` record covers a file of `size` bytes (if not, the whole-file digest is used)."""
    if not isinstance(chunks, Mapping) or xxhash is None:
        return False
    span, digests = chunks.get("bytes"), chunks.get("xxh3_128")
    if isinstance(span, bool) or not isinstance(span, int) or span <= 0 or not isinstance(digests, list):
        return False
    return size > 0 and len(digests) == -(-size // span) and all(isinstance(digest, str) for digest in digests)
