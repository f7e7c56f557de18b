"""`TorchRunner`: the PyTorch runner (single process or DDP), registered for the stacks `auto`, `torch` and `ddp`.

The class assembles construction, component building and the update strategy (this module), the
default batch contract ([`TorchBatchMixin`][danling.runners.torch_batch.TorchBatchMixin]) and checkpoint
payloads ([`TorchCheckpointMixin`][danling.runners.checkpointing.torch_state.TorchCheckpointMixin]) on top of the
backend-free [`BaseRunner`][danling.runners.base_runner.BaseRunner].
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from danling.checkpoint.manifest import verification_scope
from danling.distributed import (
    broadcast_object,
    init_process_group_from_env,
    is_distributed,
    unwrap_model,
    wrap_ddp,
)
from danling.optim import build_optimizer, build_scheduler, is_metric_scheduler

from .base_runner import BaseRunner
from .checkpointing import TorchCheckpointMixin
from .checkpointing.api import OPTIONAL_RANK_LOCAL_KEYS, RANK_LOCAL_KEYS
from .loop.events import Events
from .runner import register_runner
from .services import Compiler
from .torch_batch import TorchBatchMixin
from .torch_data import TorchDataMixin
from .torch_insight import TorchInsightMixin
from .update import EMA, GradientAccumulator, OptimizerContainer, Precision, TorchUpdateStrategy, gradient_sync_for
from .update.scheduling import advance_round_scheduler
from .update.spikes import guard_options

__all__ = ["TorchRunner"]


class TorchRunner(TorchCheckpointMixin, TorchBatchMixin, TorchDataMixin, TorchInsightMixin, BaseRunner):
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
        accumulator: The [`GradientAccumulator`][danling.runners.update.accumulation.GradientAccumulator]
            deciding which micro-steps update.
        precision_policy: The [`Precision`][danling.runners.update.precision.Precision] of `config.precision`.
        compiler: The [`Compiler`][danling.runners.services.compiler.Compiler] of the `compile` section.
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

    supported_features = ("profiling",)
    collate_fn: Callable | None = None
    scheduler_interval: str = "step"
    scheduler_monitor: str | None = None
    _train_timeout_applied: bool = False
    _owns_process_group: bool = False
    _deterministic_before: tuple | None = None

    def __post_init__(self) -> None:
        """Materialize the model, build optimizer, scheduler and dataloaders, then restore and record metadata."""
        self.precision_policy = Precision(self.precision, self.device)
        self.compiler = Compiler(dict(self.config.compile))
        self.materialize_model()
        self.build_optimizer()
        self.build_scheduler()
        self.update = self.build_update_strategy()
        self.update.bind(self.optimizer, self.scheduler, self.scheduler_interval)
        if self.datasets:
            self.build_dataloaders()
        self.init_profiler()
        super().__post_init__()
        if not self.__dict__.get("_restored", False):  # resume / auto_resume / pretrained
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

    @property
    def checkpoint_backend(self) -> str:
        """`checkpoint.backend` with `"auto"` resolved: `"dcp"` for distributed runs, `"file"` otherwise."""
        backend = self.config.checkpoint.backend or "auto"
        if backend == "auto":
            return "dcp" if self.distributed else "file"
        return backend

    # ------------------------------------------------------------------ early hooks
    def init_distributed(self) -> None:
        """Start the default process group from `WORLD_SIZE`/`RANK`/`LOCAL_RANK` when there are several processes.

        Called once during construction, before the checkpoint manager is chosen; no model exists yet.
        The runner owns the group's lifecycle: it starts it here and `close` destroys it. Rank 0's
        timestamp is broadcast so every rank names the run alike, and `TORCHELASTIC_RESTART_COUNT`
        is recorded in `elastic_state`.

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
        """Bind the DCP checkpoint manager when `checkpoint_backend` is `"dcp"`; keep the file manager otherwise.

        Runs right after `init_distributed`, on every rank (building a DCP manager with a dedicated
        asynchronous process group is collective).

        Raises:
            ValueError: `checkpoint.backend` names a backend this runner cannot write.
        """
        backend = self.checkpoint_backend
        if backend == "file":
            return
        if backend != "dcp":
            raise ValueError(
                f"checkpoint.backend={backend!r} is not supported by TorchRunner; use 'auto', 'file' or 'dcp'"
            )
        from danling.checkpoint.dcp import TorchDistributedCheckpointManager

        checkpoint = self.config.checkpoint
        manager = TorchDistributedCheckpointManager(
            self.workspace.checkpoint_dir,
            dedicated_async_process_group=checkpoint.dedicated_async_process_group,
            async_process_group_backend=checkpoint.async_process_group_backend,
            rank_local_keys=RANK_LOCAL_KEYS,
            optional_rank_local_keys=OPTIONAL_RANK_LOCAL_KEYS,
            data_rank=self.topology.rank("data"),
            data_size=self.topology.size("data"),
            **self.checkpoint_options(),
        )
        self.set_checkpoint_manager(manager)

    def set_seed(self, seed: int | None = None, bias: int | bool | None = None) -> int:
        """Seed Python, NumPy and torch (every device).

        Arguments are those of [`BaseRunner.set_seed`][danling.runners.base_runner.BaseRunner.set_seed]. In a
        distributed run without a configured seed, rank 0 draws one and broadcasts it, so all ranks
        shuffle the data alike (their own offset `bias` still differs).
        """
        if seed is None and self.config.get("seed") is None and is_distributed():
            self.config.seed = broadcast_object(random.SystemRandom().randrange(2**31), group=None)
            self._seed_was_drawn = True
        seed = super().set_seed(seed, bias)
        torch.manual_seed(seed)
        self.rng_state.capture()
        return seed

    def set_deterministic(self) -> None:
        """Request deterministic kernels (`torch.use_deterministic_algorithms`, cuDNN).

        `close` puts the previous settings back, since they are global to the process.
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

        Called once by `__post_init__`, before the optimizer is built (it must see the final
        parameters). Overrides must keep the device move and must not wrap an already wrapped model.

        Raises:
            ValueError: `self.model` is not set.
            TypeError: `self.model` is not an `nn.Module`.
        """
        self.require_model()
        self.model = self.model.to(self.device)
        self.model = self.compiler.compile(self.model, distributed=self.distributed)
        trainable = any(param.requires_grad for param in self.model.parameters())
        if self.distributed and trainable:
            self.model = wrap_ddp(self.model, self.device)  # also broadcasts rank 0's weights
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
        """`(name, parameter)` of every trainable parameter, named as in the unwrapped model."""
        for name, param in self.unwrap(self.model).named_parameters():
            if param.requires_grad:
                yield name, param

    def iter_optimizer_parameters(self) -> Iterator[nn.Parameter]:
        """Every trainable parameter of the model."""
        for _, param in self.iter_optimizer_named_parameters():
            yield param

    def build_optimizer(self) -> None:
        """Build `self.optimizer` from `config.optim` (alias `optimizer`) unless one is already bound.

        Called by `__post_init__` after `materialize_model`. Nothing is built while the section
        has no `type`. `optim.param_groups` patterns are searched in the names of
        `iter_optimizer_named_parameters` (see [`build_optimizer`][danling.optim.build_optimizer]).
        """
        if self.optimizer is not None:
            return
        section = self._merged_section("optim", "optimizer")
        if section.get("type"):
            self.optimizer = build_optimizer(list(self.iter_optimizer_named_parameters()), section)

    def build_scheduler(self) -> None:
        """Build `self.scheduler` from `config.scheduler` (alias `sched`) unless one is bound; set its interval.

        Called by `__post_init__` after `build_optimizer`. Schedulers that take a run length get
        the optimizer-step budget. `interval` defaults to `"step"`, or `"epoch"` for metric
        schedulers such as `ReduceLROnPlateau`, which step with the value at `monitor`.

        Raises:
            ValueError: a metric scheduler is configured with `interval="step"`.
        """
        section = self._merged_section("sched", "scheduler")
        if self.scheduler is None and self.optimizer is not None and section.get("type"):
            total_steps = self._total_steps()
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
    def build_update_strategy(self) -> TorchUpdateStrategy:
        """The [`TorchUpdateStrategy`][danling.runners.update.strategy.TorchUpdateStrategy] of this run.

        Called once by `__post_init__` after `materialize_model`, `build_optimizer` and
        `build_scheduler` (the optimizer and scheduler are bound to it right after). It reads
        `accum_steps`, `precision`, the clipping and non-finite settings, and takes the model's
        gradient-sync control (DDP `no_sync`, FSDP2's sync flag) and the gradient domain's group.
        Backends whose engine owns backward and step return their own strategy.
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
    def accumulator(self) -> GradientAccumulator:
        """The accumulation window state of the update strategy."""
        return self.update.accumulator

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

        Raises:
            RuntimeError: no optimizer is bound (set `config.optim.type` or `self.optimizer`).
        """
        container = self.update.container
        if container is None or container.optimizer is not self.optimizer or container.scheduler is not self.scheduler:
            self.update.bind(self.optimizer, self.scheduler, self.scheduler_interval)  # reassigned by the user
            if self.update.container is None:
                raise RuntimeError(
                    f"{type(self).__name__} has no optimizer to step: set config.optim.type or assign self.optimizer"
                )
        applied = self._apply_update()
        if applied:
            if isinstance(self.ema, EMA):
                self.ema.update(self.model)
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
        """
        if self.scheduler is None or self.scheduler_interval == "step":
            return  # nothing steps per round (and nothing to look up)
        configured = self.config.get("score_split")
        advance_round_scheduler(
            self.scheduler,
            self.scheduler_interval,
            result,
            monitor=self.scheduler_monitor,
            score_name=self.score_name,
            splits=[configured] if configured else ["val", "validate", "validation", *self.evaluate_splits],
        )

    # ==== torch loop surface ====
    # (keep this marker; add this area's public names right below it)

    # ==== torch checkpoint surface ====
    # (keep this marker; add this area's public names right below it)

    # ==== torch data and insight surface ====
    # (keep this marker; add this area's public names right below it)

    # ------------------------------------------------------------------ misc
    def unwrap(self, model: Any) -> Any:
        """The plain module inside DDP / `torch.compile` wrappers (the averaged module for an `EMA`)."""
        if isinstance(model, EMA):
            model = model.module
        return unwrap_model(model) if isinstance(model, nn.Module) else model

    def close(self, timeout: float | None = None) -> bool:
        """Close the runner (see [`BaseRunner.close`][danling.runners.base_runner.BaseRunner.close]), restore the
        deterministic-kernel settings and destroy a process group this runner started."""
        if self.__dict__.get("_closed", True):
            return True
        try:
            return super().close(timeout)
        finally:
            if self.profiler is not None:
                self.profiler.stop()
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
