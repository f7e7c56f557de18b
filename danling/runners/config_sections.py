"""The typed sections of [`RunnerConfig`][danling.runners.config.RunnerConfig], one class per component.

Each section declares its keys as annotated class attributes, with their defaults; values from
files or the command line are converted to the declared types. A section rejects keys it does
not declare unless it is open (`optim`, `scheduler`); see `RunnerConfig` for the checks.
"""

from typing import Any

from chanfig import Config
from chanfig.utils import get_cached_annotations

from danling.data import LOADER_OPTIONS, resolve_loader_options

__all__ = [
    "OptimConfig",
    "SchedulerConfig",
    "CheckpointConfig",
    "DataloaderConfig",
    "WandbConfig",
    "CSVConfig",
    "MLflowConfig",
    "FaultToleranceConfig",
    "ParallelAxesConfig",
    "ParallelConfig",
    "FsdpConfig",
    "CompileConfig",
    "CommConfig",
    "GcConfig",
    "ProfilingConfig",
    "EmaConfig",
    "HeartbeatConfig",
]


class _TypedConfig(Config):
    """Config whose subclasses inherit their parents' annotations.

    chanfig converts and checks values against the annotations of the instance's own class
    only; merging the inherited ones here keeps `epochs: int | None` honoured in user subclasses.

    A section rejects keys it does not declare (`STRICT`), so a typo such as
    `checkpoint.intervall` fails validation instead of being ignored; `EXTRA_KEYS` are accepted
    too, and with `NAMED_SUBSECTIONS` an undeclared mapping is a named override section.
    (Plain class attributes, not annotations: annotated names would become config keys.)
    """

    STRICT = True
    EXTRA_KEYS = frozenset()
    NAMED_SUBSECTIONS = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        merged: dict[str, Any] = {}
        for klass in reversed(cls.__mro__[1:]):
            if issubclass(klass, _TypedConfig):
                merged.update(get_cached_annotations(klass))
        merged.update(cls.__dict__.get("__annotations__", {}))
        cls.__annotations__ = merged


class OptimConfig(_TypedConfig):
    """Optimizer section (`optim.*`); an optimizer is configured once `optim.type` is set.

    Open: every other key is an option of the optimizer (`optim.lr`, `optim.weight_decay`, ...).

    Attributes:
        param_groups: Optional regex-selected parameter groups (`pattern` plus group options).
    """

    STRICT = False
    param_groups: list[dict] | None = None


class SchedulerConfig(_TypedConfig):
    """Learning-rate scheduler section (`scheduler.*`); a scheduler is configured once `type` is set.

    Open: every other key is an option of the scheduler.

    Attributes:
        interval: `"step"`, `"epoch"` or `"validation"`; None picks by scheduler kind.
        monitor: Dotted metric path for metric-driven schedulers (e.g. `"val.loss"`).
    """

    STRICT = False
    interval: str | None = None
    monitor: str | None = None


class CheckpointConfig(_TypedConfig):
    """Checkpoint section (`checkpoint.*`). Keys and defaults follow the reference table."""

    dir_name: str = "checkpoints"
    backend: str = "auto"
    interval: int | None = None
    keep_latest_k: int = 0
    save_top_k: int | None = None
    load_only: bool = False
    async_enabled: bool = True
    async_mode: str | None = None
    dedicated_async_process_group: bool = True
    async_process_group_backend: str = "gloo"
    wait_timeout: float | None = 600.0
    enable_ft_dataloader_checkpoints: bool = False
    ft_replica_id: str | None = None
    ft_dataloader_checkpoint_prefix: str = "ft-replica"
    exclude_from_loading: list[str] | str | None = []
    last_save_model_only: bool = False
    export_dtype: str | None = None
    trust_pickle: bool = False
    continue_on_save_error: bool = False


class DataloaderConfig(_TypedConfig):
    """Dataloader defaults (`dataloader.*`); a mapping under a split name overrides them for that split.

    `dataloader.train.shuffle=False` changes only the `train` loader. Use
    `kwargs` to get the merged arguments. Besides the declared keys, every option the loader
    builder passes on (`danling.data.LOADER_OPTIONS`, e.g. `timeout`) is accepted.
    """

    EXTRA_KEYS = LOADER_OPTIONS
    NAMED_SUBSECTIONS = True

    batch_size: int | None = None
    shuffle: bool | None = None
    drop_last: bool | None = None
    num_workers: int = 0
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    pin_memory: bool = False
    in_order: bool = True
    snapshot_every_n_steps: int | None = 1

    def kwargs(self, split: str, *, train: bool) -> dict[str, Any]:
        """Dataloader keyword arguments for one split: defaults, then the split's overrides.

        Unset `shuffle`/`drop_last` follow `train`; keys left as None are dropped so the
        dataloader's own defaults apply.

        Examples:
            >>> from danling.runners import RunnerConfig
            >>> loader = RunnerConfig(**{"dataloader.batch_size": 8, "dataloader.val.batch_size": 32}).dataloader
            >>> loader.kwargs("train", train=True)["batch_size"], loader.kwargs("train", train=True)["shuffle"]
            (8, True)
            >>> loader.kwargs("val", train=False)["batch_size"], loader.kwargs("val", train=False)["drop_last"]
            (32, False)
        """
        # One merge rule for the config and the loader builder: danling.data owns it.
        return resolve_loader_options(self, split, is_train=train)


