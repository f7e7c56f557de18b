"""A residual MLP with repeated blocks, the runner that trains it, and helpers of the parallel runner tests."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from danling.runners import Runner
from tests.runners._torch_toy import make_data

# Tensor parallel over each block: the first layer's outputs split, the second layer's inputs split.
TENSOR_PLAN = {"layers.*.up": "colwise", "layers.*.down": "rowwise"}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class ResidualMLP(nn.Module):
    def __init__(self, width: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class ParallelRegression(Runner):
    """Regression on 32 samples; records every micro-step loss, averaged over the data-parallel ranks, and
    the full weights after each update listed in `snapshot_steps`."""

    snapshot_steps: tuple[int, ...] = ()

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        torch.manual_seed(0)  # the same initial weights on every rank and in the reference run
        self.model = ResidualMLP()
        self.criterion = nn.MSELoss()
        self.datasets.train = make_data(32, seed=0)
        self.datasets.val = make_data(8, seed=1)
        self.losses: list[float] = []
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}

    def optimizer_step(self) -> bool:
        applied = super().optimizer_step()
        if applied and self.train_state.global_step in self.snapshot_steps:
            self.snapshots[self.train_state.global_step] = full_weights(self)
        return applied

    def train_step(self, data: Any) -> tuple[Any, Any]:
        pred, loss = super().train_step(data)
        self.losses.append(float(self.reduce(loss)))
        return pred, loss


def parallel_config(root: str, name: str, **overrides: Any) -> dict[str, Any]:
    config = {
        "stack": "parallel",
        "workspace_root": os.path.join(root, name),
        "epochs": 2,
        "seed": 0,
        "log": False,
        "optim.type": "sgd",
        "optim.lr": 0.01,
        "optim.momentum": 0.5,
        "dataloader.batch_size": 4,
        "dataloader.train.shuffle": False,
        "checkpoint.async_enabled": False,
    }
    config.update(overrides)
    return config


def full_weights(runner: Any) -> dict[str, torch.Tensor]:
    """The whole model's weights on every rank (gathers shards: collective when the model is sharded)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=dist.is_initialized())
    state = get_model_state_dict(runner.checkpointing.checkpoint_model, options=options)
    return {key: value.detach().cpu().clone() for key, value in state.items()}


def ema_weights(runner: Any) -> dict[str, torch.Tensor]:
    """This rank's view of the EMA weights: whole tensors (gathered when sharded; a pipeline stage's own only)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=dist.is_initialized())
    state = get_model_state_dict(runner.unwrap(runner.ema), options=options)
    return {key: value.detach().cpu().clone() for key, value in state.items()}
