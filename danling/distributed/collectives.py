"""Collectives that degrade to local no-ops when no multi-rank process group is active."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .process_group import is_distributed

if TYPE_CHECKING:  # only for annotations: builds without distributed support lack the class
    from torch.distributed import ProcessGroup

__all__ = ["all_gather_strided", "all_reduce_any", "all_reduce_gradients", "all_reduce_mean", "broadcast_object"]


def _on_backend_device(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """NCCL only reduces CUDA tensors (GPU-only branch); other backends take the tensor as is."""
    if dist.get_backend(group) == "nccl" and not tensor.is_cuda:
        return tensor.cuda()
    return tensor


def all_reduce_mean(tensor: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Return the mean of `tensor` over the ranks of `group` (default: all); the input is not modified.

    Integer and boolean inputs are averaged as floats. Unless `group` is active and has more than
    one rank, the result is a copy of the (float) input.

    Examples:
        >>> all_reduce_mean(torch.tensor([1, 2]))
        tensor([1., 2.])
    """
    out = tensor.detach().clone() if tensor.is_floating_point() else tensor.detach().float()
    if is_distributed(group):
        reduced = _on_backend_device(out, group)
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
        reduced /= dist.get_world_size(group)
        out = reduced.to(tensor.device)
    return out


def all_reduce_any(flag: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Return a boolean tensor, true where `flag` is true on at least one rank of `group` (default: all).

    Use it so that all ranks take the same branch (e.g. skipping an update with non-finite gradients).

    Examples:
        >>> all_reduce_any(torch.tensor(False)), all_reduce_any(torch.tensor([True, False]))
        (tensor(False), tensor([ True, False]))
    """
    out = flag.detach().to(torch.int32)
    if is_distributed(group):
        reduced = _on_backend_device(out, group)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
        out = reduced.to(flag.device)
    return out.bool()


def broadcast_object(obj: Any, src: int = 0, group: ProcessGroup | None = None) -> Any:
    """Return the `obj` of rank `src` of `group` (default: all ranks) on every rank of `group`.

    `src` counts within `group`, so ``src=0`` is the group's first rank whatever its global rank.
    Any picklable object; the identity unless `group` has more than one rank.

    Examples:
        >>> broadcast_object({"run": "a"})
        {'run': 'a'}
    """
    if not is_distributed(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=src)
    return box[0]


def all_gather_strided(items: list[Any], total: int | None = None, group: ProcessGroup | None = None) -> list[Any]:
    """Merge per-rank lists of a strided shard back into one list, on every rank of `group`.

    Rank ``r`` of the ``W`` ranks of `group` (default: all ranks) is taken to hold positions
    ``r, r + W, r + 2W, ...`` of the whole, which is how `torch.utils.data.DistributedSampler`
    shards without shuffling. Positions at or beyond `total` are dropped (the sampler pads the
    last round with repeated indices so that every rank gets as many). A collective: every rank
    of `group` must call it. A one-rank group returns `items` (cut to `total`).

    Examples:
        >>> all_gather_strided([0.5, 0.25, 0.125], total=2)
        [0.5, 0.25]
    """
    if not is_distributed(group):
        return list(items)[:total]
    shards: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shards, list(items), group=group)
    longest = max(len(shard) for shard in shards)
    merged = [shard[i] for i in range(longest) for shard in shards if i < len(shard)]
    return merged[:total]


def all_reduce_gradients(parameters: Iterable[torch.nn.Parameter], group: ProcessGroup | None = None) -> None:
    """Average the ``.grad`` of `parameters` over the ranks of `group` (default: all) in place.

    One flat buffer is reduced per dtype and device. DistributedDataParallel does this during
    backward; call it yourself for gradients that were accumulated without synchronisation (e.g.
    a partial accumulation window whose micro-steps all ran under ``no_sync``). Parameters without
    a gradient must be the same on every rank.
    """
    if not is_distributed(group):
        return
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            buckets[(p.grad.dtype, p.grad.device)].append(p.grad)
    world_size = dist.get_world_size(group)
    for grads in buckets.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat /= world_size
        for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)
