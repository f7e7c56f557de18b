"""`ParallelRunner`: one topology for FSDP2, tensor and pipeline parallelism, registered for the stack `parallel`.

The runner lays the ranks out on the grid of `config.parallel.axes` (see
[`Topology`][danling.distributed.Topology]) and keeps the rest of
[`TorchRunner`][danling.runners.TorchRunner]: the loops, the update strategy, metrics and the
checkpoint contract. What changes is how the model is materialized (tensor parallel, activation
checkpointing, FSDP2 or DDP over the data axes, pipeline stages), which ranks reduce what (samplers
and metrics over the data domain, gradient norms over the pipeline) and the checkpoint backend
(DCP, which reshards on load).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from danling.distributed import Topology, wrap_ddp
from danling.distributed.fsdp import apply_fsdp, block_modules, fsdp_mesh, fsdp_mixed_precision, fsdp_offload
from danling.distributed.layout import check_axes, check_layout
from danling.distributed.pipeline import (
    PipelineRuntime,
    build_stage_part,
    stage_count,
    stage_indices,
    train_batch_size,
)
from danling.distributed.tensor_parallel import checkpoint_blocks, parallelize

from .parallel import ParallelCheckpointing, PipelineSteps
from .runner import register_runner
from .torch_runner import TorchRunner
from .update import GradientSync, TorchUpdateStrategy, gradient_sync_for
from .update.spikes import guard_options

__all__ = ["ParallelRunner"]


class ParallelRunner(TorchRunner):
    """Torch runner for explicit parallel layouts: FSDP2/HSDP, tensor parallel and pipeline parallel.

    Configure the layout with `parallel.axes` (`replicate`, `shard`, `context`, `pipeline`,
    `tensor`; their product is the world size, one may be -1 to take the rest) and the sharding
    with `fsdp.*`; the model, criterion and data are bound exactly as for
    [`TorchRunner`][danling.runners.TorchRunner]. Each local model part is materialized in this
    order: moved to the device, `parallelize_model` (tensor parallel), `apply_activation_checkpointing`,
    then FSDP2 (`fsdp.enabled`) or DDP over the data axes, then `torch.compile`.

    Layout rules: `shard > 1` needs `fsdp.enabled` (and FSDP2 needs `shard > 1`; `replicate > 1`
    with it is HSDP); plain `replicate` is DDP; tensor parallelism with several data ranks needs
    FSDP2. Context parallelism needs CUDA (see `build_topology`). In one process the runner
    behaves like `TorchRunner` (nothing to shard).

    Checkpoints of distributed runs are DCP checkpoints (`checkpoint.backend` `auto` or `dcp`):
    every rank writes its own shards, keyed by parameter name, and a load reads whatever slices the
    current layout needs, so a checkpoint saved on one layout loads on another.

    Attributes:
        model_parts: The local model parts after materialization (one, or this rank's pipeline
            stages); `model` is the first of them.
        pipeline_schedule: The `torch.distributed.pipelining` schedule when `pipeline > 1`.
        pipeline_stages: The `PipelineStage` of each local part.
        pipeline_has_first_stage: Whether this rank feeds the pipeline its inputs.
        pipeline_has_last_stage: Whether this rank computes the loss.
        pipeline: The [`PipelineSteps`][danling.runners.parallel.pipeline.PipelineSteps] component that
            runs the train/evaluate/infer steps through the schedule (`pipeline.runtime` holds the
            built [`PipelineRuntime`][danling.distributed.pipeline.PipelineRuntime]).
    """

    supported_features = ("parallel", "fsdp")
    model_parts: list[nn.Module] | None = None
    pipeline_schedule: Any = None
    pipeline_stages: tuple[Any, ...] = ()
    pipeline_has_first_stage: bool = True
    pipeline_has_last_stage: bool = True
    _pipeline_num_stages: int | None = None  # fixed once the parts are built

    @property
    def pipeline(self) -> PipelineSteps:
        """The pipeline steps component (created on first use)."""
        steps = self.__dict__.get("_pipeline_steps")
        if steps is None:
            steps = self._pipeline_steps = PipelineSteps(self)
        return steps

    # ------------------------------------------------------------------ layout
    @property
    def parallel(self) -> Topology:
        """The topology, under the name a model's `parallelize(parallel)` hook receives it."""
        return self.topology

    def build_topology(self) -> Topology:
        """The grid of `config.parallel.axes` with a device mesh over its axes above degree one.

        Called when: once during construction, right after `init_distributed`, on every rank.
        Holds on entry: the process group (if any) is up; `config.parallel.axes` is final; no model is
            materialized yet.
        Side effects: creates the device mesh and its process groups (collective).
        Overrides must not: return degrees that differ between ranks or do not multiply to the world size,
            or skip a rank (building the mesh is collective).

        Raises:
            ValueError: A degree is not a positive integer (or the one -1), or the degrees do not
                multiply to the world size (the message names each degree and the world size).
            RuntimeError: `context > 1` on a CPU device (see [`check_axes`][danling.distributed.layout.check_axes]).
        """
        axes = {name: value for name, value in self.config.parallel.axes.dict().items() if value is not None}
        check_axes(axes, self.device.type)
        return Topology.from_axes(axes, device_type=self.device.type)

    checkpointing_class = ParallelCheckpointing  # DCP only when distributed; checkpoints hold every local part
    checkpointing: ParallelCheckpointing

    # ------------------------------------------------------------------ model
    def materialize_model(self) -> None:
        """Materialize the local model parts: device, tensor parallel, activation checkpointing, FSDP2/DDP, compile.

        Called when: once, by `__post_init__` during construction, on every rank; first of the components.
        Holds on entry: the topology (mesh and groups), precision policy and compiler are set up;
            `self.model` (or preset `model_parts`) is the user's module; no optimizer is built yet.
        Side effects: binds `model_parts` and `model` (their first), with `pipeline > 1` also
            `pipeline_schedule` and the pipeline attributes; creates the EMA copy.
        Overrides must not: build the optimizer (it must see the sharded parameters) or run collectives on
            some ranks only (FSDP2 and DDP wrapping are collective).

        With `pipeline > 1` the model is first split with `build_pipeline_model_parts`, and the
        schedule is built from the materialized parts.

        Raises:
            ValueError: No model is bound, or the layout cannot be implemented (see the class).
            TypeError: `self.model` is not an `nn.Module`.
        """
        if self.model is None and self.model_parts:
            self.model = self.model_parts[0]
        self.require_model()
        check_layout(
            self.topology.degrees,
            world_size=self.topology.world_size,
            data_size=self.topology.size("data"),
            fsdp=bool(self.config.fsdp.enabled),
            ema=bool(self.config.ema.enabled),
        )
        pipelined = self.topology.size("pipeline") > 1
        if self.model_parts:
            parts = list(self.model_parts)
        elif pipelined:
            parts = self.build_pipeline_model_parts(self.model)
        else:
            parts = [self.model]
        parts = [self._materialize_part(part, strict=not pipelined) for part in parts]
        self.model_parts = parts
        self.model = parts[0]
        if pipelined and self.pipeline_schedule is None:
            self.pipeline_schedule = self.build_pipeline_schedule(parts if len(parts) > 1 else parts[0])
        self.materialize_ema()

    def _materialize_part(self, part: nn.Module, *, strict: bool) -> nn.Module:
        part = part.to(self.device)
        part = self.parallelize_model(part)
        part = self.apply_activation_checkpointing(part)
        trainable = any(param.requires_grad for param in part.parameters())
        fsdp = self.config.fsdp
        if fsdp.enabled and self.distributed:
            apply_fsdp(
                part,
                fsdp_mesh(self.topology),
                units=block_modules(part, fsdp.modules, strict=strict),
                reshard_after_forward=fsdp.reshard_after_forward,
                mp_policy=fsdp_mixed_precision(fsdp.mp_policy, self.precision),
                offload_policy=fsdp_offload(fsdp.offload_policy),
            )
            return self.compiler.compile(part, distributed=True)
        part = self.compiler.compile(part, distributed=self.distributed)
        if self.topology.size("data") > 1 and trainable:
            part = wrap_ddp(part, self.device, process_group=self.topology.group("data"))
        return part

    def parallelize_model(self, model: nn.Module) -> nn.Module:
        """Apply tensor parallelism to one local part (before activation checkpointing, FSDP and compile).

        Called when: by `materialize_model`, once per local part, first after the device move, on every rank.
        Holds on entry: the part is on `self.device`; the topology's tensor axis and groups exist.
        Side effects: shards the part's parameters over the tensor axis (in place, or a returned module).
        Overrides must not: rename parameters (checkpoints and `param_groups` use the full model's names) or wrap in
            FSDP/DDP (done afterwards).

        The model's own `parallelize(parallel)` method wins; otherwise `parallel.tensor_plan` is applied
        over the tensor axis (see [`parallelize`][danling.distributed.tensor_parallel.parallelize]).

        Raises:
            TypeError: `model.parallelize` returned something other than a module or None.
            NotImplementedError: `tensor > 1` with neither a `parallelize` method nor a plan.
        """
        return parallelize(model, self.parallel, self.config.parallel.tensor_plan, distributed=self.distributed)

    def apply_activation_checkpointing(self, model: nn.Module) -> nn.Module:
        """Recompute activations of the part's blocks in backward, per `parallel.activation_checkpointing`.

        Called when: by `materialize_model`, once per local part, after `parallelize_model` and before FSDP2/DDP and
            compile.
        Holds on entry: the part is on `self.device` and tensor-parallel where configured.
        Side effects: wraps the selected blocks' forward in place so backward recomputes their activations; returns the
            part.
        Overrides must not: change parameter names or move parameters (FSDP2 shards the same modules next).

        `none` leaves the part alone; `block` and `selective` apply to the modules `fsdp.modules`
        names, or every member of an `nn.ModuleList` (see
        [`checkpoint_blocks`][danling.distributed.tensor_parallel.checkpoint_blocks]). Runs before FSDP2
        wraps the part; parameter names do not change.
        """
        mode = self.config.parallel.activation_checkpointing or "none"
        if mode == "none":
            return model
        checkpoint_blocks(block_modules(model, self.config.fsdp.modules, strict=False), mode)
        return model

    def iter_optimizer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """`(name, parameter)` of every trainable parameter of every local part, with the full model's names.

        Called when: by `build_optimizer` (and `iter_optimizer_parameters`), once during construction, after
            `materialize_model`.
        Holds on entry: `model_parts` holds the materialized (sharded, wrapped) local parts.
        Side effects: none.
        Overrides must not: yield a parameter twice, parameters of another rank's stage, or names without the full
            model's prefixes.
        """
        for part in self.model_parts or [self.model]:
            for name, param in self.unwrap(part).named_parameters():
                if param.requires_grad:
                    yield name, param

    @TorchRunner.mode.setter  # type: ignore[attr-defined]
    def mode(self, mode: Any) -> None:
        TorchRunner.mode.fset(self, mode)
        for part in (self.model_parts or [])[1:]:
            part.train(self.mode.value == "train")

    # ------------------------------------------------------------------ pipeline
    def pipeline_stage_indices(self, num_stages: int | None = None) -> tuple[int, ...]:
        """Indices of the pipeline stages this rank owns, in increasing order.

        Stages are looped over the pipeline ranks (rank `r` of `pp` owns `r, r + pp, ...`); the V
        schedules (`ZBVZeroBubble`, `DualPipeV`) place them down and back up (see
        [`stage_indices`][danling.distributed.pipeline.stage_indices]).

        Called when: by `build_pipeline_model_parts` and `build_pipeline_schedule`, once each, on every rank.
        Holds on entry: the topology is built; `config.parallel` is final.
        Side effects: none.
        Overrides must not: give ranks disagreeing stage counts or break a V schedule's placement;
            override it for other placements.

        Args:
            num_stages: Total number of stages; by default from `parallel.module_fqns_per_model_part`,
                the model's `pipeline_num_stages`, or the schedule (see
                [`stage_count`][danling.distributed.pipeline.stage_count]).

        Raises:
            ValueError: `num_stages` is not a positive multiple of the pipeline degree, or a
                single-stage schedule is given more stages than ranks.
        """
        if num_stages is None:
            num_stages = self._stage_count(self.model)
        schedule = self.config.parallel.pipeline_schedule
        return stage_indices(
            self.topology.rank("pipeline"), self.topology.size("pipeline"), num_stages, schedule=schedule
        )

    def _stage_count(self, model: nn.Module | None) -> int:
        if self._pipeline_num_stages is not None:
            return self._pipeline_num_stages
        parallel = self.config.parallel
        return stage_count(
            self.topology.size("pipeline"),
            schedule=parallel.pipeline_schedule,
            module_fqns=parallel.module_fqns_per_model_part,
            model=model,
        )

    def build_pipeline_model_part(self, model: nn.Module, stage_index: int | None = None) -> nn.Module:
        """The module of one pipeline stage (by default the first stage this rank owns).

        If `model` defines `build_pipeline_model_part(stage_index, num_stages)`, its result is used
        as is; otherwise the stage is cut out by `parallel.module_fqns_per_model_part` (see
        [`build_stage_part`][danling.distributed.pipeline.build_stage_part]): the listed submodules at
        their original paths, shared with `model`, not copied.

        Called when: by `build_pipeline_model_parts`, once per local stage, before materialization.
        Holds on entry: `model` is the user's whole model, on its original device.
        Side effects: none on the runner.
        Overrides must not: rename parameters (checkpoints are keyed by the whole model's names).

        Raises:
            ValueError: neither the hook nor `module_fqns_per_model_part` is available, or the names
                do not fit the model or the pipeline degree.
            TypeError: the model's hook returned something other than a module.
        """
        num_stages = self._stage_count(model)
        if stage_index is None:
            stage_index = self.pipeline_stage_indices(num_stages)[0]
        degree, fqns = self.topology.size("pipeline"), self.config.parallel.module_fqns_per_model_part
        return build_stage_part(model, stage_index, num_stages, degree=degree, module_fqns=fqns)

    def build_pipeline_model_parts(self, model: nn.Module) -> list[nn.Module]:
        """The modules of every stage this rank owns, in stage order (see `pipeline_stage_indices`).

        Called when: by `materialize_model`, once during construction when `pipeline > 1` and no `model_parts` are
            preset.
        Holds on entry: the topology is built; `model` is the user's whole model, on its original device.
        Side effects: fixes the pipeline's stage count on the runner; the parts share modules with `model`.
        Overrides must not: return parts out of stage order or for stages `pipeline_stage_indices` does not give this
            rank.
        """
        num_stages = self._stage_count(model)
        parts = [self.build_pipeline_model_part(model, index) for index in self.pipeline_stage_indices(num_stages)]
        self._pipeline_num_stages = num_stages
        return parts

    def build_pipeline_schedule(self, stage_model: nn.Module | Sequence[nn.Module]) -> Any:
        """The PyTorch schedule over this rank's stage modules (the final, wrapped ones).

        Called when: by `materialize_model`, once during construction when `pipeline > 1`, after the parts are
            materialized.
        Holds on entry: the parts are final (sharded, wrapped, compiled); `config.parallel` and `config.dataloader` are
            final.
        Side effects: binds `pipeline.runtime`, the stage count, `pipeline_stages`, `pipeline_has_first_stage` and
            `pipeline_has_last_stage`.
        Overrides must not: bind `pipeline_schedule` itself (the caller does) or build stages over unwrapped copies of
            the parts.

        Builds a [`PipelineRuntime`][danling.distributed.pipeline.PipelineRuntime] (one `PipelineStage`
        per part, the class named by `parallel.pipeline_schedule`, the microbatch count of
        `parallel.pipeline_n_microbatches`/`pipeline_microbatch_size`, the normalising loss of
        `pipeline.loss`, `scale_grads=False`) and binds it to `pipeline.runtime`; sets `pipeline_stages`,
        `pipeline_has_first_stage` and `pipeline_has_last_stage`. The caller binds the returned
        schedule to `pipeline_schedule`.

        Raises:
            ValueError: an unknown schedule name, a bad microbatch count, or a number of parts that
                does not match the schedule (one per rank for GPipe/1F1B).
        """
        parts = [stage_model] if isinstance(stage_model, nn.Module) else list(stage_model)
        runtime = PipelineRuntime.from_config(
            parts,
            self.config.parallel,
            batch_size=train_batch_size(self.config.dataloader),
            topology=self.topology,
            device=self.device,
            loss_fn=self.pipeline.loss,
        )
        self.pipeline.runtime, self._pipeline_num_stages = runtime, runtime.num_stages
        self.pipeline_stages = runtime.stages
        self.pipeline_has_first_stage, self.pipeline_has_last_stage = runtime.has_first_stage, runtime.has_last_stage
        return runtime.schedule

    # ------------------------------------------------------------------ updates
    def build_update_strategy(self) -> TorchUpdateStrategy:
        """The torch update strategy over every local part.

        Called when: once during construction, by `__post_init__` after `build_optimizer` and `build_scheduler`, on
            every rank.
        Holds on entry: `model_parts` are materialized; the topology's gradient, pipeline and world groups exist.
        Side effects: none: returns a new strategy, which the caller binds to the optimizer and scheduler.
        Overrides must not: return a strategy whose gradient-norm or skip decisions differ between ranks (they must use
            the given groups).

        It has the gradient-sync control of each part, the gradient domain's group, and gradient
        norms summed over the pipeline stages.

        Pipeline schedules decide gradient synchronisation per microbatch themselves, so windows do
        not suppress it there.
        """
        topology = self.topology
        pipelined = topology.size("pipeline") > 1
        norm_group = None
        if pipelined:
            norm_group = topology.group("pipeline") or dist.group.WORLD
        return TorchUpdateStrategy(
            self.accum_steps,
            precision=self.precision_policy,
            gradient_sync=GradientSync() if pipelined else gradient_sync_for(self.model_parts or [self.model]),
            group=topology.group("gradient"),
            max_grad_norm=self.max_grad_norm,
            max_grad_value=self.max_grad_value,
            skip_nonfinite_grad=self.skip_nonfinite_grad,
            skip_group=topology.group("world"),
            norm_group=norm_group,
            **guard_options(self.config, self.logger, spikes_supported=not pipelined),
        )

    # ------------------------------------------------------------------ steps
    def train_step(self, data: Any) -> tuple[Any, torch.Tensor | None]:
        """The pipeline step when a schedule is set (see `pipeline.train_step`), else TorchRunner's.

        Called when: by the training loop, once per micro-batch, on every rank (pipeline ranks without inputs too).
        Holds on entry: the model is in train mode; `data` is the batch (a placeholder on ranks that do not feed the
            pipeline).
        Side effects: runs forward and backward (through the schedule when pipelined) and counts the micro-step.
        Overrides must not: call the schedule on some pipeline ranks only, or skip `step()` (the accumulation window
            would stall).
        """
        if self.pipeline_schedule is not None:
            return self.pipeline.train_step(data)
        return super().train_step(data)

    def evaluate_step(self, data: Any) -> tuple[Any, torch.Tensor | None]:
        """The pipeline evaluation step when a schedule is set, else TorchRunner's.

        Called when: by the evaluation loop, once per batch, on every rank (pipeline ranks without inputs too).
        Holds on entry: the model is in eval mode; `data` is the batch or a placeholder.
        Side effects: runs forward (through the schedule when pipelined) and updates the metrics; no gradients.
        Overrides must not: call the schedule on some pipeline ranks only (it is collective across stages).
        """
        if self.pipeline_schedule is not None:
            return self.pipeline.evaluate_step(data)
        return super().evaluate_step(data)

    def infer_step(self, data: Any) -> list[Any]:
        """The pipeline inference step when a schedule is set, else TorchRunner's.

        Called when: by `infer`, once per batch, on every rank (pipeline ranks without inputs too).
        Holds on entry: the model is in eval mode; `data` is the batch or a placeholder.
        Side effects: runs forward (through the schedule when pipelined); returns this rank's outputs.
        Overrides must not: call the schedule on some pipeline ranks only (it is collective across stages).
        """
        if self.pipeline_schedule is not None:
            return self.pipeline.infer_step(data)
        return super().infer_step(data)

    def build_dataloaders(self) -> None:
        """TorchRunner's loaders; ranks whose stages neither feed inputs nor compute the loss get placeholders.

        Called when: once during construction, by `__post_init__` after the update strategy is built, when datasets are
            given.
        Holds on entry: the model is materialized and, when pipelined, `pipeline_schedule` and `pipeline.runtime` are
            set.
        Side effects: binds `self.dataloaders`; with a schedule, wraps each so non-feeding pipeline ranks get
            placeholders.
        Overrides must not: give pipeline ranks loaders of different lengths (every stage must run the same number of
            steps).
        """
        super().build_dataloaders()
        if self.pipeline_schedule is not None:
            for split, loader in list(self.dataloaders.items()):
                self.dataloaders[split] = self.pipeline.runtime.loader(loader)


register_runner("parallel", ParallelRunner)
