"""Sections of [`RunnerConfig`][danling.runners.config.RunnerConfig] about how a run is operated and
protected rather than what it trains: heartbeats, the hang watchdog, non-finite checks, loss-spike
recovery, Slurm preemption, inference into files, and the diagnosis plug-ins (stragglers, replica
consistency, out-of-memory recovery, replayable failures). None of them is part of the experiment's identity.
"""

from .config_sections import _TypedConfig

__all__ = [
    "ConsistencyConfig",
    "HeartbeatConfig",
    "InferenceConfig",
    "NonFiniteConfig",
    "OomConfig",
    "ReplayConfig",
    "SlurmConfig",
    "SpikeConfig",
    "StragglerConfig",
    "WatchdogConfig",
]


class HeartbeatConfig(_TypedConfig):
    """Per-rank heartbeat files (`heartbeat.*`) under `<run dir>/<dir_name>`.

    Attributes:
        enabled: Each rank rewrites its heartbeat file while it runs.
        interval_seconds: Seconds between writes.
        dir_name: Directory of the files, relative to the run directory.
    """

    enabled: bool = False
    interval_seconds: float = 60.0
    dir_name: str = "heartbeats"


class InferenceConfig(_TypedConfig):
    """Inference into files (`inference.*`): what `runner.infer(split)` does when no `output` is passed.

    Attributes:
        output: File the outputs are streamed into (`.jsonl`, `.npy`, `.parquet` or a registered
            suffix), relative to the working directory; None keeps `infer()` returning its outputs in memory.
        progress_interval: Batches between two progress records (the points a killed run resumes from).
        resume: Continue from the progress record of an earlier run into the same output; False starts over.
    """

    output: str | None = None
    progress_interval: int = 100
    resume: bool = True


class NonFiniteConfig(_TypedConfig):
    """Updates with NaN/inf losses or gradients (`nonfinite.*`) while `skip_nonfinite_grad` is off.

    Attributes:
        check: `log` (default): the training loss is checked where the loop reads it anyway (step
            logs, the end of a pass, before a mid-pass checkpoint) and a non-finite one stops the
            run with an error, at no extra cost; `update`: every update's gradients are checked
            (one host synchronisation per update) and a non-finite update is dropped, never
            applied; `off`: no check.
        max_consecutive: Non-finite updates in a row that stop the run with an error (`check=update`,
            or `skip_nonfinite_grad` on); None: 1 with `check=update` (the first one), no limit
            with `skip_nonfinite_grad`.
    """

    check: str = "log"
    max_consecutive: int | None = None


class SpikeConfig(_TypedConfig):
    """Loss-spike detection and recovery (`spikes.*`); off while `policy` is None.

    A window loss above `factor` x the running median of the last `window` losses is a spike.

    Attributes:
        policy: None (off), `skip` (drop the update) or `rollback` (reload the newest checkpoint that
            verifies, lower the learning rates for a cooldown and skip the batches that spiked).
        factor: Threshold, as a multiple of the running median (> 1).
        window: Number of recent update losses the median is taken over.
        min_history: Losses seen before detection starts; None: `window`.
        max_rollbacks: Rollbacks allowed; the next spike stops the run with an error.
        lr_factor: Learning rates are multiplied by this during a cooldown, in (0, 1].
        cooldown_steps: Optimizer steps a cooldown after a rollback lasts.
    """

    policy: str | None = None
    factor: float = 3.0
    window: int = 50
    min_history: int | None = None
    max_rollbacks: int = 3
    lr_factor: float = 0.5
    cooldown_steps: int = 100


class WatchdogConfig(_TypedConfig):
    """Hang watchdog (`watchdog.*`): a stuck step, a silent rank or a stuck collective ends the run.

    In a multi-process run every rank writes a heartbeat (its phase and step) to a file in the run
    directory; a rank whose peers have been silent for `timeout_seconds` logs which ranks are stuck,
    in which phase and at which step, and exits. A single-process run is watched by a thread that
    reads the run's progress counters instead, and ends the run with the same message.

    Attributes:
        enabled: Run the watchdog (started by `train()`).
        timeout_seconds: Seconds without a heartbeat or progress before the run is ended.
        interval_seconds: Seconds between heartbeats (reads of the counters in a single process); None: a
            tenth of the timeout (at most 5 s).
        exit_code: Exit status of a rank the watchdog ends.
    """

    enabled: bool = True
    timeout_seconds: float = 600.0
    interval_seconds: float | None = None
    exit_code: int = 124


class SlurmConfig(_TypedConfig):
    """Slurm preemption and requeue (`slurm.*`); used only inside a Slurm job (`SLURM_JOB_ID` set).

    `signal` becomes a stop signal like SIGTERM: every rank stops at the same step, saves a
    `shutdown` checkpoint and exits. With `requeue`, the main process then runs
    `scontrol requeue $SLURM_JOB_ID`, and the requeued job resumes with `auto_resume` in the same
    run directory. Slurm delivers the signal to the tasks of the job's steps with
    `#SBATCH --signal=USR1@<seconds>` (`B:USR1` reaches only the batch shell); see the clusters guide.

    Attributes:
        signal: Signal that asks for a checkpoint and stop (`USR1`, `SIGUSR2`, `TERM`, ...); None disables it.
        requeue: After the stop that `signal` caused, requeue the job with `scontrol requeue`.
    """

    signal: str | None = "USR1"
    requeue: bool = False


