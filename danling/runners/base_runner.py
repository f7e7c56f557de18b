"""`BaseRunner`: the backend-free runner core.

The class owns the construction lifecycle, process facts (rank, world size), seeding and the
services every backend shares (workspace, logging, trackers, checkpoint manager, supervisor).
Loops live in [`loops`][danling.runners.loop.loops], budgets and split selection in
[`progress`][danling.runners.loop.budget], result bookkeeping in [`results`][danling.runners.services.results]
and checkpointing in [`RunnerCheckpointing`][danling.runners.checkpointing.component.RunnerCheckpointing]
(`runner.checkpointing`, its hooks in [`CheckpointHooks`][danling.runners.checkpointing.hooks.CheckpointHooks]);
`BaseRunner` delegates result bookkeeping to its
[`RunnerResults`][danling.runners.services.results.RunnerResults] (`runner.bookkeeping`).
"""

from __future__ import annotations

import logging
import os
import random
import sys
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import suppress
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from chanfig import FlatDict

from danling.checkpoint import CheckpointManager, FileCheckpointManager
from danling.checkpoint.failures import CheckpointSaveError
from danling.checkpoint.manifest import CheckpointNotFoundError
from danling.distributed import Topology
from danling.distributed.slurm import SlurmJob, apply_slurm_launch
from danling.metrics import AverageMeters
from danling.utils import RoundDict
from danling.utils.io import save as save_file

from .checkpointing import CheckpointHooks, RunnerCheckpointing
from .checkpointing.resume import LoopState
from .config import RunnerConfig
from .diagnosis import (
    Diagnosis,
    DiagnosisSetup,
    ReplayRecorder,
    ReplaySetup,
    build_diagnosis,
    build_oom_guard,
    describe_runner,
    replica_tensors,
)
from .loop import EventBus, Events, LogContext, Loop, StepContext, StepHooks
from .loop.budget import checked_count, default_interval, evaluation_default, length_of, selected_splits, step_budget
from .registry import RUNNERS
from .services import RunnerResults, RunnerSupervisor, RunnerWorkspace, Trackers, flatten_result
from .services.errors import report_errors_briefly
from .services.observability import RunStatus, Throughput, is_train_step_log
from .services.preemption import SlurmPreemption
from .services.progress_bar import ProgressBar
from .services.run_dirs import resolve_resume_path
from .services.supervisor import StartupFreeze
from .services.tracking import TRACKERS, TrackerSetup, tensorboard_tracker, wandb_tracker
from .state import RunnerElasticState, RunnerRNGState, RunnerState, RunnerTrainState

__all__ = ["BaseRunner", "MetaRunner"]

_FALLBACK_LOGGER = "danling.runners"


