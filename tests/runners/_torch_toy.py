"""A tiny regression `TorchRunner` shared by the torch runner tests and their child processes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from danling.runners import TorchRunner

WEIGHTS = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def make_data(n: int, seed: int = 0) -> TensorDataset:
    """`n` noisy samples of a fixed linear function of 4 features (identical for equal `seed`)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    y = x @ WEIGHTS + 0.1 * torch.randn(n, 1, generator=generator)
    return TensorDataset(x, y)


def make_model(dropout: float = 0.1) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(dropout), nn.Linear(8, 1))


class TinyRunner(TorchRunner):
    """MLP regression on `make_data`; the dropout makes the result depend on the torch RNG."""

    n_train = 20
    n_val = 8
    dropout = 0.1

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.model = make_model(self.dropout)
        self.criterion = nn.MSELoss()
        self.datasets.train = make_data(self.n_train, seed=0)
        self.datasets.val = make_data(self.n_val, seed=1)


def tiny_config(root: Any, **overrides: Any) -> dict[str, Any]:
    """2 epochs of AdamW, batch size 4, synchronous checkpoints, no log file."""
    config = {
        "workspace_root": str(root),
        "epochs": 2,
        "seed": 0,
        "log": False,
        "optim.type": "adamw",
        "optim.lr": 0.01,
        "dataloader.batch_size": 4,
        "checkpoint.async_enabled": False,
    }
    config.update(overrides)
    return config


def model_state(runner: TorchRunner) -> dict[str, torch.Tensor]:
    """Detached CPU copy of the unwrapped model's weights."""
    return {key: value.detach().cpu().clone() for key, value in runner.unwrap(runner.model).state_dict().items()}
