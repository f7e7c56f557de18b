"""Expert parallelism: experts split over the `expert` axis, tokens exchanged with all-to-all.

A mixture-of-experts layer keeps its experts' weights stacked along a leading expert dimension.
Its `parallelize(parallel)` hook calls [`distribute_experts`][danling.distributed.expert_parallel.distribute_experts],
which turns each stacked weight into a DTensor sharded on that dimension over the mesh of the
`expert` axis: rank `i` of an expert group holds experts `i * E/ep ... (i + 1) * E/ep - 1`, and
checkpoints (DCP) store the whole stack, so they reshard between layouts. In forward the layer
sorts its tokens by expert, [`dispatch_tokens`][danling.distributed.expert_parallel.dispatch_tokens]
sends each token to the rank holding its expert, the local experts run, and
[`combine_tokens`][danling.distributed.expert_parallel.combine_tokens] sends the results back.
Both are differentiable: backward runs the reverse exchange.

Gradients. Every rank of the expert group reads its own batch (the expert axis borrows
data-parallel ranks), so a rank's expert gradient already sums the contributions of the tokens
of the whole expert group. Dense parameters are averaged over the data domain as usual (DDP or FSDP2);
expert parameters are left out of both and reduced by
[`ExpertGradients`][danling.distributed.expert_parallel.ExpertGradients]: summed over the ranks
holding the same experts (`expert_data`) and divided by the data domain's size. Both then equal
the gradient of the mean loss over the global batch, as in one process.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from .topology import ParallelContext, ParallelTopology

__all__ = [
    "ExpertGradients",
    "combine_tokens",
    "dispatch_tokens",
    "distribute_experts",
    "expert_parameters",
    "is_expert_parameter",
]


def distribute_experts(module: nn.Module, parallel: ParallelContext, names: Sequence[str] | None = None) -> int:
    """Shard `module`'s stacked expert weights over the `expert` axis, in place; return the local expert count.

    Args:
        module: The mixture-of-experts layer (or the module that holds the stacked weights).
        parallel: The run's [`ParallelContext`][danling.distributed.topology.ParallelContext].
        names: Names of the parameters to split on their first dimension; by default all of
            `module`'s own parameters (`recurse=False`).

    Returns:
        The number of experts this rank holds (the first dimension divided by the expert degree).

    Raises:
        ValueError: A parameter's first dimension does not divide by the expert degree, or the
            parameters disagree on the number of experts.
    """
    degree = parallel.topology.degrees["expert"]
    params = dict(module.named_parameters(recurse=False))
    chosen = list(params) if names is None else list(names)
    counts = {params[name].shape[0] for name in chosen}
    if len(counts) != 1 or next(iter(counts)) % degree:
        shapes = {name: tuple(params[name].shape) for name in chosen}
        raise ValueError(
            f"expert weights {shapes} must share a first dimension (the number of experts) that "
            f"parallel.axes.expert={degree} divides"
        )
    if degree == 1 or parallel.mesh is None:
        return next(iter(counts))
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = parallel.mesh["expert"]
    for name in chosen:
        param = params[name]
        # Every rank holds the same initial stack (same seed): each keeps its own slice, no communication.
        sharded = nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)], src_data_rank=None))
        sharded.requires_grad_(param.requires_grad)
        # Marked rather than recognised by mesh: FSDP2 may shard dense parameters over the same 1-D mesh.
        sharded._danling_expert = True
        setattr(module, name, sharded)
    return next(iter(counts)) // degree


def is_expert_parameter(param: torch.Tensor) -> bool:
    """Whether `param` was split by [`distribute_experts`][danling.distributed.expert_parallel.distribute_experts]."""
    return getattr(param, "_danling_expert", False)


def expert_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """`(name, parameter)` of each expert parameter of `model` (names as `model.named_parameters` gives them)."""
    for name, param in model.named_parameters():
        if is_expert_parameter(param):
            yield name, param


def _splits(counts: torch.Tensor, group: ProcessGroup | None) -> tuple[torch.Tensor, list[int], list[int]]:
    """Exchange per-(rank, local expert) token counts; return the received counts and both split lists."""
    degree = dist.get_world_size(group)
    counts = counts.reshape(degree, -1)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    return received, counts.sum(1).tolist(), received.sum(1).tolist()


def dispatch_tokens(
    tokens: torch.Tensor, counts: torch.Tensor, group: ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send tokens sorted by global expert to the ranks holding those experts (differentiable).

    Args:
        tokens: `(n, ...)` tokens sorted by their expert.
        counts: `(E,)` int64 number of tokens for each global expert on this rank.
        group: The `expert` domain's group (`parallel.group("expert")`).

    Returns:
        The tokens this rank's experts must process, grouped by source rank then local expert,
        and their `(ep, E/ep)` counts (keep them for
        [`combine_tokens`][danling.distributed.expert_parallel.combine_tokens]).
    """
    from torch.distributed.nn.functional import all_to_all_single

    received_counts, send, receive = _splits(counts, group)
    output = tokens.new_empty((sum(receive), *tokens.shape[1:]))
    return all_to_all_single(output, tokens, receive, send, group=group), received_counts


def combine_tokens(
    outputs: torch.Tensor, counts: torch.Tensor, received_counts: torch.Tensor, group: ProcessGroup | None
) -> torch.Tensor:
    """Send expert outputs back to the ranks their tokens came from, in the order they were sent (differentiable)."""
    from torch.distributed.nn.functional import all_to_all_single

    degree = dist.get_world_size(group)
    send = received_counts.sum(1).tolist()
    receive = counts.reshape(degree, -1).sum(1).tolist()
    output = outputs.new_empty((sum(receive), *outputs.shape[1:]))
    return all_to_all_single(output, outputs, receive, send, group=group)


class ExpertGradients:
    """Reduce expert gradients over the ranks holding the same experts, once per update.

    Expert parameters are left out of DDP and FSDP2, whose average over the data domain would mix
    different experts. Before each optimizer step their gradients are summed over `expert_data`
    and divided by the data domain's size (see the module for why this equals one process).

    Args:
        parameters: The expert parameters (DTensors over the expert mesh).
        topology: The run's topology (its `expert_data` group and data size).
    """

    def __init__(self, parameters: Iterable[torch.Tensor], topology: ParallelTopology) -> None:
        self.parameters = list(parameters)
        self.ids = {id(param) for param in self.parameters}
        self.group = topology.group("expert_data")
        self.reduce_over = topology.size("expert_data")
        self.divisor = topology.size("data")

    def reduce(self) -> None:
        """Sum each local expert gradient over `expert_data` and divide it by the data size, in place."""
        with torch.no_grad():
            for param in self.parameters:
                if param.grad is None:
                    continue
                local = _local(param.grad)
                if self.reduce_over > 1:
                    dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.group)
                local.div_(self.divisor)


def _local(tensor: Any) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself otherwise), sharing its storage for in-place updates."""
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor
