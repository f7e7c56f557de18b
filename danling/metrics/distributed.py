"""Collectives used when metric values are read in a multi-process run.

Nothing here runs on the update path: meters and containers only call these helpers when a
synchronised value (`bat`, `avg`) is requested, so every rank must read those values together,
just as every rank must enter any other collective. Each helper takes a `group`: the ranks to
combine (the default `None` is every rank); a group of one rank makes the helper a no-op.

- [`sum_across_ranks`][danling.metrics.distributed.sum_across_ranks]: element-wise sum of a
  tensor of the same shape on every rank.
- [`gather_across_ranks`][danling.metrics.distributed.gather_across_ranks]: concatenation of
  shards whose first dimension differs between ranks (a rank may even have nothing), each
  broadcast by its rank straight into its slice of the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from danling.distributed.process_group import is_distributed

if TYPE_CHECKING:  # only for annotations: builds without distributed support lack the class
    from torch.distributed import ProcessGroup

__all__ = [
    "GroupHandle",
    "collective_device",
    "gather_across_ranks",
    "gather_shapes",
    "get_world_size",
    "is_distributed",
    "pack_group",
    "sum_across_ranks",
    "unpack_group",
]

# Tensors travel in a dtype every backend supports; they are cast back after the collective.
_WIRE_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_MAX_NDIM = 8
# What travels in place of dtypes some backends lack (Gloo: bool, int16, half precisions).
_WIRE_CASTS = {
    torch.bool: torch.uint8,
    torch.int16: torch.int32,
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
}


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in `group` (the default group when `None`; 1 without a process group)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


class GroupHandle:
    """Carries a container's process group through copies and pickles.

    A process group is a handle to this process's communicators, not data: a copy made in the
    same process shares it, while a pickle leaves it out (no other process could use it), so
    an unpickled container reduces over every rank until its `group` is set again.
    """

    __slots__ = ("group",)

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group

    def __copy__(self) -> GroupHandle:
        return self

    def __deepcopy__(self, memo: dict) -> GroupHandle:
        return self

    def __reduce__(self) -> tuple:
        return (GroupHandle, (None,))


def pack_group(state: dict, key: str = "group") -> dict:
    """Wrap the process group stored under `key` of an object's state for copying or pickling."""
    if state.get(key) is not None:
        state[key] = GroupHandle(state[key])
    return state


def unpack_group(state: dict, key: str = "group") -> dict:
    """Undo [`pack_group`][danling.metrics.distributed.pack_group] on a state being restored."""
    handle = state.get(key)
    if isinstance(handle, GroupHandle):
        state[key] = handle.group
    return state


def collective_device(preferred: torch.device | str | None = None, group: ProcessGroup | None = None) -> torch.device:
    """Device on which tensors must live to take part in a collective of `group`.

    NCCL needs the current CUDA device; a pure Gloo group works on CPU tensors; groups that
    mix backends per device follow the data (`preferred`), falling back to CPU.
    """
    backend = str(dist.get_backend(group))
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo" or preferred is None:
        return torch.device("cpu")
    return torch.device(preferred)


def sum_across_ranks(
    tensor: Tensor, device: torch.device | str | None = None, group: ProcessGroup | None = None
) -> Tensor:
    """Return the element-wise sum of `tensor` over the ranks of `group`, on `tensor`'s device.

    Every rank of `group` must pass a tensor of the same shape and dtype.
    """
    if not is_distributed(group):
        return tensor
    wire = tensor.to(collective_device(device or tensor.device, group), copy=True)
    dist.all_reduce(wire, group=group)
    return wire.to(tensor.device)


def gather_shapes(
    shapes: Sequence[torch.Size | None],
    device: torch.device | str | None = None,
    group: ProcessGroup | None = None,
) -> list[list]:
    """Exchange a list of shapes (or `None` for "nothing here") with every rank of `group`.

    Returns:
        One list per rank of `group`, in group rank order, each holding that rank's shapes
        (`torch.Size` or `None`).
    """
    rows = []
    for shape in shapes:
        if shape is not None and len(shape) > _MAX_NDIM:
            raise ValueError(f"cannot synchronise tensors with more than {_MAX_NDIM} dimensions, got shape {shape}")
        dims = list(shape) if shape is not None else []
        rows.append([int(shape is not None), len(dims), *dims, *([0] * (_MAX_NDIM - len(dims)))])
    local = torch.tensor(rows, dtype=torch.int64, device=collective_device(device, group)).reshape(len(rows), -1)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    result = []
    for rank_rows in gathered:
        result.append([torch.Size(row[2 : 2 + row[1]]) if row[0] else None for row in rank_rows.tolist()])
    return result


