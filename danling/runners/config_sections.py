"""The typed sections of [`RunnerConfig`][danling.runners.config.RunnerConfig], one class per component.

Each section declares its keys as annotated class attributes, with their defaults, and describes
them in the `Attributes:` section of its docstring (which `--help` prints); values from files or
the command line are converted to the declared types. A section rejects keys it does not declare
unless it is open (`optim`, `scheduler`); see `RunnerConfig` for the checks.
"""

from typing import Any

from danling.data import LOADER_OPTIONS, resolve_loader_options

from ._config_base import _TypedConfig

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
    "ScoreConfig",
    "TelemetryConfig",
    "Fp8Config",
]


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
    """Checkpoint section (`checkpoint.*`). Keys and defaults follow the reference table.

    Attributes:
        dir_name: Checkpoint directory, relative to the run directory.
        backend: `auto`, `file` (one torch file), `dcp` (sharded torch.distributed.checkpoint) or `deepspeed`.
        interval: Epochs (steps in step mode) between periodic checkpoints; None: every epoch, or a tenth of `steps`.
        keep_latest_k: Keep only the k newest periodic checkpoints; 0 keeps them all.
        save_top_k: Also keep the k best checkpoints by the monitored score (None or 0: off).
        load_only: Never save; checkpoints are only read (resume, pretrained).
        async_enabled: Write checkpoints in the background while training goes on.
        async_mode: `disabled`, `async` or `async_with_pinned_mem`; None follows `async_enabled`.
        dedicated_async_process_group: Give background saves their own process group.
        async_process_group_backend: Backend of that process group (`gloo` or `nccl`).
        wait_timeout: Seconds to wait for a pending background save; None waits forever.
        enable_ft_dataloader_checkpoints: Per-replica dataloader checkpoints for TorchFT (`ft.enabled`): each
            replica group saves its own data position (DCP) after every update and resumes it when it
            recovers from a peer; binds a `TorchFTCheckpointManager`.
        ft_replica_id: Replica id in the name of those checkpoints; None: `$FT_REPLICA_ID`, else `ft.replica_id`.
        ft_dataloader_checkpoint_prefix: Their directory is `<prefix>-<replica id>`, beside `dir_name`.
        exclude_from_loading: State parts not restored on resume (`optimizer`, `scheduler`, `dataloaders`, ...,
            or a dotted key inside one); a name that is no part of a checkpoint is refused.
        last_save_model_only: Make the final checkpoint hold the model weights only.
        export_dtype: Cast the weights of a model-only final checkpoint to this dtype.
        trust_pickle: Load checkpoints with the full unpickler (only for files you trust).
        continue_on_save_error: Log a failed save (ERROR) and retry at the next one instead of stopping the run; a
            run whose last save failed still ends with an error and `failed` in status.json.
        unverifiable: What `auto_resume` does when no checkpoint of the run verifies: `new-version` starts
            from scratch in a new version of the run directory (the old checkpoints stay untouched), `stop`
            refuses to start and names them with the reasons.
        checksum: Integrity checksum recorded for every checkpoint file: `xxh3_128` (fast, against torn
            writes) or `sha256` (cryptographic); either verifies on load, whatever a checkpoint recorded.
    """

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
    unverifiable: str = "new-version"
    checksum: str = "xxh3_128"


class DataloaderConfig(_TypedConfig):
    """Dataloader defaults (`dataloader.*`); a mapping under a split name overrides them for that split.

    `dataloader.train.shuffle=False` changes only the `train` loader. Use
    `kwargs` to get the merged arguments. Besides the declared keys, every option the loader
    builder passes on (`danling.data.LOADER_OPTIONS`, e.g. `timeout`) is accepted.

    Attributes:
        batch_size: Samples per batch; None keeps the loader's default of 1.
        shuffle: Shuffle each epoch; None shuffles training splits only.
        drop_last: Drop the last incomplete batch; None drops it for training splits only.
        num_workers: Worker processes loading batches; 0 loads in the main process.
        persistent_workers: Keep workers alive between epochs.
        prefetch_factor: Batches each worker loads ahead; None keeps torch's default.
        pin_memory: Copy batches into pinned memory for faster transfer to the GPU.
        in_order: Yield batches in sampler order even when workers finish out of order.
        snapshot_every_n_steps: Steps between snapshots of the loader state used to resume mid-epoch.
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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # `dataloader.<split>` sections take the same keys, typed the same way
        super().__init__(*args, default_factory=DataloaderSplitConfig, **kwargs)

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


class DataloaderSplitConfig(_TypedConfig):
    """Overrides of one split's loader (`dataloader.<split>.*`): the keys of `DataloaderConfig`, none set by default."""

    EXTRA_KEYS = LOADER_OPTIONS
    __annotations__ = {key: value for key, value in DataloaderConfig.__annotations__.items()}


