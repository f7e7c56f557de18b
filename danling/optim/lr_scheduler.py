"""`LRScheduler`: one scheduler with warmup, cooldown and a pluggable decay curve."""

from __future__ import annotations

import difflib
import inspect
import logging
from math import cos, exp, isclose, pi
from numbers import Integral
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import _LRScheduler

from ..utils.registry import Registry, check_arguments

__all__ = ["LR_METHODS", "LRScheduler"]

LR_METHODS = Registry("lr method")
"""Decay curves of [`LRScheduler`][danling.optim.LRScheduler], by name.

Each entry maps training progress `p` in `[0, 1]` to a decay ratio `r` in `[0, 1]` (`0` keeps the
initial learning rate, `1` reaches the final one); extra keyword arguments of the function become
options of the scheduler. Registering a function here is all it takes to add a method; it is then
also available by name in [`SCHEDULERS`][danling.optim.SCHEDULERS].
"""

SCALINGS = ("percentile", "numerical")
# The shape of a schedule: set by construction from the run's budget, never taken from a saved state.
_SHAPE = ("total_steps", "warmup_steps", "cooldown_steps")
logger = logging.getLogger(__name__)


@LR_METHODS.register
def linear(progress: float) -> float:
    r"""Ratio grows in proportion to progress: $r = p$."""
    return progress


@LR_METHODS.register
def cosine(progress: float) -> float:
    r"""Half a cosine wave, flat at both ends: $r = (1 - \cos(\pi p)) / 2$."""
    return 1 - (1 + cos(pi * progress)) / 2


@LR_METHODS.register
def constant(progress: float) -> float:
    r"""No decay: $r = 0$, so only warmup and cooldown change the learning rate."""
    return 0.0


@LR_METHODS.register
def exponential(progress: float, rate: float = 5.0) -> float:
    r"""Fast early decay that slows down: $r = (1 - e^{-k p}) / (1 - e^{-k})$ with $k$ = `rate`.

    Larger `rate` front-loads the decay; `rate` near `0` approaches `linear`, a negative `rate` back-loads it.
    """
    if rate == 0:
        return progress
    return (1 - exp(-rate * progress)) / (1 - exp(-rate))


@LR_METHODS.register
def polynomial(progress: float, power: float = 2.0) -> float:
    r"""Polynomial decay: $r = 1 - (1 - p)^{q}$ with $q$ = `power` (`1` is linear).

    With `scaling="numerical"` and a final learning rate of `0` this matches
    `torch.optim.lr_scheduler.PolynomialLR`.
    """
    if power <= 0:
        raise ValueError(f"polynomial power must be positive, got {power}")
    return 1 - (1 - progress) ** power


