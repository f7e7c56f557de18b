"""The runner's observability hooks: logging, trackers, heartbeats, signals and GC pacing.

[`ObservabilityMixin`][danling.runners.services.observability.ObservabilityMixin] holds the
`init_*` hooks that attach these services during construction. Each attaches itself as a
subscriber of the runner's event bus (progress bar, heartbeat, trackers) or as a supervisor
setting, never as a branch in the loop.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ..loop.events import Events, LogContext, StepContext
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
            self.trackers.log(dict(context.values), step=context.step)

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
        self.supervisor.logger = self.logger
        self.checkpoint_manager.logger = self.logger
        if self.is_main_process and sys.stdout.isatty():
            ProgressBar().attach(self.events)

    def init_tensorboard(self, *args: Any, **kwargs: Any) -> None:
        """Send every written result to TensorBoard under `<run dir>/tensorboard` (main process only)."""
        if self.is_main_process:
            log_dir = kwargs.pop("log_dir", os.path.join(self.dir, "tensorboard"))
            self.trackers.append(TensorBoardTracker(log_dir, *args, **kwargs))

    def init_wandb(self, *args: Any, **kwargs: Any) -> None:
        """Send every written result to a W&B run (main process only).

        Project, group and name default to the lineage, experiment and run id; `wandb.*` config
        keys and keyword arguments override them.
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
        self.trackers.append(WandbTracker(*args, **options))
