"""The real `ParallelRunner` on the pipeline test model: it splits the model into stages, builds the
schedule, the update strategy and the loaders of data-free stages, and dispatches the three step hooks."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from danling.metrics import regression_metrics
from danling.runners import ParallelRunner, TorchRunner
from tests.runners._pipeline_harness import IN, make_net


def _dataset(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, IN, generator=generator), torch.randn(n, 1, generator=generator))


def _bind(runner: TorchRunner) -> None:
    runner.model = make_net()
    runner.criterion = nn.MSELoss()
    runner.metrics = regression_metrics(num_outputs=1)
    runner.datasets.train = _dataset(24, 0)
    runner.datasets.val = _dataset(10, 1)
    runner.datasets.infer = _dataset(6, 2)


class PlainRunner(TorchRunner):
    """Regression on `Net`: 24 training, 10 validation (a short last batch) and 6 inference samples."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        _bind(self)


class PipelinedRunner(ParallelRunner):
    """`ParallelRunner` on `Net`; with `pipeline > 1` the runner splits it into stages itself."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        _bind(self)


def runner_config(root: str, **overrides: Any) -> dict[str, Any]:
    """2 epochs of SGD with momentum (per-parameter state to checkpoint), batch size 4, 2 batches per update,
    unshuffled training data."""
    config = {
        "workspace_root": root,
        "epochs": 2,
        "seed": 0,
        "log": False,
        "optim.type": "sgd",
        "optim.lr": 0.1,
        "optim.momentum": 0.5,
        "accum_steps": 2,
        "dataloader.batch_size": 4,
        "dataloader.train.shuffle": False,
        "checkpoint.async_enabled": False,
    }
    config.update(overrides)
    return config


def run(runner: TorchRunner, *, predict: bool = True) -> dict[str, Any]:
    """Train, predict, close: per-epoch losses and mse, predictions, the local weights and the checkpoint directory."""
    rows = runner.train()
    parts = getattr(runner, "model_parts", None) or [runner.model]
    state = {key: value for part in parts for key, value in runner.unwrap(part).state_dict().items()}
    weights = {key: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for key, v in state.items()}
    result = {
        "rows": {
            (epoch, split): (float(row["loss"]), float(row["mse"]))
            for epoch, r in rows.items()
            for split, row in r.items()
        },
        "predictions": runner.infer() if predict else None,
        "keys": sorted(runner.model.state_dict()),
        "weights": weights,
        "checkpoints": str(runner.workspace.checkpoint_dir),
    }
    runner.close()
    return result


class SavingRunner(PipelinedRunner):
    """Saves a checkpoint right after optimizer step `save_at` (mid-epoch)."""

    save_at = 4

    def optimizer_step(self) -> bool:
        applied = super().optimizer_step()
        if applied and self.train_state.global_step == self.save_at:
            self.save_checkpoint(force=True)
        return applied
