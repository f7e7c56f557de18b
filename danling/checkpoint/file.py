"""Single-file checkpoints written with `torch.save` by the main process."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ._writeback import WritebackWriter
from .base import CheckpointManager, Verified
from .checksums import _beside, _fsync_path
from .manifest import (
    DEFAULT_CHECKSUM,
    HashingReader,
    check_checksum,
    mark_verified,
    take_streamed,
)
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
    either verify.

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
        """Wrap the open payload file; the writer hashes bytes as `torch.save` emits them."""
        return WritebackWriter(raw, getattr(self, "checksum", DEFAULT_CHECKSUM))

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
        entry = take_streamed(path)
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


def read_checkpoint(
    checkpoint: Mapping[str, Any] | bytes | str | os.PathLike, *, map_location: Any = "cpu", trusted: bool = False
) -> dict[str, Any]:
    """Same as [`danling.checkpoint.read_checkpoint`][danling.checkpoint.read_checkpoint] (any registered format)."""
    from .formats import read_checkpoint as read_any

    return read_any(checkpoint, map_location=map_location, trusted=trusted)
