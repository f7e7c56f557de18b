"""`BaseRunner`: the backend-free runner core.

The class owns the construction lifecycle, process facts (rank, world size), seeding and the
services every backend shares (workspace, logging, trackers, checkpoint manager, supervisor).
Loops live in [`loops`][danling.runners.loop.loops], budgets and split selection in
[`progress`][danling.runners.loop.budget], result bookkeeping in [`results`][danling.runners.services.results]
and the checkpoint API in [`checkpointing`][danling.runners.checkpointing.api]; `BaseRunner` mixes
them together.
"""

from __future__ import annotations

import logging
import os
import random
import time
import warnings
from collections.abc import Mapping
from contextlib import suppress
from typing import Any

import numpy as np
from chanfig import FlatDict

from danling.checkpoint import CheckpointManager, FileCheckpointManager
from danling.distributed import Topology
from danling.metrics import AverageMeters
from danling.utils import RoundDict
from danling.utils.io import save as save_file

from .checkpointing import CheckpointMixin
from .config import RunnerConfig
from .loop import EventBus, Events, LoopMixin, LoopState, ProgressMixin
from .services import ObservabilityMixin, ResultsMixin, RunnerSupervisor, RunnerWorkspace, Trackers
from .services.errors import report_errors_briefly
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


class BaseRunner(CheckpointMixin, ResultsMixin, ObservabilityMixin, LoopMixin, ProgressMixin, metaclass=MetaRunner):
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
    5. `init_logging`, `init_trackers` (TensorBoard, W&B, CSV, MLflow as configured), stdout routing for
       non-main ranks, `init_signal_handlers`, `init_heartbeat`.
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
        results: One row per round (epoch index or global step) mapping split to metrics.
        meters: [`AverageMeters`][danling.metrics.AverageMeters] of the step losses of the split being run.
        checkpoint_manager: Where checkpoints are written and read.
        workspace: Run directory, logging and metadata.
        supervisor: Signal handling, heartbeat and GC pacing.
        trackers: TensorBoard / W&B fan-out (empty when neither is enabled).
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
        report_errors_briefly(None)  # an error ending the script is one line; init_logging names the run log
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
        self.init_logging()
        self.init_trackers()
        self.workspace.route_print()
        self.init_signal_handlers()
        self.init_heartbeat()

    def __post_init__(self) -> None:
        """Finish construction once the subclass `__init__` has returned.

        Offsets the seed by the data rank (`set_seed()`), subscribes `@on` handlers, builds the
        update strategy and writes the run metadata on the main process. The backend-free runner
        restores nothing: it cannot know what a checkpoint's components load into. Concrete
        runners build their model, optimizer and dataloaders, call `super().__post_init__()` and
        then restore what `config.resume` / `config.auto_resume` / `config.pretrained` ask for with
        [`auto_restore`][danling.runners.checkpointing.api.CheckpointMixin.auto_restore]
        (`TorchRunner` does); a `BaseRunner` subclass does the same in its own `__post_init__`,
        or calls `auto_restore()` after construction.
        """
        self.set_seed()  # the model is built: from here on ranks draw their own numbers (dropout, augmentations)
        self.events.subscribe_object(self)  # methods marked with @on(...)
        if "update" not in self.__dict__:
            self.update = self.build_update_strategy()
        self.loop_state.accumulator = self.update.accumulator
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
        from .runner import RUNNERS  # runner.py imports this module

        backends = {backend for name, backend in RUNNERS.items() if name != "auto" and isinstance(self, backend)}
        derived = [b for b in backends if not any(o is not b and issubclass(o, b) for o in backends)]
        if len(derived) != 1:
            return
        names = [name for name, backend in RUNNERS.items() if backend is derived[0] and name != "auto"]
        self.config.stack = "ddp" if "ddp" in names else names[0]

    def _bind_components(self) -> None:
        """Step 2 of construction: workspace, containers, checkpoint manager, supervisor."""
        self.workspace = RunnerWorkspace(self.config, rank=self.rank, world_size=self.world_size)
        self.logger = logging.getLogger(_FALLBACK_LOGGER)
        # Subclasses may fill these before calling super().__init__; keep what they set.
        if "datasets" not in self.__dict__:
            self.datasets = FlatDict()
        if "dataloaders" not in self.__dict__:
            self.dataloaders = FlatDict()
        self.results = RoundDict()
        self.events = EventBus()
        self.events.subscribe(Events.LOG, self._forward_to_trackers)
        self.loop_state = LoopState()
        self.meters = AverageMeters()
        self.trackers = Trackers()
        self.ft = None
        self.checkpoint_manager = self._build_file_checkpoint_manager()
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
        """Set up the process group.

        Called once during construction, before the checkpoint manager hook; the runner has its
        config, workspace and default checkpoint manager but no model yet. The default does
        nothing (a single process needs no group); backends initialise `torch.distributed` here.
        """

    def build_topology(self) -> Topology:
        """Who this rank is along each parallel axis, and the process group of each reduction domain.

        Called once during construction, right after `init_distributed`. The default is plain
        data parallelism ([`Topology.data_parallel`][danling.distributed.topology.Topology.data_parallel]):
        the data, metrics and gradient domains are the whole world, so every collective uses the
        default group. Samplers, loader sharding, the inference gather, metric reduction, the
        per-rank seed offset and per-rank checkpoint entries follow the `data` domain; gradient
        synchronisation follows the `gradient` domain. Backends with model parallelism return a
        topology built from their axes.
        """
        return Topology.data_parallel()

    def init_checkpoint_manager(self) -> None:
        """Swap in the checkpoint backend this runner needs.

        Called once during construction after `init_distributed`. The default keeps the
        `FileCheckpointManager` bound in step 2; backends call
        [`set_checkpoint_manager`][danling.runners.base_runner.BaseRunner.set_checkpoint_manager] to replace it.
        """

    def set_checkpoint_manager(self, manager: CheckpointManager) -> None:
        """Bind `manager`, closing the previous one without waiting."""
        if not isinstance(manager, CheckpointManager):
            raise TypeError(f"expected a CheckpointManager, got {type(manager).__name__}: {manager!r}")
        previous = self.__dict__.get("checkpoint_manager")
        self.checkpoint_manager = manager
        if previous is not None and previous is not manager:
            previous.close(timeout=0)

    def init_fault_tolerance(self) -> None:
        """Bind a fault-tolerance runtime to `self.ft`.

        The base runner has no fault-tolerance backend, so enabling `ft.enabled` here is an error;
        backends that support TorchFT override this hook.
        """
        if self.config.get("ft.enabled"):
            raise ValueError(
                f"ft.enabled=True but {type(self).__name__} has no fault-tolerance backend; "
                "use a runner stack that supports TorchFT or set ft.enabled=False"
            )

    # ------------------------------------------------------------------ randomness
    def set_seed(self, seed: int | None = None, bias: int | bool | None = None) -> int:
        """Seed Python's and NumPy's generators and snapshot the RNG state.

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
            self._seed_was_drawn = True  # a resumed checkpoint's seed replaces it (see load_state_dict)
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
        """Make backend kernels deterministic.

        Python and NumPy are deterministic once seeded, so the base runner has nothing to switch;
        backends override this to configure their libraries (cuDNN, deterministic algorithms).
        """

    # ------------------------------------------------------------------ misc
    def unwrap(self, model: Any) -> Any:
        """Return the plain model inside any backend wrapper; the base runner adds no wrapper."""
        return model

    def save(self, obj: Any, file: str | os.PathLike, main_process_only: bool = True, *args: Any, **kwargs: Any) -> Any:
        """Write `obj` with [`danling.utils.save`][danling.utils.save], on the main process only by default."""
        if main_process_only and not self.is_main_process:
            return file
        return save_file(obj, file, *args, **kwargs)

    def close(self, timeout: float | None = None) -> bool:
        """Release everything the runner holds; safe to call more than once.

        Waits for pending checkpoint writes (up to `timeout`, default `checkpoint.wait_timeout`)
        and result files, closes trackers, restores signal handlers, automatic GC and stdout, and
        closes the log files. A checkpoint write still running after `timeout` is left to finish
        in the background with a `RuntimeWarning`; calling `close()` again waits for it (and for
        anything else the first call could not close).

        Returns:
            `True` when no checkpoint write was left in flight.
        """
        if self.__dict__.get("_closed", True):
            return True
        first = not self.__dict__.get("_closing", False)
        self._closing = True
        drained = True
        manager = self.__dict__.get("checkpoint_manager")
        writer = self.__dict__.get("_results_writer")
        try:
            if manager is not None:
                drained = manager.close(timeout)
        finally:
            try:
                if writer is not None:
                    writer.close(timeout)
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

    # ==== loop surface: thin delegations to the loop component ====
    # (keep this marker; add this component's public names right below it)

    # ==== checkpoint surface: thin delegations to the checkpoint component ====
    # (keep this marker; add this component's public names right below it)

    # ==== results surface: thin delegations to the results component ====
    # (keep this marker; add this component's public names right below it)

    # ==== observability surface: thin delegations to the observability component ====
    # (keep this marker; add this component's public names right below it)

    def __enter__(self) -> BaseRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        workspace = self.__dict__.get("workspace")
        where = os.fspath(workspace.path) if workspace is not None else None
        return f"{type(self).__name__}(stack={self.config.get('stack')!r}, dir={where!r})"