class WandbConfig(_TypedConfig):
    """Weights & Biases section (`wandb.*`); unset names fall back to lineage/experiment/run id.

    Attributes:
        enabled: Log the run to Weights & Biases (needs the `wandb` package).
        project: W&B project; None uses the lineage.
        entity: W&B user or team; None uses your default entity.
        group: Run group; None uses the experiment.
        name: Run name; None uses the run id.
        job_type: Job type shown in the W&B UI.
        tags: Tags of the run.
        dir: Directory of W&B's local files; None uses the run directory.
        mode: `online`, `offline` or `disabled`; None uses W&B's default.
    """

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
    """TorchFT replica groups (`ft.*`; see docs/fault-tolerance.md). Needs `torchft` and a lighthouse.

    Attributes:
        enabled: Run as one replica group of a TorchFT job (the lighthouse address comes from
            `$TORCHFT_LIGHTHOUSE`).
        process_group: Backend of the process group between the replica groups (`gloo` or `nccl`).
        process_group_timeout_ms: Timeout of that group's collectives and of TorchFT's calls, in milliseconds.
        replica_id: Id of this replica group, in `[0, group_size)`; it also picks the group's data shards.
        group_size: Number of replica groups the data is sharded over.
        min_replica_size: Fewest live replica groups an update needs; with fewer, training waits.
    """

    enabled: bool = False
    process_group: str = "gloo"
    process_group_timeout_ms: int = 10000
    replica_id: int = 0
    group_size: int = 1
    min_replica_size: int = 1


class ParallelAxesConfig(_TypedConfig):
    """Parallel degrees (`parallel.axes.*`); one axis may be -1 to absorb the rest of the world size.

    Attributes:
        replicate: Data-parallel replicas (DDP-style, full copies).
        shard: Data-parallel shards (FSDP2).
        context: Context (sequence) parallel degree.
        pipeline: Pipeline stages.
        tensor: Tensor-parallel degree.
        expert: Expert-parallel degree: the experts of a mixture-of-experts model are split over
            this many data-parallel ranks (borrowed from the innermost data axis above 1, which it
            must divide; not part of the world-size product). Not with tensor or pipeline axes.
        expert_tensor: Tensor-parallel degree inside each expert; must be 1 (refused above).
    """

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


class DdpConfig(_TypedConfig):
    """`DistributedDataParallel` section (`ddp.*`): how the model is wrapped under several processes.

    Read by the runners that wrap the model in DDP (`TorchRunner`, `GraphRunner`, and
    `ParallelRunner` where it replicates without FSDP2); a key set elsewhere is refused.

    Attributes:
        find_unused_parameters: Look for parameters a forward did not use, so that DDP does not wait
            for their gradients (models whose branches change from batch to batch); costs a
            traversal of the graph at every step. Without it such a model stops with DDP's
            "Expected to have finished reduction" error.
        static_graph: Tell DDP that the parameters used and the graph never change between steps:
            unused parameters and activation checkpointing are then handled once, cheaply.
        gradient_as_bucket_view: Keep gradients as views into DDP's buckets, saving one
            gradient-sized copy of memory.
        bucket_cap_mb: Size of a gradient bucket in MiB (`None`: DDP's own default, 25).
        broadcast_buffers: Send rank 0's buffers (BatchNorm statistics) to every rank at each forward.
    """

    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    bucket_cap_mb: float | None = None
    broadcast_buffers: bool = True


class CompileConfig(_TypedConfig):
    """`torch.compile` section (`compile.*`); None leaves torch's own default in place.

    Attributes:
        enable: Compile the model with `torch.compile`.
        backend: Compiler backend (`inductor`, `aot_eager`, ...).
        fullgraph: Require one graph without breaks.
        dynamic: Compile for dynamic shapes; None lets torch decide.
        mode: Compile mode (`default`, `reduce-overhead`, `max-autotune`, ...).
        options: Backend options, as a mapping.
        optimize_ddp: How dynamo splits graphs at DDP bucket boundaries.
        precompile_artifact_dir: `GraphRunner`: directory of the compiler's cache artifacts, written
            after the first update and loaded at start so a second launch skips compiling.
        memory_policy: `GraphRunner`: memory policy of the compiled step; `None` or `"default"`.
    """

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
    """Process-group timeouts (`comm.*`), in seconds.

    Attributes:
        init_timeout_seconds: Timeout while the process group starts; None keeps torch's default.
        train_timeout_seconds: Timeout of collectives, applied once training has started; None leaves it unchanged.
    """

    init_timeout_seconds: int | None = None
    train_timeout_seconds: int | None = None


