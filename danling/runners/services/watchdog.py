"""A hang watchdog for multi-process runs: a silent rank or a stuck collective ends the run with a message.

Every rank runs a [`Watchdog`][danling.runners.services.watchdog.Watchdog] thread. The training
loops tell it, with plain attribute writes, which phase the rank is in (data loading, forward,
backward, optimizer step, checkpoint save, evaluation) and at which step; the thread publishes
that, with a beat counter of its own, to `<dir>/rank-<N>.json` every `interval` seconds and reads
the files of the other ranks. It judges by what it sees change, on its own monotonic clock, so
clocks that differ between hosts do not matter:

- a rank whose beat counter has not moved for `timeout` seconds is *silent*: its process is
  frozen (SIGSTOP, a debugger, swapping) or gone;
- a rank inside a loop whose progress has not moved for `timeout` seconds is *stalled*: stuck in a
  collective, in a data loader, in a save.

When any rank is silent or stalled, every live rank logs one message naming the stuck ranks
(the silent ones, else the stalled ones furthest behind), the phase each was last in and its
last step, flushes its logs and leaves with `os._exit(exit_code)`: a process blocked inside a
collective cannot be unwound, and `destroy_process_group` could block as well.

Files rather than the rendezvous store: the store is served by one rank, and a frozen rank 0
would freeze every store call of the others. The run directory must be visible to every rank
(as checkpoints already require); ranks whose file was never seen are not judged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import sys
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

from danling.checkpoint.manifest import atomic_write_text

__all__ = ["PHASES", "LocalWatchdog", "Watchdog"]

PHASES = ("data loading", "forward", "backward", "optimizer step", "checkpoint save", "evaluation", "idle")


class _WatchThread(ABC):
    """What both watchdogs share: their limits, a daemon thread that looks every `interval` seconds,
    and the ending ([`end_run`][danling.runners.services.watchdog.end_run]) when a look finds a hang."""

    # Errors a look may meet without ending the process (logged at DEBUG, the next look tries again).
    _TOLERATED: tuple[type[BaseException], ...] = (OSError,)

    def _limits(
        self,
        timeout: float,
        interval: float | None,
        exit_code: int,
        logger: logging.Logger | None,
        on_timeout: Callable[[str], Any] | None,
    ) -> None:
        check_times(timeout, interval)
        self.timeout = float(timeout)
        self.interval = float(interval) if interval is not None else min(self.timeout / 10, 5.0)
        self.exit_code = exit_code
        self.logger = logger or logging.getLogger("danling.runners")
        self.on_timeout = on_timeout
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _start_thread(self, name: str) -> None:
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _stop_thread(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            # A look under way when the stop came must finish first (a beat being written would
            # otherwise land after its file is removed); on a loaded machine that can take a while.
            thread.join(self.interval + 10.0)

    @abstractmethod
    def _look(self, now: float) -> str | None:
        """One look: the message to end the run with, or `None` while all is well."""

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                message = self._look(time.monotonic())
            except self._TOLERATED as error:  # a full or vanished directory, a runner torn down under it
                self.logger.debug("watchdog: %r", error)
                continue
            if message is not None and not self._stop.is_set():
                end_run(message, self.exit_code, self.logger, self.on_timeout)
                return


class Watchdog(_WatchThread):
    """Heartbeat thread of one rank that ends the run when a rank stops making progress.

    Args:
        directory: Directory of the per-rank files, shared by every rank.
        rank: This process's global rank.
        world_size: Number of ranks.
        timeout: Seconds without progress (or without a heartbeat) before the run is ended.
        interval: Seconds between heartbeats (default: a tenth of `timeout`, at most 5 s).
        exit_code: Status this process exits with when the watchdog fires.
        logger: Where the message goes (it is also written to stderr).
        on_timeout: Called with the message instead of exiting (tests, embedding); the thread then stops.

    Attributes:
        phase: The phase this rank is in (set by the loops).
        step: The global step of that phase.
        active: Whether the rank is inside a loop (a rank outside loops is never "stalled").
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        rank: int,
        world_size: int,
        timeout: float,
        *,
        interval: float | None = None,
        exit_code: int = 124,
        logger: logging.Logger | None = None,
        on_timeout: Callable[[str], Any] | None = None,
    ) -> None:
        self._limits(timeout, interval, exit_code, logger, on_timeout)
        self.directory = Path(directory)
        self.rank, self.world_size = rank, world_size
        self.phase, self.step, self.progress, self.active = "idle", 0, 0, False
        self._beat = 0
        self._seen: dict[int, _Seen] = {}

    # main thread ------------------------------------------------------------------------------

    def enter(self, phase: str, step: int) -> None:
        """Record that this rank entered `phase` at global step `step` (cheap: attribute writes only)."""
        self.phase, self.step = phase, step
        self.progress += 1

    def start(self) -> None:
        """Start the heartbeat thread (idempotent)."""
        if self._thread is not None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        self._publish()
        self._start_thread(f"danling-watchdog-{self.rank}")

    def close(self) -> None:
        """Stop the thread and remove this rank's file, so peers do not take its silence for a hang."""
        self._stop_thread()  # a beat being written lands before the file is removed (it would recreate it)
        with contextlib.suppress(OSError):
            self.file.unlink(missing_ok=True)  # peers take a vanished file for a closed rank
            self.directory.rmdir()  # the last rank to leave removes the launch's directory
            self.directory.parent.rmdir()
            self.directory.parent.parent.rmdir()  # the heartbeat directory, unless heartbeats use it

    @property
    def file(self) -> Path:
        return self.directory / f"rank-{self.rank}.json"

    # watchdog thread --------------------------------------------------------------------------

    def _look(self, now: float) -> str | None:
        self._publish()
        return self.check(now)

    def _publish(self) -> None:
        if self._stop.is_set() and self._thread is None:  # closed: its file is gone for good
            return
        self._beat += 1
        record = {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "beat": self._beat,
            "progress": self.progress,
            "phase": self.phase,
            "step": self.step,
            "active": self.active,
        }
        atomic_write_text(self.file, json.dumps(record) + "\n")

    def _read(self, rank: int) -> dict[str, Any] | None:
        try:
            return json.loads((self.directory / f"rank-{rank}.json").read_text())
        except (OSError, ValueError):  # not written yet, or replaced mid-read
            return None

    def check(self, now: float) -> str | None:
        """Read every rank's file; return the message to end the run with, or `None` while all is well."""
        silent, stalled = [], []
        for rank in range(self.world_size):
            record = self._read(rank)
            if record is None or record.get("closed"):  # not started yet, or closed (its file removed)
                self._seen.pop(rank, None)
                continue
            seen = self._observe(rank, record, now)
            if rank != self.rank and now - seen.beat_at >= self.timeout:  # (its own thread is running)
                silent.append(seen.record)
            elif seen.record.get("active") and now - seen.progress_at >= self.timeout:
                stalled.append(seen.record)
        return _verdict(silent, stalled, self.timeout, self.rank, self.exit_code)

    def _observe(self, rank: int, record: dict[str, Any], now: float) -> _Seen:
        """Update when `rank`'s beat and progress were last seen moving."""
        seen = self._seen.get(rank)
        if seen is None:
            seen = self._seen[rank] = _Seen(record, now, now)
            return seen
        if record["beat"] != seen.record["beat"]:
            seen.beat_at = now
        if record["progress"] != seen.record["progress"] or record.get("active") != seen.record.get("active"):
            seen.progress_at = now
        seen.record = record
        return seen


