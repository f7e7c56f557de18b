"""`TorchRunner`: the PyTorch runner (single process or DDP), registered for the stacks `auto`, `torch` and `ddp`.

The class assembles construction, component building, the update strategy and the default batch
contract (the step hooks `train_step`, `evaluate_step`, `infer_step` and their contexts, this
module) and its checkpointing component
([`TorchCheckpointing`][danling.runners.checkpointing.torch_state.TorchCheckpointing]) on top of the
backend-free [`BaseRunner`][danling.runners.base_runner.BaseRunner]. Loaders come from
[`torch_data`][danling.runners.torch_data], the start-of-run summary from
[`torch_insight`][danling.runners.torch_insight] and the step profiler from
[`StepProfiler`][danling.runners.services.profiling.StepProfiler].
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler, IterableDataset

from danling.checkpoint.manifest import verification_scope
from danling.data import build_dataloader, resolve_loader_options, split_batch
from danling.distributed import (
    all_gather_strided,
    all_reduce_mean,
    broadcast_object,
    ddp_options,
    init_process_group_from_env,
    is_distributed,
    unwrap_model,
    wrap_ddp,
)
from danling.optim import build_optimizer, build_scheduler, is_metric_scheduler
from danling.utils import to_device

from .base_runner import BaseRunner
from .checkpointing import TorchCheckpointing
from .checkpointing.component import OPTIONAL_RANK_LOCAL_KEYS, RANK_LOCAL_KEYS
from .ft import (
    FaultTolerance,
    ReplicaPositions,
    check_fault_tolerance,
    ft_checkpoint_options,
)
from .loop import RunnerMode
from .loop.events import Events
from .runner import register_runner
from .services import Compiler
from .services.profiling import StepProfiler
from .services.telemetry import FlopsTelemetry, build_flops_telemetry
from .torch_data import build_sampler, epoch_budget, why_no_steps
from .torch_fused_step import STEP_HOOKS, PlainStep, label_range_message, plain_train_step
from .torch_insight import format_run_summary, run_summary
from .update import EMA, OptimizerContainer, Precision, TorchUpdateStrategy, gradient_sync_for
from .update.fp8 import Fp8Policy, fp8_refusal
from .update.optimizer import outside_parameters
from .update.scheduling import advance_round_scheduler
from .update.spikes import guard_options

__all__ = ["TorchRunner"]


class TorchRunner(BaseRunner):
    """PyTorch runner for training, evaluation and inference, in one process or under DDP.

    Subclass it and, in `__init__` after `super().__init__(config)`, bind `self.model` (required),
    usually `self.criterion`, datasets (`self.datasets.<split>`) or ready dataloaders
    (`self.dataloaders.<split>`) and optionally `self.metrics` (or separate `self.train_metrics` /
    `self.evaluate_metrics`). The optimizer and scheduler come from `config.optim` and
    `config.scheduler` (or `config.sched`) unless you assign them yourself.

    When the subclass `__init__` returns, `__post_init__` runs, in order: `materialize_model`
    (device, EMA copy when `ema.enabled`, `torch.compile` when `compile.enable`, DDP when more than
    one process), `build_optimizer`, `build_scheduler`, `build_dataloaders` (resumable torchdata
    loaders; train splits shuffle and drop the last partial batch by default) and the restore asked
    for by `resume` / `auto_resume` / `pretrained`.

    The default steps read batches as mappings (`input`, `target`), sequences (items 0 and 1) or a
    bare input; override `train_step`, `evaluate_step` or `infer_step` for anything else.

    Attributes:
        model: The model after materialization (moved to `device`, possibly compiled and DDP-wrapped).
        ema: The [`EMA`][danling.runners.update.ema.EMA] copy (or your own module) used by
            evaluation and inference when set.
        criterion: Loss function `criterion(pred, target)` of the default steps.
        optimizer: The optimizer, built from `config.optim` unless assigned.
        scheduler: The learning-rate scheduler, built from the scheduler section unless assigned.
        optimizer_container: The [`OptimizerContainer`][danling.runners.update.optimizer.OptimizerContainer]
            that applies each update (clipping, non-finite skip, step-interval scheduler).
        precision_policy: The [`Precision`][danling.runners.update.precision.Precision] of `config.precision`.
        compiler: The [`Compiler`][danling.runners.services.compiler.Compiler] of the `compile` section.
        fp8: The [`Fp8Policy`][danling.runners.update.fp8.Fp8Policy] of `precision: fp8` (None otherwise).
        telemetry: The [`FlopsTelemetry`][danling.runners.services.telemetry.FlopsTelemetry] adding
            `tflops` and `mfu` to the training step logs (None with `telemetry.enabled` off).
        scheduler_interval: When the scheduler steps: `"step"` (each update) or `"epoch"`/`"validation"`.
        scheduler_monitor: Dotted result path a metric scheduler watches, or `None` for the score metric.
        collate_fn: Batch collation used by `build_dataloaders` (`None`: torch's default).

    Examples:
        >>> import tempfile
        >>> import torch
        >>> from torch import nn
        >>> class Regression(TorchRunner):
        ...     def __init__(self, config):
        ...         super().__init__(config)
        ...         self.model = nn.Linear(2, 1)
        ...         self.criterion = nn.MSELoss()
        ...         x = torch.randn(32, 2)
        ...         y = x.sum(dim=1, keepdim=True)
        ...         self.datasets.train = list(zip(x, y))
        ...         self.datasets.val = list(zip(x[:8], y[:8]))
        >>> config = {"epochs": 2, "seed": 1, "optim.type": "sgd", "optim.lr": 0.1, "dataloader.batch_size": 8,
        ...           "workspace_root": tempfile.mkdtemp(), "log": False, "checkpoint.async_enabled": False}
        >>> with Regression(config) as runner:
        ...     results = runner.train()
        ...     predictions = runner.infer("val")
        >>> runner.train_state.global_step, sorted(runner.latest_result), len(predictions)
        (8, ['index', 'train', 'val'], 8)
    """

    supported_features = ("profiling", "fault-tolerance", "ft-dataloader-checkpoints", "ddp")
    collate_fn: Callable | None = None
    fp8: Fp8Policy | None = None
    telemetry: FlopsTelemetry | None = None

    # ==== torch fp8 and telemetry surface ====
    # (keep this marker; add this area's public names right below it)
    @property
    def fp8_enabled(self) -> bool:
        """Whether the run trains its linears in float8 (`precision: fp8`)."""
        return self.precision == "fp8"

    def setup_fp8(self) -> None:
        """Check that this run can train in float8 and build its `Fp8Policy` from `fp8.*`.

        Called when: once, by `__post_init__`, before `materialize_model`, on every rank.
        Holds on entry: `self.device` and the config are final; the model is the user's module.
        Side effects: with `fp8_enabled`, sets `self.fp8`; without it, nothing.
        Overrides must not: convert the model here (`materialize_model` does, before compiling and
            wrapping), or let a device that cannot run float8 through (training would fail later).

        Raises:
            RuntimeError: fp8 on a device without float8 matrix products (not CUDA, or compute
                capability below 8.9, named in the message), or without torchao.
        """
        if not self.fp8_enabled:
            return
        section = self.config.fp8
        emulate = bool(section.emulate)
        refusal = fp8_refusal(self.device, emulate=emulate)
        if refusal is not None:
            raise RuntimeError(refusal)
        all_gather = section.fsdp_all_gather is not False
        self.fp8 = Fp8Policy(section.recipe or "tensorwise", section.filter_fqns or (), all_gather, emulate)

    def apply_fp8(self, model: nn.Module, *, fsdp: bool = False) -> None:
        """Convert the eligible linears of `model` (a model or a model part) to float8, when `fp8_enabled`.

        Called when: by `materialize_model` (each backend's), for each model part, after the device
            move and before compiling and wrapping (`fsdp=True` when FSDP2 shards the part next).
        Holds on entry: `setup_fp8` ran; `model` is on its device, not compiled or wrapped.
        Side effects: replaces `nn.Linear` modules in place; logs what was converted and skipped.
        Overrides must not: convert after compiling or wrapping (torchao swaps modules by name).
        """
        if self.fp8 is None:
            return
        done = self.fp8.apply(model, fsdp=fsdp)
        kept = f": {done.skipped}" if done.skipped else ""
        self.logger.info(
            "fp8: %d linears converted, %d kept in high precision%s", len(done.converted), len(done.skipped), kept
        )

    def _init_telemetry(self) -> None:
        self.telemetry = build_flops_telemetry(
            self.config.telemetry,
            device=self.device,
            precision=self.precision,
            compiled=self.compiler.enabled,
            model=lambda: self.model,
            progress=lambda: self.train_state.global_step,
            logger=self.logger if self.is_main_process else None,
        )
        if self.telemetry is not None:
            self.throughput.telemetry = self.telemetry.attach(self.events)

    scheduler_interval: str = "step"
    scheduler_monitor: str | None = None
    _train_timeout_applied: bool = False
    _owns_process_group: bool = False
    _deterministic_before: tuple | None = None
    _profiler: StepProfiler | None = None
    # The first step hook (of `torch_fused_step.STEP_HOOKS`) this class overrides, recorded when the class
    # is created: its training passes then call the hooks instead of the plain default step.
    _overridden_step_hook: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        below = cls.__mro__[: cls.__mro__.index(TorchRunner)]  # the subclass and the mixins it puts first
        cls._overridden_step_hook = next((name for name in STEP_HOOKS if any(name in vars(k) for k in below)), None)

    def __post_init__(self) -> None:
        """Materialize the model, build optimizer, scheduler and dataloaders, then restore and record metadata."""
        self.precision_policy = Precision(self.precision, self.device)
        self.compiler = Compiler(dict(self.config.compile))
        self.setup_fp8()
        bound = self._bound_parameter_names()
        self.materialize_model()
        self._follow_materialized_parameters(bound)
        self.build_optimizer()
        self.build_scheduler()
        self.update = self.build_update_strategy()
        self._bind_update()
        if self.datasets:
            self.build_dataloaders()
        self._init_profiler()
        super().__post_init__()
        self._init_telemetry()
        if not self.checkpointing.restored:  # resume / auto_resume / pretrained
            with verification_scope():  # finding, checking and reading a checkpoint hash its files once
                self.auto_restore()
        if self.is_main_process:
            self.events.subscribe(Events.RUN_START, self._log_run_summary)

    # ------------------------------------------------------------------ process facts
    @property
    def world_size(self) -> int:
        """Number of processes: the default process group's size when one is running, else `WORLD_SIZE`."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return super().world_size

    @property
    def rank(self) -> int:
        """Global rank: from the default process group when one is running, else `RANK`."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
        return super().rank

    @cached_property
    def device(self) -> torch.device:
        """Device of this process: `cuda:<local_rank>` when CUDA is available, else CPU (assignable in `__init__`)."""
        if torch.cuda.is_available():  # GPU-only branch
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    # ------------------------------------------------------------------ early hooks
    def init_distributed(self) -> None:
        """Start the default process group from `WORLD_SIZE`/`RANK`/`LOCAL_RANK` when there are several processes.

        Called when: once during construction (step 3), first of the early hooks, on every rank.
        Holds on entry: config, workspace, default checkpoint manager and supervisor are bound; no
            model or topology yet.
        Side effects: starts the group (timeout `comm.init_timeout_seconds`) and owns it (`close`
            destroys it), broadcasts rank 0's `timestamp` so every rank names the run alike, and
            records `TORCHELASTIC_RESTART_COUNT` in `elastic_state`.
        Overrides must not: leave a group running that `close` does not destroy, or skip the
            timestamp broadcast (ranks would write to different run directories).

        Raises:
            RuntimeError: `WORLD_SIZE` > 1 and a default process group is already running (started
                outside the runner, which would then not own it).
        """
        timeout = self.config.comm.init_timeout_seconds
        self._owns_process_group = init_process_group_from_env(timeout=timeout)
        if is_distributed():
            self.timestamp = broadcast_object(self.timestamp, group=None)  # the world: no topology yet
        self.elastic_state.restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)

    def init_checkpoint_manager(self) -> None:
        """Bind the DCP checkpoint manager when `checkpointing.backend` is `"dcp"`; keep the file manager otherwise.

        Called when: once during construction, after `build_topology`, on every rank.
        Holds on entry: the process group and `self.topology` exist; the file manager is bound.
        Side effects: with `"dcp"`, builds a `TorchDistributedCheckpointManager` (collective when it
            gets a dedicated asynchronous process group) and binds it with `set_checkpoint_manager`;
            with `checkpoint.enable_ft_dataloader_checkpoints`, a
            [`TorchFTCheckpointManager`][danling.checkpoint.ft.TorchFTCheckpointManager] instead, which
            also keeps this replica group's data position under `<prefix>-<replica id>`.
        Overrides must not: build the manager on some ranks only, or assign `checkpoint_manager`
            without `set_checkpoint_manager` (the file manager would stay open).

        Raises:
            ValueError: `checkpoint.backend` names a backend this runner cannot write, or
                `checkpoint.enable_ft_dataloader_checkpoints` is set without `ft.enabled` or with
                `checkpoint.backend='file'`.
        """
        backend, checkpoint = self.checkpointing.backend, self.config.checkpoint
        replica = ft_checkpoint_options(checkpoint, self.config.ft, backend)  # None: no per-replica checkpoints
        if backend == "file":
            return
        if backend != "dcp":
            raise ValueError(
                f"checkpoint.backend={backend!r} is not supported by TorchRunner; use 'auto', 'file' or 'dcp'"
            )
        from danling.checkpoint.dcp import TorchDistributedCheckpointManager
        from danling.checkpoint.ft import TorchFTCheckpointManager

        manager_class = TorchDistributedCheckpointManager if replica is None else TorchFTCheckpointManager
        manager = manager_class(
            self.workspace.checkpoint_dir,
            dedicated_async_process_group=checkpoint.dedicated_async_process_group,
            async_process_group_backend=checkpoint.async_process_group_backend,
            rank_local_keys=RANK_LOCAL_KEYS,
            optional_rank_local_keys=OPTIONAL_RANK_LOCAL_KEYS,
            data_rank=self.topology.rank("data"),
            data_size=self.topology.size("data"),
            **(replica or {}),
            **self.checkpoint_options(),
        )
        self.set_checkpoint_manager(manager)

    def set_seed(self, seed: int | None = None, bias: int | bool | None = None) -> int:
        """Seed Python, NumPy and torch (every device).

        Arguments are those of [`BaseRunner.set_seed`][danling.runners.base_runner.BaseRunner.set_seed]. In a
        distributed run without a configured seed, rank 0 draws one and broadcasts it, so all ranks
        shuffle the data alike (their own offset `bias` still differs).

        Called when: as `BaseRunner.set_seed`: during construction (`bias=False`) and in `__post_init__`.
        Holds on entry: the process group (if any) and `self.topology` exist.
        Side effects: seeds every generator, may store the drawn seed in `config.seed` (a collective
            then), and captures `rng_state`.
        Overrides must not: skip `super()`, or draw a seed on each rank separately (data order would differ).
        """
        if seed is None and self.config.get("seed") is None and is_distributed():
            self.config.seed = broadcast_object(random.SystemRandom().randrange(2**31), group=None)
            self.checkpointing.seed_was_drawn = True
        seed = super().set_seed(seed, bias)
        torch.manual_seed(seed)
        self.rng_state.capture()
        return seed

    def set_deterministic(self) -> None:
        """Request deterministic kernels (`torch.use_deterministic_algorithms`, cuDNN).

        Called when: once during construction, after `set_seed(bias=False)`, when `config.deterministic` is set.
        Holds on entry: seeded; no model exists yet.
        Side effects: sets `CUBLAS_WORKSPACE_CONFIG` (unless set), switches deterministic algorithms on
            and cuDNN benchmarking off, and remembers the previous settings, which `close` puts back.
        Overrides must not: change further process-wide settings without restoring them in `close`.
        """
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        cudnn = torch.backends.cudnn
        self._deterministic_before = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            cudnn.deterministic,
            cudnn.benchmark,
        )
        torch.use_deterministic_algorithms(True)
        cudnn.deterministic, cudnn.benchmark = True, False

    # ------------------------------------------------------------------ components
    def materialize_model(self) -> None:
        """Put `self.model` on `self.device`, create the EMA copy, compile, and wrap in DDP when distributed.

        Called when: once, by `__post_init__` during construction, on every rank; first of the components.
        Holds on entry: the process group, topology, precision policy and compiler are set up; `self.model` is
            the user's module; no optimizer is built yet.
        Side effects: rebinds `self.model` (moved, its linears converted to float8 when `fp8_enabled`,
            compiled, DDP-wrapped when distributed and trainable) and creates the EMA copy.
        Overrides must not: skip the device move, wrap an already wrapped model, or build the optimizer (it
            must see the final parameters, and `build_optimizer` runs next).

        Raises:
            ValueError: `self.model` is not set.
            TypeError: `self.model` is not an `nn.Module`.
        """
        self.require_model()
        self.model = self.model.to(self.device)
        self.apply_fp8(self.model)
        self.model = self.compiler.compile(self.model, distributed=self.distributed)
        trainable = any(param.requires_grad for param in self.model.parameters())
        if self.distributed and trainable:
            # also broadcasts rank 0's weights
            self.model = wrap_ddp(self.model, self.device, **ddp_options(self.config))
        self.materialize_ema()

    def materialize_ema(self) -> None:
        """The EMA copy of the materialized model (`ema.enabled`), or a user's own EMA module moved and synced.

        Called when: once, at the end of `materialize_model` (also the backends' overrides), on every rank.
        Holds on entry: `self.model` is materialized (on its device, wrapped); `self.ema` is unset or
            the user's own module.
        Side effects: sets `self.ema` (a new EMA copy), or moves the user's and broadcasts its weights
            over the data group.
        Overrides must not: copy the model before it is materialized (the average would start from
            weights other ranks do not share).
        """
        if self.ema is None and self.config.ema.enabled:
            # Copied after the DDP broadcast, so every rank starts from the same average.
            self.ema = EMA(self.model, decay=self.config.ema.decay)
        elif isinstance(self.ema, nn.Module):
            self.ema = self.ema.to(self.device)
            if is_distributed():
                for tensor in self.ema.state_dict().values():
                    dist.broadcast(tensor, group=self.topology.group("data"), group_src=0)

    def require_model(self) -> None:
        """Check that `self.model` is a bound `nn.Module` whose parameters all have elements.

        Called when: first thing in `materialize_model` (and in the backends' overrides), once, on every rank.
        Holds on entry: the user's `__init__` has run; `self.model` is whatever it bound.
        Side effects: none.
        Overrides must not: accept a model that is not an `nn.Module` (every later step assumes one).

        Raises:
            ValueError: `self.model` is unset, or a parameter has no element (a size of 0).
            TypeError: `self.model` is not an `nn.Module`.
        """
        if self.model is None:
            raise ValueError(f"{type(self).__name__} needs self.model: assign an nn.Module in __init__")
        if not isinstance(self.model, nn.Module):
            raise TypeError(f"self.model must be a torch.nn.Module, got {type(self.model).__name__}")
        for name, param in self.model.named_parameters():
            # A width of 0 (often a config value) builds a layer that computes and learns nothing, silently.
            if param.numel() == 0 and not isinstance(param, nn.parameter.UninitializedParameter):
                raise ValueError(
                    f"model parameter {name!r} has shape {tuple(param.shape)}, no element: a size of 0 (often a "
                    "config value, e.g. a width of 0) builds a layer that computes nothing; give it a positive size"
                )

    def iter_optimizer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """`(name, parameter)` of every trainable parameter, named as in the unwrapped model.

        Called when: by `build_optimizer` (the names match `optim.param_groups` patterns) and by
            `iter_optimizer_parameters`.
        Holds on entry: the model is materialized (wrapped, on its device).
        Side effects: none.
        Overrides must not: yield frozen parameters, or names other than the unwrapped model's
            (parameter-group patterns and checkpoints use those).
        """
        for name, param in self.unwrap(self.model).named_parameters():
            if param.requires_grad:
                yield name, param

    def iter_optimizer_parameters(self) -> Iterator[nn.Parameter]:
        """Every trainable parameter of the model."""
        for _, param in self.iter_optimizer_named_parameters():
            yield param

    def build_optimizer(self) -> None:
        """Build `self.optimizer` from `config.optim` (alias `optimizer`) unless one is already bound.

        Called when: once, by `__post_init__` right after `materialize_model`, on every rank.
        Holds on entry: the model is materialized (moved, compiled, wrapped); no scheduler is built yet.
        Side effects: binds `self.optimizer` when the section has a `type`; nothing is built otherwise.
        Overrides must not: build over parameters other than those the model trains with (a wrapper's
            copies), or replace an optimizer the user already bound.

        `optim.param_groups` patterns are searched in the names of `iter_optimizer_named_parameters`
        (see [`build_optimizer`][danling.optim.build_optimizer]).
        """
        if self.optimizer is not None:
            return
        section = self._merged_section("optim", "optimizer")
        if section.get("type"):
            self.optimizer = build_optimizer(list(self.iter_optimizer_named_parameters()), section)

    def build_scheduler(self) -> None:
        """Build `self.scheduler` from `config.scheduler` (alias `sched`) unless one is bound; set its interval.

        Schedulers that take a run length get the optimizer-step budget. `interval` defaults to
        `"step"`, or `"epoch"` for metric schedulers such as `ReduceLROnPlateau`, which step with
        the value at `monitor`.

        Called when: once by `__post_init__` after `build_optimizer`, and again when an elastic
            resume changes `accum_steps` (the scheduler is rebuilt for the new number of updates).
        Holds on entry: `self.optimizer` is built (or `None`: nothing is built); the loaders may not be
            built yet (the run length is then estimated from the datasets).
        Side effects: sets `self.scheduler` (unless bound), `scheduler_interval` and `scheduler_monitor`.
        Overrides must not: replace a scheduler the user bound, or leave `scheduler_interval` unset
            (the update strategy and `advance_schedulers` read it).

        Raises:
            ValueError: a metric scheduler is configured with `interval="step"`.
        """
        section = self._merged_section("sched", "scheduler")
        if self.scheduler is None and self.optimizer is not None and section.get("type"):
            # The run length is counted in the scheduler's own steps: a scheduler stepped once per
            # round (interval "epoch"/"validation") would otherwise get the optimizer-step count and
            # cover only a fraction of its schedule by the end of the run.
            kind = section.get("interval") or ("epoch" if is_metric_scheduler(section["type"]) else "step")
            total_steps = self._total_steps() if kind == "step" else self._total_rounds()
            try:
                self.scheduler = build_scheduler(self.optimizer, section, total_steps=total_steps)
            except ValueError as error:  # a run length the data cannot give: say why, not what is missing
                reason = self._why_no_steps() if total_steps is None else None
                if reason is None:
                    raise
                raise ValueError(f"scheduler {section.get('type')!r} needs the run length, but {reason}") from error
            self.logger.info("scheduler: %r", self.scheduler)  # with the warmup/cooldown steps it settled on
        metric = self.scheduler is not None and is_metric_scheduler(self.scheduler)
        interval = section.get("interval") or ("epoch" if metric else "step")
        if metric and interval == "step":
            raise ValueError(
                f"{type(self.scheduler).__name__} steps with a monitored metric: set scheduler.interval to 'epoch'"
            )
        self.scheduler_interval = interval
        self.scheduler_monitor = section.get("monitor")

    def _merged_section(self, primary: str, alias: str) -> dict[str, Any]:
        """The keys set in the section `primary` (or `alias`: the config renames an alias on input,
        so both names read the one section whose values are recorded)."""
        section = self.config.get(primary)
        if not isinstance(section, Mapping):
            section = self.config.get(alias)
        if not isinstance(section, Mapping):
            return {}
        plain = section.dict() if callable(getattr(section, "dict", None)) else dict(section)
        return {key: value for key, value in plain.items() if value is not None}

    # ------------------------------------------------------------------ updates
    def _bound_parameter_names(self) -> dict[int, str]:
        """Names of the model's parameters a user-bound optimizer holds, before materialization may replace them."""
        if self.optimizer is None or self.model is None:
            return {}
        held = {id(param) for group in self.optimizer.param_groups for param in group["params"]}
        return {id(param): name for name, param in self.model.named_parameters() if id(param) in held}

    def _follow_materialized_parameters(self, bound: dict[int, str]) -> None:
        """Point a user-bound optimizer at the parameters that replaced the ones it was built over.

        Sharding (FSDP2, tensor parallel) puts new parameters (DTensors) in the model; an optimizer
        bound in `__init__` would otherwise step the old tensors, which the model no longer uses.
        They are matched by name; an optimizer that has already stepped is refused, since its state
        has the old layout.
        """
        if not bound:
            return
        now = dict(self.unwrap(self.model).named_parameters())
        if all(now.get(name) is None or id(now[name]) == key for key, name in bound.items()):
            return  # nothing was replaced (DDP and torch.compile keep the parameters)
        if self.optimizer.state:
            raise ValueError(
                f"{type(self).__name__}: the bound {type(self.optimizer).__name__} has state for parameters that "
                "materialize_model replaced (sharding); bind a fresh optimizer or set config.optim instead"
            )
        for group in self.optimizer.param_groups:
            group["params"] = [now[bound[id(param)]] if id(param) in bound else param for param in group["params"]]

    def _bind_update(self) -> None:
        """Bind the optimizer and scheduler to the update strategy, naming the optimizer's parameters
        that are not in the model by the runner attribute that holds them (the criterion's
        `criterion.<name>`, a bare `self.<name>`), so that they are averaged over the ranks and
        checkpointed by name; one held nowhere is refused (see `outside_parameters`)."""
        outside = {}
        if self.optimizer is not None and self.update.steps_bound_optimizer:
            holders = {
                name: value
                for name, value in vars(self).items()
                if not name.startswith("_")
                and name not in ("model", "ema")
                and isinstance(value, (nn.Module, torch.Tensor))
            }
            outside = outside_parameters(self.checkpointing.checkpoint_model, self.optimizer, holders)
        self.update.bind(self.optimizer, self.scheduler, self.scheduler_interval, outside)

    def build_update_strategy(self) -> TorchUpdateStrategy:
        """The [`TorchUpdateStrategy`][danling.runners.update.strategy.TorchUpdateStrategy] of this run.

        It reads `accum_steps`, `precision`, the clipping and non-finite settings, and takes the
        model's gradient-sync control (DDP `no_sync`, FSDP2's sync flag) and the gradient domain's
        group. Backends whose engine owns backward and step return their own strategy.

        Called when: once by `__post_init__`, after `materialize_model`, `build_optimizer` and `build_scheduler`.
        Holds on entry: the model is materialized (wrapped); `self.precision_policy` is set.
        Side effects: none here; `__post_init__` binds the optimizer and scheduler to the result
            and stores it as `self.update`.
        Overrides must not: take the gradient-sync control of an unwrapped model (DDP's `no_sync`
            lives on the wrapper), or a window size other than `accum_steps`.
        """
        return TorchUpdateStrategy(
            self.accum_steps,
            precision=self.precision_policy,
            gradient_sync=gradient_sync_for(self.model),
            group=self.topology.group("gradient"),
            max_grad_norm=self.max_grad_norm,
            max_grad_value=self.max_grad_value,
            skip_nonfinite_grad=self.skip_nonfinite_grad,
            skip_group=self.topology.group("world"),
            **guard_options(self.config, self.logger),
        )

    @property
    def optimizer_container(self) -> OptimizerContainer | None:
        """The [`OptimizerContainer`][danling.runners.update.optimizer.OptimizerContainer] applying each update."""
        return self.__dict__["update"].container if "update" in self.__dict__ else None

    def optimizer_step(self) -> bool:
        """Apply one update from the accumulated gradients; return whether it was applied.

        Waits until a pending asynchronous checkpoint no longer reads the parameters, then lets the
        [`OptimizerContainer`][danling.runners.update.optimizer.OptimizerContainer] unscale, skip
        non-finite gradients (all ranks agree), clip, step optimizer and step-interval scheduler and
        zero the gradients. An applied update increments `train_state.global_step` and refreshes
        the EMA copy; a skipped one changes neither.

        Called when: by `step()` when a micro-step closes its window, by the loop for a window a pass
            leaves open, and by the fused step when the optimizer or scheduler was reassigned; once per update.
        Holds on entry: the window's gradients are accumulated; inside a training pass.
        Side effects: rebinds the update strategy when `self.optimizer` / `self.scheduler` were reassigned; steps
            the optimizer (and a step-interval scheduler), zeroes gradients, increments `global_step`, updates EMA.
        Overrides must not: increment `global_step` themselves or skip `super()` (the skip decision is
            collective, and the EMA copy and train timeout follow an applied update).

        Raises:
            RuntimeError: no optimizer is bound (set `config.optim.type` or `self.optimizer`).
        """
        container = self.update.container
        if container is None or container.optimizer is not self.optimizer or container.scheduler is not self.scheduler:
            self._bind_update()  # reassigned by the user
            if self.update.container is None:
                raise RuntimeError(
                    f"{type(self).__name__} has no optimizer to step: set config.optim.type or assign self.optimizer"
                )
        applied = self._replicas_commit() and self._apply_update()
        if applied:
            if isinstance(self.ema, EMA):
                self.ema.update(self.model if self.ema.live is None else self.ema.live)
            self.apply_train_timeout()
        return applied

    def apply_train_timeout(self) -> None:
        """Switch the default group to `comm.train_timeout_seconds` once the first update went through.

        Called when: after every applied optimizer update (`optimizer_step`, the backends' and the fused
            step's); only the first call changes anything.
        Holds on entry: an update was applied, so every rank has passed its first (slow) collective.
        Side effects: the first time, sets the default process group's timeout (distributed runs with
            `comm.train_timeout_seconds` set).
        Overrides must not: shorten the timeout before the first update (first steps compile and warm up).
        """
        if self._train_timeout_applied:
            return
        self._train_timeout_applied = True
        seconds = self.config.comm.train_timeout_seconds
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if seconds and is_distributed() and set_timeout is not None:
            set_timeout(timedelta(seconds=seconds), None)

    def advance_schedulers(self, result: Mapping[str, Any]) -> None:
        """Step an epoch-interval scheduler once per round; metric schedulers get the monitored value.

        The value is `scheduler.monitor` (a dotted path in the row), else the score metric of
        `score_split`, or of the first validation split that has it.

        Called when: once per round (each epoch, or each full round over the train splits in step
            mode), before the round's row is stored.
        Holds on entry: `result` maps the round's splits to their metrics; `scheduler_interval` is set.
        Side effects: steps `self.scheduler` when its interval is not `"step"`.
        Overrides must not: step a `"step"`-interval scheduler (the optimizer container already does),
            or modify `result`.
        """
        if self.scheduler is None or self.scheduler_interval == "step":
            return  # nothing steps per round (and nothing to look up)
        configured = self.config.get("score_split")
        advance_round_scheduler(
            self.scheduler,
            self.scheduler_interval,
            result,
            monitor=self.scheduler_monitor,
            score_name=self.bookkeeping.score_name,
            splits=[configured] if configured else ["val", "validate", "validation", *self.evaluate_splits],
        )

    # ==== torch loop surface ====
    # (keep this marker; add this area's public names right below it)
    # ------------------------------------------------------------------ mode and contexts
    @property
    def mode(self) -> RunnerMode:
        """Current [`RunnerMode`][danling.runners.loop.mode.RunnerMode]; setting it switches `model` between
        `train()` and `eval()` (the EMA copy always stays in evaluation mode).

        Called when: the setter, by the loops when a pass opens (and by periodic evaluation to switch back).
        Holds on entry: the model is materialized.
        Side effects: `model.train(mode == "train")`, `ema.eval()`.
        Overrides must not: skip `super()`'s setter (the loops read `mode` back, and dropout would stay on).
        """
        return self._mode

    @mode.setter
    def mode(self, mode: RunnerMode | str) -> None:
        self._mode = RunnerMode(mode)
        if isinstance(self.model, nn.Module):
            self.model.train(self._mode is RunnerMode.train)
        if isinstance(self.ema, nn.Module):
            self.ema.eval()

    def to_device(self, data: Any) -> Any:
        """Move one batch (any nesting of tensors) to `self.device`.

        Called when: by the default step hooks, once per batch, before the batch is split.
        Holds on entry: `self.device` is settled (the model is materialized).
        Side effects: none; returns the moved batch (tensors already there are kept).
        Overrides must not: change the batch's structure (the default steps split it afterwards).
        """
        device = self.device
        return to_device(data, device, non_blocking=device.type == "cuda")

    def forward_context(self) -> AbstractContextManager:
        """Autocast context of the configured precision, entered around every forward pass.

        Called when: by `evaluate_step` and `infer_step` once per batch (and by `train_context`).
        Holds on entry: the update strategy is built (`self.update`).
        Side effects: none; entering the context switches autocast on for the block.
        Overrides must not: disable autograd or sync gradients (evaluation and training share it).
        """
        update = self.update
        fixed = update.fixed_context
        return fixed if fixed is not None else update.forward_context()

    def train_context(self) -> AbstractContextManager:
        """Context of one training forward pass: autocast, plus gradient sync switched off for a
        micro-step that does not close its accumulation window (see the update strategy's
        [`train_context`][danling.runners.update.strategy.TorchUpdateStrategy.train_context]).

        The backward pass may run after the block.

        Called when: by `train_step`, once per training micro-batch, around the forward pass and loss.
        Holds on entry: the accumulation window position of this micro-step is known to `self.update`.
        Side effects: none; the context's block runs under autocast and, inside a window, without gradient sync.
        Overrides must not: step the optimizer or advance the window (`step()` does that).
        """
        update = self.update
        fixed = update.fixed_context
        return fixed if fixed is not None else update.train_context()

    def inference_context(self) -> AbstractContextManager:
        """`torch.inference_mode()`: evaluation passes and inference steps build no autograd graph.

        With fp8 it is `torch.no_grad()`: torchao's float8 weights cannot be cast under inference mode.
        With an EMA that holds only (sharded) weights (`EMA(..., runnable=False)`, which `ParallelRunner`
        makes for FSDP2, tensor and pipeline layouts), the averaged weights are swapped into the live
        model for the block (see [`EMA.swap`][danling.runners.update.ema.EMA.swap]).

        Called when: once around every evaluation pass (loader, steps and meters), and around each
            `infer_step` of inference.
        Holds on entry: `self.mode` is `evaluate` or `infer`.
        Side effects: none outside the block (inside it, a weights-only EMA is loaded into the model); the
            block builds no autograd graph.
        Overrides must not: return a context that enables gradients for parameters (evaluation would then
            keep graphs alive and could change weights).
        """
        grad_free = torch.inference_mode() if self.fp8 is None else torch.no_grad()
        if not isinstance(self.ema, EMA) or self.ema.runnable:
            return grad_free
        return self._with_ema_weights(self.ema, grad_free)

    @contextmanager
    def _with_ema_weights(self, ema: EMA, grad_free: AbstractContextManager) -> Iterator[None]:
        # swapped outside inference mode: the live weights must stay normal tensors for training
        with ema.swap(ema.live), grad_free:
            yield

    # ------------------------------------------------------------------ step hooks
    def train_step(self, data: Any) -> tuple[Any, torch.Tensor | None]:
        """Forward, loss, metrics, backward and accumulation for one training micro-batch.

        Called once per batch by the training loops with `self.mode == "train"`. The batch is moved
        to `self.device` and split by [`split_batch`][danling.data.split_batch] (`input`/`target` of a
        mapping, items 0/1 of a sequence, otherwise input only). The forward pass and the loss run
        in `train_context()`; the training metrics are updated; then `backward(loss)` and `step()`.
        Override it when batches or losses look different, keeping the `backward` and `step` calls;
        do not zero gradients, step the optimizer or touch the counters here.

        Called when: by the training loops, once per micro-batch of each train split.
        Holds on entry: `self.mode == "train"`, the split's pass is open (meters and metrics reset).
        Side effects: updates the training metrics, back-propagates, and calls `step()` (which may
            apply an optimizer update and increment `train_state.global_step`).
        Overrides must not: skip `step()`, call `optimizer_step()` themselves, zero gradients or
            change `train_state` (the accumulation window and the counters would drift).

        Returns:
            The model output and the detached loss. Inside a training pass whose loop discards the
            output (no step subscriber), this default step returns `None` for it and drops it
            before `backward`, so the output does not sit in memory through the backward pass; an
            override that calls `super().train_step` still gets the output.

        Raises:
            ValueError: `self.model` or `self.criterion` is not set, or the criterion returned None.
        """
        model = self.model
        if model is None:
            raise ValueError("train_step() needs self.model; set it in __init__")
        data = self.to_device(data)
        input, target = split_batch(data)
        context = self.train_context()
        if type(context) is nullcontext:  # full precision, no sync suppression: entering it does nothing
            pred = model(input)
            loss = self._criterion_loss(pred, target, required=True)
        else:
            with context:
                pred = model(input)
                loss = self._criterion_loss(pred, target, required=True)
        self.update_metrics(pred, target)
        if self._step_output_unused and type(self)._overridden_step_hook != "train_step":
            # The loop discards the output and no override of this step reads it: holding it through the
            # backward pass kept one more output-sized tensor (a language model's logits) alive at the
            # memory peak, 12% of GPT-2 small's peak on an H200 (docs/gpu.md).
            pred = None
        self.backward(loss)
        self.step()
        return pred, loss.detach()

    def evaluate_step(self, data: Any) -> tuple[Any, torch.Tensor | None]:
        """Forward (through the EMA copy when there is one), optional loss and metrics for one batch.

        Called by the evaluation loops inside `inference_context()`. The loss is computed only when
        `self.criterion` is set and the batch has a target; on the last batch of an evaluation shard
        that a `DistributedSampler` padded with repeated samples, it leaves the repeats out, as the
        metrics do. Never call `backward`/`step` or change counters here.

        Called when: by the evaluation loops, once per batch of each evaluation split.
        Holds on entry: `self.mode == "evaluate"`, inside `inference_context()`, the pass's metrics reset.
        Side effects: updates the evaluation metrics.
        Overrides must not: call `backward`/`step`, step the optimizer or change counters.

        Raises:
            ValueError: neither `self.ema` nor `self.model` is set.
        """
        model = self._inference_model()
        data = self.to_device(data)
        input, target = split_batch(data)
        with self.forward_context():
            pred = model(input)
            loss = None
            if target is not None:
                # A batch of the sampler's repeats only keeps its whole loss: the pass adds it with weight 0.
                own = self._own_samples(pred, target) if self._repeated_tail else None
                loss = self._criterion_loss(*(own or (pred, target)), required=False)
        self.update_metrics(pred, target)
        return pred, None if loss is None else loss.detach()

    def infer_step(self, data: Any) -> list[Any]:
        """Predictions for one batch as a Python list (one number per example by default).

        The input is taken as in `evaluate_step` (the target, if any, is ignored), run through the
        EMA copy or the model under `forward_context()`, and converted with
        `pred.squeeze(-1).cpu().tolist()`. Override it for outputs that are not one number per
        example; return a list, never a tensor, and leave metrics alone.

        Called when: by `infer`, once per batch of the inferred split.
        Holds on entry: `self.mode == "infer"`, inside `inference_context()`.
        Side effects: none.
        Overrides must not: update metrics or counters, or return a tensor (the outputs are concatenated as lists).

        Raises:
            ValueError: neither `self.ema` nor `self.model` is set.
        """
        model = self._inference_model()
        input, _ = split_batch(data)
        input = self.to_device(input)
        with self.forward_context():
            pred = model(input)
        values = pred.detach().squeeze(-1).cpu().tolist()
        return values if isinstance(values, list) else [values]

    def infer(
        self,
        split: str = "infer",
        *,
        steps: int | None = None,
        stream: bool | None = None,
        output: str | os.PathLike[str] | None = None,
        resume: bool | None = None,
    ) -> list[Any] | Iterator[list[Any]] | Path:
        """Predict on `split` like [`Loop.infer`][danling.runners.loop.loops.Loop.infer]; under DDP a
        list result covers the whole split, in dataset order, on every rank.

        The split's sampler shards the data over the ranks (rank `r` gets items `r, r + W, ...`
        when it does not shuffle), so each rank predicts its shard and the lists are then merged
        back in order and cut to the dataset's length (dropping the sampler's padding). This is
        a collective: call it on every rank. Streams, and loaders whose sampler shuffles or is not
        a `DistributedSampler`, return this rank's own predictions. With `output`, the file is
        written and merged as described in the Inference guide, and its path returned on every rank.
        """
        outputs = super().infer(split, steps=steps, stream=stream, output=output, resume=resume)
        if not isinstance(outputs, list) or not is_distributed():
            return outputs
        sampler = getattr(self.dataloaders[split], "sampler", None)
        if not isinstance(sampler, DistributedSampler) or sampler.shuffle:
            return outputs
        total = None if sampler.drop_last else len(sampler.dataset)
        return all_gather_strided(outputs, total, group=self.topology.group("data"))

    def _inference_model(self) -> Any:
        ema = self.ema
        # a weights-only EMA cannot run: `inference_context` swaps its weights into the model instead
        model = ema if ema is not None and getattr(ema, "runnable", True) else self.model
        if model is None:
            raise ValueError(f"{type(self).__name__} needs self.model (or self.ema) to evaluate or infer")
        return model

    def _criterion_loss(self, pred: Any, target: Any, *, required: bool) -> torch.Tensor | None:
        if self.criterion is None:
            if required:
                raise ValueError("the default train_step needs self.criterion; set it or override train_step")
            return None
        try:
            loss = self.criterion(pred, target)
        except (IndexError, RuntimeError) as err:
            self._criterion_failed(pred, target, err)
            raise
        if loss is None and required:
            raise ValueError(f"criterion {self.criterion!r} returned None; train_step needs a loss tensor")
        if required and getattr(loss, "ndim", 0) and loss.numel() != 1:  # shape reads: no device synchronisation
            raise self._non_scalar_loss(loss)
        return loss

    def _non_scalar_loss(self, loss: Any) -> ValueError:
        """The error for a criterion that returned one loss per sample instead of one per batch."""
        return ValueError(
            f"criterion {self.criterion!r} returned a loss of shape {tuple(loss.shape)}, not one number: "
            "training needs a scalar loss per batch; reduce it (reduction='mean' for torch losses, or "
            ".mean() in your criterion), or override train_step"
        )

    def _criterion_failed(self, pred: Any, target: Any, err: Exception) -> None:
        """Turn a criterion's refusal of a class label into a `ValueError` naming the split and the range.

        Returns (the caller re-raises `err`) when the error is about something else.
        """
        if "out of bounds" in str(err) or "out of range" in str(err):
            raise ValueError(label_range_message(self, pred, target, err)) from err

    def _plain_train_step(self) -> PlainStep | None:
        """The plain default step when this pass needs nothing else (see `plain_train_step`)."""
        return plain_train_step(self)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, *, op: Any = dist.ReduceOp.SUM, group: Any = None) -> torch.Tensor:
        """`tensor` reduced with `op` over `group` (default: all ranks); a copy, or the input itself alone.

        Called when: by `reduce_loss_for_logging` and user code; a collective every rank of `group` enters.
        Holds on entry: the process group (if any) is running.
        Side effects: none on `tensor`; returns the reduced copy.
        Overrides must not: skip the collective on some ranks only (the others would wait forever).
        """
        if not is_distributed(group):
            return tensor
        out = tensor.detach().clone()
        dist.all_reduce(out, op=op, group=group)
        return out

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mean of `tensor` over the metrics domain (all ranks under plain DDP).

        Called when: by `reduce_loss_for_logging` and user code; a collective over the metrics domain.
        Holds on entry: the topology's `metrics` group is set up.
        Side effects: none; returns the mean.
        Overrides must not: skip the collective on some ranks only.
        """
        return all_reduce_mean(tensor, group=self.topology.group("metrics"))

    def reduce_loss_for_logging(self, loss: torch.Tensor | None, loss_n: int | None) -> torch.Tensor | None:
        """Detached loss averaged over the metrics domain (as `reduce`), weighted by each rank's `loss_n` samples
        when given.

        Called when: by user code that logs a loss; a collective over the metrics domain when distributed.
        Holds on entry: `loss` is this rank's loss (or `None`).
        Side effects: none; returns the reduced, detached loss.
        Overrides must not: return a tensor that requires grad, or skip the collective on some ranks.
        """
        if loss is None:
            return None
        loss = loss.detach()
        if not is_distributed():
            return loss
        if loss_n is None:
            return self.reduce(loss)
        # Over the same ranks as `reduce`: not every rank (the pipeline's first stages hold no loss and
        # never get here, and tensor peers hold the same batch).
        group = self.topology.group("metrics")
        weighted = self.all_reduce(loss.float() * loss_n, group=group)
        total = self.all_reduce(torch.tensor(float(loss_n), device=loss.device), group=group)
        return weighted / total

    # ==== torch fault tolerance surface ====
    def init_fault_tolerance(self) -> None:
        """Bind a TorchFT runtime ([`FaultTolerance`][danling.runners.ft.runtime.FaultTolerance]) when `ft.enabled`.

        Called when: once during construction, after `init_checkpoint_manager`, on every rank.
        Holds on entry: the process group of this replica group (if any), the topology and the
            checkpoint manager are bound; `self.ft` is `None`; no model exists yet.
        Side effects: with `ft.enabled`, checks the section and the layout, starts the group's TorchFT
            manager (it reports to the lighthouse at `$TORCHFT_LIGHTHOUSE`) and binds it to `self.ft`;
            from then on every update waits for a quorum, averages gradients over the replica groups
            and is applied only when they agree; data is sharded over every group's ranks. With a
            `TorchFTCheckpointManager` bound (`checkpoint.enable_ft_dataloader_checkpoints`), the group
            saves its data position after every update and resumes it when it recovers from a peer.
        Overrides must not: leave `self.ft` unset while `ft.enabled` (the run would train unprotected),
            or build it on some ranks of a group only (its manager is collective within the group).

        Raises:
            ValueError: a bad `ft.*` value, no lighthouse address, or a layout TorchFT does not cover
                (TorchRunner: DDP inside a group; ParallelRunner: DDP or FSDP2 sharding inside a group).
        """
        config = self.config.ft
        if not config.enabled:
            return
        # A runner with the `parallel` feature shards with FSDP2: its groups are HSDP's replicate dimension.
        sharded = any("parallel" in vars(klass).get("supported_features", ()) for klass in type(self).__mro__)
        check_fault_tolerance(config, self.topology.degrees, sharded=sharded)
        manager = self.checkpoint_manager
        positions = manager if isinstance(manager, ReplicaPositions) else None  # a TorchFTCheckpointManager
        rank, size = self.rank, self.world_size
        self.ft = FaultTolerance(config, self, self.events, group_rank=rank, group_world_size=size, positions=positions)

    def _replicas_commit(self) -> bool:
        """Average the window's gradients over the replica groups; whether they agree to apply it (no FT: yes)."""
        ft, container = self.ft, self.update.container
        if ft is None or container is None:
            return True
        if ft.commit(container.parameters()):
            return True
        container.drop()
        return False

    def _data_shard(self) -> tuple[int, int]:
        """`(shards, shard)` of this rank's data: the data domain, spread over the replica groups under TorchFT."""
        size, rank = self.topology.size("data"), self.topology.rank("data")
        return (size, rank) if self.ft is None else self.ft.data_shard(size, rank)

    # ==== torch checkpoint surface ====
    # (keep this marker; add this area's public names right below it)
    checkpointing_class = TorchCheckpointing
    checkpointing: TorchCheckpointing

    def _rescale_accumulation(self, accum_steps: int) -> None:
        """Use `accum_steps` from now on: an elastic resume keeps the global batch on another data-parallel size."""
        self.__dict__["accum_steps"] = accum_steps  # the runner's cached value: budgets count updates with it
        self.update.set_accum_steps(accum_steps)
        if self.scheduler is not None and self._merged_section("sched", "scheduler").get("type"):
            self.scheduler = None  # built for the old number of updates per epoch: build it for the new one
            self.build_scheduler()

    # ==== torch data and insight surface ====
    # (keep this marker; add this area's public names right below it)
    def build_dataloaders(self) -> None:
        """Wrap every dataset in `self.datasets` without a dataloader yet in a resumable `StatefulDataLoader`.

        Called when: once by `__post_init__`, after `build_scheduler`, when datasets are bound.
        Holds on entry: the model is materialized, the topology is built and `self.datasets` is filled.
        Side effects: fills `self.dataloaders[split]` for every dataset without a loader; options come
            from `config.dataloader` with `config.dataloader.<split>` overrides (train splits shuffle
            and drop the last partial batch unless configured otherwise), samplers from
            `build_datasampler`, batches are collated with `self.collate_fn`.
        Overrides must not: replace loaders already in `self.dataloaders` (the user bound them), or
            shard by the global rank instead of the data domain (ranks that read the same batch
            must get the same shard).
        """
        config = self._loader_config()
        train_splits = set(self.train_splits)
        shards, shard = self._data_shard()
        for split, dataset in self.datasets.items():
            if split in self.dataloaders:
                continue
            is_train = split in train_splits
            sampler = None
            if not isinstance(dataset, IterableDataset):
                shuffle = resolve_loader_options(config, split, is_train=is_train)["shuffle"]
                sampler = self.build_datasampler(dataset, split=split, shuffle=shuffle)
            self.dataloaders[split] = build_dataloader(
                dataset,
                split=split,
                config=config,
                distributed=shards > 1,
                rank=shard,
                world_size=shards,
                seed=self._data_seed,
                is_train=is_train,
                collate_fn=self.collate_fn,
                sampler=sampler,
            )

    def build_datasampler(self, dataset: Any, *, split: str, shuffle: bool) -> Any:
        """The index sampler of one split: a [`ResumableSampler`][danling.data.ResumableSampler].

        Called when: by `build_dataloaders` once per map-style dataset, and while the scheduler's
            run length is estimated (with `shuffle=False`, only its length is read).
        Holds on entry: the topology is built; `config.seed` is set.
        Side effects: none; returns a sampler sharding over the data domain (a `DistributedSampler`
            over its ranks, or a local random or sequential sampler), whose order depends only on
            `(seed, epoch)` and whose position is saved with the loader, so a resumed run continues mid-epoch.
        Overrides must not: return a sampler whose length differs between the two calls (the
            scheduler's budget would not match the epochs), or one without a saved position.
        """
        shards, shard = self._data_shard()  # the data domain: ranks that read the same batch share a shard
        return build_sampler(
            dataset,
            loader_config=self._loader_config(),
            split=split,
            is_train=split in self.train_splits,
            shuffle=shuffle,
            seed=self._data_seed,
            num_replicas=shards,
            rank=shard,
        )

    def _loader_config(self) -> dict[str, Any]:
        return self.config.dataloader.dict()

    @property
    def _data_seed(self) -> int:
        return int(self.config.seed or 0)

    def _sampler_length(self, dataset: Any, split: str) -> int:
        return len(self.build_datasampler(dataset, split=split, shuffle=False))

    def _total_steps(self) -> int | None:
        """The optimizer-step budget, estimated from the datasets when the loaders are not built yet."""
        return epoch_budget(
            epochs=self.epochs,
            steps=self.steps,
            accum_steps=self.accum_steps,
            train_splits=self.train_splits,
            datasets=self.datasets,
            loader_config=self._loader_config(),
            sampler_length=self._sampler_length,
        )

    def _total_rounds(self) -> int | None:
        """The rounds an epoch-interval scheduler steps in: `epochs`, or in step mode the rounds over the
        train splits that `steps` reaches into (the last one may be partial)."""
        if self.epochs is not None:
            return self.epochs or None
        steps, per_round = self._total_steps(), self._total_steps_of(epochs=1)
        return -(-steps // per_round) if steps and per_round else None

    def _total_steps_of(self, *, epochs: int) -> int | None:
        return epoch_budget(
            epochs=epochs,
            steps=None,
            accum_steps=self.accum_steps,
            train_splits=self.train_splits,
            datasets=self.datasets,
            loader_config=self._loader_config(),
            sampler_length=self._sampler_length,
        )

    def _why_no_steps(self) -> str | None:
        """Why `_total_steps` found no step in epoch mode, in words; None when that is not the reason."""
        return why_no_steps(
            epochs=self.epochs,
            steps=self.steps,
            train_splits=self.train_splits,
            datasets=self.datasets,
            loader_config=self._loader_config(),
            sampler_length=self._sampler_length,
        )

    def _init_profiler(self) -> None:
        """Profile a bounded window of training steps when `profiling.enabled` (every rank; see `StepProfiler`)."""
        profiling = self.config.profiling
        if not profiling.enabled:
            return
        self._profiler = StepProfiler(
            os.path.join(self.dir, profiling.trace_dir),
            rank=self.rank,
            wait=profiling.wait,
            warmup=profiling.warmup,
            active=profiling.active,
            repeat=profiling.repeat,
            record_shapes=profiling.record_shapes,
            profile_memory=profiling.profile_memory,
            with_stack=profiling.with_stack,
            with_flops=profiling.with_flops,
            logger=self.logger,
        ).attach(self.events)

    def _run_summary(self) -> dict[str, Any]:
        """The [`run_summary`][danling.runners.torch_insight.run_summary] of this run (this rank's
        pipeline stages when the model is split into stages)."""
        return run_summary(
            self.unwrap(self.checkpointing.checkpoint_model) if self.model is not None else None,
            precision=self.precision,
            device=self.device,
            world_size=self.world_size,
            degrees=self.topology.degrees,
            epochs=self.epochs,
            steps=self.steps,
            optimizer_steps=self._total_steps(),
            accum_steps=self.accum_steps,
            run_dir=str(self.dir),
        )

    def _log_run_summary(self, context: Any) -> None:
        """One block at the start of the first `train()`, on the main process."""
        if context.mode != "train" or self.__dict__.get("_summary_logged"):
            return
        self._summary_logged = True
        self.logger.info("%s", format_run_summary(self._run_summary()))

    # ------------------------------------------------------------------ misc
    def unwrap(self, model: Any) -> Any:
        """The plain module inside DDP / `torch.compile` wrappers (the averaged module for an `EMA`).

        Called when: by the checkpoint payloads and loaders, the optimizer's parameter names, the run
            summary and user code, any number of times.
        Holds on entry: `model` is the model, its EMA copy, a part of either, or anything else.
        Side effects: none.
        Overrides must not: return a copy (a checkpoint loaded into it would be lost), or fail on
            objects they do not wrap (return those unchanged).
        """
        if isinstance(model, EMA):
            model = model.module
        return unwrap_model(model) if isinstance(model, nn.Module) else model

    def close(self, timeout: float | None = None) -> bool:
        """Close the runner (see [`BaseRunner.close`][danling.runners.base_runner.BaseRunner.close]), restore the
        deterministic-kernel settings and destroy a process group this runner started.

        Called when: as `BaseRunner.close`: by user code or `with`, a graceful stop, a failed construction.
        Holds on entry: the runner may be half-built or closed already.
        Side effects: `BaseRunner.close`, then stops the profiler, restores the deterministic settings
            and, after waiting briefly for every rank, destroys the group this runner started.
        Overrides must not: destroy the process group before `super().close()` returns (pending
            checkpoint writes may still use it).
        """
        if self.__dict__.get("_closed", True):
            return True
        try:
            return super().close(timeout)
        finally:
            if self._profiler is not None:
                self._profiler.stop()
            if self.__dict__.get("ft") is not None:
                self.ft.close()
                self.ft = None
            before = self._deterministic_before
            if before is not None:
                torch.use_deterministic_algorithms(before[0], warn_only=before[1])
                torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]
                self._deterministic_before = None
            if self._owns_process_group and dist.is_initialized():
                _leave_together()
                dist.destroy_process_group()
                self._owns_process_group = False


def _leave_together(timeout: float = 30.0) -> None:
    """Wait (briefly) for every rank before the group is torn down.

    A rank that destroys the group and exits while a peer still talks to it (rank 0 hosts the
    rendezvous store) can abort that peer's process at exit instead of letting it leave with its
    own status. A peer that is gone already only costs the timeout.
    """
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=timeout), wait_all_ranks=True)
        else:  # GPU-only branch: NCCL has no monitored barrier
            dist.barrier()
    except RuntimeError:
        pass  # a peer failed or left: nothing to wait for


register_runner(("auto", "torch", "ddp"), TorchRunner)