class WandbConfig(_TypedConfig):
    """Weights & Biases section (`wandb.*`); unset names fall back to lineage/experiment/run id."""

    enabled: bool = False
    project: str | None = None
    entity: str | None = None
    group: str | None = None
    name: str | None = None
    job_type: str | None = None
    tags: list[str] | str | None = None
    dir: str | None = None
    mode: str | None = None


class CSVConfig(_TypedConfig):
    """`metrics.csv` section (`csv.*`): every logged value, one row per step, in the run directory.

    Attributes:
        enabled: Write the file (on by default; it costs a buffered write per log step).
        file_name: File name, relative to the run directory (or an absolute path).
        flush_seconds: Longest time rows may sit in the write buffer.
    """

    enabled: bool = True
    file_name: str = "metrics.csv"
    flush_seconds: float = 5.0


class MLflowConfig(_TypedConfig):
    """MLflow section (`mlflow.*`); needs the `mlflow` extra.

    Attributes:
        enabled: Record the run in MLflow.
        tracking_uri: Where to record it; None uses a file store at `<run dir>/mlruns`.
        experiment: MLflow experiment name; None uses the lineage.
        run_name: MLflow run name; None uses `<experiment>-<run id>`.
    """

    enabled: bool = False
    tracking_uri: str | None = None
    experiment: str | None = None
    run_name: str | None = None


class FaultToleranceConfig(_TypedConfig):
    """TorchFT section (`ft.*`)."""

    enabled: bool = False
    process_group: str = "gloo"
    process_group_timeout_ms: int = 10000
    replica_id: int = 0
    group_size: int = 1
    min_replica_size: int = 1


class ParallelAxesConfig(_TypedConfig):
    """Parallel degrees (`parallel.axes.*`); one axis may be -1 to absorb the rest of the world size."""

    replicate: int = 1
    shard: int = 1
    context: int = 1
    pipeline: int = 1
    tensor: int = 1
    expert: int = 1
    expert_tensor: int = 1


class ParallelConfig(_TypedConfig):
    """Parallel layout, tensor-parallel plan, activation checkpointing and pipeline schedule (`parallel.*`).

    Attributes:
        axes: Degree of each parallel axis.
        tensor_plan: Module-name pattern (`*` matches one name level) to tensor-parallel style
            (`colwise`, `rowwise`, `sequence`), for models without a `parallelize(parallel)` method.
        activation_checkpointing: `none`, `block` (recompute each block in backward) or
            `selective` (keep matrix products, recompute the cheap ops of each block).
        pipeline_schedule: Schedule class name of `torch.distributed.pipelining`.
        pipeline_microbatch_size: Microbatch size, when `pipeline_n_microbatches` is not set.
        pipeline_n_microbatches: Microbatches per batch.
        module_fqns_per_model_part: Module names of each pipeline stage, in order.
    """

    axes: ParallelAxesConfig = ParallelAxesConfig()
    tensor_plan: dict | None = None
    activation_checkpointing: str = "none"
    pipeline_schedule: str = "1F1B"
    pipeline_microbatch_size: int = 1
    pipeline_n_microbatches: int | None = None
    module_fqns_per_model_part: list[list[str]] | None = None


class FsdpConfig(_TypedConfig):
    """FSDP2 section (`fsdp.*`).

    Attributes:
        enabled: Shard parameters, gradients and optimizer state with `fully_shard`.
        modules: Module-name patterns (`fnmatch`) sharded as their own units; by default every
            member of an `nn.ModuleList` (the blocks of most models), then the root.
        reshard_after_forward: Free the gathered parameters after forward (`None`: FSDP2's default).
        mp_policy: Mixed-precision policy: `None`/`True` follows `precision`, `False` keeps fp32.
        offload_policy: Keep sharded parameters and optimizer state in CPU memory.
    """

    enabled: bool = False
    modules: list[str] | None = None
    reshard_after_forward: bool | int | None = None
    mp_policy: bool | int | None = None
    offload_policy: bool | int | None = None


class CompileConfig(_TypedConfig):
    """`torch.compile` section (`compile.*`); None leaves torch's own default in place."""

    enable: bool = False
    backend: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    mode: str | None = None
    options: dict | None = None
    optimize_ddp: str | None = None
    precompile_artifact_dir: str | None = None
    memory_policy: str | None = None


class CommConfig(_TypedConfig):
    """Process-group timeouts (`comm.*`), in seconds."""

    init_timeout_seconds: int | None = None
    train_timeout_seconds: int | None = None


class GcConfig(_TypedConfig):
    """Runner-paced garbage collection (`gc.*`); disabled while `interval` is None."""

    interval: int | None = None
    generation: int = 1
    disable_automatic: bool = True


class ProfilingConfig(_TypedConfig):
    """Bounded `torch.profiler` tracing (`profiling.*`); `trace_dir` is relative to the run directory."""

    enabled: bool = False
    wait: int = 1
    warmup: int = 1
    active: int = 3
    repeat: int | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    trace_dir: str = "profiles"


class EmaConfig(_TypedConfig):
    """Exponential moving average of the model weights (`ema.*`).

    When `enabled`, the torch runner keeps an averaged copy of the model, updates it after every
    applied optimizer step and evaluates and infers with it.

    Attributes:
        enabled: Keep an EMA copy of the model.
        decay: Weight of the running average, in `[0, 1]`.
    """

    enabled: bool = False
    decay: float = 0.999


class HeartbeatConfig(_TypedConfig):
    """Per-rank heartbeat files (`heartbeat.*`) under `<run dir>/<dir_name>`."""

    enabled: bool = False
    interval_seconds: float = 60.0
    dir_name: str = "heartbeats"
