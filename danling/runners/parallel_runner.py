"""`ParallelRunner`: one topology for FSDP2, tensor and pipeline parallelism, registered for the stack `parallel`.

The mechanics are functions of [`danling.distributed`][danling.distributed] (`layout`, `fsdp`,
`tensor_parallel`, `pipeline*`, `parts`) and the [`PipelineSteps`][danling.runners.parallel.pipeline.PipelineSteps]
component; this class holds the public hooks that call them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from danling.distributed import ParallelContext, ParallelTopology
from danling.distributed.ddp import ddp_options
from danling.distributed.expert_parallel import ExpertGradients, expert_parameters
from danling.distributed.fsdp import block_modules, wrap_data_parallel
from danling.distributed.layout import check_axes, check_layout
from danling.distributed.parts import merge_parts
from danling.distributed.pipeline import train_batch_size
from danling.distributed.tensor_parallel import checkpoint_blocks, parallelize
from danling.utils import RoundDict

from .parallel import ParallelCheckpointing, PipelineSteps
from .runner import register_runner
from .torch_runner import TorchRunner
from .update import EMA, GradientSync, TorchUpdateStrategy, gradient_sync_for
from .update.spikes import guard_options

__all__ = ["ParallelRunner"]


class ParallelRunner(TorchRunner):
    """Torch runner for explicit parallel layouts: FSDP2/HSDP, tensor parallel and pipeline parallel.

    The layout is `parallel.axes` (`replicate`, `shard`, `context`, `pipeline`, `tensor`; their
    product is the world size, one may be -1), the sharding `fsdp.*`; the rest is bound as for
    [`TorchRunner`][danling.runners.TorchRunner]. `shard > 1` needs `fsdp.enabled` (with
    `replicate > 1`: HSDP); plain `replicate` is DDP; tensor parallelism over several data ranks
    needs FSDP2; context parallelism needs CUDA. `expert` splits a mixture-of-experts model's
    experts over data-parallel ranks it borrows (with DDP or FSDP2, in this version; see
    [`expert_parallel`][danling.distributed.expert_parallel]). Distributed runs checkpoint with
    DCP, which reshards on load, so checkpoints move between layouts.

    Attributes:
        topology: The [`ParallelTopology`][danling.distributed.topology.ParallelTopology]: axis degrees,
            this rank's coordinates, the reduction domains and the mesh shape.
        parallel: The [`ParallelContext`][danling.distributed.topology.ParallelContext] built from it: the
            device mesh and each domain's process group.
        model_parts: The materialized local parts (one, or this rank's stages); `model` is the first.
        pipeline_schedule: The `torch.distributed.pipelining` schedule when `pipeline > 1`.
        pipeline_stages: The `PipelineStage` of each local part.
        pipeline_has_first_stage: Whether this rank feeds the pipeline its inputs.
        pipeline_has_last_stage: Whether this rank computes the loss.
        pipeline: The [`PipelineSteps`][danling.runners.parallel.pipeline.PipelineSteps] component: stage
            layout, `pipeline.runtime` and the train/evaluate/infer steps through the schedule.
    """

    supported_features = ("parallel", "fsdp")
    model_parts: list[nn.Module] | None = None
    pipeline_schedule: Any = None
    pipeline_stages: tuple[Any, ...] = ()
    pipeline_has_first_stage: bool = True
    pipeline_has_last_stage: bool = True

    @property
    def pipeline(self) -> PipelineSteps:
        """The pipeline component (created on first use, once the topology exists)."""
        if "_pipeline_steps" not in self.__dict__:
            size = train_batch_size(self.config.dataloader)
            self._pipeline_steps = PipelineSteps(self, self.config.parallel, self.topology, self.device, size)
        return self._pipeline_steps

    # ------------------------------------------------------------------ layout
    @property
    def parallel(self) -> ParallelContext:
        """The device mesh and process groups of `topology`; a model's `parallelize(parallel)` hook receives it."""
        context = self.topology.context
        return context if context is not None else ParallelContext(self.topology)

    def build_topology(self) -> ParallelTopology:
        """The grid of `config.parallel.axes`, with its context (a device mesh over the axes above degree one).

        Called when: once during construction, right after `init_distributed`, on every rank.
        Holds on entry: the process group (if any) is up; `config.parallel.axes` is final; no model exists.
        Side effects: builds the topology's `ParallelContext`: the device mesh and process groups (collective).
        Overrides must not: return degrees that differ between ranks or do not multiply to the world size,
            or skip a rank (building the mesh is collective).

        Raises:
            ValueError: A degree is not a positive integer (or the one -1), or their product is not the world size.
            RuntimeError: `context > 1` on a CPU device (see [`check_axes`][danling.distributed.layout.check_axes]).
        """
        axes = {name: value for name, value in self.config.parallel.axes.dict().items() if value is not None}
        check_axes(axes, self.device.type)
        return ParallelTopology.from_axes(axes, device_type=self.device.type)

    checkpointing_class = ParallelCheckpointing  # DCP only when distributed; checkpoints hold every local part
    checkpointing: ParallelCheckpointing

    # ------------------------------------------------------------------ model
    def materialize_model(self) -> None:
        """Materialize the local parts: device, fp8, tensor parallel, activation checkpointing, FSDP2/DDP, compile.

        Called when: once, by `__post_init__` during construction, on every rank; first of the components.
        Holds on entry: topology, precision policy and compiler are set up; `self.model` (or preset
            `model_parts`) is the user's module; no optimizer exists yet.
        Side effects: binds `model_parts` and `model` (their first), with `pipeline > 1` (parts cut by
            `build_pipeline_model_parts`) also `pipeline_schedule` and the pipeline attributes; creates the EMA copy;
            under TorchFT (`ft.enabled`) installs the all-reduce hooks that average FSDP2's gradient shards
            over the replica groups.
        Overrides must not: build the optimizer (it must see the sharded parameters) or run collectives on
            some ranks only (FSDP2 and DDP wrapping are collective).

        Raises:
            ValueError: No model is bound, or a layout nothing implements (see the class).
            TypeError: `self.model` is not an `nn.Module`.
        """
        if self.model is None and self.model_parts:
            self.model = self.model_parts[0]
        self.require_model()
        topology, fsdp = self.topology, self.config.fsdp
        check_layout(topology, fsdp=bool(fsdp.enabled), ema=bool(self.config.ema.enabled))
        pipelined = topology.size("pipeline") > 1
        if self.model_parts:
            parts = list(self.model_parts)
        else:
            parts = self.build_pipeline_model_parts(self.model) if pipelined else [self.model]
        wrap = partial(wrap_data_parallel, topology=topology, fsdp=fsdp, precision=self.precision, device=self.device)
        wrap = partial(wrap, distributed=self.distributed, compile=self.compiler.compile, strict=not pipelined)
        wrap = partial(wrap, ddp=ddp_options(self.config))
        sharded = bool(fsdp.enabled and self.distributed)
        parts = [part.to(self.device) for part in parts]
        for part in parts:
            self.apply_fp8(part, fsdp=sharded)  # before sharding and tensor parallel: torchao swaps modules by name
        parts = [wrap(self.apply_activation_checkpointing(self.parallelize_model(part))) for part in parts]
        self.model_parts, self.model = parts, parts[0]
        if self.ft is not None:  # TorchFT replica groups: FSDP2 averages each gradient shard across the groups
            self.ft.reduce_shards(parts)
        if pipelined and self.pipeline_schedule is None:
            self.pipeline_schedule = self.build_pipeline_schedule(parts if len(parts) > 1 else parts[0])
        self.materialize_ema()

    def materialize_ema(self) -> None:
        """The EMA copy (`ema.enabled`): sharded like the model on FSDP2, tensor and pipeline layouts.

        On those layouts the copy holds only this rank's weights, each tensor cloned with the model's
        sharding (`EMA(..., runnable=False)`): a DTensor keeps its mesh and placements, a pipeline rank
        holds its stages' weights under the whole model's names. It is updated shard by shard without
        gathering, saved and resharded by DCP like the weights, and evaluation and inference run the
        live parts with the averaged weights swapped in (see `inference_context`). Replicated layouts
        (one process, DDP) keep TorchRunner's runnable copy (see `TorchRunner.materialize_ema`).

        Called when: once, at the end of `materialize_model`, on every rank.
        Holds on entry: `model_parts` are materialized (sharded, wrapped); `self.ema` is unset or the user's module.
        Side effects: sets `self.ema`; a user's own module is moved and synced as on TorchRunner.
        Overrides must not: copy the parts before they are sharded (each rank must clone its own shards), or
            give the copy other parameter names than the model's (checkpoints pair them by name).
        """
        if self.ema is None and self.config.ema.enabled and self._splits_weights():
            # the local parts as one tree under the whole model's names; the EMA follows this view
            parts = [self.unwrap(part) for part in self.model_parts or [self.model]]
            self.ema = EMA(merge_parts(parts), decay=self.config.ema.decay, runnable=False)
            return
        super().materialize_ema()

    def _splits_weights(self) -> bool:
        """Whether ranks hold different parts of the weights (FSDP2 shards, tensor slices, pipeline stages)."""
        topology = self.topology
        sharded = bool(self.config.fsdp.enabled) and topology.size("shard") > 1
        return self.distributed and (sharded or topology.size("tensor") > 1 or topology.size("pipeline") > 1)

    def parallelize_model(self, model: nn.Module) -> nn.Module:
        """Tensor parallelism for one local part: the model's `parallelize(parallel)`, else `parallel.tensor_plan`.

        Called when: by `materialize_model`, once per local part, first after the device move, on every rank.
        Holds on entry: the part is on `self.device`; the topology's tensor axis and groups exist.
        Side effects: shards the part's parameters over the tensor axis (in place, or a returned module).
        Overrides must not: rename parameters (checkpoints and `param_groups` use the full model's names) or
            wrap in FSDP/DDP (done afterwards).

        With `parallel.axes.expert > 1` the model's hook must also split its experts (see
        [`distribute_experts`][danling.distributed.expert_parallel.distribute_experts]).

        Raises:
            TypeError: `model.parallelize` returned something other than a module or None (see
                [`parallelize`][danling.distributed.tensor_parallel.parallelize]).
            NotImplementedError: `tensor > 1` with neither a `parallelize` method nor a plan, or
                `expert > 1` and the part holds no expert parameters after the hook.
        """
        model = parallelize(model, self.parallel, self.config.parallel.tensor_plan, distributed=self.distributed)
        expert = self.topology.degrees["expert"]
        if expert > 1 and self.distributed and next(expert_parameters(model), None) is None:
            raise NotImplementedError(
                f"parallel.axes.expert={expert} but {type(model).__name__} split no experts: its "
                "parallelize(parallel) method must call danling.distributed.expert_parallel.distribute_experts"
            )
        return model

    def apply_activation_checkpointing(self, model: nn.Module) -> nn.Module:
        """Recompute activations of the part's blocks in backward, per `parallel.activation_checkpointing`.

        Called when: by `materialize_model`, once per local part, after `parallelize_model`, before FSDP2/DDP.
        Holds on entry: the part is on `self.device` and tensor-parallel where configured.
        Side effects: wraps the selected blocks' forward in place (parameter names unchanged); returns the part.
        Overrides must not: change parameter names or move parameters (FSDP2 shards the same modules next).

        `none` leaves the part alone; `block` and `selective` apply to the modules `fsdp.modules`
        names, or every member of an `nn.ModuleList` (see
        [`checkpoint_blocks`][danling.distributed.tensor_parallel.checkpoint_blocks]).
        """
        mode = self.config.parallel.activation_checkpointing or "none"
        if mode != "none":
            checkpoint_blocks(block_modules(model, self.config.fsdp.modules, strict=False), mode)
        return model

    def iter_optimizer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """`(name, parameter)` of every trainable parameter of every local part, with the full model's names.

        Called when: by `build_optimizer` (and `iter_optimizer_parameters`), once, after `materialize_model`.
        Holds on entry: `model_parts` holds the materialized (sharded, wrapped) local parts.
        Side effects: none.
        Overrides must not: yield a parameter twice, another rank's stage, or names without the model's prefixes.
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

        Rank `r` of `pp` owns `r, r + pp, ...`; the V schedules (`ZBVZeroBubble`, `DualPipeV`) place
        them down and back up (see [`stage_indices`][danling.distributed.pipeline.stage_indices]).

        Called when: by `build_pipeline_model_parts` (and `build_pipeline_model_part`), on every rank.
        Holds on entry: the topology is built; `config.parallel` is final.
        Side effects: none.
        Overrides must not: give ranks disagreeing stage counts or break a V schedule's placement.

        `num_stages` (stages in all) defaults to `pipeline.stage_count(model)`; a ValueError names one that
        is not a positive multiple of the pipeline degree (or exceeds it for GPipe/1F1B).
        """
        return self.pipeline.stage_indices(self.pipeline.stage_count(self.model) if num_stages is None else num_stages)

    def build_pipeline_model_part(self, model: nn.Module, stage_index: int | None = None) -> nn.Module:
        """The module of one pipeline stage (by default the first stage this rank owns).

        The model's own `build_pipeline_model_part(stage_index, num_stages)` wins; otherwise the stage
        is cut by `parallel.module_fqns_per_model_part`: the listed submodules at their original paths,
        shared with `model` (see [`build_stage_part`][danling.distributed.pipeline.build_stage_part]).

        Called when: by `build_pipeline_model_parts`, once per local stage, before materialization.
        Holds on entry: `model` is the user's whole model, on its original device.
        Side effects: none on the runner.
        Overrides must not: rename parameters (checkpoints are keyed by the whole model's names).

        Raises:
            ValueError: neither the hook nor `module_fqns_per_model_part` is given, or the names do not fit.
            TypeError: the model's hook returned something other than a module.
        """
        num_stages = self.pipeline.stage_count(model)
        if stage_index is None:
            stage_index = self.pipeline_stage_indices(num_stages)[0]
        return self.pipeline.stage_part(model, stage_index, num_stages)

    def build_pipeline_model_parts(self, model: nn.Module) -> list[nn.Module]:
        """The modules of every stage this rank owns, in stage order (see `pipeline_stage_indices`).

        Called when: by `materialize_model`, once, when `pipeline > 1` and no `model_parts` are preset.
        Holds on entry: the topology is built; `model` is the user's whole model, on its original device.
        Side effects: fixes `pipeline.num_stages`; the parts share modules with `model`.
        Overrides must not: return parts out of stage order or for stages this rank does not own.
        """
        num_stages = self.pipeline.stage_count(model)
        parts = [self.build_pipeline_model_part(model, index) for index in self.pipeline_stage_indices(num_stages)]
        self.pipeline.num_stages = num_stages
        return parts

    def build_pipeline_schedule(self, stage_model: nn.Module | Sequence[nn.Module]) -> Any:
        """The PyTorch schedule over this rank's final stage modules.

        Called when: by `materialize_model`, once, when `pipeline > 1`, after the parts are materialized.
        Holds on entry: the parts are final (sharded, wrapped, compiled); `config.parallel` and
            `config.dataloader` are final.
        Side effects: binds `pipeline.runtime`, `pipeline_stages`, `pipeline_has_first_stage` and
            `pipeline_has_last_stage`; the caller binds the result to `pipeline_schedule`.
        Overrides must not: bind `pipeline_schedule` itself or build stages over unwrapped copies of the parts.

        See [`build_runtime`][danling.runners.parallel.pipeline.PipelineSteps.build_runtime] (and its errors).
        """
        runtime = self.pipeline.build_runtime(stage_model)
        self.pipeline_stages = runtime.stages
        self.pipeline_has_first_stage, self.pipeline_has_last_stage = runtime.has_first_stage, runtime.has_last_stage
        return runtime.schedule

    # ------------------------------------------------------------------ updates
    def build_update_strategy(self) -> TorchUpdateStrategy:
        """The torch update strategy over every local part, with gradient norms summed over the pipeline stages.

        Called when: once, by `__post_init__` after `build_optimizer` and `build_scheduler`, on every rank.
        Holds on entry: `model_parts` are materialized; the topology's gradient, pipeline and world groups exist.
        Side effects: none: the caller binds the returned strategy to the optimizer and scheduler.
        Overrides must not: return a strategy whose gradient-norm or skip decisions differ between ranks.
        """
        topology = self.topology
        pipelined = topology.size("pipeline") > 1
        return TorchUpdateStrategy(
            self.accum_steps,
            precision=self.precision_policy,
            # pipeline schedules decide gradient synchronisation per microbatch themselves
            gradient_sync=GradientSync() if pipelined else gradient_sync_for(self.model_parts or [self.model]),
            group=topology.group("gradient"),
            max_grad_norm=self.max_grad_norm,
            max_grad_value=self.max_grad_value,
            skip_nonfinite_grad=self.skip_nonfinite_grad,
            skip_group=topology.group("world"),
            norm_group=(topology.group("pipeline") or dist.group.WORLD) if pipelined else None,
            **guard_options(self.config, self.logger, spikes_supported=not pipelined),
            expert_gradients=self._expert_gradients(),
        )

    def _expert_gradients(self) -> ExpertGradients | None:
        """The reduction of the expert parameters DDP leaves out (`None` without expert parallelism)."""
        if self.topology.degrees["expert"] == 1:
            return None
        parts = self.model_parts or [self.model]
        return ExpertGradients([param for part in parts for _, param in expert_parameters(part)], self.topology)

    # ------------------------------------------------------------------ steps
    def train_step(self, data: Any) -> tuple[Any, torch.Tensor | None]:
        """The pipeline step when a schedule is set (see `pipeline.train_step`), else TorchRunner's.

        Called when: by the training loop, once per micro-batch, on every rank (pipeline ranks without inputs too).
        Holds on entry: the model is in train mode; `data` is the batch (a placeholder on non-feeding ranks).
        Side effects: runs forward and backward (through the schedule when pipelined) and counts the micro-step.
        Overrides must not: call the schedule on some pipeline ranks only, or skip `step()` (the window would stall).
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

    def loss_weight(self, data: Any) -> int | float:
        """TorchRunner's weight of a batch's loss; 1 on the pipeline ranks whose loader yields no batch.

        Called when: by the training and evaluation passes, once per batch whose step returned a loss.
        Holds on entry: `data` is the batch, or `None` on a pipeline rank that neither feeds inputs nor
            computes the loss (a `StepProxyLoader` is its loader).
        Side effects: none.
        Overrides must not: return a weight for `None` that differs across such ranks, or a tensor.
        """
        if data is None and self.pipeline_schedule is not None:
            # Such a rank cannot count the batch it never reads. Its loss is the last stage's, broadcast,
            # and so is its row (`collect_result`): the weight only shapes what its own step logs show.
            return 1
        return super().loss_weight(data)

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

    def collect_result(self, split: str) -> RoundDict:
        """TorchRunner's result of the pass; under a pipeline schedule, the last stage's, on every pipeline rank.

        Called when: at the end of each pass over a split (and before a step-mode evaluation), on every rank.
        Holds on entry: the pass's meters and metrics hold its batches (metrics on the last stage only).
        Side effects: as TorchRunner's; with a schedule, one object broadcast over the pipeline group.
        Overrides must not: skip the call on some ranks (the read and the broadcast are collective).
        """
        result = super().collect_result(split)
        if self.pipeline_schedule is None:
            return result
        # Only the last stage's metrics saw outputs; the other stages read NaN. Each rank chose its
        # best checkpoint and decided early stopping from its own row, so ranks disagreed, and a rank
        # that stopped left the others waiting in a collective. Every stage now takes the last
        # stage's row (the loss is the same everywhere already).
        return RoundDict.from_flat(self.pipeline.runtime.broadcast_from_last(dict(result)))

    def build_dataloaders(self) -> None:
        """TorchRunner's loaders; ranks whose stages neither feed inputs nor compute the loss get placeholders.

        Called when: once, by `__post_init__` after the update strategy is built, when datasets are given.
        Holds on entry: the model is materialized; when pipelined, `pipeline.runtime` is set.
        Side effects: binds `self.dataloaders`; with a schedule, wraps each for the non-feeding pipeline ranks.
        Overrides must not: give pipeline ranks loaders of different lengths (every stage runs the same steps).
        """
        super().build_dataloaders()
        if self.pipeline_schedule is not None:
            for split, loader in list(self.dataloaders.items()):
                self.dataloaders[split] = self.pipeline.runtime.loader(loader)


register_runner("parallel", ParallelRunner)
