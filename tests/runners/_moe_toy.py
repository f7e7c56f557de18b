"""A small mixture-of-experts regression model whose `parallelize` splits its experts over the expert axis."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from danling.distributed import ParallelContext
from danling.distributed.expert_parallel import combine_tokens, dispatch_tokens, distribute_experts
from tests.runners._parallel_toy import ParallelRegression


class Experts(nn.Module):
    """`num_experts` two-layer MLPs with stacked weights (expert first), applied to tokens grouped by expert."""

    def __init__(self, num_experts: int, width: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, width, hidden) / width**0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden, width) / hidden**0.5)
        self.local_experts = num_experts
        self.group: Any = None  # the expert group once parallelized; None runs every expert here

    def parallelize(self, parallel: ParallelContext) -> None:
        self.local_experts = distribute_experts(self, parallel)
        if parallel.topology.degrees["expert"] > 1 and dist.is_initialized():
            self.group = parallel.group("expert") or dist.group.WORLD

    def _run(self, tokens: torch.Tensor, local_index: torch.Tensor) -> torch.Tensor:
        w1, w2 = self.w1, self.w2
        if hasattr(w1, "to_local"):
            w1, w2 = w1.to_local(), w2.to_local()
        out = tokens.new_zeros(tokens.shape)
        for expert in range(self.local_experts):
            rows = (local_index == expert).nonzero().squeeze(1)
            hidden = torch.relu(tokens.index_select(0, rows) @ w1[expert])
            out = out.index_add(0, rows, hidden @ w2[expert])
        return out

    def forward(self, tokens: torch.Tensor, expert_index: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(expert_index, stable=True)
        counts = torch.bincount(expert_index, minlength=self.num_experts)
        ordered = tokens.index_select(0, order)
        if self.group is None:
            out = self._run(ordered, expert_index.index_select(0, order))
        else:
            received, received_counts = dispatch_tokens(ordered, counts, self.group)
            local = torch.arange(self.local_experts).repeat(received_counts.shape[0])
            out = self._run(received, local.repeat_interleave(received_counts.flatten()))
            out = combine_tokens(out, counts, received_counts, self.group)
        return out.index_select(0, torch.argsort(order))  # back to the tokens' own order


class MoERegression(nn.Module):
    """Input layer, a top-1 routed mixture of `num_experts` experts (residual), and a head."""

    def __init__(self, num_experts: int = 4, width: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.router = nn.Linear(width, num_experts)
        self.experts = Experts(num_experts, width, 2 * width)
        self.head = nn.Linear(width, 1)

    def parallelize(self, parallel: ParallelContext) -> None:
        self.received = parallel
        self.experts.parallelize(parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        probability, index = torch.softmax(self.router(h), dim=-1).max(dim=-1)
        return self.head(h + probability.unsqueeze(-1) * self.experts(h, index))


class MoERunner(ParallelRegression):
    """The parallel tests' regression runner, training the mixture of experts."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        torch.manual_seed(0)  # the same experts on every rank and in the one-process reference
        self.model = MoERegression()
