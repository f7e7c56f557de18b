"""A minimal host for the pipeline steps component and the single-process reference it is compared with.

`PipelineHost` provides exactly what the `PipelineHost` protocol names (criterion, the real torch
update strategy, `pipeline_schedule`, `step`, `forward_context`, `to_device`, `update_metrics`) and
materialises the model the way the parallel runner does, through the component's layout methods:
split into local parts, build the schedule over them, keep only the parts.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from danling.distributed import ParallelTopology
from danling.distributed.pipeline_parts import PipelineModelPart
from danling.runners.parallel import PipelineSteps
from danling.runners.update.precision import Precision
from danling.runners.update.strategy import TorchUpdateStrategy

IN, WIDTH = 4, 8


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class Net(nn.Module):
    """Input projection, `depth` ReLU blocks in `layers`, a one-output head."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, WIDTH)
        self.layers = nn.ModuleList(Block(WIDTH) for _ in range(depth))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class HookedNet(Net):
    """`Net` that cuts its own stages: blocks spread evenly, the projection first, the head last."""

    def build_pipeline_model_part(self, stage_index: int, num_stages: int) -> nn.Module:
        per = len(self.layers) // num_stages
        names = [f"layers.{i}" for i in range(stage_index * per, (stage_index + 1) * per)]
        if stage_index == 0:
            names.insert(0, "inp")
        if stage_index == num_stages - 1:
            names.append("head")
        return PipelineModelPart(self, names)


def make_net(seed: int = 0, hooked: bool = False) -> Net:
    torch.manual_seed(seed)
    return (HookedNet if hooked else Net)()


def make_batches(count: int, batch_size: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch_size, IN, generator=generator), torch.randn(batch_size, 1, generator=generator))
        for _ in range(count)
    ]


class PipelineHost:
    """What the parallel runner provides to the pipeline steps, and nothing more."""

    def __init__(
        self,
        model: nn.Module,
        *,
        schedule: str = "1F1B",
        batch_size: int = 8,
        n_microbatches: int | None = None,
        microbatch_size: int = 1,
        fqns: list[list[str]] | None = None,
        accum_steps: int = 1,
        lr: float = 0.1,
        axes: dict[str, int] | None = None,
        wrap: Callable[[nn.Module, ParallelTopology], nn.Module] | None = None,
        loss_scale: float | None = None,
    ) -> None:
        self.topology = topology = ParallelTopology.from_axes(axes or {"pipeline": dist.get_world_size()})
        self.schedule_name = schedule
        self.device = torch.device("cpu")
        self.criterion = nn.MSELoss()
        self.metric_updates: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.metrics = self.metric_updates  # any metrics make the last stage keep its outputs
        self.model = model
        settings = SimpleNamespace(
            pipeline_schedule=schedule,
            pipeline_n_microbatches=n_microbatches,
            pipeline_microbatch_size=microbatch_size,
            module_fqns_per_model_part=fqns,
        )
        self.pipeline = PipelineSteps(self, settings, topology, self.device, batch_size)
        num_stages = self.pipeline.stage_count(model)
        indices = self.pipeline.stage_indices(num_stages)
        parts = [self.pipeline.stage_part(model, index, num_stages) for index in indices]
        if wrap is not None:  # as the runner shards or wraps each part before building the schedule
            parts = [wrap(part, self.topology) for part in parts]
        runtime = self.pipeline.build_runtime(parts)
        self.pipeline_schedule = runtime.schedule
        self.pipeline_has_last_stage = runtime.has_last_stage
        self.model_parts, self.model = parts, parts[0]
        self.optimizer = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=lr)
        precision = Precision()
        if loss_scale is not None:  # fp16 loss scaling as on CUDA, here on CPU with an fp32 model
            precision.scaler = torch.amp.GradScaler("cpu", init_scale=loss_scale)
        self.update = TorchUpdateStrategy(accum_steps, precision=precision)
        self.update.bind(self.optimizer)
        self.update.start_pass(None)

    def to_device(self, data: Any) -> Any:
        return data

    def forward_context(self) -> Any:
        return self.update.forward_context()

    def step(self) -> None:
        if self.update.advance():
            self.update.apply()

    def pipeline_stage_indices(self) -> tuple[int, ...]:
        return self.pipeline.runtime.indices

    def update_metrics(self, pred: Any, target: Any) -> None:
        if target is not None:
            self.metric_updates.append((pred.detach().clone(), target.clone()))

    def state(self) -> dict[str, torch.Tensor]:
        """Full weights of the local parts under their (original) keys."""
        state = {k: v for part in self.model_parts for k, v in part.state_dict().items()}
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def reference_training(
    model: nn.Module, batches: list, *, accum_steps: int = 1, lr: float = 0.1
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process training of a copy of `model`: per-batch losses and the final weights."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for index, (x, y) in enumerate(batches):
        loss = nn.functional.mse_loss(model(x), y)
        (loss / accum_steps).backward()
        losses.append(loss.item())
        if (index + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_weight_diff(local: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between the local parts and the same keys of the reference."""
    return max((local[k] - reference[k]).abs().max().item() for k in local)
