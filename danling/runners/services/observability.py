"""What a runner reports while it runs, besides its result rows: training rates and the status file.

[`Throughput`][danling.runners.services.observability.Throughput] (`runner.throughput`) measures
what a training step log adds to the step losses (learning rates, gradient norm, steps, samples
and tokens per second, peak memory); [`RunStatus`][danling.runners.services.observability.RunStatus]
keeps `<run dir>/status.json` current for `danling runs`. Both attach to the runner's event bus;
the runner's `init_*` hooks (heartbeat, signals, GC pacing, TensorBoard, W&B) stay on the runner.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from danling.checkpoint.manifest import atomic_write_text

try:
    import resource
except ImportError:  # pragma: no cover - Windows has no getrusage
    resource = None  # type: ignore[assignment]

from ..loop.events import EventBus, Events, PassContext, RunContext, StopContext
from .telemetry import FlopsTelemetry

__all__ = ["RunStatus", "Throughput", "is_train_step_log"]


class Throughput:
    """Rates of the training steps between two step logs, and the tokens counted for them.

    Args:
        progress: Returns the global step (read when a training pass starts).

    Examples:
        >>> rates = Throughput(lambda: 0)
        >>> rates.count_tokens(100)
        >>> sorted(rates.rates(step=0))
        ['memory']
    """

    def __init__(self, progress: Callable[[], int]) -> None:
        self.progress = progress
        self.tokens: Any = None  # a number or a 0-d tensor, summed on its device
        # `tflops` and `mfu` from the steps per second (`runner.telemetry`, set by the torch runner)
        self.telemetry: FlopsTelemetry | None = None
        self._mark: tuple[float, int, float | None] | None = None

    def count_tokens(self, tokens: int | Any) -> None:
        """Add the tokens one training step processed; step logs then report `throughput/tokens_per_second`.

        Call it from `train_step` (`self.throughput.count_tokens(mask.sum())`) with a number or a
        0-d tensor: a tensor stays on its device and is read only at log steps, so counting costs
        no host synchronisation per step. The count is of this process; multiply by the
        data-parallel size for the whole job.
        """
        self.tokens = tokens if self.tokens is None else self.tokens + tokens

    def attach(self, bus: EventBus) -> Throughput:
        bus.subscribe(Events.PASS_START, self._pass_start)
        return self

    def _pass_start(self, context: PassContext) -> None:
        # Throughput is measured within training passes: evaluation time between them is not counted.
        if context.mode == "train":
            self._mark = (time.perf_counter(), self.progress(), None if self.tokens is None else float(self.tokens))

    def rates(
        self, step: int, *, optimizer: Any = None, grad_norm: float | None = None, samples_per_step: int | None = None
    ) -> dict[str, Any]:
        """What a training step log adds to the step losses: learning rates (of `optimizer`), the
        gradient norm (measured by clipping only), throughput since the previous call (samples per
        second when `samples_per_step` is given), `tflops` and `mfu` (with a `telemetry`) and peak memory."""
        rates: dict[str, Any] = {}
        groups = getattr(optimizer, "param_groups", None) or []
        lrs = {
            str(group.get("name", f"group{index}")): group["lr"] for index, group in enumerate(groups) if "lr" in group
        }
        if len(lrs) == 1:
            rates["lr"] = next(iter(lrs.values()))
        elif lrs:
            rates["lr"] = lrs
        if grad_norm is not None:
            rates["grad_norm"] = grad_norm
        now = time.perf_counter()
        mark, tokens = self._mark, None if self.tokens is None else float(self.tokens)
        self._mark = (now, step, tokens)
        if mark is not None and step > mark[1] and now > mark[0]:
            seconds = now - mark[0]
            steps_per_second = (step - mark[1]) / seconds
            rates["throughput"] = {"steps_per_second": steps_per_second}
            if samples_per_step:
                rates["throughput"]["samples_per_second"] = steps_per_second * samples_per_step
            if tokens is not None:
                rates["throughput"]["tokens_per_second"] = (tokens - (mark[2] or 0.0)) / seconds
            if self.telemetry is not None:
                rates.update(self.telemetry.values(steps_per_second))
        rates["memory"] = _peak_memory()
        return rates


class RunStatus:
    """Keeps `<run dir>/status.json` current: `running`, then `finished`, `failed` or `preempted`.

    Args:
        path: The status file.
        progress: Returns `(global_step, epoch)`, recorded with every status.
    """

    def __init__(self, path: str | os.PathLike, progress: Callable[[], tuple[int, int]]) -> None:
        self.path = Path(path)
        self.progress = progress
        self._stop_seen = False
        self._training = False  # a train() is under way: only its stop is a preemption of the run

    def attach(self, bus: EventBus) -> RunStatus:
        bus.subscribe(Events.RUN_START, self._running)
        bus.subscribe(Events.RUN_END, self._ended)
        bus.subscribe(Events.STOP_REQUESTED, self._stopping)
        return self

    def write(self, status: str, **extra: Any) -> None:
        """Replace the status file with `status`, the time, process, host, progress and `extra`."""
        global_step, epoch = self.progress()
        record = {
            "status": status,
            "time": time.time(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "global_step": global_step,
            "epoch": epoch,
            **extra,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps(record, sort_keys=True) + "\n")

    def _running(self, context: RunContext) -> None:
        if context.mode == "train":
            self._stop_seen, self._training = False, True
            self.write("running")

    def _stopping(self, context: StopContext) -> None:
        # An early stop ends train() normally (`finished`); a stop of evaluate() or infer() leaves the
        # training status alone (a finished run stays finished when its scoring job is preempted).
        if not self._training or context.reason == "early stop":
            return
        self._stop_seen = True
        self.write("preempted", reason=context.reason)

    def _ended(self, context: RunContext) -> None:
        if context.mode != "train":
            return
        self._training = False
        if self._stop_seen:  # a stop request already recorded `preempted`
            self._stop_seen = False
            return
        error = context.error
        if error is None:
            self.write("finished")
        else:
            self.write("failed", error=f"{type(error).__name__}: {error}"[:500])


def is_train_step_log(values: Mapping[str, Any]) -> bool:
    """A training step log is `{"<split>_step": {...}}` (see `PassEngine` in `danling.runners.loop.passes`)."""
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
