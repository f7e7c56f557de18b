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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from ._dcp_read import read_entry, read_into
from .checksums import BackgroundVerification

__all__ = ["read_whole"]


def _destination(target: Any) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """The plain tensor a target's bytes go into and that tensor's offset in the stored tensor, or None.

    A plain tensor is the whole stored tensor; a DTensor contributes its local shard, described by
    the one chunk DCP itself would plan for it.
    """
    if type(target) is torch.Tensor:
        return target.detach(), (0,) * target.dim()
    if not isinstance(target, DTensor):
        return None
    try:
        chunks = target.__create_chunk_list__()
    except (RuntimeError, ValueError):  # partial placements: DCP's path decides
        return None
    local = target.to_local().detach()
    if len(chunks) != 1 or type(local) is not torch.Tensor or tuple(chunks[0].sizes) != tuple(local.shape):
        return None
    return local, tuple(chunks[0].offsets)


def _whole(metadata: Metadata, fqn: str, target: Any) -> tuple[Any, torch.Tensor | None] | None:
    """Where the entry `fqn` is stored when it is one untransformed piece that `target` takes as it is, else None.

    Returns its storage record and the tensor to read into (None for a non-tensor entry).
    """
    stored = metadata.state_dict_metadata.get(fqn)
    destination = None
    if isinstance(stored, BytesStorageMetadata) and not isinstance(target, torch.Tensor):
        index = MetadataIndex(fqn)
    elif isinstance(stored, TensorStorageMetadata) and (destination := _destination(target)) is not None:
        local, offsets = destination
        same = [chunk for chunk in stored.chunks if tuple(chunk.offsets) == offsets]
        if len(same) != 1 or tuple(same[0].sizes) != tuple(local.shape) or local.dtype != stored.properties.dtype:
            return None  # stored in other pieces than this rank holds: DCP reshards
        index = MetadataIndex(fqn, offsets)
    else:
        return None
    info = metadata.storage_data.get(index)
    if info is None or info.transform_descriptors:
        return None
    return info, None if destination is None else destination[0]


def read_whole(
    directory: Path,
    metadata: Metadata,
    targets: dict[str, Any],
    verification: BackgroundVerification | None,
    trusted: bool,
    counted: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Read the `targets` stored in one piece: a non-tensor entry replaces its target, a tensor (a DTensor's
    local shard) is read into it.

    Each file is read front to back, every range once `verification` passed it; `counted` is
    called after each entry read. Returns the targets left for `dcp.load`.
    """
    found = {fqn: _whole(metadata, fqn, target) for fqn, target in targets.items()}
    rest = {fqn: target for fqn, target in targets.items() if found[fqn] is None}
    order = sorted((where[0].relative_path, where[0].offset, fqn) for fqn, where in found.items() if where is not None)
    handles: dict[str, Any] = {}
    plain: dict[bytes, Any] = {}
    try:
        for relative_path, _, fqn in order:
            info, destination = found[fqn]
            handle = handles.get(relative_path)
            if handle is None:
                handle = handles[relative_path] = open(directory / relative_path, "rb", buffering=0)  # noqa: SIM115
            if verification is not None:
                verification.wait(relative_path, info.offset + info.length)
            if destination is None:
                data = io.BytesIO(_read_range(handle, info.offset, info.length))
                targets[fqn] = read_entry(data, f"{directory} (entry {fqn})", trusted, plain)
            elif not read_into(handle, info.offset, info.length, destination):
                rest[fqn] = targets[fqn]  # not a plain tensor archive: DCP's reader decides
                continue
            counted()
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
