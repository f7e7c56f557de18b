"""Single-file checkpoints written with `torch.save` by the main process."""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ._file_read import parse, place, read_pieces, swap_tensors
from ._writeback import WritebackWriter
from .base import CheckpointManager, Verified
from .checksums import _beside, _fsync_path, _valid_chunks
from .manifest import (
    DEFAULT_CHECKSUM,
    CheckpointError,
    HashingReader,
    check_checksum,
    mark_verified,
    take_streamed,
)
from .payload import drop_key, load_template, missing_entry, restore_objects
from .unpickling import torch_load

__all__ = ["FileCheckpointManager", "read_checkpoint"]


def _torch_load(source: str | os.PathLike | BinaryIO, map_location: Any, origin: Any, trusted: bool = False) -> Any:
    # Runner payloads are plain containers, tensors and RNG byte tensors: weights-only reads them.
    return torch_load(source, map_location=map_location, origin=origin, trusted=trusted)


class FileCheckpointManager(CheckpointManager):
    """Checkpoint manager that stores the whole payload in one `torch.save` file per checkpoint.

    Only the main process writes; other ranks get `None` from `save` and can still load.
    Each checkpoint is `<directory>/<name>/state.pt` plus its manifest, so a torn or altered
    file is caught on load instead of silently resuming from garbage. Loading reads the payload
    with torch's weights-only unpickler, so a planted payload cannot run code; `trusted=True`
    (see [`CheckpointManager`][danling.checkpoint.CheckpointManager]) lifts that for files you trust.

    The payload is checksummed while `torch.save` writes it and while `torch.load` reads it, so
    verification costs no extra pass over the file. `checksum` picks the algorithm recorded for
    new checkpoints (``"xxh3_128"``, fast, the default; or ``"sha256"``); checkpoints recording
    either verify. With XXH3-128 the manifest also records the digest of every 4 MiB piece, and
    `load_into` reads such a payload straight into the live tensors, each piece checked before
    its bytes are copied (see `_read_into`).

    Args:
        directory: Where checkpoints live.
        checksum: Checksum algorithm for new checkpoints.
        **kwargs: The options of [`CheckpointManager`][danling.checkpoint.CheckpointManager].

    Examples:
        >>> import tempfile, torch
        >>> tmp = tempfile.TemporaryDirectory()
        >>> manager = FileCheckpointManager(tmp.name, keep_latest_k=2)
        >>> for epoch in range(1, 4):
        ...     _ = manager.save({"weight": torch.full((2,), float(epoch))}, f"epoch-{epoch:06d}")
        >>> [path.name for path in manager.checkpoints()]
        ['epoch-000003', 'epoch-000002']
        >>> manager.latest.name
        'epoch-000003'
        >>> manager.load("latest")["weight"]
        tensor([3., 3.])
        >>> tmp.cleanup()
    """

    backend = "file"
    payload_name = "state.pt"

    @property
    def required_entries(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.payload_name,)

    @property
    def streamed_entries(self) -> tuple[str, ...]:  # type: ignore[override]
        # The payload is checksummed while torch.load reads it (see `_read_file`), not in a pass before.
        return (self.payload_name,)

    def __init__(self, directory: str | os.PathLike, *, checksum: str = DEFAULT_CHECKSUM, **kwargs: Any) -> None:
        self.checksum = check_checksum(checksum)
        super().__init__(directory, **kwargs)

    def _payload_stream(self, raw: BinaryIO) -> WritebackWriter:
        """Wrap the open payload file; the writer hashes bytes as `torch.save` emits them.

        With XXH3-128 it also records the digest of every 4 MiB piece, which lets `load_into`
        check the file piece by piece while it reads it straight into live tensors.
        """
        return WritebackWriter(raw, getattr(self, "checksum", DEFAULT_CHECKSUM), chunked=True)

    def _write_payload(self, state: Mapping[str, Any], directory: Path) -> dict[str, dict[str, Any]]:
        with open(directory / self.payload_name, "wb") as raw:
            stream = self._payload_stream(raw)
            try:
                torch.save(dict(state), stream)
            except RuntimeError as err:  # torch reports a failed write as "unexpected pos": keep its cause
                if stream.error is None:
                    raise
                raise stream.error from err
            raw.flush()
        # synced beside the manifest's and the directory's syncs (see `_write_payload` of the base)
        self._syncing.setdefault(directory, []).append(_beside(_fsync_path, directory / self.payload_name))
        return {self.payload_name: stream.record()}

    def _read_payload(self, directory: Path, verified: Verified, map_location: Any) -> dict[str, Any]:
        return self._read_file(directory / self.payload_name, map_location)

    def _read_file(self, path: Path, map_location: Any) -> dict[str, Any]:
        return self._read_streamed(path, take_streamed(path), map_location)

    def _read_streamed(self, path: Path, entry: Mapping[str, Any] | None, map_location: Any) -> dict[str, Any]:
        """`torch.load` of `path` through a reader that checks it against `entry` (None: verified already)."""
        if entry is None:
            return _torch_load(path, map_location, path, self.trusted)
        with HashingReader(path, entry) as stream:
            try:
                payload = _torch_load(stream, map_location, path, self.trusted)
            except BaseException:
                stream.finish()  # a damaged file explains a failed read better than the unpickler does
                raise
            stream.finish()
        mark_verified(path, entry)
        return payload

    def _reads_in_place(self, path: Path) -> bool:
        # A checkpoint directory goes through `_read_into`, which reads a payload recording the
        # digest of each piece straight into live tensors and any other the streamed way. The
        # manifest is read once, by the verification: deciding here from a read of our own cost
        # a second parse of it on every load (about 60 us of a 2.4 ms load of 12 MiB).
        return path.is_dir()

    def _read_into(self, verified: Verified, objects: Mapping[str, Any], map_location: Any) -> dict[str, Any]:
        """Read the payload straight into the live objects' tensors, checking it piece by piece, then hand it over.

        The payload's structure is read from the archive's pickle alone, by danling's restricted
        unpickler (see `danling.checkpoint._file_read`). A stored tensor that fits the live
        tensor at the same place of an object's `state_dict_to_load()` (or `state_dict()`)
        exactly (a plain contiguous CPU tensor of the same dtype and shape, its storage's only
        tensor) is read into it; every other tensor into new memory. The file is read once, in
        order, in its 4 MiB pieces, and each piece is compared with the manifest before any of
        its bytes is copied, so a damaged piece never reaches a live tensor. Then every object
        gets `load_state_dict(payload[key])`, as in the streamed path. A piece that does not
        match raises, and the pieces before it were already copied: the objects may then hold
        part of this checkpoint; load another checkpoint into them. A `map_location` other than
        the CPU, or a payload this reader does not understand (a tensor subclass, a type the
        restricted unpickler refuses), is read the streamed way, with torch's weights-only
        unpickler (or the full one, `trusted`).

        Raises:
            CheckpointError: The payload is damaged (naming the file and the piece) or lacks an
                entry for one of `objects`.
        """
        path, origin = verified.path / self.payload_name, verified.path
        entry = take_streamed(path)  # None: the file verified earlier in this verification scope
        recorded = verified.manifest["files"][self.payload_name]
        pieces = _pieces(recorded)
        if pieces is None or not (isinstance(map_location, (str, torch.device)) and str(map_location) == "cpu"):
            return self._restore(self._read_streamed(path, entry, map_location), objects, origin)
        payload = parse(path)
        if not isinstance(payload, MutableMapping):  # not a payload this reader understands
            return self._restore(self._read_streamed(path, entry, map_location), objects, origin)
        check = pieces if entry is not None else None
        for key in self.exclude_from_loading:
            drop_key(payload, key)
        live = {key: obj for key, obj in objects.items() if key not in self.exclude_from_loading}
        for key, obj in live.items():
            if key not in payload:
                read_pieces(path, recorded["size"], [], check)
                raise missing_entry(origin, key, obj, payload)
        reads, swap = place(payload, {key: load_template(obj) for key, obj in live.items()})
        read_pieces(path, recorded["size"], reads, check)
        if entry is not None:
            mark_verified(path, entry)
        payload = swap_tensors(payload, swap)
        for key, obj in live.items():
            obj.load_state_dict(payload.pop(key))
        return dict(payload)

    def _restore(self, payload: Any, objects: Mapping[str, Any], origin: Path) -> dict[str, Any]:
        """`load_into` of a payload read whole: `load`'s checks and exclusions, then `restore_objects`."""
        if not isinstance(payload, MutableMapping):
            raise CheckpointError(f"checkpoint {origin} holds a {type(payload).__name__}, expected a mapping")
        for key in self.exclude_from_loading:
            drop_key(payload, key)
        return dict(restore_objects(payload, objects, self.exclude_from_loading, origin))


def _pieces(entry: Any) -> tuple[int, list[str]] | None:
    """``(span, XXH3-128 of each piece)`` of a manifest entry that records its pieces, else None."""
    if not isinstance(entry, Mapping) or not isinstance(entry.get("xxh3_128"), str):
        return None
    chunks = entry.get("chunks")
    if not isinstance(entry.get("size"), int) or not _valid_chunks(chunks, entry["size"]):
        return None
    return chunks["bytes"], list(chunks["xxh3_128"])


def read_checkpoint(
    checkpoint: Mapping[str, Any] | bytes | str | os.PathLike, *, map_location: Any = "cpu", trusted: bool = False
) -> dict[str, Any]:
    """Same as [`danling.checkpoint.read_checkpoint`][danling.checkpoint.read_checkpoint] (any registered format)."""
    from .formats import read_checkpoint as read_any

    return read_any(checkpoint, map_location=map_location, trusted=trusted)