def _check_method_options(method: str, method_fn: Any, options: dict[str, Any]) -> None:
    """Refuse an option neither `LRScheduler` nor its method takes, naming both's arguments.

    Keywords `LRScheduler` does not know go to the method; a typo of one of the scheduler's own
    (`warmup_step`) would otherwise be reported against the method's few arguments alone.
    """
    try:
        check_arguments(method_fn, (0.0,), options, f"lr method {method!r}")
    except ValueError:
        own = [name for name in inspect.signature(LRScheduler.__init__).parameters if name not in _NOT_OPTIONS]
        taken = [name for name in inspect.signature(method_fn).parameters if name != "progress"]
        accepted = own + taken
        unknown = next((key for key in options if key not in taken), next(iter(options)))
        close = difflib.get_close_matches(unknown, accepted, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ValueError(
            f"LRScheduler with lr method {method!r} takes no option {unknown!r}; {hint}"
            f"it accepts: {', '.join(accepted)}"
        ) from None


_NOT_OPTIONS = ("self", "optimizer", "total_steps", "method_options", "last_epoch")


class LRScheduler(_LRScheduler):
    r"""Learning-rate scheduler with built-in warmup and cooldown around a named decay curve.

    The schedule is computed in closed form from the step index `s = last_epoch + 1` (the first
    optimizer step uses `s = 1`), so it never accumulates rounding error and resumes exactly from a
    `state_dict`. For every parameter group with initial learning rate $\eta_0$ and final learning
    rate $\eta_T$ (`final_lr`, or `final_lr_ratio` $\cdot \eta_0$):

    1. progress $p = \min(s / T, 1)$ with $T$ = `total_steps`, and the method gives the ratio $r$
       (see [`LR_METHODS`][danling.optim.LR_METHODS]: linear, cosine, constant, exponential, polynomial);
    2. `scaling="percentile"` interpolates geometrically, $\eta = \eta_0 (\eta_T / \eta_0)^r$;
       `scaling="numerical"` interpolates arithmetically, $\eta = \eta_T + (\eta_0 - \eta_T)(1 - r)$;
    3. during warmup ($0 < s < W$) the rate ramps up from `min_lr`: $\eta \leftarrow m + (s / W)(\eta - m)$,
       and during cooldown ($s > T - C$) it ramps down to `min_lr`:
       $\eta \leftarrow m + (1 - (s - T + C) / C)(\eta - m)$, with $m$ = `min_lr`;
    4. the result is clamped below at `min_lr`. Groups whose initial learning rate is `0` stay at `0`.

    Steps past `total_steps` keep the learning rate at `min_lr`.

    Resuming on another budget: `load_state_dict` takes the progress (the step index and the
    initial learning rates) from the saved state and keeps the shape this scheduler was built with
    (`total_steps`, `warmup_steps`, `cooldown_steps`). A run whose budget was raised from 2 to 3
    epochs therefore continues from its saved step on the schedule of the 3-epoch run; when the
    learning rate at that step differs from the one the saved run used, a warning names both.

    Args:
        optimizer: Wrapped optimizer.
        total_steps: Total number of optimizer steps of the run; must be positive.
        final_lr_ratio: Final learning rate as a fraction of each group's initial learning rate.
            Defaults to `1e-3` when `final_lr` is not given either. Mutually exclusive with `final_lr`.
        final_lr: Final learning rate shared by all groups.
        min_lr: Floor of the learning rate. Defaults to `1e-9`.
        method: Name of the decay curve in [`LR_METHODS`][danling.optim.LR_METHODS]. Defaults to `"cosine"`.
        warmup_steps: Steps of linear warmup, or a fraction of `total_steps` (a float in `[0, 1)`,
            rounded down). Defaults to `total_steps // 20` (5%); `0` disables warmup.
        cooldown_steps: Steps of linear cooldown at the end, or a fraction of `total_steps`.
            Defaults to `total_steps // 5` (20%); `0` disables it.
        last_epoch: Index of the last step taken, `-1` for a fresh schedule.
        scaling: `"percentile"` (geometric) or `"numerical"` (arithmetic) interpolation. Defaults to
            `"numerical"` when `final_lr` is given and `"percentile"` otherwise.
        **method_options: Extra options of the method, e.g. `power` for `"polynomial"` or `rate` for `"exponential"`.

    Raises:
        ValueError: On non-positive `total_steps`, negative or oversized warmup/cooldown, negative
            learning rates or ratios, both `final_lr` and `final_lr_ratio`, or an unknown method/scaling.

    Examples:
        >>> from danling.optim import LRScheduler
        >>> import torch
        >>> from torch import optim
        >>> optimizer = optim.SGD([{'params': torch.tensor([0])}], lr=1, momentum=0.9)
        >>> scheduler = LRScheduler(optimizer, total_steps=5, final_lr_ratio=1e-5, method='linear')
        >>> lrs = []
        >>> for epoch in range(5):
        ...     lrs.append(scheduler.get_lr()[0])
        ...     optimizer.step()
        ...     scheduler.step()
        >>> [round(lr, 10) for lr in lrs]
        [0.1, 0.01, 0.001, 0.0001, 1e-09]
        >>> scheduler = LRScheduler(optimizer, total_steps=5, final_lr_ratio=1e-5, method='cosine')
        >>> lrs = []
        >>> for epoch in range(5):
        ...     lrs.append(scheduler.get_lr()[0])
        ...     optimizer.step()
        ...     scheduler.step()
        >>> [round(lr, 10) for lr in lrs]
        [0.3330753446, 0.0187302031, 0.000533897, 3.00232e-05, 1e-09]
        >>> scheduler = LRScheduler(optimizer, total_steps=5, final_lr_ratio=1e-5, method='linear', scaling='numerical')
        >>> lrs = []
        >>> for epoch in range(5):
        ...     lrs.append(scheduler.get_lr()[0])
        ...     optimizer.step()
        ...     scheduler.step()
        >>> [round(lr, 2) for lr in lrs]
        [0.8, 0.6, 0.4, 0.2, 0.0]
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        final_lr_ratio: float | None = None,
        final_lr: float | None = None,
        min_lr: float = 1e-9,
        method: str = "cosine",
        warmup_steps: int | float | None = None,
        cooldown_steps: int | float | None = None,
        last_epoch: int = -1,
        scaling: str | None = None,
        **method_options: Any,
    ) -> None:
        if not _is_count(total_steps) or total_steps <= 0:
            raise ValueError(f"total_steps must be a positive integer, got {total_steps!r}")
        warmup_steps = total_steps // 20 if warmup_steps is None else phase_steps(warmup_steps, total_steps)
        cooldown_steps = total_steps // 5 if cooldown_steps is None else phase_steps(cooldown_steps, total_steps)
        _check_phases(total_steps, warmup_steps, cooldown_steps)
        if final_lr is not None and final_lr_ratio is not None:
            raise ValueError(f"give final_lr ({final_lr}) or final_lr_ratio ({final_lr_ratio}), not both")
        if final_lr is None and final_lr_ratio is None:
            final_lr_ratio = 1e-3
        for name, value in (("final_lr", final_lr), ("final_lr_ratio", final_lr_ratio), ("min_lr", min_lr)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be non-negative, got {value}")
        scaling = scaling or ("numerical" if final_lr is not None else "percentile")
        if scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {', '.join(SCALINGS)}, got {scaling!r}")
        method_fn = LR_METHODS.get(method)
        _check_method_options(method, method_fn, method_options)
        method_fn(0.0, **method_options)  # surfaces invalid options (e.g. power <= 0) now, not mid-run
        check_learning_rates(optimizer, last_epoch)

        self.total_steps = int(total_steps)
        self.final_lr_ratio = final_lr_ratio
        self.final_lr = final_lr
        self.min_lr = min_lr
        self.method = method
        self.method_options = dict(method_options)
        self.warmup_steps = int(warmup_steps)
        self.cooldown_steps = int(cooldown_steps)
        self.scaling = scaling
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        """Learning rates of the current step (`last_epoch + 1`), one per parameter group.

        Safe to call at any time; it computes the schedule and never touches the optimizer.
        """
        step = self.last_epoch + 1
        return [self.lr_at(base_lr, step) for base_lr in self.base_lrs]

    def lr_at(self, base_lr: float | Tensor, step: int) -> float:
        """Learning rate of a group whose initial learning rate is `base_lr` at step `step` (1-based)."""
        base = float(base_lr)
        if base == 0:
            return 0.0
        progress = min(max(step / self.total_steps, 0.0), 1.0)
        ratio = LR_METHODS.get(self.method)(progress, **self.method_options)
        final = self.final_lr if self.final_lr is not None else base * self.final_lr_ratio
        if self.scaling == "percentile":
            lr = base * pow(final / base, ratio)
        else:
            lr = (1 - ratio) * (base - final) + final
        cooldown_begin = self.total_steps - self.cooldown_steps
        if 0 < step < self.warmup_steps:
            lr = step / self.warmup_steps * (lr - self.min_lr) + self.min_lr
        elif self.cooldown_steps > 0 and step > cooldown_begin:
            remaining = max(1 - (step - cooldown_begin) / self.cooldown_steps, 0.0)
            lr = remaining * (lr - self.min_lr) + self.min_lr
        return max(self.min_lr, lr)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the schedule and put the restored learning rates back into the optimizer.

        Re-applying the rates makes resumption exact whether the optimizer state is loaded before or
        after the scheduler was constructed. The schedule's shape (`total_steps`, `warmup_steps`,
        `cooldown_steps`) stays the constructed one: on a changed budget the schedule is the new
        one, continued from the saved step (see the class docstring).
        """
        load_keeping_shape(self, state_dict, _SHAPE)

    def __repr__(self) -> str:
        final = f"final_lr={self.final_lr}" if self.final_lr is not None else f"final_lr_ratio={self.final_lr_ratio}"
        return (
            f"{self.__class__.__name__}(method={self.method!r}, scaling={self.scaling!r}, {final}, "
            f"total_steps={self.total_steps}, warmup_steps={self.warmup_steps}, "
            f"cooldown_steps={self.cooldown_steps}, min_lr={self.min_lr})"
        )


def _is_count(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def phase_steps(value: int | float, total_steps: int) -> int | float:
    """Steps of a warmup/cooldown phase: a float in `[0, 1)` is a fraction of `total_steps` (rounded down).

    Anything else is returned as given, for the range checks to judge.

    Examples:
        >>> phase_steps(0.1, 95), phase_steps(7, 95), phase_steps(0.05, 10)
        (9, 7, 0)
    """
    if isinstance(value, float) and 0 <= value < 1:
        return int(value * total_steps)
    return value


def _check_phases(total_steps: int, warmup_steps: int, cooldown_steps: int) -> None:
    for name, value in (("warmup_steps", warmup_steps), ("cooldown_steps", cooldown_steps)):
        if not _is_count(value) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if warmup_steps + cooldown_steps > total_steps:
        raise ValueError(
            f"warmup_steps + cooldown_steps must not exceed total_steps, "
            f"got {warmup_steps} + {cooldown_steps} > {total_steps}"
        )


def check_learning_rates(optimizer: Optimizer, last_epoch: int = -1) -> None:
    """Raise a `ValueError` naming the group if any parameter group of `optimizer` has a negative learning rate."""
    key = "lr" if last_epoch == -1 else "initial_lr"
    for index, group in enumerate(getattr(optimizer, "param_groups", ())):
        value = group.get(key)
        if value is not None and float(value) < 0:
            raise ValueError(f"learning rate must be non-negative, got {key}={float(value)} in param_groups[{index}]")


def load_keeping_shape(scheduler: _LRScheduler, state_dict: dict[str, Any], shape_keys: tuple[str, ...]) -> None:
    """Load a scheduler's saved progress, keep the shape it was built with, and apply its learning rates.

    The attributes named by `shape_keys` (the run length and what is derived from it) keep their
    constructed values; everything else (the step index, the initial learning rates) comes from
    `state_dict`. When the saved and current learning rates at the saved step differ, a warning
    names both: the schedule was rebuilt for another budget.
    """
    shape = {key: getattr(scheduler, key) for key in shape_keys}
    saved = {key: state_dict.get(key, shape[key]) for key in shape_keys}
    _LRScheduler.load_state_dict(scheduler, state_dict)
    scheduler.__dict__.update(shape)
    if saved != shape:
        scheduler._last_lr = scheduler.get_lr()
    apply_last_lr(scheduler)
    saved_lrs = list(state_dict.get("_last_lr") or [])
    current = scheduler.get_last_lr()
    jumps = [(a, b) for a, b in zip(saved_lrs, current) if not isclose(float(a), float(b), rel_tol=1e-6)]
    if jumps:
        logger.warning(
            "learning-rate schedule rebuilt for total_steps=%s (the saved run had %s): at step %d the "
            "learning rate moves from %g to %g",
            shape.get("total_steps"),
            saved.get("total_steps"),
            scheduler.last_epoch,
            float(jumps[0][0]),
            float(jumps[0][1]),
        )


def apply_last_lr(scheduler: _LRScheduler) -> None:
    """Write `scheduler.get_last_lr()` into its optimizer's parameter groups (in place for tensor rates)."""
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
        if isinstance(group["lr"], Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = float(lr) if isinstance(lr, Tensor) else lr
