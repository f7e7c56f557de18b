"""Runner configuration: a typed, parseable `chanfig.Config` with every runner key.

`RunnerConfig` composes one section class per component ([`config_sections`][danling.runners.config_sections],
[`config_operations`][danling.runners.config_operations]), whose annotated keys convert and check values from
YAML files and the command line; `RunnerConfig.validate` adds the cross-field checks and names the offending value.
"""

import contextlib
import copy
import functools
import hashlib
import json
import os
import sys
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from typing_extensions import Self

from ._config_base import adopt_declarations, declaring
from ._config_cli import CommandLineError, StrictParser, apply_arguments, fail, wants
from ._config_help import help_text
from ._config_refs import merge_config_files, references_yaml
from ._config_utils import (
    CONFIG_ID_IGNORES,
    auto_stack,
    check_annotations,
    check_optimizer_keys,
    check_values,
    feature_keys,
    normalize_config,
    peek,
    semantic,
    unknown_keys,
    unsupported,
)
from .config_operations import (
    ConsistencyConfig,
    HeartbeatConfig,
    InferenceConfig,
    NonFiniteConfig,
    OomConfig,
    ReplayConfig,
    SlurmConfig,
    SpikeConfig,
    StragglerConfig,
    WatchdogConfig,
)
from .config_sections import (
    CheckpointConfig,
    CommConfig,
    CompileConfig,
    CSVConfig,
    DataloaderConfig,
    DdpConfig,
    EmaConfig,
    FaultToleranceConfig,
    Fp8Config,
    FsdpConfig,
    GcConfig,
    MLflowConfig,
    OptimConfig,
    ParallelConfig,
    ProfilingConfig,
    SchedulerConfig,
    ScoreConfig,
    TelemetryConfig,
    WandbConfig,
    _TypedConfig,
)
from .registry import RUNNERS, runner_stacks

# Section classes are importable from this module (and config_sections) but kept out of the package namespace.
__all__ = ["RunnerConfig"]


@functools.cache
def _base_defaults() -> dict[str, Any]:
    """Every declared key of `RunnerConfig` with its default, flattened (computed once)."""
    return RunnerConfig().dict(flatten=True)


