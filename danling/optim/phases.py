"""Piecewise learning-rate schedules described as a list of phases."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from math import cos, pi
from numbers import Integral
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler as TorchLRScheduler

from ..utils.registry import Registry
from .lr_scheduler import check_learning_rates, load_keeping_shape

__all__ = ["PHASE_CURVES", "Phase", "PhaseScheduler"]

PHASE_CURVES = Registry("phase curve")
"""Curves that move a multiplier from a phase's start value to its target, by name.

Each entry is `curve(start, target, t) -> multiplier` with `t` in `[0, 1)` the fraction of the phase
already done. A curve may raise `ValueError` for endpoints it cannot handle; the scheduler calls it
once at construction so such errors surface before training.
"""


@PHASE_CURVES.register
def linear(start: float, target: float, t: float) -> float:
    r"""Straight line: $start + (target - start) \cdot t$."""
    return start + (target - start) * t


@PHASE_CURVES.register
def cosine(start: float, target: float, t: float) -> float:
    r"""Half cosine, flat at both ends: $target + (start - target)(1 + \cos(\pi t)) / 2$."""
    return target + (start - target) * (1 + cos(pi * t)) / 2


@PHASE_CURVES.register
def constant(start: float, target: float, t: float) -> float:
    """Step change: the target multiplier holds for the whole phase."""
    return target


@PHASE_CURVES.register
def exponential(start: float, target: float, t: float) -> float:
    r"""Geometric interpolation: $start \cdot (target / start)^t$; both endpoints must be positive."""
    if start <= 0 or target <= 0:
        raise ValueError(f"exponential curve needs positive start and target multipliers, got {start} -> {target}")
    return start * (target / start) ** t


@dataclass(frozen=True)
class Phase:
    """One phase of a [`PhaseScheduler`][danling.optim.PhaseScheduler].

    Attributes:
        steps: Length of the phase in optimizer steps, or `None` for the "rest" phase that takes the
            steps left over by the others (needs the scheduler's `total_steps`).
        target_multiplier: Multiplier of the initial learning rate reached at the end of the phase.
        curve: Name of the curve in [`PHASE_CURVES`][danling.optim.PHASE_CURVES].
    """

    steps: int | None
    target_multiplier: float
    curve: str = "linear"

    @classmethod
    def parse(cls, spec: Phase | Mapping[str, Any], index: int = 0) -> Phase:
        """Build a phase from a mapping.

        Accepted keys: `target_multiplier` (required), `steps` (an integer or `"rest"`), `mode`
        (`"steps"` or `"rest"`) and `curve` (a name or a mapping with a `type` key).

        Raises:
            ValueError: On unknown keys, missing or inconsistent `steps`/`mode`, or a bad curve.
        """
        if isinstance(spec, Phase):
            return spec
        if not isinstance(spec, Mapping):
            raise ValueError(f"phases[{index}] must be a mapping, got {spec!r}")
        unknown = set(spec) - {"mode", "steps", "target_multiplier", "curve"}
        if unknown:
            raise ValueError(
                f"phases[{index}] has unknown keys {sorted(unknown)}; accepted: mode, steps, target_multiplier, curve"
            )
        if "target_multiplier" not in spec:
            raise ValueError(f"phases[{index}] needs target_multiplier, got {dict(spec)}")
        mode, steps = spec.get("mode"), spec.get("steps")
        if mode not in (None, "steps", "rest"):
            raise ValueError(f"phases[{index}].mode must be 'steps' or 'rest', got {mode!r}")
        if mode == "rest" or steps == "rest":
            if steps not in (None, "rest"):
                raise ValueError(f"phases[{index}] is a rest phase and cannot also set steps={steps!r}")
            steps = None
        elif not isinstance(steps, Integral) or isinstance(steps, bool) or steps <= 0:
            raise ValueError(f"phases[{index}].steps must be a positive integer or 'rest', got {steps!r}")
        curve = spec.get("curve", "linear")
        if isinstance(curve, Mapping):
            curve = curve.get("type")
        PHASE_CURVES.get(curve)
        target = float(spec["target_multiplier"])
        if target < 0:
            raise ValueError(f"phases[{index}].target_multiplier must be non-negative, got {target}")
        return cls(steps=None if steps is None else int(steps), target_multiplier=target, curve=curve)


class PhaseScheduler(TorchLRScheduler):
    """Scale each group's initial learning rate by a multiplier that follows a list of phases.

    The multiplier starts at `initial_multiplier` and each phase moves it to its `target_multiplier`
    along its curve over its number of steps; after the last phase the last target holds. Step `s`
    counts the optimizer steps already taken (`last_epoch`), so the first update uses
    `initial_multiplier` and the target of a phase is reached on the first step of the next one.

    Args:
        optimizer: Wrapped optimizer.
        phases: [`Phase`][danling.optim.Phase] objects or mappings accepted by
            [`Phase.parse`][danling.optim.Phase.parse]. At most one may be a "rest" phase.
        initial_multiplier: Multiplier at step 0. Defaults to `1.0`.
        total_steps: Total optimizer steps; required when a phase is "rest".
        last_epoch: Index of the last step taken, `-1` for a fresh schedule.

    Raises:
        ValueError: On an empty phase list, several rest phases, a rest phase without `total_steps`,
            fixed phases longer than `total_steps`, negative multipliers, or a curve that rejects its endpoints.

    Examples:
        >>> import torch, yaml
        >>> from danling.optim import PhaseScheduler
        >>> optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        >>> config = yaml.safe_load('''
        ... initial_multiplier: 0.0
        ... phases:
        ...   - {steps: 2, target_multiplier: 1.0, curve: linear}
        ...   - {mode: rest, target_multiplier: 0.1, curve: {type: cosine}}
        ... ''')
        >>> scheduler = PhaseScheduler(optimizer, total_steps=6, **config)
        >>> lrs = []
        >>> for _ in range(6):
        ...     optimizer.step()
        ...     lrs.append(scheduler.get_last_lr()[0])
        ...     scheduler.step()
        >>> [round(lr, 4) for lr in lrs]
        [0.0, 0.5, 1.0, 0.8682, 0.55, 0.2318]
    """

    def __init__(
        self,
        optimizer: Optimizer,
        phases: Sequence[Phase | Mapping[str, Any]],
        initial_multiplier: float = 1.0,
        total_steps: int | None = None,
        last_epoch: int = -1,
    ) -> None:
        if isinstance(phases, (str, bytes, Mapping)) or not isinstance(phases, Sequence) or not phases:
            raise ValueError(f"phases must be a non-empty list of phases, got {phases!r}")
        parsed = [Phase.parse(phase, index) for index, phase in enumerate(phases)]
        if initial_multiplier < 0:
            raise ValueError(f"initial_multiplier must be non-negative, got {initial_multiplier}")
        if total_steps is not None and (not isinstance(total_steps, Integral) or total_steps <= 0):
            raise ValueError(f"total_steps must be a positive integer, got {total_steps!r}")
        self.initial_multiplier = float(initial_multiplier)
        self.total_steps = None if total_steps is None else int(total_steps)
        self.phases = [asdict(phase) for phase in parsed]  # plain data keeps state_dict picklable
        self.segments = _segments(parsed, self.initial_multiplier, self.total_steps)
        self.final_multiplier = parsed[-1].target_multiplier
        check_learning_rates(optimizer, last_epoch)
        super().__init__(optimizer, last_epoch)

    def multiplier(self, step: int) -> float:
        """Multiplier of the initial learning rate after `step` optimizer steps."""
        for begin, length, start, target, curve in self.segments:
            if step < begin + length:
                return PHASE_CURVES.get(curve)(start, target, max(step - begin, 0) / length)
        return self.final_multiplier

    def get_lr(self) -> list[float]:  # type: ignore[override]
        """Learning rates for the current step, one per parameter group; never touches the optimizer."""
        factor = self.multiplier(self.last_epoch)
        return [float(base_lr) * factor for base_lr in self.base_lrs]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the schedule's progress and put the restored learning rates back into the optimizer.

        As for [`LRScheduler`][danling.optim.LRScheduler], the phases and `total_steps` stay the
        constructed ones: on a changed budget the schedule is the new one, continued from the saved
        step, with a warning when the learning rate at that step differs.
        """
        load_keeping_shape(self, state_dict, ("total_steps", "phases", "segments", "final_multiplier"))

    def __repr__(self) -> str:
        return (
            f"{self.__class__.__name__}(initial_multiplier={self.initial_multiplier}, "
            f"phases={self.phases}, total_steps={self.total_steps})"
        )


def _segments(phases: list[Phase], initial: float, total_steps: int | None) -> list[tuple[int, int, float, float, str]]:
    """Resolve phases into `(begin, length, start, target, curve)` tuples, dropping empty ones."""
    rest = [index for index, phase in enumerate(phases) if phase.steps is None]
    fixed = sum(phase.steps for phase in phases if phase.steps is not None)
    if len(rest) > 1:
        raise ValueError(f"at most one phase may be 'rest', got rest phases at indices {rest}")
    if rest and total_steps is None:
        raise ValueError("a 'rest' phase needs total_steps to know how many steps remain")
    if total_steps is not None and fixed > total_steps:
        raise ValueError(f"phases take {fixed} fixed steps, more than total_steps={total_steps}")
    segments, begin, start = [], 0, initial
    for index, phase in enumerate(phases):
        length = phase.steps if phase.steps is not None else total_steps - fixed  # type: ignore[operator]
        try:
            PHASE_CURVES.get(phase.curve)(start, phase.target_multiplier, 0.0)
        except ValueError as error:
            raise ValueError(f"phases[{index}]: {error}") from None
        if length > 0:
            segments.append((begin, length, start, phase.target_multiplier, phase.curve))
        begin, start = begin + length, phase.target_multiplier
    return segments
