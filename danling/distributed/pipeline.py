"""Pipeline parallelism on `torch.distributed.pipelining`: stage layout, stage modules, and the built schedule.

Everything here takes explicit values (the schedule name, the pipeline degree and rank, the model,
the process group), never a runner:

- [`schedule_class`][danling.distributed.pipeline.schedule_class],
  [`stage_count`][danling.distributed.pipeline.stage_count] and
  [`stage_indices`][danling.distributed.pipeline.stage_indices]: which schedule, how many stages,
  which of them a rank owns;
- [`build_stage_part`][danling.distributed.pipeline.build_stage_part]: the module of one stage, from the
  model's own `build_pipeline_model_part(stage_index, num_stages)` hook or from module names;
- [`microbatch_count`][danling.distributed.pipeline.microbatch_count]: microbatches per batch;
- [`PipelineRuntime`][danling.distributed.pipeline.PipelineRuntime]: the schedule over a rank's
  stage modules, with what a step needs around it (the schedule for a batch's shape, the loss
  broadcast from the last stage, the loaders of data-free ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from danling.data import resolve_loader_options, split_batch

from .pipeline_loader import StepProxyLoader
from .pipeline_parts import V_SCHEDULES, PipelineModelPart, stage_placement, validate_module_fqns
from .pipeline_runtime import ScheduleCache, broadcast_shapes

__all__ = [
    "PIPELINE_SCHEDULES",
    "PipelineRuntime",
    "build_stage_part",
    "microbatch_count",
    "schedule_class",
    "stage_count",
    "stage_indices",
    "train_batch_size",
]

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


def schedule_class(name: Any) -> tuple[type, str]:
    """The torch schedule class named `name` (`parallel.pipeline_schedule`) and its placement style (`loop`/`v`).

    Raises:
        ValueError: `name` is not one of `PIPELINE_SCHEDULES`.
    """
    from torch.distributed.pipelining.schedules import get_schedule_class

    accepted = {known.lower(): known for known in PIPELINE_SCHEDULES}
    if not isinstance(name, str) or name.lower() not in accepted:
        raise ValueError(f"unknown parallel.pipeline_schedule {name!r}; accepted: {', '.join(PIPELINE_SCHEDULES)}")
    return get_schedule_class(accepted[name.lower()]), "v" if name.lower() in V_SCHEDULES else "loop"


def single_stage(name: Any) -> bool:
    """Whether the schedule `name` runs exactly one stage per rank (GPipe, 1F1B)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return issubclass(schedule_class(name)[0], PipelineScheduleSingle)


def stage_count(degree: int, *, schedule: str, module_fqns: Any = None, model: nn.Module | None = None) -> int:
    """Total number of pipeline stages over all `degree` pipeline ranks.

    In order: the length of `module_fqns` (`parallel.module_fqns_per_model_part`); the model's
    `pipeline_num_stages` attribute; else one stage per rank for single-stage schedules and two per
    rank for multi-stage ones.

    Raises:
        ValueError: `module_fqns` does not fit `degree`, or `pipeline_num_stages` is not a positive
            multiple of it.
    """
    if module_fqns is not None:
        return len(validate_module_fqns(module_fqns, degree))
    declared = getattr(model, "pipeline_num_stages", None)
    if declared is not None:
        if isinstance(declared, bool) or not isinstance(declared, int) or declared < 1 or declared % degree:
            raise ValueError(
                f"model.pipeline_num_stages must be a positive multiple of the pipeline degree {degree}, "
                f"got {declared!r}"
            )
        return declared
    return degree if single_stage(schedule) else 2 * degree


def stage_indices(rank: int, degree: int, num_stages: int, *, schedule: str) -> tuple[int, ...]:
    """Indices of the stages pipeline rank `rank` owns, in increasing order (looped, or V for the V schedules).

    Raises:
        ValueError: `num_stages` is not a positive multiple of `degree`, or a single-stage schedule
            is given more stages than ranks.
    """
    _, style = schedule_class(schedule)
    if num_stages != degree and single_stage(schedule):
        raise ValueError(
            f"parallel.pipeline_schedule {schedule!r} runs one stage per rank, but {num_stages} stages were "
            f"requested for pipeline degree {degree}; use a multi-stage schedule such as 'Interleaved1F1B' for "
            "several stages per rank"
        )
    placement = stage_placement(num_stages, degree, style)
    return tuple(stage for stage, owner in placement.items() if owner == rank)


