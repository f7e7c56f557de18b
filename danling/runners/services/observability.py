"""The runner's observability hooks: logging, trackers, heartbeats, signals and GC pacing.

[`ObservabilityMixin`][danling.runners.services.observability.ObservabilityMixin] holds the
`init_*` hooks that attach these services during construction. Each attaches itself as a
subscriber of the runner's event bus (progress bar, heartbeat, trackers) or as a supervisor
setting, never as a branch in the loop.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import time
from typing import Any

import torch

from danling.checkpoint.manifest import atomic_write_text

try:
    import resource
except ImportError:  # pragma: no cover - Windows has no getrusage
    resource = None  # type: ignore[assignment]

from ..loop.events import CheckpointContext, Events, LogContext, PassContext, RunContext, StepContext, StopContext
from .csv_tracker import CSVTracker
from .errors import report_errors_briefly
from .mlflow_tracker import MLflowTracker
from .progress_bar import ProgressBar
from .trackers import TensorBoardTracker, WandbTracker

__all__ = ["ObservabilityMixin"]


class ObservabilityMixin:
    """`init_*` hooks of the services that watch a run; mixed into `BaseRunner`."""

    def init_garbage_collection(self) -> None:
        """Pace Python's garbage collector by global steps when `gc.interval` is set.

        The loops call `supervisor.gc_step(global_step)` after every optimizer step; with
        `gc.disable_automatic` the automatic collector stays off until `close`.
        """
        interval = self.config.gc.interval
        if interval is not None:
            # The supervisor applies pacing (and switches automatic GC off) when it is built.
            self.supervisor = self._build_supervisor(gc_interval=interval)

    def init_heartbeat(self) -> None:
        """Point the supervisor at `<run dir>/<heartbeat.dir_name>` when `heartbeat.enabled`.

        Each rank then writes `heartbeat-rank{rank}.json` at most every `heartbeat.interval_seconds`.
        """
        heartbeat = self.config.heartbeat
        if heartbeat.enabled:
            self.supervisor.heartbeat_dir = self.workspace.heartbeat_dir
            self.supervisor.heartbeat_interval = heartbeat.interval_seconds
            self.supervisor.beat(self.train_state.global_step, self.train_state.epoch, "init", force=True)
            self.events.subscribe(Events.STEP_END, self._beat)

    def _beat(self, context: StepContext) -> None:
        self.supervisor.beat(context.global_step, self.train_state.epoch, context.split)

    def _forward_to_trackers(self, context: LogContext) -> None:
        if len(self.trackers):
            values = dict(context.values)
            if _is_train_step_log(values):
                values.update(self._training_rates(context.step))
            self.trackers.log(values, step=context.step)

    def _training_rates(self, step: int) -> dict[str, Any]:
        """What a training step log adds to the step losses: learning rates, gradient norm,
        throughput and peak memory (read here, at log steps only)."""
        rates: dict[str, Any] = {}
        groups = getattr(getattr(self, "optimizer", None), "param_groups", None) or []
        lrs = {
            str(group.get("name", f"group{index}")): group["lr"] for index, group in enumerate(groups) if "lr" in group
        }
        if len(lrs) == 1:
            rates["lr"] = next(iter(lrs.values()))
        elif lrs:
            rates["lr"] = lrs
        container = getattr(getattr(self, "update", None), "container", None)
        grad_norm = getattr(container, "last_grad_norm", None)  # measured by clipping only
        if grad_norm is not None:
            rates["grad_norm"] = grad_norm
        now = time.perf_counter()
        mark = self.__dict__.get("_rate_mark")
        tokens = self.__dict__.get("_tokens_seen")
        tokens = None if tokens is None else float(tokens)
        self._rate_mark = (now, step, tokens)
        if mark is not None and step > mark[1] and now > mark[0]:
            seconds = now - mark[0]
            steps_per_second = (step - mark[1]) / seconds
            rates["throughput"] = {"steps_per_second": steps_per_second}
            batch = self.config.get("dataloader.batch_size")
            if batch:
                rates["throughput"]["samples_per_second"] = steps_per_second * batch * self.accum_steps
            if tokens is not None:
                rates["throughput"]["tokens_per_second"] = (tokens - (mark[2] or 0.0)) / seconds
        rates["memory"] = _peak_memory()
        return rates

    def count_tokens(self, tokens: int | Any) -> None:
        """Add the tokens one training step processed; step logs then report `throughput/tokens_per_second`.

        Call it from `train_step` with a number or a 0-d tensor (for instance `mask.sum()`): a
        tensor stays on its device and is read only at log steps, so counting costs no host
        synchronisation per step. The count is of this process; multiply by the data-parallel
        size for the whole job.
        """
        seen = self.__dict__.get("_tokens_seen")
        self._tokens_seen = tokens if seen is None else seen + tokens

    def _mark_training_pass(self, context: PassContext) -> None:
        # Throughput is measured within training passes: evaluation time between them is not counted.
        if context.mode == "train":
            tokens = self.__dict__.get("_tokens_seen")
            self._rate_mark = (
                time.perf_counter(),
                self.train_state.global_step,
                None if tokens is None else float(tokens),
            )

    def _resume_trackers(self, context: CheckpointContext) -> None:
        # The curves continue from the checkpoint's step: later points of the earlier run are dropped.
        self.trackers.resume_at(self.train_state.global_step)

    def init_signal_handlers(self) -> None:
        """Turn SIGTERM/SIGINT into a graceful stop request.

        The loops poll the request after every step, then save a `shutdown` checkpoint, close the
        runner and exit with 128 + the signal number. Handlers are restored by `close`.
        """
        self.supervisor.install_signal_handlers()

    # ------------------------------------------------------------------ logging and trackers
    def init_logging(self) -> None:
        """Attach the run's logger: console on the main process, plus `run.log` when `config.log` is set."""
        self.logger = self.workspace.setup_logging()
        # an error ending the script: one line on stderr, its traceback in the run log (DANLING_DEBUG prints it)
        keeps_log = self.config.get("log", True) or not self.is_main_process
        report_errors_briefly(self.workspace.log_file if keeps_log else None)
        self.supervisor.logger = self.logger
        self.checkpoint_manager.logger = self.logger
        if self.is_main_process and sys.stdout.isatty():
            ProgressBar().attach(self.events)

    def init_trackers(self) -> None:
        """Build the trackers the config asks for, in this order: TensorBoard (`tensorboard`), W&B
        (`wandb.enabled`), `metrics.csv` (`csv.enabled`, on by default) and MLflow (`mlflow.enabled`).

        Also records the run's status in `<run dir>/status.json` (main process only), which
        `danling runs` reads. Override to add your own [`Tracker`][danling.runners.services.trackers.Tracker]s
        (call `super().init_trackers()` and `self.trackers.append(...)`).
        """
        if self.config.get("tensorboard"):
            self.init_tensorboard()
        if self.config.get("wandb.enabled"):
            self.init_wandb()
        if self.config.get("csv.enabled"):
            self.init_csv()
        if self.config.get("mlflow.enabled"):
            self.init_mlflow()
        self.events.subscribe(Events.PASS_START, self._mark_training_pass)
        self.events.subscribe(Events.CHECKPOINT_LOADED, self._resume_trackers)
        if self.is_main_process:
            self.events.subscribe(Events.RUN_START, self._status_running)
            self.events.subscribe(Events.RUN_END, self._status_ended)
            self.events.subscribe(Events.STOP_REQUESTED, self._status_stopping)

    def init_csv(self) -> None:
        """Append every logged value to `<run dir>/<csv.file_name>` (main process only)."""
        if self.is_main_process:
            path = self.workspace.resolve(self.config.csv.file_name)
            self.trackers.append(CSVTracker(path, flush_seconds=self.config.csv.flush_seconds))

    def init_mlflow(self) -> None:
        """Record the run in MLflow (main process only): `<run dir>/mlruns` unless `mlflow.tracking_uri` is set.

        The experiment defaults to the lineage and the run name to `<experiment>-<run id>`;
        the config is recorded as parameters.
        """
        if not self.is_main_process:
            return
        mlflow = self.config.mlflow
        self.trackers.append(
            MLflowTracker(
                self.dir,
                tracking_uri=mlflow.tracking_uri,
                experiment=mlflow.experiment or self.workspace.lineage,
                run_name=mlflow.run_name or f"{self.workspace.experiment}-{self.id}",
                params=self.config.dict(),
                tags={"danling.run_id": self.id, "danling.run_dir": os.fspath(self.workspace.path)},
            )
        )

    # ------------------------------------------------------------------ run status
    def _write_status(self, status: str, **extra: Any) -> None:
        record = {
            "status": status,
            "time": time.time(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "global_step": self.train_state.global_step,
            "epoch": self.train_state.epoch,
            **extra,
        }
        path = self.workspace.path / "status.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(record, sort_keys=True) + "\n")

    def _status_running(self, context: RunContext) -> None:
        if context.mode == "train":
            self.__dict__["_stop_seen"] = False
            self._write_status("running")

    def _status_stopping(self, context: StopContext) -> None:
        self.__dict__["_stop_seen"] = True
        self._write_status("preempted", reason=context.reason)

    def _status_ended(self, context: RunContext) -> None:
        if context.mode != "train" or self.__dict__.pop("_stop_seen", False):
            return  # a stop request already recorded `preempted`
        error = context.error
        if error is None:
            self._write_status("finished")
        else:
            self._write_status("failed", error=f"{type(error).__name__}: {error}"[:500])

    def init_tensorboard(self, *args: Any, **kwargs: Any) -> None:
        """Send every written result to TensorBoard under `<run dir>/tensorboard` (main process only)."""
        if self.is_main_process:
            log_dir = kwargs.pop("log_dir", os.path.join(self.dir, "tensorboard"))
            kwargs.setdefault("config", self.config.dict())
            self.trackers.append(TensorBoardTracker(log_dir, *args, **kwargs))

    def init_wandb(self, *args: Any, **kwargs: Any) -> None:
        """Send every written result to a W&B run (main process only).

        Project, group and name default to the lineage, experiment and run id; `wandb.*` config
        keys and keyword arguments override them. The W&B run id is kept in `<run dir>/wandb-run-id`,
        so a run resumed in its directory (`auto_resume`) continues the same W&B run.
        """
        if not self.is_main_process:
            return
        wandb = self.config.wandb
        options = {
            "project": wandb.project or self.workspace.lineage,
            "name": wandb.name or self.id,
            "dir": wandb.dir or self.dir,
            "mode": wandb.mode,
            "config": self.config.dict(),
            "entity": wandb.entity,
            "group": wandb.group or self.workspace.experiment,
            "job_type": wandb.job_type,
            "tags": [wandb.tags] if isinstance(wandb.tags, str) else wandb.tags,
        }
        options = {key: value for key, value in options.items() if value is not None}
        options.update(kwargs)
        if "id" not in options:
            options["id"], options["resume"] = self._wandb_run_id(), "allow"
        self.trackers.append(WandbTracker(*args, **options))

    def _wandb_run_id(self) -> str:
        """The W&B run id of this run directory, chosen (and written) the first time."""
        path = self.workspace.path / "wandb-run-id"
        if path.is_file():
            return path.read_text().strip()
        run_id = f"{self.id}-{secrets.token_hex(4)}"  # unique even when run directories share an id
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, run_id + "\n")
        return run_id


def _is_train_step_log(values: dict[str, Any]) -> bool:
    """A training step log is `{"<split>_step": {...}}` (see `LoopMixin._log_step`)."""
    return len(values) == 1 and next(iter(values)).endswith("_step")


def _peak_memory() -> dict[str, float]:
    """Peak memory of this process so far, in MiB: the accelerator's allocations (CUDA) and the host's RSS."""
    peak: dict[str, float] = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    if resource is None:  # pragma: no cover
        return peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    peak["peak_rss_mib"] = rss / 2**20 if sys.platform == "darwin" else rss / 2**10
    return peak
