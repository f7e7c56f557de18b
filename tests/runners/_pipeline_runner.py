"""The real `ParallelRunner` driving the pipeline mixin, until the runner inherits it itself.

`PipelinedRunner` adds the mixin to `ParallelRunner` and splits the model before the runner
materializes the parts (its `model_parts` path); the runner then builds the schedule, the
update strategy, the loaders of data-free stages and dispatches the three step hooks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from danling.metrics import regression_metrics
from danling.runners import ParallelRunner, TorchRunner
from danling.runners.parallel.pipeline import PipelineMixin
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


class PipelinedRunner(PipelineMixin, ParallelRunner):
    """`ParallelRunner` with the pipeline mixin; the model is split before the runner materializes the parts."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        _bind(self)

    def materialize_model(self) -> None:
        if self.topology.size("pipeline") > 1 and not self.model_parts:
            self.model_parts = self.build_pipeline_model_parts(self.model)
        super().materialize_model()


def runner_config(root: str, **overrides: Any) -> dict[str, Any]:
    """2 epochs of SGD, batch size 4, 2 batches per update, unshuffled training data."""
    config = {
        "workspace_root": root,
        "epochs": 2,
        "seed": 0,
        "log": False,
        "optim.type": "sgd",
        "optim.lr": 0.1,
        "accum_steps": 2,
        "dataloader.batch_size": 4,
        "dataloader.train.shuffle": False,
        "checkpoint.async_enabled": False,
    }
    config.update(overrides)
    return config


def run(runner: TorchRunner) -> dict[str, Any]:
    """Train, predict, close; the per-epoch losses and mse, the predictions and the local weights' keys."""
    rows = runner.train()
    result = {
        "rows": {
            (epoch, split): (float(row["loss"]), float(row["mse"]))
            for epoch, r in rows.items()
            for split, row in r.items()
        },
        "predictions": runner.infer(),
        "keys": sorted(runner.model.state_dict()),
    }
    runner.close()
    return result