def build_stage_part(
    model: nn.Module, stage_index: int, num_stages: int, *, degree: int, module_fqns: Any = None
) -> nn.Module:
    """The module of stage `stage_index`: the model's own hook's, else a `PipelineModelPart` of `module_fqns`.

    The model's `build_pipeline_model_part(stage_index, num_stages)` wins; otherwise a
    [`PipelineModelPart`][danling.distributed.pipeline_parts.PipelineModelPart] holds the listed modules.

    Raises:
        ValueError: `stage_index` is out of range, or neither the hook nor `module_fqns` is available,
            or the names do not fit the model or the pipeline degree.
        TypeError: the model's hook returned something other than a module.
    """
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
    if module_fqns is None:
        raise ValueError(
            f"pipeline degree {degree} needs pipeline stages: define "
            f"{type(model).__name__}.build_pipeline_model_part(stage_index, num_stages) or set "
            "parallel.module_fqns_per_model_part"
        )
    return PipelineModelPart(model, validate_module_fqns(module_fqns, degree)[stage_index])


def microbatch_count(batch_size: int, *, n_microbatches: Any = None, microbatch_size: Any = 1) -> int:
    """Microbatches per batch: `n_microbatches`, else `batch_size // microbatch_size`.

    Raises:
        ValueError: the count is below one or does not divide `batch_size` (unequal microbatches
            would not average to the loss of the whole batch).

    Examples:
        >>> microbatch_count(8, microbatch_size=2), microbatch_count(8, n_microbatches=2)
        (4, 2)
    """
    if n_microbatches is None:
        size = microbatch_size
        if not isinstance(size, int) or size < 1 or batch_size % size:
            raise ValueError(
                f"parallel.pipeline_microbatch_size={size!r} must be a positive divisor of "
                f"dataloader.batch_size={batch_size}"
            )
        return batch_size // size
    if not isinstance(n_microbatches, int) or n_microbatches < 1 or batch_size % n_microbatches:
        raise ValueError(
            f"parallel.pipeline_n_microbatches={n_microbatches!r} must be a positive divisor of "
            f"dataloader.batch_size={batch_size}"
        )
    return n_microbatches


def train_batch_size(dataloader: Any) -> int:
    """The batch size of the `train` split: `dataloader.batch_size`, else `dataloader.train.batch_size`, else 1.

    `dataloader` is the `dataloader` config section (or anything with a `batch_size` attribute).
    """
    size = getattr(dataloader, "batch_size", None)
    if size is None and callable(getattr(dataloader, "dict", None)):
        size = resolve_loader_options(dataloader.dict(), "train", is_train=True).get("batch_size")
    return size or 1