class MetaRunner(type):
    """Metaclass that finishes construction with `__post_init__`.

    `Runner(config)` runs `__new__`, the whole `__init__` chain (the user's subclass included),
    and only then `__post_init__`, so `__post_init__` sees every attribute the subclass set.
    If construction fails part-way, the runner's process-wide side effects (signal handlers,
    stdout routing, open files) are undone before the error propagates.
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        instance = cls.__new__(cls, *args, **kwargs)
        if not isinstance(instance, cls):  # a dispatching __new__ returned a finished runner
            return instance
        try:
            instance.__init__(*args, **kwargs)
            if not instance.__dict__.get("_post_initialized", False):
                instance._post_initialized = True
                instance.__post_init__()
        except BaseException:
            with suppress(Exception):
                instance.close(timeout=0)
            raise
        return instance


class BaseRunner(CheckpointHooks, StepHooks, metaclass=MetaRunner):
    """Backend-free runner: lifecycle, bookkeeping, checkpoint API and loop skeletons.

    Construction runs in this order (concrete runners customise it through the hooks, never by
    overriding `__init__` internals):

    1. The config is normalised to a [`RunnerConfig`][danling.runners.config.RunnerConfig] and
       validated, and a fresh [`RunnerState`][danling.runners.state.RunnerState] is created.
    2. The workspace, the `datasets`/`dataloaders`/`results` containers, the default
       [`FileCheckpointManager`][danling.checkpoint.FileCheckpointManager] and the
       [`RunnerSupervisor`][danling.runners.services.supervisor.RunnerSupervisor] are bound.
    3. Early hooks: `init_distributed`, `init_checkpoint_manager`, `init_fault_tolerance`,
       `init_garbage_collection`.
    4. `set_seed(bias=False)`: every rank starts from the same seed, so the model the subclass
       `__init__` builds is the same on every rank and in every layout; then `set_deterministic`
       when `config.deterministic` is set.
    5. The run log, the trackers of the [tracker registry][danling.runners.services.tracking]
       (TensorBoard through `init_tensorboard`, W&B through `init_wandb`, then CSV, MLflow and any
       registered tracker, as configured), stdout routing for non-main ranks,
       `init_signal_handlers`, `init_heartbeat`.
    6. The subclass `__init__` finishes (it typically binds `model`, `datasets`, ...).
    7. [`MetaRunner`][danling.runners.base_runner.MetaRunner] calls `__post_init__`, which
       offsets the seed by the data rank (`set_seed()`: what must differ between ranks, such as
       dropout and augmentations, now does) and records the run's metadata; concrete runners
       restore a checkpoint there when the config asks for one (see `__post_init__`).

    Attributes:
        config: The run's configuration.
        state: Checkpointable counters and RNG snapshots (`train_state`, `elastic_state`,
            `rng_state` are shortcuts into it).
        datasets: Datasets keyed by split name.
        dataloaders: Iterables of batches keyed by split name; the loops read these.
        results: One row per round (epoch index or global step) mapping split to metrics
            (`bookkeeping.rows`).
        bookkeeping: The [`RunnerResults`][danling.runners.services.results.RunnerResults] holding
            the rows: model selection, early stopping, result files and result formatting.
        meters: [`AverageMeters`][danling.metrics.AverageMeters] of the step losses of the split being run.
        checkpoint_manager: Where checkpoints are written and read.
        workspace: Run directory, logging and metadata.
        supervisor: Signal handling, heartbeat and GC pacing.
        update: The [`UpdateStrategy`][danling.runners.update.strategy.UpdateStrategy] that turns
            micro-steps into optimizer updates (`update.accumulator` holds the accumulation window).
        preemption: The [`SlurmPreemption`][danling.runners.services.preemption.SlurmPreemption] service:
            `slurm.signal` stops the run at a checkpoint, then `slurm.requeue` requeues the job.
        loop: The [`Loop`][danling.runners.loop.loops.Loop] running the training, evaluation and
            inference loops; the loop methods below delegate to it.
        trackers: The [`Trackers`][danling.runners.services.trackers.Trackers] fan-out every logged value
            goes to; `runner.trackers.append(MyTracker())` adds one.
        throughput: The [`Throughput`][danling.runners.services.observability.Throughput] of the
            training step logs (`runner.throughput.count_tokens(n)` adds tokens per second).
        diagnosis: The [`Diagnosis`][danling.runners.diagnosis.Diagnosis] plug-ins: `diagnosis.stragglers`
            names slow ranks at the step logs (`stragglers.*`), `diagnosis.consistency` compares the
            replicas' weights (`consistency.*`); each is `None` while off.
        ft: Fault-tolerance runtime handle (`None` unless a backend provides one).
        timestamp: Wall-clock start of the run, `YYYYmmdd-HHMMSS`.

    Examples:
        >>> import tempfile
        >>> class CountingRunner(BaseRunner):
        ...     def __init__(self, config):
        ...         super().__init__(config)
        ...         self.dataloaders["train"] = [1.0, 2.0, 3.0]
        ...     def train_step(self, data):
        ...         self.step()
        ...         return data, data
        >>> config = {"epochs": 2, "workspace_root": tempfile.mkdtemp(), "log": False}
        >>> with CountingRunner(config) as runner:
        ...     results = runner.train()
        >>> runner.train_state.global_step, runner.results[1]["train"]["loss"]
        (6, 2.0)
    """

    # Components a backend or the user binds; `None` means "not used by this runner".
    model: Any = None
    ema: Any = None
    criterion: Any = None
    optimizer: Any = None
    scheduler: Any = None
    metrics: Any = None

    def __init__(self, config: RunnerConfig | Mapping[str, Any]) -> None:
        report_errors_briefly(None)  # an error ending the script is one line; _init_logging names the run log
        apply_slurm_launch()  # `srun` without torchrun: RANK, WORLD_SIZE, ... from SLURM_*, before a rank is read
        RunnerConfig.check_runner(config, type(self))  # refuse stacks/features this class does not implement
        self.config = self._normalize_config(config)
        self._resolve_auto_stack()
        self.state = RunnerState(config=self.config)
        self.timestamp = time.strftime("%Y%m%d-%H%M%S")
        self._closed = False
        self._bind_components()
        self.init_distributed()
        self.topology = self.build_topology()
        self.init_checkpoint_manager()
        self.init_fault_tolerance()
        self.init_garbage_collection()
        # The same seed on every rank while the subclass builds its model: a model initialised from
        # a per-rank stream would differ between layouts that do not broadcast it (FSDP2, tensor
        # parallel). `__post_init__` adds the per-rank offset once the model exists.
        self.set_seed(bias=False)
        if self.config.get("deterministic"):
            self.set_deterministic()
        self._init_logging()
        self._init_trackers()
        self.workspace.route_print()
        self._init_cluster()
        self.init_signal_handlers()
        self.init_heartbeat()

    def __post_init__(self) -> None:
        """Finish construction once the subclass `__init__` has returned.

        Offsets the seed by the data rank (`set_seed()`), subscribes `@on` handlers, builds the
        update strategy and the diagnosis plug-ins the config turns on (`runner.diagnosis`), and
        writes the run metadata on the main process. The backend-free runner
        restores nothing: it cannot know what a checkpoint's components load into. Concrete
        runners build their model, optimizer and dataloaders, call `super().__post_init__()` and
        then restore what `config.resume` / `config.auto_resume` / `config.pretrained` ask for with
        [`auto_restore`][danling.runners.checkpointing.hooks.CheckpointHooks.auto_restore]
        (`TorchRunner` does); a `BaseRunner` subclass does the same in its own `__post_init__`,
        or calls `auto_restore()` after construction.
        """
        self.set_seed()  # the model is built: from here on ranks draw their own numbers (dropout, augmentations)
        self.events.subscribe_object(self)  # methods marked with @on(...)
        if "update" not in self.__dict__:
            self.update = self.build_update_strategy()
        self.loop_state.accumulator = self.update.accumulator
        self.diagnosis = self._build_diagnosis()
        if self.is_main_process:
            self.workspace.write_metadata({"runner": type(self).__name__, "timestamp": self.timestamp})

    @staticmethod
    def _normalize_config(config: RunnerConfig | Mapping[str, Any]) -> RunnerConfig:
        if isinstance(config, RunnerConfig):
            config._normalize()  # spellings only ("DCP", "bfloat16"); booting again would rerun post() hooks
            config.validate()
            return config
        if isinstance(config, Mapping):
            return RunnerConfig(**config).boot()
        raise TypeError(f"config must be a RunnerConfig or a mapping, got {type(config).__name__}: {config!r}")

    def _resolve_auto_stack(self) -> None:
        """Record the backend `stack: auto` ran on: `"ddp"` for a `TorchRunner`, say.

        The name is the one registered for the most derived backend class this runner is an
        instance of (`"ddp"` preferred among a class's aliases); a runner outside the registry
        keeps `"auto"`.
        """
        if str(self.config.get("stack") or "auto").strip().lower() != "auto":
            return
        backends = {backend for name, backend in RUNNERS.items() if name != "auto" and isinstance(self, backend)}
        derived = [b for b in backends if not any(o is not b and issubclass(o, b) for o in backends)]
        if len(derived) != 1:
            return
        names = [name for name, backend in RUNNERS.items() if backend is derived[0] and name != "auto"]
        self.config.stack = "ddp" if "ddp" in names else names[0]

    def _bind_components(self) -> None:
        """Step 2 of construction: workspace, containers, checkpoint manager, supervisor."""
        # First, so that what the rest of construction imports and builds is collected faster (see StartupFreeze).
        self._startup_freeze = StartupFreeze(self.config.gc.freeze)
        self.workspace = RunnerWorkspace(self.config, rank=self.rank, world_size=self.world_size)
        self.logger = logging.getLogger(_FALLBACK_LOGGER)
        # Subclasses may fill these before calling super().__init__; keep what they set.
        if "datasets" not in self.__dict__:
            self.datasets = FlatDict()
        if "dataloaders" not in self.__dict__:
            self.dataloaders = FlatDict()
        self.bookkeeping = RunnerResults(self.config, evaluate_splits=lambda: self.evaluate_splits)
        self.events = EventBus()
        self.events.subscribe(Events.LOG, self._forward_to_trackers)
        self.loop_state = LoopState()
        self.loop = Loop(self, self.events)
        self.meters = AverageMeters()
        self.trackers = Trackers()
        self._results_restored = False  # a checkpoint was restored since the last result row was written
        self.throughput = Throughput(lambda: self.train_state.global_step).attach(self.events)
        self.ft = None
        self.checkpoint_manager = self._build_file_checkpoint_manager()
        self.checkpointing = self._build_checkpointing()
        self.supervisor = self._build_supervisor(gc_interval=None)  # GC pacing: init_garbage_collection

    def _build_supervisor(self, *, gc_interval: int | None) -> RunnerSupervisor:
        gc_config = self.config.gc
        return RunnerSupervisor(
            heartbeat_interval=self.config.heartbeat.interval_seconds,
            rank=self.rank,
            gc_interval=gc_interval,
            gc_generation=gc_config.generation,
            gc_disable_automatic=gc_config.disable_automatic,
            logger=self.logger,
        )

    def _build_file_checkpoint_manager(self) -> FileCheckpointManager:
        return FileCheckpointManager(self.workspace.checkpoint_dir, **self.checkpoint_options())

    def checkpoint_options(self) -> dict[str, Any]:
        """Keyword arguments every checkpoint manager takes, read from `config.checkpoint`.

        Called when: once, when the runner binds its checkpoint manager (`__post_init__` and the
            backends' `init_checkpoint_manager`), on every rank.
        Holds on entry: `config.checkpoint` is final; the process group (if any) is started.
        Side effects: none; returns a new dict each call.
        Overrides must not: drop keys (every manager takes them all); a backend that cannot honour
            one (DeepSpeed: `async_save`) removes it from its own copy.
        """
        checkpoint = self.config.checkpoint
        return {
            "interval": self.checkpoint_interval,
            "keep_latest_k": checkpoint.keep_latest_k or None,
            "save_top_k": checkpoint.save_top_k or None,
            # An explicit async_mode wins; unset, it follows async_enabled.
            "async_save": checkpoint.async_enabled
            if checkpoint.async_mode is None
            else checkpoint.async_mode != "disabled",
            "load_only": checkpoint.load_only,
            "exclude_from_loading": checkpoint.exclude_from_loading,
            "is_main_process": self.is_main_process,
            "timeout": checkpoint.wait_timeout,
            "logger": logging.getLogger("danling.checkpoint"),
            "trusted": checkpoint.trust_pickle,
            "checksum": checkpoint.checksum,
        }

    # ------------------------------------------------------------------ process facts
    @property
    def world_size(self) -> int:
        """Number of processes, from `WORLD_SIZE` (1 when unset)."""
        return int(os.environ.get("WORLD_SIZE", 1))

    @property
    def rank(self) -> int:
        """Global rank, from `RANK` (0 when unset)."""
        return int(os.environ.get("RANK", 0))

    @property
    def local_rank(self) -> int:
        """Rank on this node, from `LOCAL_RANK` (0 when unset)."""
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.world_size > 1

    @property
    def is_main_process(self) -> bool:
        """Whether this is global rank 0 (the process that writes files and logs)."""
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        """Whether this is rank 0 on its node."""
        return self.local_rank == 0

    @property
    def code_id(self) -> str | None:
        """Short git hash of the code being run, or `None` outside a git checkout."""
        return self.workspace.code_id

    @property
    def config_id(self) -> str:
        """Stable hash of the semantic part of the config."""
        return self.workspace.config_id

    @property
    def id(self) -> str:
        """Stable experiment id derived from `config_id` (not the code version; see `workspace.version` for reruns)."""
        return self.workspace.id

    @property
    def dir(self) -> str:
        """The run directory (created on first access on the main process)."""
        return os.fspath(self.workspace.dir)

    @property
    def train_state(self) -> RunnerTrainState:
        """Progress counters: `epoch`, `global_step`, `micro_step`."""
        return self.state.train

    @property
    def elastic_state(self) -> RunnerElasticState:
        """Restart bookkeeping for elastic launches."""
        return self.state.elastic

    @property
    def rng_state(self) -> RunnerRNGState:
        """Snapshots of the Python/NumPy/Torch random generators."""
        return self.state.rng

    # ------------------------------------------------------------------ early hooks
    def init_distributed(self) -> None:
        """Set up the process group; the default does nothing (one process needs no group).

        Called when: once during construction (step 3), first of the early hooks, on every rank.
        Holds on entry: config, state, workspace, the default checkpoint manager and the supervisor
            are bound; there is no model, topology or log file yet.
        Side effects: backends start their process group here (and may adjust `timestamp` so every
            rank names the run alike); `close` tears down a group the runner started.
        Overrides must not: read `self.topology` (built right after) or start a group they do not
            release in `close`.
        """

    def build_topology(self) -> Topology:
        """Who this rank is along each parallel axis, and the process group of each reduction domain.

        The default is plain data parallelism
        ([`Topology.data_parallel`][danling.distributed.topology.ParallelTopology.data_parallel]): the data,
        metrics and gradient domains are the whole world, so every collective uses the default
        group. Samplers, loader sharding, the inference gather, metric reduction, the per-rank seed
        offset and per-rank checkpoint entries follow the `data` domain; gradient synchronisation
        follows the `gradient` domain. Backends with model parallelism return their axes' topology.

        Called when: once during construction, right after `init_distributed`, on every rank.
        Holds on entry: the process group (if any) is running; no model exists yet.
        Side effects: none here; the returned topology is bound to `self.topology`.
        Overrides must not: return a topology whose sizes disagree between ranks, or build
            process groups on some ranks only (group creation is collective).
        """
        return Topology.data_parallel()

    def init_checkpoint_manager(self) -> None:
        """Swap in the checkpoint backend this runner needs; the default keeps the file manager.

        Called when: once during construction, after `build_topology`, on every rank.
        Holds on entry: the process group and `self.topology` exist; `checkpoint_manager` is the
            `FileCheckpointManager` bound in step 2.
        Side effects: backends build their manager and bind it with
            [`set_checkpoint_manager`][danling.runners.base_runner.BaseRunner.set_checkpoint_manager].
        Overrides must not: assign `self.checkpoint_manager` directly (the previous manager would
            stay open) or build a collective manager on some ranks only.
        """

    def set_checkpoint_manager(self, manager: CheckpointManager) -> None:
        """Bind `manager`, closing the previous one without waiting.

        Raises:
            TypeError: `manager` is not a [`CheckpointManager`][danling.checkpoint.CheckpointManager].
        """
        if not isinstance(manager, CheckpointManager):
            raise TypeError(f"expected a CheckpointManager, got {type(manager).__name__}: {manager!r}")
        previous = self.__dict__.get("checkpoint_manager")
        self.checkpoint_manager = manager
        if previous is not None and previous is not manager:
            previous.close(timeout=0)

    def init_fault_tolerance(self) -> None:
        """Bind a fault-tolerance runtime to `self.ft`; the base runner has none.

        Called when: once during construction, after `init_checkpoint_manager`, on every rank.
        Holds on entry: process group, topology and checkpoint manager are bound; `self.ft` is `None`.
        Side effects: the default only refuses `ft.enabled` (`ValueError`); backends that support
            TorchFT bind their runtime to `self.ft`.
        Overrides must not: ignore `ft.enabled` silently (a run would believe it is protected).
        """
        if self.config.ft.enabled:
            raise ValueError(
                f"ft.enabled=True but {type(self).__name__} has no fault-tolerance backend; "
                "use a runner stack that supports TorchFT or set ft.enabled=False"
            )

    # ------------------------------------------------------------------ randomness
    def set_seed(self, seed: int | None = None, bias: int | bool | None = None) -> int:
        """Seed Python's and NumPy's generators and snapshot the RNG state.

        Called when: twice during construction: `set_seed(bias=False)` in step 4 (every rank alike,
            so the model builds identically) and `set_seed()` in `__post_init__` (per data rank).
        Holds on entry: `self.topology` is built; `config.seed` may be unset.
        Side effects: seeds the generators, may store a drawn seed in `config.seed`, and captures
            `rng_state`.
        Overrides must not: skip `super()` or return a seed other than the one used (checkpoints
            record it, and a resume adopts it).

        Args:
            seed: Base seed; defaults to `config.seed`. When that is unset too, a random seed is
                drawn and stored in the config; resuming a checkpoint then adopts the seed the
                checkpointed run used.
            bias: Offset added to the seed so processes draw different augmentations. `None` or
                `True` use the rank in the data domain (ranks that read the same batch draw
                alike; under plain DDP, the rank); `False` adds nothing; an int is added as is.

        Returns:
            The seed this process actually used.
        """
        if seed is None:
            seed = self.config.get("seed")
        if seed is None:
            seed = random.SystemRandom().randrange(2**31)
            self.config.seed = seed
            self.checkpointing.seed_was_drawn = True  # a resumed checkpoint's seed replaces it (see load_state_dict)
        if bias is None or bias is True:
            topology = self.topology
            bias = self.rank if topology.is_data_parallel_only else topology.rank("data")
        elif bias is False:
            bias = 0
        seed = int(seed) + int(bias)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        self.rng_state.capture()
        return seed

    def set_deterministic(self) -> None:
        """Make backend kernels deterministic; the base runner has nothing to switch.

        Called when: once during construction, right after `set_seed(bias=False)`, when
            `config.deterministic` is set.
        Holds on entry: seeded; no model exists yet.
        Side effects: backends switch their libraries (cuDNN, deterministic algorithms) and remember
            the previous settings.
        Overrides must not: change process-wide settings that `close` does not put back.
        """

    # ------------------------------------------------------------------ misc
    def unwrap(self, model: Any) -> Any:
        """Return the plain model inside any backend wrapper; the base runner adds no wrapper.

        Called when: by the checkpoint payloads and loaders (`model`, `ema`), by the optimizer's
            parameter names and by user code, any number of times.
        Holds on entry: `model` is the runner's model, its EMA copy, or a part of either.
        Side effects: none.
        Overrides must not: return a copy (loading a checkpoint into it would change nothing) or
            fail on an object they do not wrap (return it unchanged).
        """
        return model

    def save(self, obj: Any, file: str | os.PathLike, main_process_only: bool = True, *args: Any, **kwargs: Any) -> Any:
        """Write `obj` with [`danling.utils.save`][danling.utils.save], on the main process only by default."""
        if main_process_only and not self.is_main_process:
            return file
        return save_file(obj, file, *args, **kwargs)

    def close(self, timeout: float | None = None) -> bool:
        """Release everything the runner holds; safe to call more than once.

        Waits for pending checkpoint writes (up to `timeout`, default `checkpoint.wait_timeout`)
        and result files, closes trackers, restores signal handlers, automatic GC and stdout,
        unfreezes the objects construction froze (`gc.freeze`) and closes the log files. A
        checkpoint write still running after `timeout` is left to finish in the background with a
        `RuntimeWarning`; calling `close()` again waits for it (and for anything else the first
        call could not close).

        Called when: by user code or `with` on exit, by a graceful stop before the process exits,
            and with `timeout=0` when construction fails part-way (attributes may be missing).
        Holds on entry: nothing beyond `__new__`; the runner may be half-built or closed already.
        Side effects: the releases above; `self._closed` once nothing is left in flight.
        Overrides must not: skip `super().close()`, or release their own resources before it
            returns (pending checkpoint writes may still read them); do it in a `finally` after it.

        Returns:
            `True` when no checkpoint write was left in flight.
        """
        if self.__dict__.get("_closed", True):
            return True
        first = not self.__dict__.get("_closing", False)
        self._closing = True
        drained = True
        manager = self.__dict__.get("checkpoint_manager")
        book = self.__dict__.get("bookkeeping")
        try:
            if manager is not None:
                drained = manager.close(timeout)
        finally:
            try:
                if book is not None:
                    book.close(timeout)
            finally:
                if first:  # trackers, handlers, stdout and logs: released once, on the first call
                    self._release_components()
        if not drained:
            warnings.warn(
                f"{type(self).__name__}.close(timeout={timeout}): a checkpoint write is still running and "
                "finishes in the background; call close() again to wait for it",
                RuntimeWarning,
                stacklevel=2,
            )
            return False
        self._closed = True
        return True

    def _release_components(self) -> None:
        """Close trackers and supervisor (their errors must not stop the rest) and the workspace."""
        for name in ("trackers", "supervisor"):
            component = self.__dict__.get(name)
            if component is not None:
                with suppress(Exception):
                    component.close()
        workspace = self.__dict__.get("workspace")
        if workspace is not None:
            workspace.restore_print()
            workspace.close()
        startup_freeze = self.__dict__.get("_startup_freeze")
        if startup_freeze is not None:
            startup_freeze.release()

    # ==== loop surface: thin delegations to the loop component ====
    # (keep this marker; add this component's public names right below it)
    # The split of the pass under way (or the last one); the loops set it when a pass opens.
    split: str | None = None

    # ------------------------------------------------------------------ budgets, cadences and splits (typed config)
    @property
    def epochs(self) -> int | None:
        """Number of epochs to train (`config.epochs`); `None` selects step mode."""
        return self.config.epochs

    @epochs.setter
    def epochs(self, value: int | None) -> None:
        self.config.epochs = checked_count("epochs", value, accepted="a non-negative int or None")

    @property
    def steps(self) -> int | None:
        """Optimizer-step budget.

        `config.steps` when set; otherwise `epochs` times the optimizer steps per epoch, when
        every train dataloader has a length; otherwise `None`.
        """
        loaders = [self.dataloaders.get(split) for split in self.train_splits]
        return step_budget(self.config.steps, self.epochs, loaders, self.accum_steps)

    @steps.setter
    def steps(self, value: int | None) -> None:
        self.config.steps = checked_count("steps", value, accepted="a non-negative int or None")

    @property
    def is_step_mode(self) -> bool:
        """Whether training counts optimizer steps (no `epochs` configured) instead of epochs."""
        return self.epochs is None

    @cached_property  # cached, not mirrored: an elastic resume stores the resized value in its place
    def accum_steps(self) -> int:
        """Micro-batches per optimizer step (`config.accum_steps`, default 1)."""
        return checked_count("accum_steps", self.config.accum_steps or 1, minimum=1, accepted="a positive int")

    @property
    def precision(self) -> str | None:
        """Autocast precision requested by the config (`"fp32"`, `"fp16"`, `"bf16"`), or `None`."""
        precision = self.config.precision
        if isinstance(precision, str):
            return self.config.PRECISIONS.get(precision.lower(), precision)
        return precision

    @property
    def max_grad_value(self) -> float | None:
        """Gradient value clipping threshold (`config.max_grad_value`), or `None`."""
        return self.config.max_grad_value

    @property
    def max_grad_norm(self) -> float | None:
        """Gradient norm clipping threshold (`config.max_grad_norm`), or `None`."""
        return self.config.max_grad_norm

    @property
    def skip_nonfinite_grad(self) -> bool:
        """Whether updates with NaN/inf gradients are skipped (`config.skip_nonfinite_grad`)."""
        return bool(self.config.skip_nonfinite_grad)

    @property
    def progress(self) -> float:
        """Fraction of the training budget done, in `[0, 1]` (by steps when known, else epochs)."""
        steps, state = self.steps, self.train_state
        if steps:
            value = state.global_step / steps
        elif self.epochs:
            value = state.epoch / self.epochs
        else:
            return 0.0
        return min(max(value, 0.0), 1.0)

    @property
    def batch_size(self) -> int:
        """Batch size from `dataloader.batch_size`, else from the first dataloader that has one."""
        size = self.config.dataloader.batch_size
        if size:
            return size
        for loader in self.dataloaders.values():
            size = getattr(loader, "batch_size", None)
            if size:
                return size
        raise ValueError("cannot infer the batch size: set dataloader.batch_size or bind a dataloader with batch_size")

    @property
    def log_interval(self) -> int:
        """Iterations between step logs: `config.log_interval`, else a tenth of the first train loader.

        `0` (configured) turns step logs off; results of each round are still logged.
        """
        loader = next((self.dataloaders[s] for s in self.train_splits if s in self.dataloaders), None)
        return self._log_interval_for(length_of(loader))

    def _log_interval_for(self, length: int | None) -> int:
        """The step-log interval of a pass over `length` batches (`config.log_interval` when set)."""
        configured = self.config.log_interval
        if configured is not None:
            return checked_count("log_interval", configured, accepted="an int >= 0 (0: no step logs) or None")
        return default_interval(length, self.steps, fallback=100)

    @property
    def evaluate_interval(self) -> int:
        """Optimizer steps between evaluations in step mode.

        `config.evaluate_interval` when set (`0`: only the evaluation after the last step);
        otherwise a tenth of the step budget, at least 1, which is also the default checkpoint
        cadence, so every default checkpoint holds evaluated weights. Epoch mode evaluates after
        every epoch and does not read it.
        """
        configured = self.config.evaluate_interval
        if configured is not None:
            return checked_count("evaluate_interval", configured, accepted="an int >= 0 (0: after the last step)")
        return default_interval(None, self.steps, fallback=0)

    @property
    def checkpoint_interval(self) -> int:
        """Checkpoint cadence: `checkpoint.interval`, else every epoch (epoch mode) or a tenth of `steps`."""
        configured = self.config.checkpoint.interval
        if configured:
            return configured
        if not self.is_step_mode:
            return 1
        return default_interval(None, self.config.steps, fallback=1)

    @property
    def train_splits(self) -> list[str]:
        """Splits trained on: `config.train_splits`, else every split whose name starts with `train`."""
        return selected_splits(self.config.train_splits, [s for s in self._known_splits() if s.startswith("train")])

    @property
    def evaluate_splits(self) -> list[str]:
        """Splits evaluated: `config.evaluate_splits` (`[]`: none), else every split not trained or inferred."""
        configured = self.config.evaluate_splits
        if configured is not None:  # `[]`: evaluate nothing
            return selected_splits(configured, [])
        return evaluation_default(self._known_splits(), self.train_splits)

    def _known_splits(self) -> list[str]:
        return list(dict.fromkeys([*self.datasets.keys(), *self.dataloaders.keys()]))

    def _resolve_splits(self, requested: str | Sequence[str] | None, default: list[str], kind: str) -> list[str]:
        """The `requested` splits (default: `default`); each must have a dataloader."""
        splits = selected_splits(requested, default)
        missing = [split for split in splits if split not in self.dataloaders]
        if missing:
            raise ValueError(f"{kind} split(s) {missing} have no dataloader; available: {list(self.dataloaders)}")
        return splits

    def train(
        self, train_splits: Sequence[str] | None = None, evaluate_splits: Sequence[str] | None = None
    ) -> RoundDict:
        """Train until the budget is spent: epoch mode when `epochs` is set, step mode otherwise.

        See [`Loop.train`][danling.runners.loop.loops.Loop.train] (dry runs, loss-spike rollback).

        Args:
            train_splits: Splits to train on; defaults to `self.train_splits`.
            evaluate_splits: Splits to evaluate; defaults to `self.evaluate_splits`.

        Returns:
            All result rows (`self.results`).

        Raises:
            ValueError: A requested split has no dataloader, there is no training split, or the
                budget or data would train nothing
                (see [`Loop.check_training_budget`][danling.runners.loop.loops.Loop.check_training_budget]).
            TrainingDivergedError: Non-finite updates or loss spikes came too often (`nonfinite.*`, `spikes.*`).
        """
        return self.loop.train(train_splits, evaluate_splits)

    def train_epochs(
        self, train_splits: Sequence[str] | None = None, evaluate_splits: Sequence[str] | None = None
    ) -> RoundDict:
        """Run epochs from `train_state.epoch` up to `epochs`.

        See [`Loop.train_epochs`][danling.runners.loop.loops.Loop.train_epochs] for what each epoch does.

        Raises:
            ValueError: `epochs` is not configured.
        """
        return self.loop.train_epochs(train_splits, evaluate_splits)

    def train_epoch(self, split: str = "train") -> RoundDict:
        """One full pass over `self.dataloaders[split]` in training mode; returns the split's result.

        Called when: by `train_epochs`, once per train split and epoch (and by user code).
        Holds on entry: inside the training loop's run scope; `train_state.epoch` is the epoch under way.
        Side effects: runs `train_step` on every batch (updates, counters, the loop position).
        Overrides must not: skip `super()` (the pass, its position and its metrics live there).
        """
        return self.loop.train_epoch(split)

    def train_steps(
        self, train_splits: Sequence[str] | None = None, evaluate_splits: Sequence[str] | None = None
    ) -> RoundDict:
        """Train until `train_state.global_step` reaches `steps`, evaluating along the way and at the end
        (see [`Loop.train_steps`][danling.runners.loop.loops.Loop.train_steps]).

        Raises:
            ValueError: No step budget can be resolved.
            RuntimeError: A full round over the train splits applied no optimizer step.
        """
        return self.loop.train_steps(train_splits, evaluate_splits)

    def evaluate(self, evaluate_splits: Sequence[str] | None = None) -> RoundDict:
        """Evaluate each split once and return `{split: result}`; the row is also sent to the trackers.

        Raises:
            ValueError: A requested split has no dataloader, or there is nothing to evaluate.
        """
        return self.loop.evaluate(evaluate_splits)

    def evaluate_epoch(self, split: str = "val") -> RoundDict:
        """One full pass over `self.dataloaders[split]` in evaluation mode; returns the split's result.

        Called when: by `evaluate` and by each round's evaluation (whole splits), once per evaluation split.
        Holds on entry: the model is materialized; no training pass is open on this split.
        Side effects: runs `evaluate_step` on every batch, inside `inference_context()`.
        Overrides must not: change weights or `train_state` (evaluation must not alter training).
        """
        return self.loop.evaluate_epoch(split)

    def evaluate_steps(self, split: str = "val", steps: int | None = None) -> RoundDict:
        """Evaluate the first `steps` batches of `split` (default `max(self.steps // 20, 1)`).

        Raises:
            ValueError: `steps` is negative, cannot be inferred, or the loader runs out first.
        """
        return self.loop.evaluate_steps(split, steps)

    def infer(
        self,
        split: str = "infer",
        *,
        steps: int | None = None,
        stream: bool | None = None,
        output: str | os.PathLike[str] | None = None,
        resume: bool | None = None,
    ) -> list[Any] | Iterator[list[Any]] | Path:
        """Predict on `split`: a flat list of outputs, an iterator of per-batch lists, or a file.

        See [`Loop.infer`][danling.runners.loop.loops.Loop.infer] for the arguments and the
        Inference guide for `output` files (streamed, resumable, merged across ranks).
        """
        return self.loop.infer(split, steps=steps, stream=stream, output=output, resume=resume)

    def log_values(self, values: Mapping[str, Any], step: int | None = None) -> None:
        """Send `values` to the trackers (every `LOG` subscriber) at `step` (default: the global step)."""
        step = self.train_state.global_step if step is None else step
        self.events.emit(Events.LOG, LogContext(self, values, step))

    def prepare_for_shutdown_checkpoint(self) -> None:
        """Bring the state to a consistent point before the shutdown checkpoint is written.

        Called when: once, by the loops' graceful stop (a signal or `supervisor.request_stop()`), on
            every rank, right before the `shutdown` checkpoint of a training loop is saved.
        Holds on entry: the loop stands at an accumulation-window boundary or at the end of a
            pass; evaluation's inference context has been left.
        Side effects: the default applies a window the pass left open, so the checkpoint never
            holds gradients that were computed but not applied.
        Overrides must not: save checkpoints, step the loops or skip `super()` (an open window
            would then be lost on resume).
        """
        self._close_window()

    def _stop_requested(self) -> bool:
        """Whether to stop after this batch (agreed across ranks while training); asked after every batch."""
        return self.loop.passes.stop_requested()

    def _shutdown(self) -> NoReturn:
        """Save a `shutdown` checkpoint (when training), close the runner and exit (see `PassEngine.shutdown`)."""
        self.loop.passes.shutdown()

    @property
    def _loop_depth(self) -> int:
        return self.loop.passes.loop_depth

    @property
    def _step_window(self) -> Any:
        return self.loop.passes.step_window

    # ==== checkpoint surface: thin delegations to the checkpoint component ====
    # (keep this marker; add this component's public names right below it)
    # The class of `self.checkpointing`; backends name their subclass (the hooks are `CheckpointHooks`).
    checkpointing_class: type[RunnerCheckpointing] = RunnerCheckpointing

    def _build_checkpointing(self) -> RunnerCheckpointing:
        """The checkpointing component, built in step 2 of construction (the manager is read from the runner)."""
        return self.checkpointing_class(
            self,
            config=self.config,
            state=self.state,
            loop_state=self.loop_state,
            bookkeeping=self.bookkeeping,
            workspace=self.workspace,
            events=self.events,
        )

    def _continue_pass_meters(self, split: str) -> None:
        """Put back the meters and train metrics of the interrupted `split` pass (after the pass reset them)."""
        if self.checkpointing.continue_pass_meters(split, getattr(self, "device", None)):
            # The step logs average the steps since the previous log: the restored ones are not new.
            self._step_window.mark_read(self.meters)

    def _save_failed(self, error: CheckpointSaveError) -> None:
        """A save failed (an asynchronous one is reported at the next optimizer step): see `checkpoint_save_failed`."""
        return self.checkpointing.save_failed(error)

    # ==== results surface: thin delegations to the results component ====
    # (keep this marker; add this component's public names right below it)
    @property
    def results(self) -> RoundDict:
        """The result rows: row index (epoch index, or global step in step mode) to `{split: metrics}`."""
        return self.bookkeeping.rows

    @results.setter
    def results(self, rows: RoundDict) -> None:
        self.bookkeeping.rows = rows

    @property
    def score_split(self) -> str | None:
        """Split whose metric picks the best row; None when there is none to select on.

        `config.score_split` when set, else a validation split chosen from the rows; see
        [`RunnerResults.score_split`][danling.runners.services.results.RunnerResults.score_split].
        """
        return self.bookkeeping.score_split

    @property
    def scores(self) -> FlatDict | None:
        """Row index to score, for rows that carry the score metric; `None` when no score split resolves."""
        return self.bookkeeping.scores

    @property
    def best_index(self) -> int:
        """Index of the best row (the latest one on ties); 0 when nothing is scored yet."""
        return self.bookkeeping.best_index

    @property
    def best_result(self) -> RoundDict | None:
        """Copy of the best row with its `index` added, or `None` when nothing is scored."""
        return self.bookkeeping.best_result

    @property
    def best_score(self) -> float | None:
        """Best score seen so far, or `None` when nothing is scored."""
        return self.bookkeeping.best_score

    @property
    def latest_result(self) -> RoundDict | None:
        """Copy of the newest row with its `index` added, or `None` before the first row."""
        return self.bookkeeping.latest_result

    @property
    def latest_score(self) -> float | None:
        """Score of the newest row, or `None` when it has no score."""
        return self.bookkeeping.latest_score

    @property
    def is_best(self) -> bool:
        """Whether the newest row is the best one (ties go to the latest row).

        See [`RunnerResults.is_best`][danling.runners.services.results.RunnerResults.is_best].
        """
        return self.bookkeeping.is_best

    @property
    def patience(self) -> int | float:
        """Evaluations without improvement tolerated before early stop (`config.patience`, default inf)."""
        return self.bookkeeping.patience

    def _append_result(self, result: Mapping[str, Any], index: int | None = None) -> None:
        """Store `result` as the row at `index` (default: the global step in step mode, else the epoch)
        and remember which training state it scored (`best` may only go to a checkpoint of that state)."""
        self.bookkeeping.append(result, self._row_index() if index is None else index)
        self.checkpointing.mark_scored()

    def _save_result(self) -> None:
        """Send the newest row to the trackers (every process, at the global step) and, on the main
        process, write the result files of the run directory (see `RunnerResults.write_files`)."""
        book = self.bookkeeping
        if not book.rows:
            return
        index = next(reversed(book.rows))
        row = book.plain_row(index)
        # Trackers share one x-axis, the global step: step logs already use it and W&B drops any
        # log whose step is lower than one it has seen, which epoch indices always are.
        self.log_values(row if self.is_step_mode else {**row, "epoch": index})
        if self.is_main_process:
            header = {"id": self.workspace.id, "timestamp": self.timestamp}
            book.write_files(self.workspace.path, header, restored=self._results_restored)
            self._results_restored = False

    def _check_selection(self, evaluate_splits: list[str]) -> None:
        """Before training: refuse a `patience` that cannot act; warn when no best checkpoint is selected."""
        self.bookkeeping.check_selection(
            evaluate_splits, evaluate_interval=self.evaluate_interval if self.is_step_mode else None
        )

    def _row_index(self) -> int:
        """Row index for the current progress: the global step in step mode, else the epoch."""
        return self.train_state.global_step if self.is_step_mode else self.train_state.epoch

    # ==== cluster surface: Slurm preemption and requeue (services/preemption.py) ====
    def _init_cluster(self) -> None:
        """Bind `preemption` (inert outside Slurm): `slurm.signal` stops the run like SIGTERM, then may requeue."""
        slurm = self.config.slurm
        job = SlurmJob.from_environ()
        self.preemption = SlurmPreemption(
            slurm.signal, requeue=slurm.requeue, job=job, is_main_process=self.is_main_process, logger=self.logger
        ).attach(self.events)
        self.supervisor.add_stop_signals(self.preemption.stop_signals(), repeatable=True)

    # ==== observability surface: thin delegations to the observability component ====
    # (keep this marker; add this component's public names right below it)
    def init_garbage_collection(self) -> None:
        """Pace Python's garbage collector by global steps when `gc.interval` is set.

        Called when: once during construction, after `init_fault_tolerance` (step 3).
        Holds on entry: config, workspace and the default supervisor (no GC pacing) are bound.
        Side effects: with `gc.interval`, replaces `supervisor` by one that collects every
            `gc.interval` global steps (and, with `gc.disable_automatic`, turns automatic GC off until `close`).
        Overrides must not: drop the supervisor (signals and heartbeats go through it).
        """
        interval = self.config.gc.interval
        if interval is not None:
            self.supervisor = self._build_supervisor(gc_interval=interval)

    def init_heartbeat(self) -> None:
        """Point the supervisor at `<run dir>/<heartbeat.dir_name>` when `heartbeat.enabled`.

        Called when: once during construction, last of step 5 (after `init_signal_handlers`).
        Holds on entry: workspace, supervisor, event bus and logging are set up; no model yet.
        Side effects: with `heartbeat.enabled`, writes `heartbeat-rank{rank}.json` now and at most
            every `heartbeat.interval_seconds` after each step.
        Overrides must not: beat from a thread of their own (the file says the loop advances).
        """
        heartbeat = self.config.heartbeat
        if heartbeat.enabled:
            self.supervisor.heartbeat_dir = self.workspace.heartbeat_dir
            self.supervisor.heartbeat_interval = heartbeat.interval_seconds
            self.supervisor.beat(self.train_state.global_step, self.train_state.epoch, "init", force=True)
            self.events.subscribe(Events.STEP_END, self._beat)

    def init_signal_handlers(self) -> None:
        """Turn SIGTERM/SIGINT into a graceful stop request.

        Called when: once during construction, in step 5 after the trackers.
        Holds on entry: the supervisor is bound.
        Side effects: installs process-wide handlers; the loops poll the request after every step,
            then save a `shutdown` checkpoint, close the runner and exit with 128 + the signal
            number. `close` restores the previous handlers.
        Overrides must not: install handlers that `close` cannot restore.
        """
        self.supervisor.install_signal_handlers()

    def init_tensorboard(self, *args: Any, **kwargs: Any) -> None:
        """Send every logged value to TensorBoard under `<run dir>/tensorboard` (main process only).

        Called when: once during construction, first of the trackers, when `config.tensorboard` is set.
        Holds on entry: the workspace and logging are set up; `self.trackers` may be empty.
        Side effects: appends a [`TensorBoardTracker`][danling.runners.services.trackers.TensorBoardTracker]
            (`log_dir` and other arguments go to it) to `self.trackers`.
        Overrides must not: append on other ranks than the main process (every rank would write).
        """
        if self.is_main_process:
            self.trackers.append(tensorboard_tracker(self._tracker_setup(), *args, **kwargs))

    def init_wandb(self, *args: Any, **kwargs: Any) -> None:
        """Send every logged value to a W&B run (main process only).

        Called when: once during construction, after TensorBoard, when `wandb.enabled` is set.
        Holds on entry: the workspace and logging are set up.
        Side effects: appends a [`WandbTracker`][danling.runners.services.trackers.WandbTracker]; project,
            group and name default to the lineage, experiment and run id, `wandb.*` keys and keyword
            arguments override them, and the W&B run id is kept in `<run dir>/wandb-run-id` so a run
            resumed in its directory continues the same W&B run.
        Overrides must not: start W&B on other ranks than the main process.
        """
        if self.is_main_process:
            self.trackers.append(wandb_tracker(self._tracker_setup(), *args, **kwargs))

    def _tracker_setup(self) -> TrackerSetup:
        return TrackerSetup(self.config, self.workspace)

    def _init_logging(self) -> None:
        """Attach the run's logger: console on the main process, plus `run.log` when `config.log` is set."""
        self.logger = self.workspace.setup_logging()
        # an error ending the script: one line on stderr, its traceback in the run log (DANLING_DEBUG prints it)
        keeps_log = self.config.log or not self.is_main_process
        report_errors_briefly(self.workspace.log_file if keeps_log else None)
        self.supervisor.logger = self.logger
        self.checkpoint_manager.logger = self.logger
        self.bookkeeping.logger = self.logger
        if self.is_main_process and sys.stdout.isatty():
            ProgressBar().attach(self.events)

    def _init_trackers(self) -> None:
        """Build the registered trackers the config enables, in registration order (main process only);
        `tensorboard` and `wandb` go through their hooks. Also keeps `<run dir>/status.json` current."""
        hooks = {"tensorboard": self.init_tensorboard, "wandb": self.init_wandb}
        for name, entry in list(TRACKERS.items()):
            if not entry.enabled(self.config):
                continue
            if name in hooks:
                hooks[name]()
            elif self.is_main_process:
                self.trackers.append(entry.build(self._tracker_setup()))
        self.events.subscribe(Events.CHECKPOINT_LOADED, self._resume_trackers)
        self.events.subscribe(Events.CHECKPOINT_LOADED, self._rewrite_result_files)
        if self.is_main_process:
            progress = lambda: (self.train_state.global_step, self.train_state.epoch)  # noqa: E731
            RunStatus(self.workspace.path / "status.json", progress).attach(self.events)

    def _beat(self, context: StepContext) -> None:
        self.supervisor.beat(context.global_step, self.train_state.epoch, context.split)

    def _forward_to_trackers(self, context: LogContext) -> None:
        if len(self.trackers):
            values = dict(context.values)
            if is_train_step_log(values):
                container = getattr(getattr(self, "update", None), "container", None)
                batch = self.config.dataloader.batch_size
                values.update(
                    self.throughput.rates(
                        context.step,
                        optimizer=self.optimizer,
                        grad_norm=getattr(container, "last_grad_norm", None),
                        samples_per_step=batch * self.accum_steps if batch else None,
                    )
                )
            self.trackers.log(values, step=context.step)

    def _resume_trackers(self, context: Any) -> None:
        # The curves continue from the checkpoint's step: later points of the earlier run are dropped.
        # A checkpoint of another run directory (from_checkpoint, a resume from elsewhere: this run
        # writes a new version) brought no curves here, so nothing is trimmed and points at its step
        # (an evaluate() right after the restore) are new, not repeats to leave out.
        source = None
        with suppress(CheckpointNotFoundError):  # an in-memory payload (`<dict>`) names no file
            # an alias path (<run>/checkpoints/latest) gives its pointer file; a bare alias stays a name
            source = Path(os.path.expanduser(os.fspath(resolve_resume_path(context.path))))
        run_dir = self.workspace.path.resolve()
        if source is not None and source.exists() and not source.resolve().is_relative_to(run_dir):
            return
        # At that step itself only the names of the restored row are taken (the earlier run logged it):
        # a split evaluated for the first time after the resume (`evaluate(["test"])`) is still recorded.
        book, recorded = self.bookkeeping, set()
        if book.rows:
            index = next(reversed(book.rows))
            row = book.plain_row(index)
            recorded = set(flatten_result(row if self.is_step_mode else {**row, "epoch": index}))
        self.trackers.resume_at(self.train_state.global_step, recorded)

    def _rewrite_result_files(self, context: Any) -> None:
        # The next row written rewrites every result file from the restored rows: resumed from an older
        # checkpoint, the run must not keep results.json and best.json of the continuation it abandoned.
        # Not before that row: a run resumed only to evaluate (a scoring job on `best`) changes nothing.
        self._results_restored = True

    # ==== diagnosis surface: stragglers, consistency and replay plug-ins (runner.diagnosis) ====
    # (keep this marker; add this component's names right below it)
    def _build_diagnosis(self) -> Diagnosis:
        """The plug-ins `stragglers.*`, `consistency.*`, `oom.*` and `replay.*` turn on, subscribed (none: no cost)."""
        config = self.config
        diagnosis = Diagnosis()
        if config.stragglers.enabled or config.consistency.interval is not None or config.oom.policy is not None:
            diagnosis = self._build_watchers()
        recorder = ReplayRecorder(config.replay, self._replay_setup())  # refuses bad `replay.*` values when off too
        if recorder.active:
            recorder.attach(self.events)
            diagnosis.replay = recorder
        return diagnosis

    def _replay_setup(self) -> ReplaySetup:
        def state() -> dict[str, Any]:
            optimizer, scheduler = self.optimizer, self.scheduler
            return {
                "model": self.unwrap(self.model).state_dict(),
                "optimizer": None if optimizer is None else optimizer.state_dict(),
                "scheduler": None if scheduler is None else scheduler.state_dict(),
            }

        return ReplaySetup(
            events=self.events,
            pending=lambda: self.update.pending,
            state=state,
            describe=lambda: describe_runner(type(self), self.config.dict(), self.code_id),
            directory=lambda: self.workspace.path,
            rank=self.rank,
            world_size=self.world_size,
            logger=self.logger,
        )

    def _build_watchers(self) -> Diagnosis:
        config = self.config
        setup = DiagnosisSetup(
            events=self.events,
            supervisor=self.supervisor,
            update=self.update,
            tensors=self.replicated_tensors,
            replicas=self.topology.ranks("replicate"),
            replica_group=self.topology.group("replicate"),
            rank=self.rank,
            world_size=self.world_size,
            global_step=lambda: self.train_state.global_step,
            logger=self.logger,
            world_group=self.topology.group("world"),
        )
        diagnosis = build_diagnosis(config.stragglers, config.consistency, setup)
        diagnosis.oom = build_oom_guard(config.oom, setup)
        if diagnosis.oom is not None:  # every training step of every pass runs under the guard
            self.loop.passes.step_guard = diagnosis.oom.guarded
        return diagnosis

    def replicated_tensors(self) -> Iterator[tuple[str, Any]]:
        """The `(name, tensor)` pairs every replica must hold identically, for the consistency sentinel.

        Called when: by the consistency sentinel (`consistency.interval`), at each check, on every rank.
        Holds on entry: the model (and optimizer) are built; no pass is between a forward and its update.
        Side effects: none; yields the model's parameters (`model.<name>`) and, with
            `consistency.optimizer_state`, the optimizer state (`optimizer.<name>.<key>`).
        Overrides must not: yield tensors that legitimately differ between replicas (a partitioned
            optimizer state, BatchNorm statistics) or yield them in a rank-dependent order.

        Examples:
            A backend that partitions its optimizer state compares the parameters only:

            >>> from danling.runners.diagnosis import replica_tensors
            >>> class ShardedStateRunner(BaseRunner):
            ...     def replicated_tensors(self):
            ...         return replica_tensors(self.unwrap(self.model))
        """
        optimizer = self.optimizer if self.config.consistency.optimizer_state else None
        return replica_tensors(self.unwrap(self.model), optimizer)

    def __enter__(self) -> BaseRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        workspace = self.__dict__.get("workspace")
        where = os.fspath(workspace.path) if workspace is not None else None
        return f"{type(self).__name__}(stack={self.config.get('stack')!r}, dir={where!r})"
