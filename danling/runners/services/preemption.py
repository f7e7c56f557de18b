"""Slurm preemption: the configured signal stops the run at a checkpoint, then the job requeues itself.

The stop itself is the runner's graceful stop (the supervisor's signal handlers and the loop):
[`SlurmPreemption`][danling.runners.services.preemption.SlurmPreemption] only adds its signal to
the supervisor's stop signals, so every rank stops at the same step (the ranks agree on the stop
through a collective at a step boundary, not on when the signal arrived), saves the `shutdown`
checkpoint and closes the runner. It listens on the event bus: `STOP_REQUESTED` says whether its
signal caused the stop, and `RUN_END`, which comes after the runner is closed (the checkpoint is on
disk and every rank has left the process group), is when the main process runs
`scontrol requeue <job id>`. Slurm then ends the job's remaining processes and queues the job
again; the new run finds its checkpoint with `auto_resume`.
"""

from __future__ import annotations

import logging
import signal
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

from danling.distributed.slurm import SlurmJob

from ..loop.events import EventBus, Events, RunContext, StopContext

__all__ = ["SlurmPreemption", "parse_signal"]

# `scontrol requeue` is one RPC to slurmctld; a controller that does not answer in this long will not.
_REQUEUE_TIMEOUT = 60.0


class SlurmPreemption:
    """Turn the Slurm preemption signal into a graceful stop and, when asked, a requeue of the job.

    Args:
        signal_name: `slurm.signal`: the signal's name (`USR1`, `SIGUSR1`, `TERM`) or number;
            None disables the service.
        requeue: `slurm.requeue`: requeue the job after a stop its signal caused.
        job: The Slurm job this process runs in; None (outside Slurm) disables the service.
        is_main_process: Whether this process runs the requeue (only one rank must).
        logger: Where the requeue is reported.
        run_command: Runs `scontrol` (`subprocess.run`'s signature); tests pass a fake.

    Raises:
        ValueError: `signal_name` names no signal, or `SIGKILL`/`SIGSTOP` (which cannot be caught).

    Examples:
        >>> from danling.distributed.slurm import SlurmJob
        >>> service = SlurmPreemption("USR1", requeue=True, job=SlurmJob("42"), is_main_process=True)
        >>> service.signal.name
        'SIGUSR1'
        >>> SlurmPreemption("USR1", requeue=True, job=None, is_main_process=True).signal is None
        True
    """

    def __init__(
        self,
        signal_name: str | int | None,
        *,
        requeue: bool,
        job: SlurmJob | None,
        is_main_process: bool,
        logger: logging.Logger | None = None,
        run_command: Callable[..., Any] = subprocess.run,
    ) -> None:
        parsed = parse_signal(signal_name)
        self.signal: signal.Signals | None = parsed if job is not None else None
        self.requeue = bool(requeue)
        self.job = job
        self.is_main_process = is_main_process
        self.logger = logger or logging.getLogger("danling.runners")
        self.run_command = run_command
        self.requested = False  # the stop under way was caused by `signal`
        self.requeued = False

    def stop_signals(self) -> tuple[signal.Signals, ...]:
        """The signals to add to the supervisor's stop signals (none outside Slurm or when disabled)."""
        return () if self.signal is None else (self.signal,)

    def attach(self, events: EventBus) -> SlurmPreemption:
        """Listen for the stop and the end of the run on `events`; does nothing when disabled."""
        if self.signal is not None:
            events.subscribe(Events.STOP_REQUESTED, self._on_stop)
            events.subscribe(Events.RUN_END, self._on_run_end)
        return self

    def _on_stop(self, context: StopContext) -> None:
        if context.signal is not None and self.signal is not None and int(context.signal) == int(self.signal):
            self.requested = True
            action = "requeueing the job once the checkpoint is saved" if self.requeue else "slurm.requeue is off"
            self.logger.warning("Slurm job %s: %s asks for a checkpoint; %s", self.job_id, self.signal.name, action)

    def _on_run_end(self, context: RunContext) -> None:
        if self.requested and isinstance(context.error, SystemExit):
            self.requeue_job()

    @property
    def job_id(self) -> str | None:
        """The id `scontrol requeue` takes (an array task has its own `SLURM_JOB_ID`)."""
        return None if self.job is None else self.job.job_id

    def requeue_job(self) -> bool:
        """Run `scontrol requeue <job id>` on the main process once, when `requeue` is on.

        Returns whether the requeue was issued and accepted. A failure is logged, not raised: the
        checkpoint is saved, and the job can still be resubmitted by hand.
        """
        if not (self.requeue and self.is_main_process and self.job_id) or self.requeued:
            return False
        command: Sequence[str] = ("scontrol", "requeue", self.job_id)
        try:
            result = self.run_command(command, capture_output=True, text=True, timeout=_REQUEUE_TIMEOUT, check=False)
        except (OSError, subprocess.SubprocessError) as error:
            self.logger.error("could not requeue Slurm job %s (%s); resubmit it to resume", self.job_id, error)
            return False
        if result.returncode != 0:
            detail = (result.stderr or result.stdout or "").strip()
            self.logger.error(
                "`%s` failed (exit %d: %s); resubmit the job to resume", " ".join(command), result.returncode, detail
            )
            return False
        self.requeued = True
        self.logger.warning("requeued Slurm job %s; it resumes from the shutdown checkpoint", self.job_id)
        return True


def parse_signal(value: str | int | None) -> signal.Signals | None:
    """A signal from its name (`USR1`, `SIGUSR1`, `usr1`) or number; None stays None.

    Raises:
        ValueError: the value names no signal, or one a process cannot catch.

    Examples:
        >>> parse_signal("usr2").name, parse_signal("SIGTERM").name, parse_signal(None)
        ('SIGUSR2', 'SIGTERM', None)
    """
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    try:
        if isinstance(value, int) or str(value).strip().isdigit():
            parsed = signal.Signals(int(value))
        else:
            name = str(value).strip().upper()
            parsed = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    except (KeyError, ValueError):
        raise ValueError(f"slurm.signal={value!r} names no signal; use a name such as USR1, USR2 or TERM") from None
    if parsed in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"slurm.signal={value!r} cannot be caught; use a signal such as USR1, USR2 or TERM")
    return parsed
