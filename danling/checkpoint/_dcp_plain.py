"""Reading the DCP entries that are stored in one piece, without DCP's load machinery.

`dcp.load` plans every read (flattening the targets, matching them with the metadata, a local and
a global plan step) before its reader touches a file, which costs more than reading a few dozen
small entries: the runner state, RNG snapshots and loader positions a restore reads first. An
entry stored whole needs no plan: a non-tensor entry is one pickled archive, and a tensor saved
from a plain tensor is one chunk that the `.metadata` index places in one file. Those are read
here, straight from their byte range, with the same checks as DCP's path in
[`danling.checkpoint._dcp_io`][]: the bytes are read once the running verification passed them,
pickles go through the restricted unpickler unless trusted, and a tensor is read into its target
by [`read_into`][danling.checkpoint._dcp_read.read_into]. Anything else (a sharded tensor, a
transformed entry) is left to `dcp.load`.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from ._dcp_read import NOT_PLAIN, read_into, read_plain
from .checksums import BackgroundVerification
from .unpickling import SAFE_GLOBALS, torch_load

__all__ = ["read_whole"]


def _whole(metadata: Metadata, fqn: str, target: Any) -> Any:
    """Where the entry `fqn` is stored when it is one untransformed piece that `target` can take, else None."""
    stored = metadata.state_dict_metadata.get(fqn)
    if isinstance(stored, BytesStorageMetadata) and not isinstance(target, torch.Tensor):
        index = MetadataIndex(fqn)
    elif isinstance(stored, TensorStorageMetadata) and type(target) is torch.Tensor and len(stored.chunks) == 1:
        chunk = stored.chunks[0]
        if any(chunk.offsets) or not tuple(chunk.sizes) == tuple(stored.size) == tuple(target.shape):
            return None
        index = MetadataIndex(fqn, chunk.offsets)
    else:
        return None
    info = metadata.storage_data.get(index)
    return None if info is None or info.transform_descriptors else info


def read_whole(
    directory: Path,
    metadata: Metadata,
    targets: dict[str, Any],
    verification: BackgroundVerification | None,
    trusted: bool,
) -> dict[str, Any]:
    """Read the `targets` stored in one piece: a non-tensor entry replaces its target, a tensor is read into it.

    Each file is read front to back, every range once `verification` passed it. Returns the
    targets left for `dcp.load`.
    """
    found = {fqn: _whole(metadata, fqn, target) for fqn, target in targets.items()}
    rest = {fqn: target for fqn, target in targets.items() if found[fqn] is None}
    order = sorted((info.relative_path, info.offset, fqn) for fqn, info in found.items() if info is not None)
    handles: dict[str, Any] = {}
    plain: dict[bytes, Any] = {}
    try:
        for relative_path, _, fqn in order:
            info = found[fqn]
            handle = handles.get(relative_path)
            if handle is None:
                handle = handles[relative_path] = open(directory / relative_path, "rb", buffering=0)  # noqa: SIM115
            if verification is not None:
                verification.wait(relative_path, info.offset + info.length)
            if not isinstance(targets[fqn], torch.Tensor):
                targets[fqn] = _plain(_read_range(handle, info.offset, info.length), directory, fqn, trusted, plain)
            elif not read_into(handle, info.offset, info.length, targets[fqn]):
                rest[fqn] = targets[fqn]  # not a plain tensor archive: DCP's reader decides
    finally:
        for handle in handles.values():
            handle.close()
    return rest


def _read_range(handle: Any, offset: int, length: int) -> bytes:
    data = os.pread(handle.fileno(), length, offset)
    while len(data) < length:
        more = os.pread(handle.fileno(), length - len(data), offset + len(data))
        if not more:
            raise OSError(f"unexpected end of checkpoint data at byte {offset + len(data)} of {handle.name}")
        data += more
    return data


def _plain(data: bytes, directory: Path, fqn: str, trusted: bool, cache: Mapping[bytes, Any]) -> Any:
    """Unpickle a non-tensor entry as the planner of `danling.checkpoint._dcp_io` does."""
    value = NOT_PLAIN if trusted else read_plain(io.BytesIO(data), list(SAFE_GLOBALS), cache)
    if value is NOT_PLAIN:
        value = torch_load(io.BytesIO(data), map_location="cpu", origin=f"{directory} (entry {fqn})", trusted=trusted)
    return value
