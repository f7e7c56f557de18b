"""Single-file checkpoints written with `torch.save` by the main process."""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .base import CheckpointManager
from .manifest import CheckpointError, HashingWriter

__all__ = ["FileCheckpointManager", "read_checkpoint"]

_logger = logging.getLogger("danling.checkpoint")


def _torch_load(source: str | os.PathLike | BinaryIO, map_location: Any, origin: Any) -> Any:
    try:
        # Runner payloads hold configs and RNG states, which the weights-only unpickler rejects.
        return torch.load(source, map_location=map_location, weights_only=False)
    except Exception as err:
        raise CheckpointError(f"checkpoint {origin} cannot be unpickled: {err}") from err


class FileCheckpointManager(CheckpointManager):
    """Checkpoint manager that stores the whole payload in one `torch.save` file per checkpoint.

    Only the main process writes; other ranks get `None` from `save` and can still load.
    Each checkpoint is `<directory>/<name>/state.pt` plus its manifest, so a torn or altered
    file is caught on load instead of silently resuming from garbage. Loading unpickles the
    payload: only load checkpoints you trust.

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

    def _payload_stream(self, raw: BinaryIO) -> HashingWriter:
        """Wrap the open payload file; the writer hashes bytes as `torch.save` emits them."""
        return HashingWriter(raw)

    def _write_payload(self, state: Mapping[str, Any], directory: Path) -> dict[str, dict[str, Any]]:
        with open(directory / self.payload_name, "wb") as raw:
            stream = self._payload_stream(raw)
            torch.save(dict(state), stream)
            raw.flush()
            os.fsync(raw.fileno())
        return {self.payload_name: stream.record()}

    def _read_payload(self, directory: Path, manifest: Mapping[str, Any], map_location: Any) -> dict[str, Any]:
        if self.payload_name not in manifest["files"]:
            raise CheckpointError(f"checkpoint {directory} has no {self.payload_name} in its manifest")
        return self._read_file(directory / self.payload_name, map_location)

    def _read_file(self, path: Path, map_location: Any) -> dict[str, Any]:
        return _torch_load(path, map_location, path)


def read_checkpoint(
    checkpoint: Mapping[str, Any] | bytes | str | os.PathLike, *, map_location: Any = "cpu"
) -> dict[str, Any]:
    """Load a checkpoint payload without keeping a manager around.

    Directories and files inside a checkpoint are verified against the manifest first; pointer
    files (`latest.pointer`) are followed; a plain `torch.save` file with no manifest is loaded
    as is; bytes are unpickled with `torch.load`; a mapping is returned as a shallow `dict` copy.

    Examples:
        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory()
        >>> path = FileCheckpointManager(tmp.name).save({"step": 7}, "step-000007")
        >>> read_checkpoint(path)["step"], read_checkpoint(path.parent / "latest.pointer")["step"]
        (7, 7)
        >>> read_checkpoint({"step": 1})
        {'step': 1}
        >>> tmp.cleanup()
    """
    if isinstance(checkpoint, Mapping):
        return dict(checkpoint)
    if isinstance(checkpoint, (bytes, bytearray, memoryview)):
        payload = _torch_load(io.BytesIO(bytes(checkpoint)), map_location, "<bytes>")
    elif isinstance(checkpoint, (str, os.PathLike)):
        path = Path(checkpoint)
        manager = FileCheckpointManager(path.parent, load_only=True, logger=_logger)
        return manager.load(path, map_location=map_location)
    else:
        raise TypeError(
            f"read_checkpoint() accepts a mapping, bytes or a path, got {type(checkpoint).__name__}: {checkpoint!r}"
        )
    if not isinstance(payload, dict):
        raise CheckpointError(f"checkpoint <bytes> holds a {type(payload).__name__}, expected a mapping")
    return payload