class PipelineRuntime:
    """The schedule over one rank's stage modules, and the per-step plumbing around it.

    Builds one `PipelineStage` per part, then the schedule class named `schedule` with
    `microbatches` microbatches, `loss_fn` and `scale_grads=False` (the caller normalises losses).
    Batches of another shape run through schedules built the same way for their shape (see
    [`ScheduleCache`][danling.distributed.pipeline_runtime.ScheduleCache]).

    Args:
        parts: This rank's stage modules (the final, wrapped ones), in stage order.
        schedule: `parallel.pipeline_schedule`.
        microbatches: Microbatches per batch.
        rank: This rank's pipeline rank.
        ranks: The global ranks of its pipeline group, in order.
        group: The pipeline process group (`None`: the default group).
        device: The stages' device.
        loss_fn: The loss of one microbatch on the last stage, `(pred, target) -> loss`.

    Attributes:
        schedule: The main schedule; `stages`, `has_first_stage`, `has_last_stage`,
            `n_microbatches` (of the schedule run last), `first_rank`/`last_rank` (global ranks).

    Raises:
        ValueError: a number of parts that does not fit the schedule (one per rank for GPipe/1F1B).
    """

    def __init__(
        self,
        parts: Sequence[nn.Module],
        *,
        schedule: str,
        microbatches: int,
        rank: int,
        ranks: Sequence[int],
        group: Any,
        device: torch.device,
        loss_fn: Callable[[Any, Any], torch.Tensor],
    ) -> None:
        self.parts, self.name, self.group, self.device, self.loss_fn = list(parts), schedule, group, device, loss_fn
        self.schedule_class, self.style = schedule_class(schedule)
        single = single_stage(schedule)
        if not self.parts or (single and len(self.parts) != 1):
            raise ValueError(
                f"parallel.pipeline_schedule {schedule!r} needs {'exactly one' if single else 'at least one'} "
                f"local stage module, got {len(self.parts)}"
            )
        self.degree = len(ranks)
        self.num_stages = len(self.parts) * self.degree
        self.indices = stage_indices(rank, self.degree, self.num_stages, schedule=schedule)
        placement = stage_placement(self.num_stages, self.degree, self.style)
        self.first_rank, self.last_rank = ranks[placement[0]], ranks[placement[self.num_stages - 1]]
        self.has_first_stage, self.has_last_stage = 0 in self.indices, self.num_stages - 1 in self.indices
        self.n_microbatches = microbatches
        self.cache = ScheduleCache(lambda count: self._build(count)[0], self._fallback(single))
        self.schedule, stages = self._build(microbatches)
        self.stages = tuple(stages)

    @classmethod
    def from_config(
        cls,
        parts: Sequence[nn.Module],
        parallel: Any,
        *,
        batch_size: int,
        topology: Any,
        device: torch.device,
        loss_fn: Callable[[Any, Any], torch.Tensor],
    ) -> PipelineRuntime:
        """The runtime of the `parallel` config section over the pipeline domain of `topology`.

        Reads `pipeline_schedule`, `pipeline_n_microbatches` and `pipeline_microbatch_size`;
        `batch_size` is the training batch size the microbatches divide.
        """
        count = microbatch_count(
            batch_size,
            n_microbatches=parallel.pipeline_n_microbatches,
            microbatch_size=parallel.pipeline_microbatch_size,
        )
        return cls(
            parts,
            schedule=parallel.pipeline_schedule,
            microbatches=count,
            rank=topology.rank("pipeline"),
            ranks=topology.ranks("pipeline"),
            group=topology.group("pipeline"),
            device=device,
            loss_fn=loss_fn,
        )

    def _build(self, microbatches: int, cls: type | None = None) -> tuple[Any, list]:
        """A schedule over fresh `PipelineStage`s of the parts for `microbatches` microbatches."""
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        cls = cls or self.schedule_class
        stages = [
            PipelineStage(part, index, self.num_stages, self.device, group=self.group)
            for part, index in zip(self.parts, self.indices, strict=True)
        ]
        single = issubclass(cls, PipelineScheduleSingle)
        schedule = cls(
            stages[0] if single else stages, n_microbatches=microbatches, loss_fn=self.loss_fn, scale_grads=False
        )
        return schedule, stages

    def _fallback(self, single: bool) -> Callable[[int], Any] | None:
        """A builder of the simplest schedule of the same kind, for batches the configured one rejects."""
        if self.style != "loop":
            return None
        from torch.distributed.pipelining.schedules import ScheduleGPipe, ScheduleLoopedBFS

        simple = ScheduleGPipe if single else ScheduleLoopedBFS
        return lambda microbatches: self._build(microbatches, simple)[0]

    def select(self, args: tuple[Any, ...], main: Any = None) -> Any:
        """The schedule for this batch's input shapes (shared by the first stage with every pipeline rank).

        `main` is the schedule the runner holds (by default this runtime's own).
        """
        key = broadcast_shapes(args, src=self.first_rank, group=self.group, device=self.device, degree=self.degree)
        schedule = self.cache.get(self.schedule if main is None else main, key)
        self.n_microbatches = schedule._n_microbatches
        return schedule

    def check_forward_only(self) -> None:
        """Refuse evaluation under the V schedules, which torch (2.13) cannot run forward-only.

        Every rank reads the same config, so all of them raise together instead of hanging.
        """
        check_forward_only(self.name)

    def inputs(self, data: Any, *, need_target: bool = True) -> tuple[tuple[Any, ...], Any]:
        """Positional inputs for the first stage and the target for the last one (empty/None elsewhere).

        `data` is the batch on the device (`None` on ranks that read no data).
        """
        if data is None:
            if self.has_first_stage or (need_target and self.has_last_stage):
                raise ValueError("this rank owns the first or last pipeline stage and needs a batch, got None")
            return (), None
        input, target = split_batch(data)
        if need_target and self.has_last_stage and target is None:
            raise ValueError("the last pipeline stage needs a target to compute the training loss")
        if not self.has_first_stage:
            args: tuple[Any, ...] = ()
        elif isinstance(input, torch.Tensor):
            args = (input,)
        elif isinstance(input, (tuple, list)):
            args = tuple(input)
        else:
            kind = "a mapping" if isinstance(input, Mapping) else type(input).__name__
            raise ValueError(f"pipeline input must be a tensor or a tuple of tensors, got {kind}")
        return args, target if self.has_last_stage else None

    def mean_loss(self, losses: list[torch.Tensor], *, optional: bool = False) -> torch.Tensor | None:
        """Mean microbatch loss of the last stage, broadcast over the pipeline group.

        A loss may carry its unscaled value as `_danling_raw_loss`; that one is averaged. With
        `optional`, a flag travels with it telling whether the last stage computed a loss at all
        (no criterion or no target: `None` on every rank).
        """
        raw = [getattr(loss, "_danling_raw_loss", loss) for loss in losses]
        loss = torch.stack(raw).float().mean() if raw else torch.zeros((), device=self.device)
        if optional:
            loss = torch.stack([loss.to(self.device), torch.tensor(float(bool(losses)), device=self.device)])
        if self.degree > 1:
            loss = loss.to(self.device)
            dist.broadcast(loss, src=self.last_rank, group=self.group)
        if not optional:
            return loss
        return loss[0] if loss[1].item() else None

    def broadcast_from_last(self, value: Any) -> Any:
        """`value` of the rank with the last stage, on every pipeline rank (one object broadcast)."""
        values = [value]
        if self.degree > 1:
            dist.broadcast_object_list(values, src=self.last_rank, group=self.group)
        return values[0]

    def loader(self, loader: Any, *, needs_target: bool = True) -> Any:
        """The loader this rank iterates: `loader` itself, or a stand-in that yields `None`.

        See [`StepProxyLoader`][danling.distributed.pipeline_loader.StepProxyLoader]. Ranks with the
        first stage read inputs, ranks with the last stage read targets (unless
        `needs_target` is false, as for inference); every other rank gets a stand-in of the same
        length, so all ranks take the same number of steps.
        """
        return pipeline_loader(loader, self.has_first_stage, self.has_last_stage, needs_target=needs_target)


def pipeline_loader(loader: Any, has_first_stage: bool, has_last_stage: bool, *, needs_target: bool = True) -> Any:
    """`loader` for a rank with the first (or, when targets are needed, the last) stage, else a `StepProxyLoader`."""
    if has_first_stage or (needs_target and has_last_stage):
        return loader
    return StepProxyLoader(loader)


def check_forward_only(schedule: str) -> None:
    """Raise `NotImplementedError` for a V schedule, which torch cannot run forward-only (evaluate/infer)."""
    if schedule_class(schedule)[1] == "v":
        raise NotImplementedError(
            f"parallel.pipeline_schedule {schedule!r} trains, but torch's V schedules cannot run forward-only "
            "(evaluate/infer); use 'Interleaved1F1B' or 'InterleavedZeroBubble' in runs that evaluate"
        )
