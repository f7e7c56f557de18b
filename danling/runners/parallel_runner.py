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

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from danling.distributed import Topology, wrap_ddp

from .parallel import (
    apply_fsdp,
    apply_tensor_plan,
    block_modules,
    checkpoint_blocks,
    fsdp_mixed_precision,
    fsdp_offload,
    merge_parts,
)
from .parallel.pipeline import PipelineMixin
from .runner import register_runner
from .torch_runner import TorchRunner
from .update import GradientSync, TorchUpdateStrategy, gradient_sync_for
from .update.spikes import guard_options

__all__ = ["ParallelRunner"]


class ParallelRunner(PipelineMixin, TorchRunner):
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
        pipeline_has_first_stage: Whether this rank feeds the pipeline its inputs.
        pipeline_has_last_stage: Whether this rank computes the loss.
    """

    supported_features = ("parallel", "fsdp")
    model_parts: list[nn.Module] | None = None
    pipeline_schedule: Any = None
    pipeline_has_first_stage: bool = True
    pipeline_has_last_stage: bool = True

    # ------------------------------------------------------------------ layout
    @property
    def parallel(self) -> Topology:
        """The topology, under the name a model's `parallelize(parallel)` hook receives it."""
        return self.topology

    def build_topology(self) -> Topology:
        """The grid of `config.parallel.axes` with a device mesh over its axes above degree one.

        Called right after `init_distributed`, on every rank (building the mesh is collective).

        Raises:
            ValueError: A degree is not a positive integer (or the one -1), or the degrees do not
                multiply to the world size (the message names each degree and the world size).
            RuntimeError: `context > 1` on a CPU device (see below).
        """
        axes = {name: value for name, value in self.config.parallel.axes.dict().items() if value is not None}
        if axes.get("context", 1) not in (1, -1) and self.device.type == "cpu":
            # Measured with torch 2.13 on CPU: SDPA has no CPU sharding strategy for context_parallel
            # and FlexAttention has no CPU backward, so a context-parallel step cannot run here.
            raise RuntimeError(
                f"parallel.axes.context={axes['context']} needs CUDA devices: torch's context parallelism shards "
                "attention over the sequence, and on CPU neither scaled-dot-product attention (no CPU sharding "
                "strategy) nor FlexAttention (no CPU backward) can be sharded; set parallel.axes.context to 1"
            )
        if axes.get("context", 1) not in (1, -1):
            raise NotImplementedError(
                f"parallel.axes.context={axes['context']}: context parallelism is not built in this version of "
                "danling; shard the sequence in your model or set parallel.axes.context to 1"
            )
        return Topology.from_axes(axes, device_type=self.device.type)

    @property
    def checkpoint_backend(self) -> str:
        """`"dcp"` for distributed runs (the only format that reshards); the file backend is refused there."""
        backend = self.config.checkpoint.backend or "auto"
        if not self.distributed:
            return super().checkpoint_backend
        if backend not in ("auto", "dcp"):
            raise ValueError(
                f"checkpoint.backend={backend!r} is not supported by ParallelRunner in a distributed run: its "
                "checkpoints are sharded and only 'dcp' (or 'auto') can write and reshard them"
            )
        return "dcp"

    def _check_layout(self) -> None:
        """Refuse layouts whose axes nothing would implement, before any model work."""
        degrees, fsdp = self.topology.degrees, bool(self.config.fsdp.enabled)
        if self.topology.world_size == 1:
            return
        if degrees["shard"] > 1 and not fsdp:
            raise ValueError(
                f"parallel.axes.shard={degrees['shard']} shards parameters with FSDP2: set fsdp.enabled to true, "
                "or use parallel.axes.replicate for plain data parallelism"
            )
        if fsdp and degrees["shard"] == 1:
            raise ValueError(
                "fsdp.enabled shards over parallel.axes.shard, which is 1 here: set parallel.axes.shard above 1 "
                f"(degrees: {degrees})"
            )
        if degrees["tensor"] > 1 and self.topology.size("data") > 1 and not fsdp:
            raise ValueError(
                f"tensor parallelism with {self.topology.size('data')} data-parallel ranks needs FSDP2 over the data "
                "axes: set fsdp.enabled and parallel.axes.shard"
            )
        if self.config.ema.enabled and (fsdp or degrees["tensor"] > 1 or degrees["pipeline"] > 1):
            raise ValueError(
                "ema.enabled is not supported with FSDP2, tensor or pipeline parallelism in this version: the "
                "averaged copy would need the same sharding; disable ema or use replicate-only layouts"
            )

    # ------------------------------------------------------------------ model
    def materialize_model(self) -> None:
        """Materialize the local model parts: device, tensor parallel, activation checkpointing, FSDP2/DDP, compile.

        Called once by `__post_init__`, before the optimizer is built (it must see the sharded
        parameters). With `pipeline > 1` the model is first split with
        `build_pipeline_model_parts`, and the schedule is built from the materialized parts.

        Raises:
            ValueError: No model is bound, or the layout cannot be implemented (see the class).
            TypeError: `self.model` is not an `nn.Module`.
        """
        if self.model is None and self.model_parts:
            self.model = self.model_parts[0]
        self.require_model()
        self._check_layout()
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
                self._fsdp_mesh(),
                units=(block_modules if strict else _units)(part, fsdp.modules),
                reshard_after_forward=fsdp.reshard_after_forward,
                mp_policy=fsdp_mixed_precision(fsdp.mp_policy, self.precision),
                offload_policy=fsdp_offload(fsdp.offload_policy),
            )
            return self.compiler.compile(part, distributed=True)
        part = self.compiler.compile(part, distributed=self.distributed)
        if self.topology.size("data") > 1 and trainable:
            part = wrap_ddp(part, self.device, process_group=self.topology.group("data"))
        return part

    def _fsdp_mesh(self) -> Any:
        mesh = self.topology.mesh
        if self.topology.degrees["replicate"] > 1:
            return mesh["replicate", "shard"]  # HSDP: replicate across, shard within
        return mesh["shard"]

    def parallelize_model(self, model: nn.Module) -> nn.Module:
        """Apply tensor parallelism to one local part (before activation checkpointing, FSDP and compile).

        The model's own `parallelize(parallel)` method wins (it may change the model in place and
        return None, or return the new module); otherwise `parallel.tensor_plan` is applied over
        the tensor axis. Without either, a tensor axis above 1 is an error, since it would only
        duplicate work.

        Raises:
            TypeError: `model.parallelize` returned something other than a module or None.
            NotImplementedError: `tensor > 1` with neither a `parallelize` method nor a plan.
        """
        hook = getattr(model, "parallelize", None)
        if callable(hook):
            result = hook(self.parallel)
            if result is not None and not isinstance(result, nn.Module):
                raise TypeError(f"{type(model).__name__}.parallelize() must return a module or None, got {result!r}")
            return model if result is None else result
        plan = self.config.parallel.tensor_plan
        if self.topology.degrees["tensor"] == 1 or not self.distributed:
            return model
        if not plan:
            raise NotImplementedError(
                f"parallel.axes.tensor={self.topology.degrees['tensor']} but {type(model).__name__} has no "
                "parallelize(parallel) method and parallel.tensor_plan is empty: give one of them"
            )
        return apply_tensor_plan(model, self.topology.mesh["tensor"], dict(plan))

    def apply_activation_checkpointing(self, model: nn.Module) -> nn.Module:
        """Recompute activations of the part's blocks in backward, per `parallel.activation_checkpointing`.

        `none` leaves the part alone; `block` and `selective` apply to the modules `fsdp.modules`
        names, or every member of an `nn.ModuleList` (see
        [`checkpoint_blocks`][danling.runners.parallel.tensor.checkpoint_blocks]). Runs before FSDP2
        wraps the part; parameter names do not change.
        """
        mode = self.config.parallel.activation_checkpointing or "none"
        if mode == "none":
            return model
        checkpoint_blocks(_units(model, self.config.fsdp.modules), mode)
        return model

    def iter_optimizer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """`(name, parameter)` of every trainable parameter of every local part, with the full model's names."""
        for part in self.model_parts or [self.model]:
            for name, param in self.unwrap(part).named_parameters():
                if param.requires_grad:
                    yield name, param

    @property
    def checkpoint_model(self) -> nn.Module:
        """All local parts as one module (see [`merge_parts`][danling.runners.parallel.parts.merge_parts])."""
        parts = self.model_parts or [self.model]
        return merge_parts([self.unwrap(part) for part in parts]) if len(parts) > 1 else parts[0]

    @TorchRunner.mode.setter  # type: ignore[attr-defined]
    def mode(self, mode: Any) -> None:
        TorchRunner.mode.fset(self, mode)
        for part in (self.model_parts or [])[1:]:
            part.train(self.mode.value == "train")

    # ------------------------------------------------------------------ updates
    def build_update_strategy(self) -> TorchUpdateStrategy:
        """The torch strategy over every local part: gradient-sync control of each part, the gradient
        domain's group, and gradient norms summed over the pipeline stages.

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
        """The pipeline step when a schedule is set (see `pipeline_train_step`), else TorchRunner's."""
        if self.pipeline_schedule is not None:
            return self.pipeline_train_step(data)
        return super().train_step(data)

    def evaluate_step(self, data: Any) -> tuple[Any, torch.Tensor | None]:
        """The pipeline evaluation step when a schedule is set, else TorchRunner's."""
        if self.pipeline_schedule is not None:
            return self.pipeline_evaluate_step(data)
        return super().evaluate_step(data)

    def infer_step(self, data: Any) -> list[Any]:
        """The pipeline inference step when a schedule is set, else TorchRunner's."""
        if self.pipeline_schedule is not None:
            return self.pipeline_infer_step(data)
        return super().infer_step(data)

    def build_dataloaders(self) -> None:
        """TorchRunner's loaders; ranks whose stages neither feed inputs nor compute the loss get placeholders."""
        super().build_dataloaders()
        if self.pipeline_schedule is not None:
            for split, loader in list(self.dataloaders.items()):
                self.dataloaders[split] = self.pipeline_loader(loader)


def _units(model: nn.Module, patterns: Any) -> list[nn.Module]:
    """Block modules of one part; patterns may match nothing in a part that holds none of those blocks."""
    try:
        return block_modules(model, patterns)
    except ValueError:
        return []


register_runner("parallel", ParallelRunner)