class RunnerConfig(_TypedConfig):
    r"""Every setting of a runner, as a nested, attribute-access `chanfig.Config`.

    Keys are annotated class attributes, so subclasses add typed keys the same way and values
    from files or the command line are converted to the annotated type. Sub-sections
    (`checkpoint`, `dataloader`, `wandb`, ...) are typed too. A key annotated as `Config` or `dict`
    (`network: Config = Config()`) is a free-form section: any key below it is accepted.

    Lifecycle: construct (defaults, then keyword overrides) → `parse`
    (`--config FILE`, then dotted CLI overrides) → `boot()` runs every `post()` hook, normalises
    aliases and calls `validate`. After `boot()`
    reading a missing key raises `AttributeError`; use `config.get("key")` for optional keys.

    Class attributes (not config keys):
        STACKS: Accepted values of `stack`; extend them with `register_stack`.
        PRECISIONS: Accepted `precision` spellings, mapped to `"fp32"`, `"fp16"`, `"bf16"` or `"fp8"`.
        CONFIG_ID_IGNORES: Dotted key patterns (`*` matches one level) left out of `config_id`.
        FEATURES: Documented keys that only some runners read, by feature name (`section.*` covers
            a section). A runner lists the features it implements in `supported_features`; for
            any other feature, a key set to a non-default value fails `check_supported`.

    Every key must be declared (annotated, created by your `__init__`/`post()`, or in `EXTRA_KEYS`):
    an unknown key fails construction, `merge` and `validate` with a `ValueError` naming the closest
    keys (`parse` exits with status 2). `optim.*` takes the arguments of the optimizer `optim.type`
    names; `ALIASES` are renamed on input; one converter types every value whatever its source.
    `--help` lists every key with the description from the `Attributes:` section declaring it.

    Attributes:
        stack: Runner stack picked by `Runner`: `"auto"`, `"ddp"`/`"torch"`, `"graph"`, `"deepspeed"`/`"ds"`
            or `"parallel"`.
        seed: Base random seed; None lets the runner draw one.
        deterministic: Request deterministic kernels (slower, reproducible).
        steps: Global optimizer-step budget (step mode).
        epochs: Epoch budget (epoch mode; takes precedence over `steps`).
        accum_steps: Micro-batches accumulated per optimizer step (>= 1).
        precision: Autocast precision (`"fp32"`, `"fp16"`, `"bf16"` or an alias); None disables autocast.
            `"fp8"` trains the linears in float8 (torchao, CUDA compute capability >= 8.9) under bf16 autocast.
        max_grad_norm: Clip gradients to this total norm; None disables.
        max_grad_value: Clip each gradient element to this magnitude; None disables.
        skip_nonfinite_grad: Skip the optimizer update when a gradient is NaN/inf.
        patience: Evaluations (epochs in epoch mode) without an improvement of the score before
            training stops early; None never stops early. See `score.min_delta`.
        evaluate_interval: Step mode: optimizer steps between evaluations (0: after the last only; None: steps // 10).
        evaluate_batches: Batches of each evaluation split per evaluation while training; None: whole splits.
        dry_run: Batches per split of a dry run (one checkpoint round trip, own run directory); None is off.
        train_splits: Dataset splits to train on; None infers them.
        evaluate_splits: Dataset splits to evaluate; None infers them, `[]` evaluates none.
        score_split: Split whose metric selects the best checkpoint; None picks `val` (or `validate`,
            `validation`), else the first evaluation split not named `test*`, else none: no best checkpoint.
        score_name: Metric name used for model selection.
        score_mode: `"min"` or `"max"`: whether a lower or a higher score is better; None infers
            it from `score_name` (losses and errors are minimised).
        score: Early-stopping threshold (`score.min_delta`); see `ScoreConfig`.
        workspace_root: Directory holding every lineage.
        lineage: Top-level namespace of the run directory (`"lin"` when None).
        experiment: Experiment namespace, the prefix of the run directory name (`"exp"` when None).
        resume: Full-state checkpoint to resume from.
        auto_resume: Resume from the run's latest checkpoint when one exists.
        resume_allow_changes: Let `resume` load a checkpoint whose run trained a different config
            (identity keys differ); each difference is logged as a warning instead of refusing.
        pretrained: Model-only checkpoint to initialise from.
        log: Write a log file in the run directory (main process only).
        log_interval: Steps between progress logs; 0 turns step logs off; None lets the runner choose.
        tensorboard: Write TensorBoard scalars.
        csv: `metrics.csv` in the run directory (on by default); see `CSVConfig`.
        mlflow: MLflow tracking (off by default); see `MLflowConfig`.
        nonfinite: What NaN/inf updates do; see `NonFiniteConfig`.
        spikes: Loss-spike detection and recovery (off by default); see `SpikeConfig`.
        watchdog: Hang watchdog (on by default); see `WatchdogConfig`.
        slurm: Slurm preemption signal and requeue; see `SlurmConfig`.
        telemetry: TFLOP/s and MFU in the training step logs (on by default); see `TelemetryConfig`.
        fp8: The float8 conversion of `precision: fp8`; see `Fp8Config`.
        stragglers: Slow ranks named at step logs (off by default); see `StragglerConfig`.
        consistency: Replica consistency checks (off by default); see `ConsistencyConfig`.
        oom: Out-of-memory errors survived by all ranks together (off by default); see `OomConfig`.
        replay: Bundles of failing updates for `danling replay` (off by default); see `ReplayConfig`.

    Examples:
        >>> config = RunnerConfig()
        >>> config.stack, config.accum_steps, config.checkpoint.dir_name, config.parallel.axes.shard
        ('auto', 1, 'checkpoints', 1)
        >>> config.optim.lr = 1e-3
        >>> config["optim"]["lr"]
        0.001
        >>> class MyConfig(RunnerConfig):
        ...     epochs: int = 10
        ...     learning_rate: float = 0.001
        >>> config = MyConfig().parse(["--epochs", "20", "--optim.lr", "0.01", "--precision", "bfloat16"])
        >>> config.epochs, config.optim.lr, config.precision
        (20, 0.01, 'bf16')
        >>> RunnerConfig(accum_steps=0)
        Traceback (most recent call last):
        ValueError: config.accum_steps must be an integer >= 1, got 0
    """

    STACKS = ("auto", "ddp", "torch", "graph", "deepspeed", "ds", "parallel")
    PRECISIONS = {
        "fp32": "fp32",
        "float32": "fp32",
        "fp16": "fp16",
        "float16": "fp16",
        "half": "fp16",
        "bf16": "bf16",
        "bfloat16": "bf16",
        "fp8": "fp8",
        "float8": "fp8",
    }
    # Where predictions go, how a hang is caught, how a cluster preempts, what the step logs measure and what
    # the diagnosis plug-ins watch do not define the experiment.
    CONFIG_ID_IGNORES = (
        *CONFIG_ID_IGNORES,
        "inference",
        "watchdog",
        "slurm",
        "telemetry",
        "stragglers",
        "consistency",
        "oom",
        "replay",
    )
    # Features only some runners implement; a backend lifts one by naming it in its
    # `supported_features` (and the entry is dropped once every runner reads those keys).
    FEATURES = {
        "parallel": ("parallel.*",),
        "fsdp": ("fsdp.*",),
        "ddp": ("ddp.*",),
        "profiling": ("profiling.*",),
        "fault-tolerance": ("ft.*",),
        "ft-dataloader-checkpoints": (
            "checkpoint.enable_ft_dataloader_checkpoints",
            "checkpoint.ft_replica_id",
            "checkpoint.ft_dataloader_checkpoint_prefix",
        ),
        "graph": ("compile.precompile_artifact_dir", "compile.memory_policy"),
    }
    EXTRA_KEYS = frozenset({"deepspeed"})  # DeepSpeed's own JSON config: read, not declared
    ALIASES = {"optimizer": "optim", "sched": "scheduler"}  # renamed on input: one name per section
    DECLARES = True  # keys a subclass's `__init__`/`post()` creates are declared (`self.network.type = ...`)

    stack: str = "auto"
    seed: int | None = None
    deterministic: bool = False
    steps: int | None = None
    epochs: int | None = None
    accum_steps: int = 1
    precision: str | None = None
    max_grad_norm: float | None = None
    max_grad_value: float | None = None
    skip_nonfinite_grad: bool = False
    patience: int | float | None = None
    evaluate_interval: int | None = None
    evaluate_batches: int | None = None
    dry_run: int | None = None
    train_splits: list[str] | None = None
    evaluate_splits: list[str] | None = None
    score_split: str | None = None
    score_name: str = "loss"
    score_mode: str | None = None
    score: ScoreConfig = ScoreConfig()
    workspace_root: str = "experiments"
    lineage: str | None = "lin"
    experiment: str | None = "exp"
    resume: str | None = None
    auto_resume: bool = False
    resume_allow_changes: bool = False
    pretrained: str | None = None
    log: bool = True
    log_interval: int | None = None
    tensorboard: bool = False
    optim: OptimConfig = OptimConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    dataloader: DataloaderConfig = DataloaderConfig()
    wandb: WandbConfig = WandbConfig()
    csv: CSVConfig = CSVConfig()
    mlflow: MLflowConfig = MLflowConfig()
    ft: FaultToleranceConfig = FaultToleranceConfig()
    parallel: ParallelConfig = ParallelConfig()
    fsdp: FsdpConfig = FsdpConfig()
    ddp: DdpConfig = DdpConfig()
    compile: CompileConfig = CompileConfig()
    comm: CommConfig = CommConfig()
    gc: GcConfig = GcConfig()
    profiling: ProfilingConfig = ProfilingConfig()
    heartbeat: HeartbeatConfig = HeartbeatConfig()
    ema: EmaConfig = EmaConfig()
    inference: InferenceConfig = InferenceConfig()
    nonfinite: NonFiniteConfig = NonFiniteConfig()
    spikes: SpikeConfig = SpikeConfig()
    watchdog: WatchdogConfig = WatchdogConfig()
    slurm: SlurmConfig = SlurmConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    fp8: Fp8Config = Fp8Config()
    stragglers: StragglerConfig = StragglerConfig()
    consistency: ConsistencyConfig = ConsistencyConfig()
    oom: OomConfig = OomConfig()
    replay: ReplayConfig = ReplayConfig()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        if len(args) == 1 and isinstance(args[0], (str, bytes, os.PathLike)):
            args = merge_config_files(self, [os.fsdecode(args[0])])
        if args or kwargs:
            self.merge(*args, **kwargs)

    def merge(self, *args: Any, **kwargs: Any) -> Self:
        """chanfig's `merge`, then the section key check: an undeclared key in a typed section raises `ValueError`."""
        super().merge(*args, **kwargs)
        self._check_keys()
        return self

    def _check_keys(self) -> None:
        problems = unknown_keys(self)
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_dict(cls, obj: Mapping | Sequence) -> Any:
        """Build a config from a mapping: class defaults first, then the mapping's values.

        chanfig's generic version turns every nested mapping into an instance of `cls`, which
        would nest whole runner configs inside sections; this keeps sections typed instead.
        """
        if isinstance(obj, Mapping):
            config = cls()
            config.merge(obj)
            return config
        return super().from_dict(obj)

    @classmethod
    def load(cls, file: Any, method: str | None = None, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Class defaults, then the config file `file`, read as `--config FILE` reads it.

        `1e-3` is a number, `!env`/`!include` values are remembered so that a run's records keep the
        reference, and a bad key or value names the file (and line). An open stream or an explicit
        `method` (or reader arguments) is left to chanfig's reader.
        """
        if method is not None or args or kwargs or not isinstance(file, (str, bytes, os.PathLike)):
            return super().load(file, method, *args, **kwargs)
        config = cls()
        merge_config_files(config, [os.fsdecode(file)])
        return config

    @classmethod
    def register_stack(cls, name: str) -> str:
        """Accept `name` as a value of `stack` for this class and its subclasses; returns the stored spelling.

        Examples:
            >>> class MyConfig(RunnerConfig):
            ...     pass
            >>> MyConfig.register_stack("Custom")
            'custom'
            >>> "custom" in MyConfig.STACKS, "custom" in RunnerConfig.STACKS
            (True, False)
        """
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"stack name must be a non-empty string, got {name!r}")
        name = name.strip().lower()
        if name not in cls.STACKS:
            cls.STACKS = (*cls.STACKS, name)
        return name

    def parse(
        self,
        args: Iterable[str] | None = None,
        default_config: str | None = "config",
        no_default_config_action: str = "ignore",
        boot: bool = True,
        strict: bool = False,
    ) -> Self:
        """Apply `--config FILE` (YAML, JSON or TOML) and then dotted command-line overrides.

        Precedence, lowest first: class defaults and values set in `__init__`, each config file in
        the order given, then the remaining `--key value` arguments. Unset keys can be given as
        `none`/`null`; list-typed keys take several values (`--train_splits train extra`); values of
        keys in free-form sections (`optim.*`, `scheduler.*`, `dict`/`Config` keys) are read as numbers,
        booleans or strings, several of them as a list (`--optim.betas 0.9 0.99`). Returns this config.
        `--help` prints every key (type, default, description) and `--print-config` the merged
        config as YAML; both then exit with status 0.

        Args:
            args: Arguments to parse; defaults to `sys.argv[1:]`.
            default_config: Name of the option carrying config files (`--config`); None disables files.
            no_default_config_action: What to do when no file is given: `"ignore"`, `"warn"` or `"raise"`.
            boot: Run `boot()` (post hooks, normalisation, validation) afterwards.
            strict: Reject arguments that are not existing keys.

        Raises:
            SystemExit: Status 2 for an unknown key, a bad value or a bad or missing config file,
                after one `prog: error: message` line on stderr; the exception is also a `ValueError`.
        """
        if no_default_config_action not in ("ignore", "warn", "raise"):
            raise ValueError(
                f"no_default_config_action must be 'ignore', 'warn' or 'raise', got {no_default_config_action!r}"
            )
        args = list(sys.argv[1:] if args is None else args)
        parser = self.getattr("parser", None) or StrictParser()  # typed options first, then free-form keys
        if wants(args, "-h", "--help"):
            sys.stdout.write(help_text(self, parser.prog, default_config))
            raise SystemExit(0)
        print_config = wants(args, "--print-config", "--print_config")
        # `--debug` is read from sys.argv by the error hook (tracebacks printed, not only logged): not a key.
        args = [arg for arg in args if arg not in ("--print-config", "--print_config", "--debug")]
        self.setattr("parser", parser)
        if boot:
            self._declare_post_keys()
        try:
            apply_arguments(self, parser, args, default_config, no_default_config_action, strict)
            if boot:
                self.boot()
        except CommandLineError:
            raise
        except (ValueError, TypeError, FileNotFoundError) as exc:  # a bad value, key or file: a usage error
            raise fail(parser.prog, str(exc)) from exc
        finally:
            self.popattr("parser", None)  # argparse state; dropping it keeps the config light and picklable
        if print_config:  # `!env`/`!include` values as their tags, like the run's own config.yaml
            sys.stdout.write(references_yaml(self, self.dict()) or self.yamls())
            raise SystemExit(0)
        return self

    def _declare_post_keys(self) -> None:
        """Declare the keys `post()` creates before files and flags are merged, which happens before it runs.

        They are declarations like those of `__init__`, and the run's own `config.yaml` (or `--print-config`)
        holds them: without this it could not be read back with `--config`. They are learned by booting a
        copy of the config; a `post()` that fails on it (it may need a value still to come) declares what it
        created before failing.
        """
        if type(self).post is RunnerConfig.post:
            return
        try:
            probe = copy.deepcopy(self)  # a value that cannot be copied: nothing learned, nothing lost
        except Exception:
            return
        with contextlib.suppress(Exception):  # only the declarations are wanted; the real boot reports errors
            probe.boot()
        adopt_declarations(self, probe)

    def post(self) -> None:
        """Hook for derived values, run by `boot()` after parsing; calling `super().post()` is optional.

        The base implementation canonicalises spellings (stack case, precision aliases,
        `checkpoint.exclude_from_loading` aliases, string `wandb.tags`); `boot()` repeats it
        and validates afterwards, so overrides may skip it.
        """
        self._normalize()

    def boot(self) -> Self:
        """Run `post()` hooks bottom-up, resolve `${...}` references, normalise and validate.

        Keys the `post()` hooks create are declarations, like those of `__init__`.
        """
        with declaring():
            super().boot()
        self._normalize()
        self.validate()
        return self

    def validate(self, training: bool = False) -> None:
        """Check every known key and raise on the first problem.

        Runs automatically on construction and at the end of `boot()`; runners call it with
        `training=True` before training, which additionally requires `epochs` or `steps`.

        Args:
            training: Also require a training budget.

        Raises:
            ValueError: A known key holds an unacceptable value (the message names key, value and
                what is accepted), or a typed section holds a key it does not declare.
            TypeError: A value does not match its annotation.

        Examples:
            >>> RunnerConfig(**{"checkpoint.intervall": 5})
            Traceback (most recent call last):
            ValueError: config.checkpoint.intervall is not a key of config.checkpoint; did you mean checkpoint.interval?
            >>> RunnerConfig(stack="jax")
            Traceback (most recent call last):
            ValueError: config.stack='jax' is not a known stack; expected one of: auto, ddp, torch, ...
            >>> RunnerConfig(epochs=-1)
            Traceback (most recent call last):
            ValueError: config.epochs must be an integer >= 0 or None, got -1
            >>> RunnerConfig().validate(training=True)
            Traceback (most recent call last):
            ValueError: training needs a budget: set config.epochs or config.steps (both are None)
        """
        self._check_keys()
        stack = peek(self, "stack")
        if not isinstance(stack, str) or stack.strip().lower() not in self.STACKS:
            raise ValueError(f"config.stack={stack!r} is not a known stack; expected one of: {', '.join(self.STACKS)}")
        precision = peek(self, "precision")
        if precision is not None and (not isinstance(precision, str) or precision.lower() not in self.PRECISIONS):
            raise ValueError(
                f"config.precision={precision!r} is not supported; expected None or one of: "
                f"{', '.join(self.PRECISIONS)}"
            )
        check_values(self)
        check_optimizer_keys(self)
        from .diagnosis import check_settings  # here: the diagnosis package imports this module's sections

        check_settings(self)
        if training and peek(self, "epochs") is None and peek(self, "steps") is None:
            raise ValueError("training needs a budget: set config.epochs or config.steps (both are None)")
        check_annotations(self)

    def check_supported(
        self, stacks: Collection[str], features: Collection[str] = (), *, runner: str | None = None
    ) -> None:
        """Raise unless a runner offering `stacks` and `features` can run this config as written.

        `stack` must be one of `stacks`, and every key of a `FEATURES` entry missing from
        `features` must keep its default: a setting nothing reads would otherwise be ignored.

        Args:
            stacks: Stack names the runner implements.
            features: Names of `FEATURES` entries the runner implements.
            runner: Runner name for the messages.

        Raises:
            ValueError: The stack is not among `stacks` (the message lists them), or keys of
                missing features hold non-default values (the message names each key and value).

        Examples:
            >>> RunnerConfig(stack="deepspeed").check_supported(["auto", "ddp", "torch"], runner="TorchRunner")
            Traceback (most recent call last):
            ValueError: config.stack='deepspeed' is not available with TorchRunner in this version of danling; ...
            >>> RunnerConfig(**{"fsdp.enabled": True}).check_supported(["auto"])
            Traceback (most recent call last):
            ValueError: config.fsdp.enabled=True is not available yet in this version of danling: it needs ...
            >>> RunnerConfig(**{"fsdp.enabled": True}).check_supported(["auto"], ["fsdp"])
        """
        defaults = _base_defaults()
        problem = unsupported(self, stacks, features, runner, feature_keys(self.FEATURES, defaults), defaults)
        if problem:
            raise ValueError(problem)

    @classmethod
    def check_runner(cls, config: Any, runner: type) -> None:
        """`check_supported` for a runner class: the check a runner runs first thing when constructed.

        The stacks come from the runner registry
        ([`runner_stacks`][danling.runners.registry.runner_stacks]); the features are the union of
        `supported_features` over `runner` and its bases. A stack registered to a different runner
        class is reported with that class's name. Values that are not mappings are left to the
        runner's own type check.

        Raises:
            ValueError: See `check_supported`; also for unknown keys of typed sections.
        """
        if not isinstance(config, RunnerConfig):
            if not isinstance(config, Mapping):
                return
            config = cls(**config)
        stacks = runner_stacks(runner)
        stack = str(config.get("stack") or "auto").strip().lower()
        owner = RUNNERS.get(stack)
        if stack not in stacks and owner is not None:
            raise ValueError(
                f"config.stack={stack!r} is implemented by {owner.__name__}, not by {runner.__name__} "
                f"(available stacks: {list(stacks)}); build the runner with Runner(config) or subclass {owner.__name__}"
            )
        features = {name for klass in runner.__mro__ for name in vars(klass).get("supported_features", ())}
        # A subclass that replaces what its base implements (DeepSpeed's engine instead of DDP) gives it up.
        features -= {name for klass in runner.__mro__ for name in vars(klass).get("unsupported_features", ())}
        config.check_supported(stacks, features, runner=runner.__name__)

    def _normalize(self) -> None:
        normalize_config(self, self.PRECISIONS)

    def semantic_dict(self) -> dict[str, Any]:
        """The part of the config that defines the experiment, as plain nested dicts.

        Keys matching `CONFIG_ID_IGNORES` (budget, paths, logging, cadences, infrastructure),
        None values and empty sections are left out, so adding a new optional key or touching an
        unset section does not change it. `"ddp"`/`"torch"` (what a runner records for `"auto"`)
        count as `"auto"`.
        """
        ignores = tuple(tuple(pattern.split(".")) for pattern in self.CONFIG_ID_IGNORES)
        return auto_stack(semantic(self.dict(), (), ignores), RUNNERS)

    @property
    def config_id(self) -> str:
        """Stable 12-hex-digit hash of `semantic_dict`.

        Examples:
            >>> a = RunnerConfig(epochs=3, workspace_root="/tmp/a", experiment="x")
            >>> b = RunnerConfig(epochs=3, workspace_root="/tmp/b", experiment="y")
            >>> a.config_id == b.config_id, a.config_id == RunnerConfig(epochs=4).config_id
            (True, True)
            >>> a.config_id == RunnerConfig(epochs=3, seed=1).config_id
            False
            >>> len(a.config_id)
            12
        """
        payload = json.dumps(self.semantic_dict(), sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:12]


class _RecordedConfig(RunnerConfig):
    """A config read back from a run's records (checkpoint, `config.yaml`), whose class is not at hand.

    The user's subclass declared the extra top-level keys the record holds; without that class
    they are kept as they are instead of rejected. Sections are still checked.
    """

    STRICT = False


def recorded_config(saved: Mapping[str, Any]) -> RunnerConfig:
    """`RunnerConfig` of a saved mapping, keeping the top-level keys a user's subclass declared."""
    return _RecordedConfig(**saved)