class StragglerConfig(_TypedConfig):
    """Slow ranks named (`stragglers.*`): per-rank phase times compared across ranks at step logs.

    Every rank times its phases (data loading, forward, backward, optimizer step) from the phase
    marks the loops already write for the hang watchdog; at each training step log the ranks
    exchange their totals in one small collective, and the step log and the trackers carry the
    slowest rank, its phase and how much slower it is than the median of the other ranks.

    Attributes:
        enabled: Time the phases and name the slowest rank (multi-process training runs only).
        factor: A rank whose time per step (without waiting in collectives) exceeds `factor` x
            the median of the other ranks' is slow; > 1.
        window: Step-log intervals the comparison sums over (a rolling window); >= 1.
        patience: Consecutive step logs the same rank must be slow before a WARNING names it; >= 1.
        collective_phases: Phases holding a collective that every rank leaves together, so that a
            fast rank waits there for a slow one (`backward` under DDP: the gradient all-reduce);
            their time above the fastest rank's counts as waiting, not as work.
    """

    enabled: bool = False
    factor: float = 1.5
    window: int = 5
    patience: int = 3
    collective_phases: list[str] = ["backward"]


class ConsistencyConfig(_TypedConfig):
    """Replica consistency sentinel (`consistency.*`): replicas compared by checksum every `interval` steps.

    The parameters (and the optimizer state) that must be identical on every replica of the
    replicate domain (all ranks under DDP, the replicate axis of HSDP) are checksummed bit for bit
    and compared in one small collective; a mismatch names the differing rank(s) and the first
    differing tensor, then `policy` runs.

    Attributes:
        interval: Optimizer steps between checks; None (default) is off.
        policy: `warn` (log and go on), `stop` (a graceful stop through the supervisor: the run
            saves its shutdown checkpoint and exits) or `rollback` (reload the newest checkpoint
            saved right after a check that passed, and go on).
        optimizer_state: Also compare the optimizer state (when it is replicated).
        max_rollbacks: Rollbacks allowed (`policy=rollback`); the next mismatch stops the run with an error.
    """

    interval: int | None = None
    policy: str = "warn"
    optimizer_state: bool = True
    max_rollbacks: int = 3


class OomConfig(_TypedConfig):
    """Out-of-memory errors survived together (`oom.*`); off while `policy` is None.

    When a training micro-batch runs out of memory on any rank, every rank learns it at the same
    point of the step (one small all-reduce before each backward, before each optimizer step and
    at the end of each micro-batch), frees what the failed attempt held, and goes on by `policy`.
    See the diagnosis guide for the cases that cannot be survived (an out-of-memory error inside a
    backward that all-reduces gradients, or inside the optimizer step).

    Attributes:
        policy: None (off: no per-step cost), `skip` (drop the update the micro-batch belongs to, on
            every rank) or `split` (run the micro-batch again as halves, each halved again when it
            runs out of memory in turn, with the losses weighted so that the update is the one of
            the whole micro-batch).
        max_consecutive: Out-of-memory errors in a row (without a micro-batch that ran through
            without one) that stop the run with an error naming the counts; >= 1.
        max_splits: Times a micro-batch may be halved (`split`); the next error stops the run; >= 1.
    """

    policy: str | None = None
    max_consecutive: int = 3
    max_splits: int = 3


class ReplayConfig(_TypedConfig):
    """Replayable failures (`replay.*`): a bundle to re-run one failing update on one process.

    On a non-finite training loss or dropped non-finite update (`on_nonfinite`), a loss-spike
    rollback (`on_rollback`) or a chosen update (`capture_steps`), a rank writes a bundle under
    `<run dir>/<dir_name>/`: the micro-batches of the update, the RNG states, the model and
    optimizer state before it, the config and the code version. `danling replay BUNDLE` re-runs it
    and names the first module whose output (forward) or gradient (backward) is not finite.

    Attributes:
        on_nonfinite: Bundle the first update whose loss is not finite on this rank, or that the
            non-finite check drops (one host synchronisation per micro-batch while on).
        on_rollback: Bundle the update a loss-spike rollback (`spikes.policy=rollback`) leaves.
        capture_steps: Global steps (the step an update brings `global_step` to) to bundle
            whatever happens; only these updates pay for the copy.
        max_copy_bytes: With `on_nonfinite` or `on_rollback`, model and optimizer state up to this
            size are copied at the start of every update; larger ones are bundled as the newest
            checkpoint plus the micro-batches since (kept by reference until the next checkpoint).
            Settled at the first update, where an optimizer without state yet counts as twice the
            model (Adam's two moments).
        max_bundles: Failure bundles this rank writes per run (a NaN that persists would write one per
            update); the chosen steps (`capture_steps`) are always written.
        dir_name: Directory of the bundles, relative to the run directory.
    """

    on_nonfinite: bool = False
    on_rollback: bool = False
    capture_steps: list[int] = []
    max_copy_bytes: int = 1 << 28
    max_bundles: int = 1
    dir_name: str = "replay"
