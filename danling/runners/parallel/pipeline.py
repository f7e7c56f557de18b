"""Pipeline parallelism for the parallel runner (`ParallelRunner`), on `torch.distributed.pipelining`.

[`PipelineMixin`][danling.runners.parallel.pipeline.PipelineMixin] cuts the model into stages,
builds the PyTorch schedule over the local stages and runs the runner's train, evaluate and
infer steps through it. It relies on the runner for the rest: `topology` (the `"pipeline"`
domain), `config.parallel`, `device`, `criterion`, the update strategy (`update`), `step()`,
`forward_context()`, `to_device()` and `_update_metrics()`.

Stages come from the model's own `build_pipeline_model_part(stage_index, num_stages)` when it
defines one, else from `parallel.module_fqns_per_model_part`. Losses are normalised by danling,
never by the schedule (`scale_grads=False`): each microbatch loss is divided by the number of
microbatches and by the size of its accumulation window, so the gradients of a step equal those
of one big batch. Only the last stage computes a loss; its mean over the microbatches is then
broadcast over the pipeline group, so every rank reports the same number.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from danling.data import resolve_loader_options, split_batch

from .pipeline_loader import StepProxyLoader
from .pipeline_parts import V_SCHEDULES, PipelineModelPart, stage_placement, validate_module_fqns
from .pipeline_runtime import ScheduleCache, broadcast_shapes, no_grad_outside_inference, without_loss

__all__ = ["PIPELINE_SCHEDULES", "PipelineMixin", "StepProxyLoader"]

PIPELINE_SCHEDULES: tuple[str, ...] = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
"""Names `parallel.pipeline_schedule` accepts (case-insensitive), resolved by torch's `get_schedule_class`.
Each trains like single-process training on CPU (torch 2.13); the V schedules (`ZBVZeroBubble`,
`DualPipeV`) cannot evaluate or infer."""


class PipelineMixin:
    """Pipeline-parallel stages, schedule and step hooks; mixed into the parallel runner.

    Attributes:
        pipeline_schedule: The PyTorch schedule of this rank (`None` without pipeline parallelism).
        pipeline_stages: The `PipelineStage` of each local part.
        pipeline_has_first_stage: Whether a local stage takes the batch input.
        pipeline_has_last_stage: Whether a local stage produces the output and the loss.
    """

    pipeline_schedule: Any = None
    pipeline_stages: tuple[Any, ...] = ()
    pipeline_has_first_stage: bool = True
    pipeline_has_last_stage: bool = True
    _pipeline_num_stages: int | None = None  # fixed once the parts are built
    _pipeline_n_microbatches: int = 1
    _pipeline_first_rank: int = 0  # global ranks that own the first and the last stage
    _pipeline_last_rank: int = 0
    _pipeline_schedules: ScheduleCache

    # ------------------------------------------------------------------ layout
    def _pipeline_schedule_class(self) -> tuple[type, str]:
        """The schedule class named by `parallel.pipeline_schedule`, and its stage placement style."""
        from torch.distributed.pipelining.schedules import get_schedule_class

        name = self.config.parallel.pipeline_schedule
        accepted = {known.lower(): known for known in PIPELINE_SCHEDULES}
        if not isinstance(name, str) or name.lower() not in accepted:
            raise ValueError(f"unknown parallel.pipeline_schedule {name!r}; accepted: {', '.join(PIPELINE_SCHEDULES)}")
        return get_schedule_class(accepted[name.lower()]), "v" if name.lower() in V_SCHEDULES else "loop"

    def _pipeline_single_stage(self) -> bool:
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        return issubclass(self._pipeline_schedule_class()[0], PipelineScheduleSingle)

    def _pipeline_stage_count(self, model: nn.Module | None = None) -> int:
        """Total number of pipeline stages (over all pipeline ranks).

        In order: the count the parts were built with; the length of
        `parallel.module_fqns_per_model_part`; the model's `pipeline_num_stages` attribute; else
        one stage per rank for single-stage schedules and two per rank for multi-stage ones.
        """
        if self._pipeline_num_stages is not None:
            return self._pipeline_num_stages
        degree = self.topology.size("pipeline")
        fqns = self.config.parallel.module_fqns_per_model_part
        if fqns is not None:
            return len(validate_module_fqns(fqns, degree))
        declared = getattr(model if model is not None else self.model, "pipeline_num_stages", None)
        if declared is not None:
            if isinstance(declared, bool) or not isinstance(declared, int) or declared < 1 or declared % degree:
                raise ValueError(
                    f"model.pipeline_num_stages must be a positive multiple of the pipeline degree {degree}, "
                    f"got {declared!r}"
                )
            return declared
        return degree if self._pipeline_single_stage() else 2 * degree

    def pipeline_stage_indices(self, num_stages: int | None = None) -> tuple[int, ...]:
        """Indices of the pipeline stages this rank owns, in increasing order.

        Stages are looped over the pipeline ranks: rank `r` of degree `pp` owns `r, r + pp,
        r + 2pp, ...`. The zero-bubble V schedules (`ZBVZeroBubble`, `DualPipeV`) instead place
        them down and back up (rank `r` owns `r` and `2pp - 1 - r`). Override this for other
        placements.

        Args:
            num_stages: Total number of stages; by default the length of
                `parallel.module_fqns_per_model_part`, else the model's `pipeline_num_stages`,
                else one stage per rank for single-stage schedules (GPipe, 1F1B) and two per
                rank for multi-stage ones (Interleaved1F1B, ...).

        Raises:
            ValueError: `num_stages` is not a positive multiple of the pipeline degree, or a
                single-stage schedule is given more stages than ranks.
        """
        degree = self.topology.size("pipeline")
        if num_stages is None:
            num_stages = self._pipeline_stage_count()
        _, style = self._pipeline_schedule_class()
        if num_stages != degree and self._pipeline_single_stage():
            raise ValueError(
                f"parallel.pipeline_schedule {self.config.parallel.pipeline_schedule!r} runs one stage per rank, "
                f"but {num_stages} stages were requested for pipeline degree {degree}; use a multi-stage schedule "
                "such as 'Interleaved1F1B' for several stages per rank"
            )
        placement = stage_placement(num_stages, degree, style)
        rank = self.topology.rank("pipeline")
        return tuple(stage for stage, owner in placement.items() if owner == rank)

    # ------------------------------------------------------------------ model parts
    def build_pipeline_model_part(self, model: nn.Module, stage_index: int | None = None) -> nn.Module:
        """The module of one pipeline stage (by default the first stage this rank owns).

        If `model` defines `build_pipeline_model_part(stage_index, num_stages)`, its result is
        used as is. Otherwise the stage is cut out by `parallel.module_fqns_per_model_part`: a
        [`PipelineModelPart`][danling.runners.parallel.pipeline_parts.PipelineModelPart] holding
        the listed submodules at their original paths (so the part's state-dict keys equal the
        whole model's) and running them in the listed order. Modules are shared with `model`,
        not copied: once the runner drops `model`, other stages' parameters are freed.

        Raises:
            ValueError: neither the hook nor `module_fqns_per_model_part` is available, or the
                names do not fit the model or the pipeline degree.
            TypeError: the model's hook returned something other than a module.
        """
        num_stages = self._pipeline_stage_count(model)
        if stage_index is None:
            stage_index = self.pipeline_stage_indices(num_stages)[0]
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index must be in [0, {num_stages}), got {stage_index}")
        hook = getattr(model, "build_pipeline_model_part", None)
        if callable(hook):
            part = hook(stage_index, num_stages)
            if not isinstance(part, nn.Module):
                raise TypeError(
                    f"{type(model).__name__}.build_pipeline_model_part({stage_index}, {num_stages}) must return an "
                    f"nn.Module, got {type(part).__name__}"
                )
            return part
        fqns = self.config.parallel.module_fqns_per_model_part
        if fqns is None:
            raise ValueError(
                f"pipeline degree {self.topology.size('pipeline')} needs pipeline stages: define "
                f"{type(model).__name__}.build_pipeline_model_part(stage_index, num_stages) or set "
                "parallel.module_fqns_per_model_part"
            )
        return PipelineModelPart(model, validate_module_fqns(fqns, self.topology.size("pipeline"))[stage_index])

    def build_pipeline_model_parts(self, model: nn.Module) -> list[nn.Module]:
        """The modules of every stage this rank owns, in stage order (see `pipeline_stage_indices`)."""
        num_stages = self._pipeline_stage_count(model)
        parts = [self.build_pipeline_model_part(model, index) for index in self.pipeline_stage_indices(num_stages)]
        self._pipeline_num_stages = num_stages
        return parts

    # ------------------------------------------------------------------ schedule
    def pipeline_microbatches(self) -> int:
        """Microbatches per batch: `parallel.pipeline_n_microbatches`, else batch size // microbatch size.

        Raises:
            ValueError: the count is below one or does not divide `dataloader.batch_size`
                (unequal microbatches would not average to the loss of the whole batch).
        """
        parallel = self.config.parallel
        batch_size = self._pipeline_batch_size()
        count = parallel.pipeline_n_microbatches
        if count is None:
            size = parallel.pipeline_microbatch_size
            if not isinstance(size, int) or size < 1 or batch_size % size:
                raise ValueError(
                    f"parallel.pipeline_microbatch_size={size!r} must be a positive divisor of "
                    f"dataloader.batch_size={batch_size}"
                )
            return batch_size // size
        if not isinstance(count, int) or count < 1 or batch_size % count:
            raise ValueError(
                f"parallel.pipeline_n_microbatches={count!r} must be a positive divisor of "
                f"dataloader.batch_size={batch_size}"
            )
        return count

    def _pipeline_batch_size(self) -> int:
        """`dataloader.batch_size`, else the `train` split's own (`dataloader.train.batch_size`), else 1."""
        loader = self.config.dataloader
        size = getattr(loader, "batch_size", None)
        if size is None and callable(getattr(loader, "dict", None)):
            size = resolve_loader_options(loader.dict(), "train", is_train=True).get("batch_size")
        return size or 1

    def build_pipeline_schedule(self, stage_model: nn.Module | Sequence[nn.Module]) -> Any:
        """The PyTorch schedule over this rank's stage modules (the final, wrapped ones).

        Builds one `PipelineStage` per part (stage indices from `pipeline_stage_indices`, the
        pipeline group of the topology), then the class named by `parallel.pipeline_schedule`
        with `pipeline_microbatches()` microbatches, danling's normalising loss and
        `scale_grads=False`. Sets `pipeline_stages`, `pipeline_has_first_stage` and
        `pipeline_has_last_stage`; the caller binds the returned schedule to
        `self.pipeline_schedule`. Batches of another shape later run through schedules built
        the same way for their shape.

        Raises:
            ValueError: an unknown schedule name, a bad microbatch count, or a number of parts
                that does not match the schedule (one per rank for GPipe/1F1B).
        """
        parts = [stage_model] if isinstance(stage_model, nn.Module) else list(stage_model)
        single = self._pipeline_single_stage()
        if not parts or (single and len(parts) != 1):
            raise ValueError(
                f"parallel.pipeline_schedule {self.config.parallel.pipeline_schedule!r} needs "
                f"{'exactly one' if single else 'at least one'} local stage module, got {len(parts)}"
            )
        count = self.pipeline_microbatches()
        degree = self.topology.size("pipeline")
        num_stages = len(parts) * degree
        indices = self.pipeline_stage_indices(num_stages)
        _, style = self._pipeline_schedule_class()
        placement = stage_placement(num_stages, degree, style)
        ranks = self.topology.ranks("pipeline")
        self._pipeline_first_rank, self._pipeline_last_rank = ranks[placement[0]], ranks[placement[num_stages - 1]]
        self._pipeline_num_stages, self._pipeline_n_microbatches = num_stages, count
        self.pipeline_has_first_stage, self.pipeline_has_last_stage = 0 in indices, num_stages - 1 in indices

        def build(microbatches: int, schedule_class: type | None = None) -> Any:
            return self._pipeline_build(parts, indices, microbatches, schedule_class)[0]

        self._pipeline_schedules = ScheduleCache(build, self._pipeline_fallback(build, style))
        schedule, stages = self._pipeline_build(parts, indices, count)
        self.pipeline_stages = tuple(stages)
        return schedule

    def _pipeline_build(
        self, parts: list[nn.Module], indices: tuple[int, ...], microbatches: int, schedule_class: type | None = None
    ) -> tuple[Any, list]:
        """A schedule over fresh `PipelineStage`s of `parts` for `microbatches` microbatches."""
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        schedule_class = schedule_class or self._pipeline_schedule_class()[0]
        group, num_stages = self.topology.group("pipeline"), self._pipeline_num_stages
        stages = [
            PipelineStage(part, index, num_stages, self.device, group=group)
            for part, index in zip(parts, indices, strict=True)
        ]
        single = issubclass(schedule_class, PipelineScheduleSingle)
        schedule = schedule_class(
            stages[0] if single else stages, n_microbatches=microbatches, loss_fn=self._pipeline_loss, scale_grads=False
        )
        return schedule, stages

    def _pipeline_fallback(self, build: Any, style: str) -> Any:
        """A builder of the simplest schedule of the same kind, for batches the configured one rejects."""
        if style != "loop":
            return None
        from torch.distributed.pipelining.schedules import ScheduleGPipe, ScheduleLoopedBFS

        simple = ScheduleGPipe if self._pipeline_single_stage() else ScheduleLoopedBFS
        return lambda microbatches: build(microbatches, simple)

    def _pipeline_select(self, args: tuple[Any, ...]) -> Any:
        """The schedule for this batch's input shapes (shared by the first stage with every pipeline rank)."""
        key = broadcast_shapes(
            args,
            src=self._pipeline_first_rank,
            group=self.topology.group("pipeline"),
            device=self.device,
            degree=self.topology.size("pipeline"),
        )
        schedule = self._pipeline_schedules.get(self.pipeline_schedule, key)
        self._pipeline_n_microbatches = schedule._n_microbatches
        return schedule

    def _pipeline_loss(self, pred: torch.Tensor, target: Any) -> torch.Tensor:
        """Loss of one microbatch on the last stage, scaled for the backward pass.

        The raw loss travels with the returned one for reporting; that one is divided by the number of
        microbatches and by the accumulation window, and multiplied by the fp16 loss scale when
        there is one, exactly what the runner's own backward does for one whole batch.
        """
        loss = self.criterion(pred, target)
        if not isinstance(loss, torch.Tensor):
            raise ValueError(f"criterion {self.criterion!r} must return a loss tensor under pipeline parallelism")
        raw = loss.detach()
        if torch.is_grad_enabled():  # training: scale what flows back; evaluation returns the raw loss
            loss = self.update.accumulator.normalize(loss) / self._pipeline_n_microbatches
            scaler = self._pipeline_scaler()
            loss = loss if scaler is None else scaler.scale(loss)
        # The schedule also calls this once to infer shapes; only the losses it returns count,
        # so each carries its raw value.
        loss._danling_raw_loss = raw  # type: ignore[attr-defined]
        return loss

    # ------------------------------------------------------------------ steps
    def pipeline_train_step(self, data: Any) -> tuple[None, torch.Tensor]:
        """One training micro-step through the schedule; returns `(None, loss)` on every rank.

        The first stage feeds the input and the last stage the target (other ranks may pass
        `None`). The loss is the mean of the microbatch losses, broadcast from the last stage
        over the pipeline group. Ranks with the last stage update the training metrics with the
        concatenated outputs. Then `step()` counts the micro-step and applies the optimizer at
        the end of the accumulation window.
        """
        args, target = self._pipeline_inputs(data)
        scaler = self._pipeline_scaler()
        if scaler is not None and not self.pipeline_has_last_stage:
            # The loss scale is applied on the last stage only; this creates the (same initial)
            # scale that the optimizer step of this rank divides its gradients by.
            scaler.scale(torch.zeros((), device=self.device))
        losses: list[torch.Tensor] = []
        schedule = self._pipeline_select(args)
        with self.forward_context():
            output = schedule.step(*args, target=target, losses=losses, return_outputs=self._pipeline_keeps_outputs())
        if output is not None:
            self._update_metrics(output, target)
        loss = self._pipeline_mean_loss(losses)
        self.step()
        return None, loss

    def pipeline_evaluate_step(self, data: Any) -> tuple[None, torch.Tensor | None]:
        """One evaluation batch through the schedule (forward only); returns `(None, loss)` on every rank.

        The loss is `None` when the criterion is unset or the batch has no target (known to
        every rank only through the last stage, so it is broadcast as well). Ranks with the last
        stage update the evaluation metrics with the concatenated outputs.

        Raises:
            NotImplementedError: a V schedule (`ZBVZeroBubble`, `DualPipeV`), which torch cannot
                run forward-only.
        """
        self._pipeline_check_forward_only()
        args, target = self._pipeline_inputs(data, need_target=False)
        target = target if self.criterion is not None else None
        losses: list[torch.Tensor] = []
        schedule = self._pipeline_select(args)
        with no_grad_outside_inference(), self.forward_context(), without_loss(schedule, target is None):
            output = schedule.eval(
                *args,
                target=target,
                losses=None if target is None else losses,
                return_outputs=self._pipeline_keeps_outputs(),
            )
        if output is not None:
            self._update_metrics(output, target)
        return None, self._pipeline_mean_loss(losses, optional=True)

    def pipeline_infer_step(self, data: Any) -> list[Any]:
        """Predictions for one batch through the schedule, the same list on every pipeline rank.

        The last stage's output is converted as `TorchRunner.infer_step` does
        (`pred.squeeze(-1).tolist()`) and broadcast over the pipeline group.

        Raises:
            ValueError: the output of the last stage is not a tensor.
            NotImplementedError: a V schedule (`ZBVZeroBubble`, `DualPipeV`), which torch cannot
                run forward-only.
        """
        self._pipeline_check_forward_only()
        args, _ = self._pipeline_inputs(data, need_target=False)
        values: list[Any] = [None]
        schedule = self._pipeline_select(args)
        with no_grad_outside_inference(), self.forward_context(), without_loss(schedule):
            output = schedule.eval(*args)
        if self.pipeline_has_last_stage:
            if not isinstance(output, torch.Tensor):
                kind = type(output).__name__
                raise ValueError(f"pipeline inference expects a tensor from the last stage, got {kind}")
            result = output.detach().squeeze(-1).cpu().tolist()
            values = [result if isinstance(result, list) else [result]]
        if self.topology.size("pipeline") > 1:
            dist.broadcast_object_list(values, src=self._pipeline_last_rank, group=self.topology.group("pipeline"))
        return values[0]

    def pipeline_loader(self, loader: Any, *, needs_target: bool = True) -> Any:
        """The loader this rank iterates: `loader` itself, or a stand-in that yields `None`.

        Ranks with the first stage read inputs, ranks with the last stage read targets (unless
        `needs_target` is false, as for inference); every other rank gets a
        [`StepProxyLoader`][danling.runners.parallel.pipeline_loader.StepProxyLoader] of the same
        length, so all ranks take the same number of steps.
        """
        if self.pipeline_has_first_stage or (needs_target and self.pipeline_has_last_stage):
            return loader
        return StepProxyLoader(loader)

    # ------------------------------------------------------------------ helpers
    def _pipeline_scaler(self) -> Any:
        """The fp16 gradient scaler of the update strategy, if any."""
        return getattr(getattr(self.update, "precision", None), "scaler", None)

    def _pipeline_keeps_outputs(self) -> bool:
        """Whether the last stage merges its outputs: only for metrics (they may be large, e.g. logits)."""
        names = ("metrics", "train_metrics", "evaluate_metrics")
        return self.pipeline_has_last_stage and any(getattr(self, name, None) is not None for name in names)

    def _pipeline_check_forward_only(self) -> None:
        """Refuse evaluation under the V schedules, which torch (2.13) cannot run forward-only.

        Every rank reads the same config, so all of them raise together instead of hanging.
        """
        if self._pipeline_schedule_class()[1] == "v":
            raise NotImplementedError(
                f"parallel.pipeline_schedule {self.config.parallel.pipeline_schedule!r} trains, but torch's V "
                "schedules cannot run forward-only (evaluate/infer); use 'Interleaved1F1B' or 'InterleavedZeroBubble' "
                "in runs that evaluate"
            )

    def _pipeline_inputs(self, data: Any, *, need_target: bool = True) -> tuple[tuple[Any, ...], Any]:
        """Positional inputs for the first stage and the target for the last one (empty/None elsewhere)."""
        if data is None:
            if self.pipeline_has_first_stage or (need_target and self.pipeline_has_last_stage):
                raise ValueError("this rank owns the first or last pipeline stage and needs a batch, got None")
            return (), None
        input, target = split_batch(self.to_device(data))
        if need_target and self.pipeline_has_last_stage and target is None:
            raise ValueError("the last pipeline stage needs a target to compute the training loss")
        if not self.pipeline_has_first_stage:
            args: tuple[Any, ...] = ()
        elif isinstance(input, torch.Tensor):
            args = (input,)
        elif isinstance(input, (tuple, list)):
            args = tuple(input)
        else:
            kind = "a mapping" if isinstance(input, Mapping) else type(input).__name__
            raise ValueError(f"pipeline input must be a tensor or a tuple of tensors, got {kind}")
        return args, target if self.pipeline_has_last_stage else None

    def _pipeline_mean_loss(self, losses: list[torch.Tensor], *, optional: bool = False) -> torch.Tensor | None:
        """Mean microbatch loss of the last stage, broadcast over the pipeline group.

        With `optional`, a flag travels with it telling whether the last stage computed a loss
        at all (no criterion or no target: `None` on every rank).
        """
        raw = [getattr(loss, "_danling_raw_loss", loss) for loss in losses]
        loss = torch.stack(raw).float().mean() if raw else torch.zeros((), device=self.device)
        if optional:
            loss = torch.stack([loss.to(self.device), torch.tensor(float(bool(losses)), device=self.device)])
        if self.topology.size("pipeline") > 1:
            loss = loss.to(self.device)
            dist.broadcast(loss, src=self._pipeline_last_rank, group=self.topology.group("pipeline"))
        if not optional:
            return loss
        return loss[0] if loss[1].item() else None