def gather_across_ranks(
    tensor: Tensor | Sequence[Tensor] | None,
    device: torch.device | str | None = None,
    group: ProcessGroup | None = None,
) -> Tensor | None:
    """Concatenate along dim 0 the shards that the ranks of `group` hold, in group rank order.

    Shards may differ in length (uneven or variable-length data) and a rank may pass `None`
    when it has seen nothing; the other dimensions must agree, and so must the dtype, except
    that integer shards of different widths are widened to the widest. A rank may pass its
    shard as a list of pieces (concatenated along dim 0): they are copied straight into the
    buffer sent, never into a local concatenation first. When `group` has a single rank (or no
    process group runs) the tensor (or the pieces, concatenated) is returned.

    Every rank's shard is received straight into its slice of the result (one broadcast per
    rank with data, in rank order), so the gathered data is held once: no padded send buffer,
    no received copy besides the result. The result is a new tensor even for the local rows;
    only a shard whose dtype travels in a wider one (bool, int16, half precisions) is cast back
    afterwards, which takes one more copy.

    Returns:
        The concatenation on the local shard's device (CPU when the local shard is `None`),
        or `None` if no rank had data.

    Raises:
        ValueError: If ranks disagree on the trailing shape or the dtype.
    """
    pieces = None if tensor is None or isinstance(tensor, Tensor) else [p for p in tensor]
    if pieces is not None:
        if not pieces:
            tensor = None
        elif len(pieces) == 1 or not is_distributed(group):
            tensor, pieces = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)), None
        else:
            dtype = pieces[0].dtype
            for piece in pieces[1:]:
                dtype = torch.promote_types(dtype, piece.dtype)
            tensor = pieces[0]  # describes the shard: trailing shape and device
    if not is_distributed(group):
        return tensor
    local_device = tensor.device if tensor is not None else torch.device("cpu")
    wire_device = collective_device(device or local_device, group)
    local_dtype = (dtype if pieces is not None else tensor.dtype) if tensor is not None else None
    length = 0 if tensor is None else sum(p.shape[0] for p in pieces) if pieces is not None else tensor.shape[0]
    code = _WIRE_DTYPES.index(local_dtype) if tensor is not None else -1
    shape = None if tensor is None else torch.Size([length, *tensor.shape[1:], code])  # dtype rides as a fake dim
    if tensor is not None and tensor.ndim == 0:
        raise ValueError("gather_across_ranks needs tensors with a first dimension, got a 0-d tensor")
    per_rank = [shapes[0] for shapes in gather_shapes([shape], wire_device, group)]
    present = [(rank, s) for rank, s in enumerate(per_rank) if s is not None]
    if not present:
        return None
    codes = {s[-1] for _, s in present}
    if len(codes) > 1 and all(not _WIRE_DTYPES[c].is_floating_point and _WIRE_DTYPES[c] != torch.bool for c in codes):
        widest = _WIRE_DTYPES[codes.pop()]
        for other in codes:
            widest = torch.promote_types(widest, _WIRE_DTYPES[other])
        present = [(rank, torch.Size([*s[:-1], _WIRE_DTYPES.index(widest)])) for rank, s in present]
    trailing = {(tuple(s[1:-1]), s[-1]) for _, s in present}
    if len(trailing) > 1:
        described = ", ".join(f"rank {r}: shape {tuple(s[:-1])} dtype {_WIRE_DTYPES[s[-1]]}" for r, s in present)
        raise ValueError(f"cannot gather shards whose trailing shape or dtype differ across ranks ({described})")
    ((trailing_shape, code),) = trailing
    dtype = _WIRE_DTYPES[code]
    wire_dtype = _WIRE_CASTS.get(dtype, dtype)
    lengths = [s[0] if s is not None else 0 for s in per_rank]
    # Every shard lands straight in its slice of the one result: the local pieces are copied
    # there, then each rank broadcasts its slice to the others. An all-gather would need a send
    # buffer padded to the longest shard, and gloo's adds a full received copy of its own.
    out = torch.empty((sum(lengths), *trailing_shape), dtype=wire_dtype, device=wire_device)
    offsets = [sum(lengths[:rank]) for rank in range(len(lengths))]
    row = offsets[dist.get_rank(group)]
    for piece in pieces if pieces is not None else ([tensor] if tensor is not None else []):
        out[row : row + piece.shape[0]] = piece
        row += piece.shape[0]
    for rank, (offset, rows) in enumerate(zip(offsets, lengths)):
        if rows:
            dist.broadcast(out[offset : offset + rows], group=group, group_src=rank)
    return out.to(device=local_device, dtype=dtype)
