"""Slow ranks named: per-rank phase times, compared across ranks at the training step logs (`stragglers.enabled`).

The loops already mark, for the hang watchdog, which phase a rank enters (data loading, forward,
backward, optimizer step) with `enter(phase, step)` calls. While a training run is under way,
[`StragglerMonitor`][danling.runners.diagnosis.stragglers.StragglerMonitor] puts a
[`PhaseClock`][danling.runners.diagnosis.stragglers.PhaseClock] in the watchdog's place: it adds
the time since the previous mark to the phase being left, and passes each mark on to the
watchdog. Nothing else runs per batch. At each training step log the ranks exchange their totals
since the previous log in one small all-gather, and
[`name_straggler`][danling.runners.diagnosis.stragglers.name_straggler] names the slowest rank.

**Waiting in collectives.** A phase that holds a collective every rank leaves together (under
DDP, `backward`: the gradient all-reduce completes on all ranks at once) lasts longest on the
*fast* ranks, which arrive first and wait for the slow one. Its time there is therefore split:
the fastest rank's time counts as work on every rank, the rest as waiting. A rank is ranked by
its work per step (all phases, waiting left out); its phase is the one of its phases outside the
collective ones that exceeds the median of the other ranks the most. A rank slow *inside* a
collective phase (a slow GPU's backward) makes every rank equally slow there, so it is named
through its other phases (the same GPU runs its forward slowly too).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..config_operations import StragglerConfig
from ..loop.events import EventBus, Events, RunContext, StepLogContext

__all__ = ["TRAINING_PHASES", "PhaseClock", "Straggler", "StragglerMonitor", "name_straggler"]

TRAINING_PHASES = ("data loading", "forward", "backward", "optimizer step")
"""The phases of a training step the monitor compares (the watchdog's names)."""


class PhaseClock:
    """Stands in for the hang watchdog while a training run is under way, timing the phases it is told.

    Args:
        inner: The watchdog to pass every mark on to (`None`: no watchdog runs).

    Attributes:
        totals: Seconds spent in each phase so far (the phase under way not yet added).
        phase: The phase this rank is in; step: its global step (the watchdog's attributes).
    """

    __slots__ = ("inner", "phase", "step", "totals", "_since")

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner
        self.phase: str = getattr(inner, "phase", "idle")
        self.step: int = getattr(inner, "step", 0)
        self.totals: dict[str, float] = {}
        self._since = perf_counter()

    def enter(self, phase: str, step: int) -> None:
        """Add the time since the previous mark to the phase being left, then enter `phase`."""
        now = perf_counter()
        totals, left = self.totals, self.phase
        totals[left] = totals.get(left, 0.0) + (now - self._since)
        self._since, self.phase, self.step = now, phase, step
        if self.inner is not None:
            self.inner.enter(phase, step)

    def close(self) -> None:
        """Close the watchdog behind it (the supervisor closes whatever holds its place)."""
        if self.inner is not None:
            self.inner.close()


@dataclass(frozen=True)
class Straggler:
    """The slowest rank over the window, as the step log reports it.

    Attributes:
        rank: Its global rank.
        phase: Its phase furthest above the median of the other ranks.
        slowdown: Its work per step over the median of the other ranks' (waiting left out).
        lag_ms: Milliseconds per step it spends in `phase` beyond that median.
        waiting_ms: Milliseconds per step the median other rank waits in collective phases.
    """

    rank: int
    phase: str
    slowdown: float
    lag_ms: float
    waiting_ms: float

    def values(self) -> dict[str, Any]:
        """What the step log and the trackers get under `straggler`: scalar trackers keep the numbers,
        so the phase is also given as `phase_id`, its index in `TRAINING_PHASES`."""
        return {
            "rank": self.rank,
            "phase": self.phase,
            "phase_id": TRAINING_PHASES.index(self.phase) if self.phase in TRAINING_PHASES else -1,
            "slowdown": round(self.slowdown, 3),
            "lag_ms": round(self.lag_ms, 3),
            "waiting_ms": round(self.waiting_ms, 3),
        }


def name_straggler(
    per_step: Sequence[Sequence[float]], phases: Sequence[str], collective: Sequence[str]
) -> Straggler | None:
    """Name the slowest of the ranks given their seconds per step in each phase (`per_step[rank][phase]`).

    Time in a `collective` phase above the fastest rank's is waiting (see the module's docstring);
    `None` for fewer than two ranks.

    Examples:
        >>> times = [[0.001, 0.01, 0.09, 0.002], [0.08, 0.01, 0.01, 0.002]]  # rank 1 loads slowly
        >>> straggler = name_straggler(times, ["data loading", "forward", "backward", "optimizer step"], ["backward"])
        >>> straggler.rank, straggler.phase, round(straggler.lag_ms), round(straggler.waiting_ms)
        (1, 'data loading', 79, 80)
    """
    ranks = len(per_step)
    if ranks < 2:
        return None
    work = [list(row) for row in per_step]
    waiting = [0.0] * ranks
    for index, phase in enumerate(phases):
        if phase in collective:
            floor = min(row[index] for row in per_step)
            for rank in range(ranks):
                waiting[rank] += per_step[rank][index] - floor
                work[rank][index] = floor
    busy = [sum(row) for row in work]
    slowest = max(range(ranks), key=lambda rank: (busy[rank], -rank))
    others = [rank for rank in range(ranks) if rank != slowest]
    median_busy = statistics.median(busy[rank] for rank in others)
    own = [index for index, phase in enumerate(phases) if phase not in collective] or list(range(len(phases)))
    excess = {index: work[slowest][index] - statistics.median(work[rank][index] for rank in others) for index in own}
    worst = max(own, key=lambda index: excess[index])
    return Straggler(
        rank=slowest,
        phase=phases[worst],
        slowdown=busy[slowest] / median_busy if median_busy > 0 else float("inf"),
        lag_ms=1000.0 * excess[worst],
        waiting_ms=1000.0 * statistics.median(waiting[rank] for rank in others),
    )


class _PhaseMarks(Protocol):
    """What the monitor uses of the supervisor: the slot of the object the loops mark phases on."""

    watchdog: Any


class _PhaseReporter(Protocol):
    """What the monitor uses of the update strategy: it reports backward and optimizer steps to `watch`."""

    def watch(self, watchdog: Any) -> None: ...


class StragglerMonitor:
    """Times this rank's phases during training runs and names the slowest rank at each training step log.

    Args:
        section: The `stragglers.*` config.
        world_size: Ranks in the run (the monitor does nothing below two).
        group: Process group of every rank (`None`: the default group).
        logger: Where the WARNING about a persistently slow rank goes.
        report: Whether this rank logs that WARNING (the main process: every rank computes the same).
        global_step: The current global step (where a run's first window starts).

    Attributes:
        latest: The straggler of the latest step log (`None` before the first).
        warnings: WARNINGs logged so far (one per streak of slow step logs).

    Raises:
        ValueError: A `stragglers.*` value outside its range (the message names it).
    """

    def __init__(
        self,
        section: StragglerConfig,
        *,
        world_size: int,
        group: Any = None,
        logger: logging.Logger | None = None,
        report: bool = True,
        global_step: Callable[[], int] = lambda: 0,
    ) -> None:
        check_section(section)
        self.global_step = global_step
        self.factor, self.patience = float(section.factor), int(section.patience)
        self.collective = tuple(section.collective_phases)
        self.world_size, self.group = world_size, group
        self.logger = logger or logging.getLogger("danling.runners")
        self.report = report
        self.history: deque[torch.Tensor] = deque(maxlen=int(section.window))
        self.latest: Straggler | None = None
        self.warnings = 0
        self.clock: PhaseClock | None = None
        self._marks: _PhaseMarks | None = None
        self._reporter: _PhaseReporter | None = None
        self._seen = torch.zeros(len(TRAINING_PHASES) + 1, dtype=torch.float64)
        self._streak: tuple[int, int] = (-1, 0)  # (rank, consecutive slow step logs)

    def attach(self, events: EventBus, marks: _PhaseMarks, reporter: _PhaseReporter) -> None:
        """Time the phases of every training run from now on (`marks`: the supervisor; `reporter`: the update)."""
        if self.world_size < 2:
            return  # one rank has no one to be slower than: no clock, no collective
        self._marks, self._reporter = marks, reporter
        events.subscribe(Events.RUN_START, self._start)
        events.subscribe(Events.RUN_END, self._end)
        events.subscribe(Events.STEP_LOG, self._compare)

    def _start(self, context: RunContext) -> None:
        if context.mode != "train" or self._marks is None or self._reporter is None:
            return
        self.clock = PhaseClock(self._marks.watchdog)
        self._marks.watchdog = self.clock
        self._reporter.watch(self.clock)
        self._seen.zero_()
        self._seen[-1] = self.global_step()  # a resumed run counts its steps from where it starts
        self.history.clear()

    def _end(self, context: RunContext) -> None:
        clock = self.clock
        if clock is None or self._marks is None or self._reporter is None:
            return
        self.clock = None
        if self._marks.watchdog is clock:
            self._marks.watchdog = clock.inner
        self._reporter.watch(clock.inner)

    def _compare(self, context: StepLogContext) -> None:
        """At a training step log: gather every rank's phase times since the previous one and name the slowest."""
        clock = self.clock
        if clock is None or context.mode != "train":
            return
        totals = clock.totals
        now = torch.tensor([*(totals.get(phase, 0.0) for phase in TRAINING_PHASES), float(context.step)])
        row, self._seen = now - self._seen, now
        self.history.append(_gather(row, self.world_size, self.group))
        window = torch.stack(tuple(self.history)).sum(0)
        steps = window[:, -1:].clamp_min(1.0)  # every rank counts the same steps
        straggler = name_straggler((window[:, :-1] / steps).tolist(), TRAINING_PHASES, self.collective)
        if straggler is None:
            return
        self.latest = straggler
        context.values["straggler"] = straggler.values()
        self._judge(straggler, context.step)

    def _judge(self, straggler: Straggler, step: int) -> None:
        """Count consecutive slow step logs of the same rank; WARN once when they reach `patience`."""
        rank, count = self._streak
        if straggler.slowdown < self.factor:
            self._streak = (-1, 0)
            return
        count = count + 1 if rank == straggler.rank else 1
        self._streak = (straggler.rank, count)
        if count != self.patience:
            return
        self.warnings += 1
        if self.report:
            self.logger.warning(
                "straggler: rank %d has been %.2fx the median step time of the other ranks for %d step logs "
                "(global step %d; stragglers.factor=%g), most of it in %s (+%.1f ms per step); the other ranks "
                "wait %.1f ms per step for it in collectives",
                straggler.rank,
                straggler.slowdown,
                count,
                step,
                self.factor,
                straggler.phase,
                straggler.lag_ms,
                straggler.waiting_ms,
            )


def _gather(row: torch.Tensor, world_size: int, group: Any) -> torch.Tensor:
    """Every rank's `row`, stacked by rank: one all-gather (on the GPU under NCCL)."""
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    local = row.to(device)
    rows = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(rows, local, group=group)
    return torch.stack(rows).cpu()


def check_section(section: StragglerConfig) -> None:
    """Refuse a `stragglers.*` value outside its range, naming it (when the section is built, and by `validate`)."""
    factor, window, patience = section.factor, section.window, section.patience
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        raise ValueError(f"stragglers.factor must be a number above 1, got {factor!r}")
    for name, value in (("window", window), ("patience", patience)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"stragglers.{name} must be an integer >= 1, got {value!r}")
    unknown = [phase for phase in section.collective_phases if phase not in TRAINING_PHASES]
    if unknown:
        raise ValueError(
            f"stragglers.collective_phases names unknown phases {unknown}; accepted: {', '.join(TRAINING_PHASES)}"
        )