def end_run(
    message: str, exit_code: int, logger: logging.Logger, on_timeout: Callable[[str], Any] | None = None
) -> None:
    """What a watchdog does when it fires: log the main thread's stack and `message`, flush, `os._exit(exit_code)`.

    With `on_timeout`, that is called with `message` instead of exiting.
    """
    stack = _main_thread_stack()
    if stack:
        logger.error(stack)  # before the line, so that the line ends the output
    logger.error(message)
    if on_timeout is not None:
        on_timeout(message)
        return
    handlers = _handlers(logger)
    if not any(_is_console(handler) for handler in handlers):
        # a process whose log goes to files only still says it on stderr
        sys.__stderr__.write((stack + "\n" if stack else "") + message + "\n")
    for handler in handlers:
        with contextlib.suppress(Exception):  # a broken handler must not keep a hung process alive
            handler.flush()
    sys.stdout.flush()
    sys.__stderr__.flush()
    os._exit(exit_code)


def _main_thread_stack() -> str:
    """Where the main thread is (its Python frames; a C call shows as the line that made it)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None or threading.current_thread() is threading.main_thread():
        return ""
    stack = "".join(traceback.format_stack(frame)).rstrip()
    return f"main thread when the watchdog fired (most recent call last):\n{stack}"


class LocalWatchdog(_WatchThread):
    """Hang watchdog of a single-process run: ends the run when its progress counters stop moving.

    A thread reads `progress()` every `interval` seconds; the loops are told nothing, so the steps
    cost what they cost without a watchdog (the fused training pass included). While `progress()`
    says the run is inside a loop and its counters have not changed for `timeout` seconds, it names
    the phase and step `where()` gives, as the multi-process
    [`Watchdog`][danling.runners.services.watchdog.Watchdog]
    would for a stalled rank, and ends the process the same way
    ([`end_run`][danling.runners.services.watchdog.end_run]).

    Args:
        progress: Called on the thread: `(inside a loop, counters)`; any change of `counters` is progress.
        where: Called on the thread when it fires: `(phase, global step)`.
        timeout: Seconds without progress inside a loop before the run is ended.
        interval: Seconds between reads (default: a tenth of `timeout`, at most 5 s).
        exit_code: Status this process exits with when the watchdog fires.
        logger: Where the message goes (it is also written to stderr).
        on_timeout: Called with the message instead of exiting (tests, embedding); the thread then stops.
    """

    def __init__(
        self,
        progress: Callable[[], tuple[bool, Any]],
        where: Callable[[], tuple[str, int]],
        timeout: float,
        *,
        interval: float | None = None,
        exit_code: int = 124,
        logger: logging.Logger | None = None,
        on_timeout: Callable[[str], Any] | None = None,
    ) -> None:
        self._limits(timeout, interval, exit_code, logger, on_timeout)
        self.progress, self.where = progress, where
        self._last: tuple[bool, Any] | None = None
        self._moved_at = 0.0

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._start_thread("danling-watchdog")

    def close(self) -> None:
        """Stop the thread."""
        self._stop_thread()

    def check(self, now: float) -> str | None:
        """Read the progress; return the message to end the run with, or `None` while all is well."""
        current = self.progress()
        if current != self._last:
            self._last, self._moved_at = current, now
            return None
        if not current[0] or now - self._moved_at < self.timeout:  # outside loops nothing is expected
            return None
        phase, step = self.where()
        record = {"rank": 0, "host": socket.gethostname(), "pid": os.getpid(), "phase": phase, "step": step}
        return _verdict([], [record], self.timeout, 0, self.exit_code)

    _TOLERATED = (Exception,)  # a runner torn down under it must not end the process

    def _look(self, now: float) -> str | None:
        return self.check(now)


def _handlers(logger: logging.Logger) -> list[logging.Handler]:
    """The handlers a record sent to `logger` reaches (its own and its ancestors' while propagating)."""
    handlers: list[logging.Handler] = []
    current: logging.Logger | None = logger
    while current is not None:
        handlers.extend(current.handlers)
        current = current.parent if current.propagate else None
    return handlers


def _is_console(handler: logging.Handler) -> bool:
    stream = getattr(handler, "stream", None)
    return not isinstance(handler, logging.FileHandler) and stream in (
        sys.stderr,
        sys.stdout,
        sys.__stderr__,
        sys.__stdout__,
    )


class _Seen:
    """The last record read from one rank, and when (monotonic) its beat and its progress last moved."""

    __slots__ = ("beat_at", "progress_at", "record")

    def __init__(self, record: dict[str, Any], beat_at: float, progress_at: float) -> None:
        self.record, self.beat_at, self.progress_at = record, beat_at, progress_at


def _verdict(silent: list[dict], stalled: list[dict], timeout: float, rank: int, code: int) -> str | None:
    """The message naming the stuck ranks: the silent ones, else the stalled ones furthest behind."""
    if silent:
        stuck, how = silent, "no heartbeat"
    elif stalled:
        behind = min(int(record["step"]) for record in stalled)
        stuck, how = [record for record in stalled if int(record["step"]) == behind], "no progress"
    else:
        return None
    names = "; ".join(
        f"rank {r['rank']} ({r.get('host', '?')} pid {r.get('pid', '?')}): last in {r['phase']} at step {r['step']}"
        for r in stuck
    )
    return (
        f"watchdog (rank {rank}): {how} for {timeout:g} s from {len(stuck)} rank(s): {names}. "
        f"Ending this rank with exit code {code} (watchdog.timeout_seconds)"
    )


def check_times(timeout: Any, interval: Any = None) -> None:
    """Refuse a `watchdog.timeout_seconds` / `watchdog.interval_seconds` that could never work, naming the value."""
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ValueError(f"watchdog.timeout_seconds must be a positive number of seconds, got {timeout!r}")
    if interval is not None and (not isinstance(interval, (int, float)) or interval <= 0 or interval >= timeout):
        raise ValueError(
            f"watchdog.interval_seconds must be positive and below watchdog.timeout_seconds ({timeout!r}), "
            f"got {interval!r}"
        )


def watch_runner(runner: Any) -> Watchdog | None:
    """Start the watchdog of a runner once, as `watchdog.*` says; the multi-process one, else `None`.

    A single-process runner gets a [`LocalWatchdog`][danling.runners.services.watchdog.LocalWatchdog]
    (`supervisor.local_watchdog`), which the loops need not tell anything: `None` is returned for it.

    Called by the training loop on every rank when it starts (a collective: the ranks agree on a
    token naming this launch's directory, so files left by an earlier launch are never read).
    """
    supervisor = runner.supervisor
    if supervisor.watchdog is not None:
        return supervisor.watchdog
    section = runner.config.get("watchdog")
    if section is None:
        return None
    check_times(section.timeout_seconds, section.interval_seconds)  # also where it would never start
    if not section.enabled:
        return None
    if not runner.distributed:
        _watch_single_process(runner, section)
        return None  # the loops report nothing to it: the steps (and the fused pass) stay as they are
    import torch.distributed as dist

    root = runner.workspace.heartbeat_dir / "watchdog"
    # Rank 0's run directory names the launch's directory for every rank: other ranks never
    # derive a run directory of their own to write into.
    launch = [str(root / f"{os.getpid()}-{time.time_ns()}")]
    if runner.rank == 0 and root.is_dir():  # left by launches that were killed
        for stale in root.iterdir():
            shutil.rmtree(stale, ignore_errors=True)
    dist.broadcast_object_list(launch, src=0)
    watchdog = Watchdog(
        Path(launch[0]),
        runner.rank,
        runner.world_size,
        section.timeout_seconds,
        interval=section.interval_seconds,
        exit_code=section.exit_code,
        logger=runner.logger,
    )
    watchdog.start()
    supervisor.watchdog = watchdog
    return watchdog


# Functions of the main thread's stack that name the phase it is in, checked from the innermost frame out;
# a training step elsewhere is in "forward" (as the multi-process loops call it until backward starts).
_PHASE_OF_FUNCTION = {
    "save_checkpoint": "checkpoint save",
    "finish_checkpoints": "checkpoint save",
    "backward": "backward",
    "optimizer_step": "optimizer step",
    "step_plain": "optimizer step",
    "evaluate_step": "evaluation",
    "infer_step": "inference",
    "__next__": "data loading",
}


def _watch_single_process(runner: Any, section: Any) -> None:
    """Start the `LocalWatchdog` of a single-process runner once (closed with its supervisor)."""
    supervisor = runner.supervisor
    if supervisor.local_watchdog is not None:
        return

    def progress() -> tuple[bool, Any]:
        # Counters the loops update anyway: micro-steps and steps in training (the fused pass
        # too), batches of the pass position, the loss meter's count (the samples of evaluation
        # batches) and the inference batches.
        state, meters = runner.train_state, runner.meters
        loss = meters["loss"].count if "loss" in meters else None
        inferred = runner.loop.passes.infer_batches
        counters = (
            state.micro_step,
            state.global_step,
            runner.loop_state.batch,
            loss,
            inferred,
            runner.mode,
            runner.split,
        )
        return runner._loop_depth > 0, counters

    def where() -> tuple[str, int]:
        frame = sys._current_frames().get(threading.main_thread().ident or -1)
        while frame is not None:
            phase = _PHASE_OF_FUNCTION.get(frame.f_code.co_name)
            if phase is not None:
                break
            frame = frame.f_back
        else:
            phase = "forward" if runner.mode == "train" else "evaluation"  # `RunnerMode` is a str enum
        return phase, runner.train_state.global_step

    watchdog = LocalWatchdog(
        progress,
        where,
        section.timeout_seconds,
        interval=section.interval_seconds,
        exit_code=section.exit_code,
        logger=runner.logger,
    )
    watchdog.start()
    supervisor.local_watchdog = watchdog
