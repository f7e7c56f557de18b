"""`torch.profiler` over a bounded window of training steps, as a subscriber of the runner's events."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

from ..loop.events import EventBus, Events, PassContext, RunContext, StepContext

__all__ = ["StepProfiler"]


class StepProfiler:
    """Profile training steps `wait + warmup + 1 ... wait + warmup + active` (per cycle) with `torch.profiler`.

    The profiler starts at the first training pass and advances once per training micro-step
    (evaluation and inference steps are not profiled). It skips `wait` steps, warms up for
    `warmup` steps (recorded, then discarded, so start-up costs do not distort the trace), records
    `active` steps and writes one trace per cycle and rank, `repeat` cycles in all (`None`: one).
    Traces are Chrome/Perfetto JSON files (`*.pt.trace.json`), which TensorBoard's profiler
    plugin reads from the same directory. The profiler stops by itself after the last cycle, so
    the rest of the run pays nothing.

    Args:
        trace_dir: Directory of the trace files.
        rank: Rank, used in the trace file names.
        wait: Steps skipped before each cycle.
        warmup: Steps recorded and discarded before each cycle's active steps.
        active: Steps recorded per cycle.
        repeat: Number of cycles (`None` or 0: one).
        record_shapes: Passed to `torch.profiler.profile` (input shapes of each op).
        profile_memory: Passed to `torch.profiler.profile` (tensor allocations).
        with_stack: Passed to `torch.profiler.profile` (Python stacks of each op).
        with_flops: Passed to `torch.profiler.profile` (estimated FLOPs of matrix products).
        logger: Where to say where the traces went.
    """

    def __init__(
        self,
        trace_dir: str | os.PathLike,
        *,
        rank: int = 0,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int | None = None,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        with_flops: bool = False,
        logger: logging.Logger | None = None,
    ) -> None:
        for name, value, minimum in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"profiling.{name} must be an integer >= {minimum}, got {value!r}")
        self.trace_dir = Path(trace_dir)
        self.rank = rank
        self.window = (wait, warmup, active, repeat or 1)
        self.options = {
            "record_shapes": record_shapes,
            "profile_memory": profile_memory,
            "with_stack": with_stack,
            "with_flops": with_flops,
        }
        self.logger = logger or logging.getLogger(__name__)
        self.steps = 0
        self.traces: list[Path] = []
        self._profiler: Any = None
        self._training = False
        self._modes: list[bool] = []
        self._done = False

    @property
    def total_steps(self) -> int:
        """Training steps the whole profile spans."""
        wait, warmup, active, repeat = self.window
        return (wait + warmup + active) * repeat

    def attach(self, bus: EventBus) -> StepProfiler:
        bus.subscribe(Events.PASS_START, self._pass_start)
        bus.subscribe(Events.PASS_END, self._pass_end)
        bus.subscribe(Events.STEP_END, self._step)
        bus.subscribe(Events.RUN_END, self._run_end)
        return self

    def _pass_start(self, context: PassContext) -> None:
        self._modes.append(self._training)  # a pass may run inside a training pass (step-mode evaluation)
        self._training = context.mode == "train"
        if self._training and self._profiler is None and not self._done:
            self._start()

    def _pass_end(self, context: PassContext) -> None:
        self._training = self._modes.pop() if self._modes else False

    def _step(self, context: StepContext) -> None:
        if not self._training or self._profiler is None:
            return
        with warnings.catch_warnings():  # each cycle is written on its own: that torch clears events is intended
            warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
            self._profiler.step()
        self.steps += 1
        if self.steps >= self.total_steps:
            self.stop()

    def _run_end(self, context: RunContext) -> None:
        self.stop()

    def _start(self) -> None:
        import torch.profiler as profiler

        wait, warmup, active, repeat = self.window
        activities = [profiler.ProfilerActivity.CPU]
        if _cuda_available():  # GPU-only branch: kernel timings
            activities.append(profiler.ProfilerActivity.CUDA)
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        self._profiler = profiler.profile(
            activities=activities,
            schedule=profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=repeat),
            on_trace_ready=self._write_trace,
            **self.options,
        )
        self._profiler.start()
        self.logger.info(
            "profiling training steps %d-%d (%d cycle(s) of %d active steps) into %s",
            wait + warmup + 1,
            self.total_steps,
            repeat,
            active,
            self.trace_dir,
        )

    def _write_trace(self, prof: Any) -> None:
        path = self.trace_dir / f"rank{self.rank}-cycle{len(self.traces)}.pt.trace.json"
        prof.export_chrome_trace(os.fspath(path))
        self.traces.append(path)
        self.logger.info("profiler trace written to %s (open in Perfetto or TensorBoard)", path)

    def stop(self) -> None:
        """Stop profiling (a trace of an unfinished cycle is not written); later steps are not profiled."""
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            self._done = True
            profiler.stop()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
