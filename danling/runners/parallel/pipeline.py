"""The pipeline-parallel train, evaluate and infer steps of a parallel runner.

[`ParallelRunner`][danling.runners.parallel_runner.ParallelRunner] delegates them to this component.

[`PipelineSteps`][danling.runners.parallel.pipeline.PipelineSteps] lays the stages out (how many,
which this rank owns, how each is cut from the model), builds the
[`PipelineRuntime`][danling.distributed.pipeline.PipelineRuntime] (the schedule over this rank's
stages), runs one batch through it, and calls back into the runner only through
[`PipelineHost`][danling.runners.parallel.pipeline.PipelineHost]: the criterion, the update strategy,
`step()`, `forward_context()`, `to_device()` and `update_metrics()`.

Losses are normalised by danling, never by the schedule (`scale_grads=False`): each microbatch
loss is divided by the number of microbatches and by the size of its accumulation window, so the
gradients of a step equal those of one big batch. Only the last stage computes a loss; its mean
over the microbatches is then broadcast over the pipeline group, so every rank reports the same number.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

from danling.distributed.pipeline import PipelineRuntime, build_stage_part, stage_count, stage_indices
from danling.distributed.pipeline_runtime import no_grad_outside_inference, without_loss

__all__ = ["PipelineHost", "PipelineSteps"]


class PipelineHost(Protocol):
    """What the pipeline steps use of the runner."""

    criterion: Any
    update: Any  # the update strategy: `accumulator.normalize` and `precision.scaler`
    pipeline_schedule: Any

    def step(self) -> Any: ...

    def forward_context(self) -> AbstractContextManager: ...

    def to_device(self, data: Any) -> Any: ...

    def update_metrics(self, pred: Any, target: Any) -> None: ...


class PipelineSteps:
    """The stage layout, the schedule, and one training, evaluation or inference batch through it.

    Args:
        host: The runner (see [`PipelineHost`][danling.runners.parallel.pipeline.PipelineHost]).
        parallel: The `parallel` config section (`pipeline_schedule`, `pipeline_n_microbatches`,
            `pipeline_microbatch_size`, `module_fqns_per_model_part`).
        topology: The run's topology (the pipeline domain's size, rank, ranks and group).
        device: The device the stages run on.
        batch_size: The training batch size the microbatches divide.

    Attributes:
        runtime: The [`PipelineRuntime`][danling.distributed.pipeline.PipelineRuntime], bound by
            `build_runtime` (its loss function is `loss`).
        num_stages: The number of stages in all, fixed once the stages are cut (`None` before).
    """

    def __init__(self, host: PipelineHost, parallel: Any, topology: Any, device: torch.device, batch_size: int) -> None:
        self.host = host
        self.parallel, self.topology, self.device, self.batch_size = parallel, topology, device, batch_size
        self.runtime: PipelineRuntime | None = None
        self.num_stages: int | None = None

    # ------------------------------------------------------------------ layout
    def stage_count(self, model: nn.Module | None) -> int:
        """Stages in all: fixed once cut; else from `module_fqns_per_model_part`, the model's
        `pipeline_num_stages`, or the schedule (see [`stage_count`][danling.distributed.pipeline.stage_count])."""
        if self.num_stages is not None:
            return self.num_stages
        return stage_count(
            self.topology.size("pipeline"),
            schedule=self.parallel.pipeline_schedule,
            module_fqns=self.parallel.module_fqns_per_model_part,
            model=model,
        )

    def stage_indices(self, num_stages: int) -> tuple[int, ...]:
        """The stages this rank owns (see [`stage_indices`][danling.distributed.pipeline.stage_indices])."""
        topology = self.topology
        schedule = self.parallel.pipeline_schedule
        return stage_indices(topology.rank("pipeline"), topology.size("pipeline"), num_stages, schedule=schedule)

    def stage_part(self, model: nn.Module, stage_index: int, num_stages: int) -> nn.Module:
        """Stage `stage_index` of `model` (see [`build_stage_part`][danling.distributed.pipeline.build_stage_part])."""
        degree, fqns = self.topology.size("pipeline"), self.parallel.module_fqns_per_model_part
        return build_stage_part(model, stage_index, num_stages, degree=degree, module_fqns=fqns)

    def build_runtime(self, parts: nn.Module | Sequence[nn.Module]) -> PipelineRuntime:
        """The runtime over this rank's final (wrapped) stage module(s), bound to `runtime`; fixes `num_stages`.

        Raises:
            ValueError: an unknown schedule name, a bad microbatch count, or a number of parts that
                does not match the schedule (one per rank for GPipe/1F1B).
        """
        runtime = PipelineRuntime.from_config(
            [parts] if isinstance(parts, nn.Module) else list(parts),
            self.parallel,
            batch_size=self.batch_size,
            topology=self.topology,
            device=self.device,
            loss_fn=self.loss,
        )
        self.runtime, self.num_stages = runtime, runtime.num_stages
        return runtime

    # ------------------------------------------------------------------ steps

    def _runtime(self) -> PipelineRuntime:
        if self.runtime is None:
            raise RuntimeError("the pipeline schedule is not built yet: call build_pipeline_schedule first")
        return self.runtime

    def loss(self, pred: torch.Tensor, target: Any) -> torch.Tensor:
        """Loss of one microbatch on the last stage, scaled for the backward pass.

        The raw loss travels with the returned one for reporting; that one is divided by the number
        of microbatches and by the accumulation window, and multiplied by the fp16 loss scale when
        there is one, exactly what the runner's own backward does for one whole batch.
        """
        criterion = self.host.criterion
        loss = criterion(pred, target)
        if not isinstance(loss, torch.Tensor):
            raise ValueError(f"criterion {criterion!r} must return a loss tensor under pipeline parallelism")
        raw = loss.detach()
        if torch.is_grad_enabled():  # training: scale what flows back; evaluation returns the raw loss
            loss = self.host.update.accumulator.normalize(loss) / self._runtime().n_microbatches
            scaler = self._scaler()
            loss = loss if scaler is None else scaler.scale(loss)
        # The schedule also calls this once to infer shapes; only the losses it returns count,
        # so each carries its raw value.
        loss._danling_raw_loss = raw  # type: ignore[attr-defined]
        return loss

    def _scaler(self) -> Any:
        """The fp16 gradient scaler of the update strategy, if any."""
        return getattr(getattr(self.host.update, "precision", None), "scaler", None)

    def _keep(self) -> bool:
        """Whether the last stage merges its outputs: only for metrics (they may be large, e.g. logits)."""
        names = ("metrics", "train_metrics", "evaluate_metrics")
        return self._runtime().has_last_stage and any(getattr(self.host, name, None) is not None for name in names)

    def train_step(self, data: Any) -> tuple[None, torch.Tensor]:
        """One training micro-step through the schedule; returns `(None, loss)` on every rank.

        The first stage feeds the input and the last stage the target (other ranks may pass
        `None`). The loss is the mean of the microbatch losses, broadcast from the last stage
        over the pipeline group. Ranks with the last stage update the training metrics with the
        concatenated outputs. Then `host.step()` counts the micro-step and applies the optimizer
        at the end of the accumulation window.
        """
        runtime, host = self._runtime(), self.host
        args, target = runtime.inputs(None if data is None else host.to_device(data))
        scaler = self._scaler()
        if scaler is not None and not runtime.has_last_stage:
            # The loss scale is applied on the last stage only; this creates the (same initial)
            # scale that the optimizer step of this rank divides its gradients by.
            scaler.scale(torch.zeros((), device=runtime.device))
        losses: list[torch.Tensor] = []
        schedule = runtime.select(args, host.pipeline_schedule)
        with host.forward_context():
            output = schedule.step(*args, target=target, losses=losses, return_outputs=self._keep())
        if output is not None:
            host.update_metrics(output, target)
        loss = runtime.mean_loss(losses)
        host.step()
        return None, loss

    def evaluate_step(self, data: Any) -> tuple[None, torch.Tensor | None]:
        """One evaluation batch through the schedule (forward only); returns `(None, loss)` on every rank.

        The loss is `None` when the criterion is unset or the batch has no target (known to every
        rank only through the last stage, so it is broadcast as well). Ranks with the last stage
        update the evaluation metrics with the concatenated outputs.

        Raises:
            NotImplementedError: a V schedule (`ZBVZeroBubble`, `DualPipeV`), which torch cannot
                run forward-only.
        """
        runtime, host = self._runtime(), self.host
        runtime.check_forward_only()
        args, target = runtime.inputs(None if data is None else host.to_device(data), need_target=False)
        target = target if host.criterion is not None else None
        losses: list[torch.Tensor] = []
        schedule = runtime.select(args, host.pipeline_schedule)
        with no_grad_outside_inference(), host.forward_context(), without_loss(schedule, target is None):
            output = schedule.eval(
                *args, target=target, losses=None if target is None else losses, return_outputs=self._keep()
            )
        if output is not None:
            host.update_metrics(output, target)
        return None, runtime.mean_loss(losses, optional=True)

    def infer_step(self, data: Any) -> list[Any]:
        """Predictions for one batch through the schedule, the same list on every pipeline rank.

        The last stage's output is converted as `TorchRunner.infer_step` does
        (`pred.squeeze(-1).tolist()`) and broadcast over the pipeline group.

        Raises:
            ValueError: the output of the last stage is not a tensor.
            NotImplementedError: a V schedule, which torch cannot run forward-only.
        """
        runtime, host = self._runtime(), self.host
        runtime.check_forward_only()
        args, _ = runtime.inputs(None if data is None else host.to_device(data), need_target=False)
        schedule = runtime.select(args, host.pipeline_schedule)
        with no_grad_outside_inference(), host.forward_context(), without_loss(schedule):
            output = schedule.eval(*args)
        result = None
        if runtime.has_last_stage:
            if not isinstance(output, torch.Tensor):
                raise ValueError(
                    f"pipeline inference expects a tensor from the last stage, got {type(output).__name__}"
                )
            values = output.detach().squeeze(-1).cpu().tolist()
            result = values if isinstance(values, list) else [values]
        return runtime.broadcast_from_last(result)
