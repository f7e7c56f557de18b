"""A real `TorchRunner` driving the pipeline mixin, until the parallel runner wires it itself.

`PipelinedRunner` overrides only what the parallel runner is to override for pipelining: the
topology (from `parallel.axes`), model materialisation (split into parts, build the schedule),
the loaders of data-free stages, and the three step hooks. Everything else (loops, accumulation,
the update strategy, metrics, logging, evaluation and inference passes) is the torch runner's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from danling.distributed import Topology
from danling.metrics import regression_metrics
from danling.runners import TorchRunner
from danling.runners.parallel.pipeline import PipelineMixin, StepProxyLoader
from tests.runners._pipeline_harness import IN, make_net


def _dataset(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, IN, generator=generator), torch.randn(n, 1, generator=generator))


class PlainRunner(TorchRunner):
    """Regression on `Net`: 24 training, 10 validation (a short last batch) and 6 inference samples."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.model = make_net()
        self.criterion = nn.MSELoss()
        self.metrics = regression_metrics(num_outputs=1)
        self.datasets.train = _dataset(24, 0)
        self.datasets.val = _dataset(10, 1)
        self.datasets.infer = _dataset(6, 2)


class PipelinedRunner(PipelineMixin, PlainRunner):
    supported_features = ("parallel",)

    def build_topology(self) -> Topology:
        return Topology.from_axes(self.config.parallel.axes.dict())

    def materialize_model(self) -> None:
        self._require_model()
        parts = [part.to(self.device) for part in self.build_pipeline_model_parts(self.model)]
        self.pipeline_schedule = self.build_pipeline_schedule(parts)
        self.model_parts, self.model = parts, parts[0]

    def build_dataloaders(self) -> None:
        super().build_dataloaders()
        for split, loader in list(self.dataloaders.items()):
            if not isinstance(loader, StepProxyLoader):
                self.dataloaders[split] = self.pipeline_loader(loader, needs_target=split != "infer")

    def train_step(self, data: Any) -> Any:
        return self.pipeline_train_step(data)

    def evaluate_step(self, data: Any) -> Any:
        return self.pipeline_evaluate_step(data)

    def infer_step(self, data: Any) -> list[Any]:
        return self.pipeline_infer_step(data)


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
