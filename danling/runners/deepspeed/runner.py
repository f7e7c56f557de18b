"""`DeepSpeedRunner`: DeepSpeed ZeRO owns backward, reduction and the optimizer step; danling owns the loop.

Registered for the stacks `deepspeed` and `ds`, so `Runner(config)` with `stack: deepspeed` picks it
and a user's script does not change. It is a thin [`TorchRunner`][danling.runners.TorchRunner]:

- `materialize_model` moves and compiles the model (no DDP: the engine wraps it);
- `build_update_strategy` creates the engine with `deepspeed.initialize` from the user's model,
  optimizer and, for a step-interval scheduler, scheduler, and returns a
  [`DeepSpeedUpdateStrategy`][danling.runners.deepspeed.update.DeepSpeedUpdateStrategy];
- checkpoints go through a [`DeepSpeedCheckpointManager`][danling.checkpoint.deepspeed.DeepSpeedCheckpointManager]
  (`engine.save_checkpoint` into a tag directory plus danling's state, pointers after success)
  and are restored with `engine.load_checkpoint`.

`import danling` does not import DeepSpeed: the runner imports it when it builds the engine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from danling.checkpoint import register_format
from danling.data import resolve_loader_options
from danling.utils.imports import optional_import

from ..checkpointing.component import OPTIONAL_RANK_LOCAL_KEYS, RANK_LOCAL_KEYS, CheckpointSource
from ..checkpointing.resume import describe_source
from ..diagnosis import replica_tensors
from ..runner import register_runner
from ..services.run_dirs import resolve_resume_path
from ..torch_runner import TorchRunner
from ..update import EMA
from ..update.gradient_sync import OwnsAccumulationBoundary
from .checkpoint import DeepSpeedCheckpointing, export_fp32
from .config import build_deepspeed_config
from .update import DeepSpeedUpdateStrategy, gathered_parameters

__all__ = ["DeepSpeedRunner"]


class DeepSpeedRunner(TorchRunner):
    """Runner whose model is a DeepSpeed engine (ZeRO stages 0-3); danling keeps loop, data, metrics and checkpoints.

    The engine runs with `gradient_accumulation_steps: 1`; danling's `accum_steps` decides where a
    window ends and tells the engine through its boundary flag. Configure DeepSpeed in the
    `deepspeed` section of the config (any DeepSpeed key; see
    [`get_deepspeed_config`][danling.runners.deepspeed.runner.DeepSpeedRunner.get_deepspeed_config]).

    Attributes:
        model: The `DeepSpeedEngine` once the runner is built (the user's module before).
        deepspeed_config: The effective config passed to `deepspeed.initialize`.
        unsupported_features: Config features of its bases this runner does not implement (`ddp`:
            the engine synchronises gradients itself), so their keys are refused.
    """

    deepspeed_config: dict[str, Any] | None = None
    # The engine synchronises gradients itself: no DDP wrapper reads `ddp.*`.
    unsupported_features = ("ddp",)

    # ------------------------------------------------------------------ process and checkpoints
    def init_distributed(self) -> None:
        """Start (or adopt) the default process group; a single process gets a one-rank gloo group.

        Called when: once during construction (step 3), first of the early hooks, on every rank.
        Holds on entry: config, state, workspace and supervisor are bound; no model or topology yet.
        Side effects: starts the process group (a one-rank gloo group for one process, kept for the process's life) and
            sets the launcher variables DeepSpeed reads.
        Overrides must not: leave a single process without a default group (`deepspeed.initialize` needs one) or destroy
            the adopted one-rank group.

        DeepSpeed always talks through `torch.distributed` and caches the groups it derives from
        the default one for the life of the process, so the one-rank group is left in place when
        the runner closes: a later runner in the same process adopts it.
        """
        super().init_distributed()
        if not (dist.is_available() and dist.is_initialized()):
            store = dist.HashStore()
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
            # DeepSpeed reads the launcher's variables even for one process.
            for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
                os.environ.setdefault(key, value)

    checkpointing_class = DeepSpeedCheckpointing  # the engine writes and loads model and optimizer itself
    checkpointing: DeepSpeedCheckpointing

    def init_checkpoint_manager(self) -> None:
        """Bind a [`DeepSpeedCheckpointManager`][danling.checkpoint.deepspeed.DeepSpeedCheckpointManager].

        Called when: once during construction, right after `build_topology`, on every rank.
        Holds on entry: the topology is built; `checkpoint.backend` is `auto` or `deepspeed`.
        Side effects: binds a DeepSpeed checkpoint manager (synchronous saves); the engine is bound to it later, by
            `build_update_strategy`.
        Overrides must not: bind a manager of another format (the engine's files are only read by this one) or enable
            asynchronous saves.
        """
        self.checkpointing.backend  # noqa: B018 - validates checkpoint.backend
        from danling.checkpoint.deepspeed import DeepSpeedCheckpointManager

        options = self.checkpoint_options()
        options.pop("async_save", None)  # the engine writes its own files synchronously
        manager = DeepSpeedCheckpointManager(
            self.workspace.checkpoint_dir,
            rank_local_keys=RANK_LOCAL_KEYS,
            optional_rank_local_keys=OPTIONAL_RANK_LOCAL_KEYS,
            data_rank=self.topology.rank("data"),
            data_size=self.topology.size("data"),
            **options,
        )
        self.set_checkpoint_manager(manager)

    # ------------------------------------------------------------------ components
    def init_fault_tolerance(self) -> None:
        """Refuse `ft.enabled`: DeepSpeed's engine owns the gradient reduction and the step TorchFT must gate.

        Called when: once during construction, after `init_checkpoint_manager`, on every rank.
        Holds on entry: the process group and the DeepSpeed checkpoint manager are bound; `self.ft` is `None`.
        Side effects: none; raises when `ft.enabled` or `checkpoint.enable_ft_dataloader_checkpoints`.
        Overrides must not: bind a runtime the engine's own step would bypass (the run would look protected).

        Raises:
            ValueError: `ft.enabled` or `checkpoint.enable_ft_dataloader_checkpoints` is set.
        """
        if self.config.ft.enabled:
            raise ValueError(
                "ft.enabled=True is not supported by DeepSpeedRunner: the DeepSpeed engine reduces gradients and "
                "steps itself, so TorchFT cannot gate its updates; use stack='ddp' or set ft.enabled=False"
            )
        if self.config.checkpoint.enable_ft_dataloader_checkpoints:
            raise ValueError(
                "checkpoint.enable_ft_dataloader_checkpoints=True is not supported by DeepSpeedRunner: it needs "
                "ft.enabled=True, which DeepSpeedRunner refuses; set it to False"
            )

    def materialize_model(self) -> None:
        """Move the model to `device`, compile it and create the EMA copy; the engine wraps it later.

        Called when: once, by `__post_init__` during construction, on every rank; first of the components.
        Holds on entry: the process group, topology, precision policy and compiler are set up; `self.model` is the
            user's module.
        Side effects: rebinds `self.model` (moved, its linears converted to float8 when `fp8_enabled`, and
            compiled) and creates or moves the EMA copy.
        Overrides must not: wrap the model in DDP or an engine (`build_update_strategy` creates the engine later).

        Raises:
            ValueError: `self.model` is not set.
            TypeError: `self.model` is not an `nn.Module`.
        """
        self.require_model()
        self.model = self.model.to(self.device)
        self.apply_fp8(self.model)
        self.model = self.compiler.compile(self.model, distributed=self.distributed)
        if self.ema is None and self.config.ema.enabled:
            self.ema = EMA(self.model, decay=self.config.ema.decay)
        elif isinstance(self.ema, nn.Module):
            self.ema = self.ema.to(self.device)

    def get_deepspeed_config(self) -> dict[str, Any]:
        """The effective DeepSpeed config: `config.deepspeed` plus what danling owns.

        Called when: by `build_update_strategy`, once during construction, right before `deepspeed.initialize`.
        Holds on entry: the model is materialized, the optimizer and scheduler are built (or not), dataloaders may not
            exist yet.
        Side effects: none: returns a new mapping, which the caller stores in `deepspeed_config`.
        Overrides must not: re-enable DeepSpeed's gradient accumulation or clipping defaults (danling owns windows and
            clipping).

        `gradient_accumulation_steps` is forced to 1 (danling owns the windows);
        `train_micro_batch_size_per_gpu` is filled from the training loader's batch size;
        `precision` (`bf16`/`fp16`) enables the matching DeepSpeed section; `max_grad_norm`
        becomes `gradient_clipping` (unset, clipping is off, where DeepSpeed's own default clips
        at 1.0). With a danling-built (client) optimizer,
        `zero_allow_untested_optimizer` defaults to true. `skip_nonfinite_grad` keeps the ZeRO
        optimizer's own agreed skip on (`bf16.check_grad_overflow`, `compute_grad_norm`).

        Raises:
            ValueError: `config.deepspeed` is not a mapping, a DeepSpeed setting conflicts with
                the runner's (both values are named), or a runner setting has no DeepSpeed
                counterpart (`max_grad_value`; `skip_nonfinite_grad` in fp32 without ZeRO).
        """
        return build_deepspeed_config(
            self.config.get("deepspeed"),
            accum_steps=self.accum_steps,
            micro_batch_size=self._micro_batch_size(),
            world_size=self.world_size,
            precision=self.precision,
            max_grad_norm=self.max_grad_norm,
            max_grad_value=self.max_grad_value,
            skip_nonfinite_grad=self.skip_nonfinite_grad,
            model=self.model,
            client_optimizer=self.optimizer is not None,
        )

    def _micro_batch_size(self) -> int | None:
        """The first training split's batch size: its loader's, else what `config.dataloader` gives it."""
        for split in self.train_splits:
            loader = self.dataloaders.get(split)
            if loader is not None and getattr(loader, "batch_size", None):
                return int(loader.batch_size)
            if split in self.datasets:
                options = resolve_loader_options(self.config.dataloader.dict(), split, is_train=True)
                return int(options.get("batch_size", 1))
        return None

    def build_update_strategy(self) -> DeepSpeedUpdateStrategy:
        """Create the DeepSpeed engine and return the strategy that drives it.

        Called when: once during construction, by `__post_init__` after `build_optimizer` and `build_scheduler`, on
            every rank.
        Holds on entry: the model is materialized; `self.checkpoint_manager` is the DeepSpeed manager; the process group
            is up.
        Side effects: creates the engine (collective), rebinds `self.model`, `self.optimizer` and a step-interval
            `self.scheduler` to the engine's, seeds the EMA copy, binds the engine to the checkpoint manager.
        Overrides must not: call `deepspeed.initialize` on some ranks only, or keep references to the pre-engine model
            or optimizer.

        Runs after `build_optimizer` and `build_scheduler`: `deepspeed.initialize` receives the
        model, the optimizer (or builds one from the DeepSpeed config when none is bound) and the
        scheduler when its interval is `"step"` (the engine steps it); `self.model`,
        `self.optimizer` and `self.scheduler` are rebound to what the engine returns.
        """
        deepspeed = optional_import("deepspeed", "deepspeed")
        deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts the running group
        _forget_destroyed_world_group(deepspeed)
        self.deepspeed_config = self.get_deepspeed_config()
        scheduler = self.scheduler if self.scheduler_interval == "step" else None
        parameters = None if self.optimizer is not None else [p for p in self.model.parameters() if p.requires_grad]
        if self.optimizer is not None:
            inside = {id(param) for param in self.model.parameters()}
            if any(id(param) not in inside for group in self.optimizer.param_groups for param in group["params"]):
                raise ValueError(
                    f"DeepSpeedRunner: the bound {type(self.optimizer).__name__} updates parameters outside the model; "
                    "the engine partitions and steps the model's parameters only: make them part of the model"
                )
        engine, optimizer, _, engine_scheduler = deepspeed.initialize(
            model=self.model,
            optimizer=self.optimizer,
            model_parameters=parameters,
            lr_scheduler=scheduler,
            config=self.deepspeed_config,
        )
        self.model, self.optimizer = engine, optimizer
        if isinstance(self.ema, EMA):  # start the average from the weights the engine broadcast, on every rank
            module = self.unwrap(engine)
            with gathered_parameters(engine, module.parameters()):
                self.ema.module.load_state_dict(module.state_dict())
        if scheduler is not None:
            self.scheduler = engine_scheduler
        self.checkpoint_manager.bind(engine)
        return DeepSpeedUpdateStrategy(engine, self.accum_steps, precision=self.precision_policy)

    @property
    def engine_owns_scheduler(self) -> bool:
        """Whether the engine steps (and checkpoints) the scheduler."""
        return self.scheduler is not None and self.scheduler_interval == "step"

    def optimizer_step(self) -> bool:
        """Step the engine at danling's window boundary; count the update and refresh the EMA copy.

        Called when: by `step()` when a micro-step closes its window, and by the loop for a window a pass leaves open;
            once per update, on every rank.
        Holds on entry: the window's gradients are accumulated in the engine; inside a training pass.
        Side effects: steps the engine; an applied update increments `global_step` and refreshes the EMA copy (gathering
            ZeRO-3 parameters).
        Overrides must not: skip a rank (the ZeRO-3 gather is collective) or increment `global_step` themselves.

        Under ZeRO-3 the EMA update gathers the partitioned parameters (a collective on every rank).
        """
        applied = super(TorchRunner, self).optimizer_step()  # the engine, not an OptimizerContainer
        if applied:
            if isinstance(self.ema, EMA):
                module = self.unwrap(self.model)
                with gathered_parameters(self.model, module.parameters()):
                    self.ema.update(module)
            self.apply_train_timeout()
        return applied

    def unwrap(self, model: Any) -> Any:
        """The user's module inside the engine (and DDP / `torch.compile` wrappers).

        Called when: wherever the user's module is needed: checkpoint loading and saving, EMA updates and seeding,
            parameter iteration.
        Holds on entry: `model` is an engine, a DDP or compiled wrapper, or a plain module.
        Side effects: none.
        Overrides must not: return a wrapper (parameter names would carry its prefix) or a copy of the module.
        """
        if isinstance(model, OwnsAccumulationBoundary) and isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        return super().unwrap(model)

    def replicated_tensors(self) -> Iterator[tuple[str, Any]]:
        """What stays replicated under ZeRO, for the consistency sentinel (`consistency.*`).

        Called when: by the consistency sentinel at each check, on every rank.
        Holds on entry: the engine is built.
        Side effects: none; yields the parameters below stage 3 and nothing at stage 3 (partitioned);
            the optimizer state is partitioned from stage 1 and never compared.
        Overrides must not: yield partitioned tensors (every check would then find a mismatch).
        """
        if self.model.zero_optimization_stage() >= 3:
            return iter(())
        return replica_tensors(self.unwrap(self.model))

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's whole state dict as detached CPU copies, on every rank.

        Called when: only when the user calls it (e.g. to export weights); never by the runner itself.
        Holds on entry: the engine is built (`build_update_strategy` has run).
        Side effects: gathers ZeRO-3 partitions temporarily (a collective on every rank); returns CPU copies.
        Overrides must not: skip a rank under ZeRO-3 (the gather is collective) or return views of live tensors.

        Under ZeRO-3 the partitioned parameters are gathered first, so every rank must call it.
        """
        module = self.unwrap(self.model)
        with gathered_parameters(self.model, module.parameters()):
            return {key: value.detach().cpu().clone() for key, value in module.state_dict().items()}

    def load_model(self, state_dict: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        """Load a whole (unpartitioned) state dict into the engine's module, on every rank.

        Called when: by `load_checkpoint` for a non-DeepSpeed source and by `load_pretrained` for EMA weights, once per
            restore, on every rank.
        Holds on entry: the engine is built; `state_dict` is a whole (unpartitioned) state dict.
        Side effects: replaces the module's weights (gathered and re-partitioned under ZeRO-3) and refreshes the ZeRO
            fp32 master copy.
        Overrides must not: skip the master-copy refresh (the next step would write the old weights back) or load on
            some ranks only.

        Under ZeRO-3 the parameters are gathered, loaded and partitioned again; the ZeRO
        optimizer's fp32 master copy is then refreshed from them, or its next step would write
        the old weights back.
        """
        strict = kwargs.pop("strict", args[0] if args else True)
        module = self.unwrap(self.model)
        with gathered_parameters(self.model, module.parameters(), modifier_rank=0):
            module.load_state_dict(state_dict, strict=strict)
        refresh = getattr(getattr(self.model, "optimizer", None), "refresh_fp32_params", None)
        if callable(refresh):
            refresh()

    # ------------------------------------------------------------------ checkpoints
    def load_pretrained(self, checkpoint: CheckpointSource, *args: Any, **kwargs: Any) -> None:
        """Load model weights only: the EMA weights when danling's state has them, else the engine's module.

        Called when: by `auto_restore` when `pretrained` is set and no checkpoint is resumed, and by `from_pretrained`;
            once per run.
        Holds on entry: the engine is built (`self.model` is the engine).
        Side effects: replaces the model weights (EMA weights preferred) and the ZeRO master copy; sets
            `config.pretrained`.
        Overrides must not: restore optimizer state, scheduler, counters or dataloaders, or load on some ranks only.

        Optimizer state, scheduler, counters and dataloaders stay as they are; the ZeRO
        optimizer's fp32 master weights follow the loaded weights. Works under ZeRO-3 and on
        another data-parallel size.
        """
        given = checkpoint
        if _is_path_source(checkpoint):  # a run directory, its checkpoints/ or an alias path: see resolve_resume_path
            checkpoint = resolve_resume_path(checkpoint, self.config.checkpoint.dir_name)
        checkpointing = self.checkpointing
        if not checkpointing.is_engine_source(checkpoint):
            return super().load_pretrained(checkpoint, *args, **kwargs)
        payload = self.read_checkpoint(checkpoint, map_location=kwargs.pop("map_location", "cpu"))
        if payload.get("ema") is not None:
            self.load_model(payload["ema"], *args, **kwargs)
            source = "ema"
        else:
            tag = checkpointing.tag_directory(checkpoint)
            # ZeRO-3's module file holds no weights: its fp32 partitions are merged instead.
            checkpointing.engine_load(
                tag, load_module_only=True, load_optimizer_states=self.model.zero_optimization_stage() < 3
            )
            source = "model"
        self.config.pretrained = os.fspath(given)
        self.logger.info("loaded %s weights from %s", source, describe_source(given))

    def export_consolidated(self, checkpoint: CheckpointSource, file: str | os.PathLike) -> Path:
        """Write the fp32 weights of a DeepSpeed checkpoint as one `torch.save` state dict, usable without DeepSpeed.

        Called when: only when the user calls it, during or after training; never by the runner itself.
        Holds on entry: `checkpoint` names a DeepSpeed tag written by this run's manager or another.
        Side effects: the main process writes `file`; every rank returns its path.
        Overrides must not: write on every rank, or need the engine (it must work after training).

        Reads the ZeRO partitions on the main process only (see
        [`export_fp32`][danling.runners.deepspeed.checkpoint.export_fp32]), so it also works after
        training. Returns the path written (on every rank).
        """
        tag, trust = self.checkpointing.tag_directory(checkpoint), self.config.checkpoint.trust_pickle
        return export_fp32(tag, Path(file), trust_pickle=trust, is_main_process=self.is_main_process)


def _is_path_source(checkpoint: Any) -> bool:
    return isinstance(checkpoint, (str, os.PathLike))


def _detect(path: Path) -> bool:
    from danling.checkpoint.deepspeed import is_deepspeed_checkpoint

    return is_deepspeed_checkpoint(path)


def _manager(directory: Any, **options: Any) -> Any:
    from danling.checkpoint.deepspeed import DeepSpeedCheckpointManager

    return DeepSpeedCheckpointManager(directory, **options)


register_format("deepspeed", detect=_detect, manager=_manager, replace=True)


def _forget_destroyed_world_group(deepspeed: Any) -> None:
    """Drop DeepSpeed's cached clone of the world group when that group was destroyed.

    A runner destroys the process group it started when it closes; DeepSpeed keeps its clone of
    the old world group, and every collective of the next engine on it fails ("not registered").
    """
    groups = deepspeed.utils.groups
    cached = getattr(groups, "_WORLD_GROUP", None)
    if cached is None:
        return
    try:
        dist.get_process_group_ranks(cached)  # raises for a group the current world does not know
    except (KeyError, RuntimeError, ValueError):
        groups._WORLD_GROUP = None


register_runner(("deepspeed", "ds"), DeepSpeedRunner)
