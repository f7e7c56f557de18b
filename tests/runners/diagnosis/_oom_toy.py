"""A `TinyRunner` whose model runs out of memory (raises `torch.OutOfMemoryError`) on chosen batches."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.runners._torch_toy import TinyRunner


class RunsOutOfMemory(nn.Module):
    """Passes its input through; raises `torch.OutOfMemoryError` on the calls `fail` names, while the batch
    holds more than `fits` samples (the pieces of a split fit), or always with `fits=0`."""

    def __init__(self, fail: set[int], fits: int) -> None:
        super().__init__()
        self.fail, self.fits, self.calls = fail, fits, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls in self.fail and x.shape[0] > self.fits:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return x


class RunsOutOfMemoryInBackward(nn.Module):
    """Passes its input through; on the calls `fail` names, the backward pass through it raises
    `torch.OutOfMemoryError` (after the layers behind it got their gradients: a partial backward)."""

    def __init__(self, fail: set[int]) -> None:
        super().__init__()
        self.fail, self.calls = fail, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and x.requires_grad:
            self.calls += 1
            if self.calls in self.fail:
                x.register_hook(_run_out)
        return x


def _run_out(grad: torch.Tensor) -> torch.Tensor:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected in backward)")


class OomRunner(TinyRunner):
    """No dropout (a split draws no other masks); on rank `rank_out` the model runs out of memory on the
    forward calls in `fail`, and its backward on those in `fail_backward` (counted from 1 over the run's
    training forwards, pieces of a split included)."""

    dropout = 0.0
    n_train = 32

    def __init__(
        self,
        config: Any,
        *,
        fail: set[int] = frozenset(),
        fits: int = 2,
        rank_out: int = 1,
        fail_backward: set[int] = frozenset(),
    ) -> None:
        super().__init__(config)
        here = self.rank == rank_out
        first, *rest = self.model
        forward = RunsOutOfMemory(set(fail) if here else set(), fits)
        backward = RunsOutOfMemoryInBackward(set(fail_backward) if here else set())
        self.model = nn.Sequential(forward, first, backward, *rest)