class GcConfig(_TypedConfig):
    """Runner-paced garbage collection (`gc.*`); disabled while `interval` is None.

    Attributes:
        interval: Steps between collections run by the runner; None leaves collection to Python.
        generation: Generation collected (0, 1 or 2).
        disable_automatic: Turn Python's automatic collection off while the runner paces it.
        freeze: Move the objects alive when the runner is built (torch, every imported module,
            what the script built before it) out of the collector's reach until `close`
            (`gc.freeze()`), so the full collections Python runs while the optimizer, the model and
            torch's lazily imported parts are set up skip them. Skipped when something froze
            objects already.
    """

    interval: int | None = None
    generation: int = 1
    disable_automatic: bool = True
    freeze: bool = True


class ProfilingConfig(_TypedConfig):
    """Bounded `torch.profiler` tracing (`profiling.*`); `trace_dir` is relative to the run directory.

    Attributes:
        enabled: Profile a window of training steps.
        wait: Steps skipped before the window.
        warmup: Steps traced but discarded, so the window starts warm.
        active: Steps recorded.
        repeat: How many windows; None repeats while training.
        record_shapes: Record the input shapes of operators.
        profile_memory: Record tensor allocations.
        with_stack: Record Python stacks of operators.
        with_flops: Estimate FLOPs of matrix products and convolutions.
        trace_dir: Directory of the traces.
    """

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


class ScoreConfig(_TypedConfig):
    """Model selection and early stopping (`score.*`); the split, metric and direction are `score_split`,
    `score_name` and `score_mode`.

    Attributes:
        min_delta: How much an evaluation's score must beat the best so far to count as an
            improvement for `patience` (a tie never does).
    """

    min_delta: float = 0.0


class EmaConfig(_TypedConfig):
    """Exponential moving average of the model weights (`ema.*`).

    When `enabled`, the torch runner keeps an averaged copy of the model, updates it after every
    applied optimizer step and evaluates and infers with it. On FSDP2, tensor and pipeline layouts
    the copy is sharded like the model and swapped into it for evaluation and inference.

    Attributes:
        enabled: Keep an EMA copy of the model.
        decay: Weight of the running average, in `[0, 1]`.
    """

    enabled: bool = False
    decay: float = 0.999


class TelemetryConfig(_TypedConfig):
    """TFLOP/s and MFU in the training step logs (`telemetry.*`); see `danling.runners.services.telemetry`.

    Attributes:
        enabled: Add `tflops` and `mfu` to the training step logs (trackers: TensorBoard, CSV, ...).
        flops_per_step: FLOPs of one optimizer step (forward and backward of all its micro-batches);
            None counts them once over the first training step (eager models, known peak only).
        peak_tflops: Peak TFLOP/s of one device; None looks the device up in `PEAK_TFLOPS` by the
            run's precision (an unknown device shows no MFU and counts nothing).
    """

    enabled: bool = True
    flops_per_step: float | None = None
    peak_tflops: float | None = None


class Fp8Config(_TypedConfig):
    """How `precision: fp8` converts the model (`fp8.*`): torchao's float8 training of `nn.Linear` layers.

    The defaults are None (so that the section leaves `config_id` alone until a key is set).

    Attributes:
        recipe: torchao's float8 recipe: `"tensorwise"` (None), `"rowwise"` or `"rowwise_with_gw_hp"`.
        filter_fqns: Modules whose qualified name contains one of these strings stay in high
            precision (e.g. `["lm_head"]`); linears with a dimension not divisible by 16 always do.
        fsdp_all_gather: Under FSDP2, all-gather the weights in float8 (tensorwise recipe only; None: on).
        emulate: Emulate the float8 matrix products in high precision (any device; for tests; None: off).
    """

    recipe: str | None = None
    filter_fqns: list[str] | None = None
    fsdp_all_gather: bool | None = None
    emulate: bool | None = None
