"""Loss-spike detection and the bookkeeping of recovering from spikes and non-finite updates.

A [`SpikeGuard`][danling.runners.update.spikes.SpikeGuard] watches the loss of every update
window: a loss above `factor` times the running median of the last `window` (accepted) losses is
a spike. Its policy decides what happens then:

- `"skip"`: the update is dropped, as a non-finite one is;
- `"rollback"`: the update strategy raises [`LossSpike`][danling.runners.update.spikes.LossSpike];
  the training loop reloads the newest checkpoint that verifies, lowers the learning rates by
  `lr_factor` for `cooldown_steps` optimizer steps and skips the batches that spiked when the
  data stream reaches them again. The batches are keyed by `(split, epoch, batch index in the
  pass)` and kept in the checkpoint, so a run resumed later skips them too. After
  `max_rollbacks` rollbacks the next spike stops the run with
  [`TrainingDivergedError`][danling.runners.update.spikes.TrainingDivergedError].

Reading the window loss is one host synchronisation (and one all-reduce in a multi-process run,
so every rank takes the same decision) per update; it is only made while a policy is set.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["LossSpike", "RollbackRequest", "SpikeDetector", "SpikeGuard", "TrainingDivergedError", "guard_options"]

POLICIES = ("skip", "rollback")
NONFINITE_CHECKS = ("log", "update", "off")


class TrainingDivergedError(RuntimeError):
    """The run stopped because its losses or gradients kept diverging (non-finite, or spiking too often)."""


class RollbackRequest(Exception):
    """Raised inside a training pass to ask the training loop to reload a checkpoint and go on.

    The loop leaves the pass (this is not a failure: no `FAILURE` event, no failure handling),
    reloads `path` and trains on from the position it holds. [`LossSpike`][danling.runners.update.spikes.LossSpike]
    is one (the loop picks its checkpoint); the replica consistency sentinel raises one naming the
    newest checkpoint that verified consistent.

    Attributes:
        path: The checkpoint to reload (the same on every rank); `None` lets the loop choose.
    """

    path: str | None = None


class LossSpike(RollbackRequest):
    """Raised by the update strategy to ask the training loop for a rollback (policy `"rollback"`).

    Attributes:
        loss: The window loss that spiked.
        median: The running median it was compared with.
        step: Global step the update would have had.
        micro_steps: Micro-batches of the spiking window (the loop turns them into batch keys).
        batches: `(split, epoch, batch)` keys of those micro-batches, filled in by the loop.
    """

    def __init__(self, loss: float, median: float, step: int | None = None, micro_steps: int = 1) -> None:
        super().__init__(f"loss {loss:.6g} spiked above the running median {median:.6g}")
        self.loss, self.median, self.step, self.micro_steps = loss, median, step, micro_steps
        self.batches: list[tuple[str, int, int]] = []


class SpikeDetector:
    """`loss > factor * median(last window losses)`, once `min_history` losses have been seen.

    Spiking and non-finite losses do not enter the history, so a spike does not raise the bar for
    the next one.

    Args:
        factor: Threshold multiplier of the running median (> 1).
        window: Number of recent losses the median is taken over.
        min_history: Losses observed before anything counts as a spike (default: `window`).

    Examples:
        >>> detector = SpikeDetector(factor=3.0, window=4)
        >>> [detector.observe(x) for x in (1.0, 1.2, 0.9, 1.1, 5.0, 1.0)]
        [False, False, False, False, True, False]
        >>> detector.median
        1.05
    """

    def __init__(self, factor: float = 3.0, window: int = 50, min_history: int | None = None) -> None:
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 1:
            raise ValueError(f"spikes.factor must be a number > 1, got {factor!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"spikes.window must be a positive integer, got {window!r}")
        if min_history is not None and (isinstance(min_history, bool) or not isinstance(min_history, int)):
            raise ValueError(f"spikes.min_history must be a non-negative integer or None, got {min_history!r}")
        self.factor = float(factor)
        self.min_history = window if min_history is None else max(1, min(min_history, window))
        self.history: deque[float] = deque(maxlen=window)

    @property
    def median(self) -> float | None:
        """Median of the history, `None` while it is empty."""
        return statistics.median(self.history) if self.history else None

    def is_spike(self, loss: float) -> bool:
        """Whether `loss` spikes against the current history (nothing is recorded)."""
        if len(self.history) < self.min_history:
            return False
        median = statistics.median(self.history)
        return median > 0 and loss > self.factor * median

    def observe(self, loss: float) -> bool:
        """Check `loss`, record it when it is an ordinary one, and return whether it spiked."""
        if loss != loss or loss in (float("inf"), float("-inf")):
            return False  # non-finite losses are the non-finite check's business
        if self.is_spike(loss):
            return True
        self.history.append(float(loss))
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history.clear()
        self.history.extend(float(x) for x in state.get("history") or ())


class SpikeGuard:
    """A [`SpikeDetector`][danling.runners.update.spikes.SpikeDetector] with its policy and recovery state.

    Args:
        policy: `"skip"` or `"rollback"`.
        factor: Threshold multiplier of the running median (see `SpikeDetector`).
        window: Losses the median is taken over.
        min_history: Losses seen before detection starts (default: `window`).
        max_rollbacks: Rollbacks allowed; the next spike after them stops the run.
        lr_factor: Multiplier of the learning rates during a cooldown, in `(0, 1]`.
        cooldown_steps: Optimizer steps a cooldown lasts.

    Attributes:
        skipped_batches: `(split, epoch, batch)` keys of spiked batches the data stream skips.
        rollbacks: Rollbacks done so far.
        spikes: Spikes seen so far (skipped or rolled back).
        cooldown_left: Optimizer steps left in the current cooldown.
    """

    def __init__(
        self,
        policy: str,
        *,
        factor: float = 3.0,
        window: int = 50,
        min_history: int | None = None,
        max_rollbacks: int = 3,
        lr_factor: float = 0.5,
        cooldown_steps: int = 100,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"spikes.policy must be one of {POLICIES} or None, got {policy!r}")
        if isinstance(max_rollbacks, bool) or not isinstance(max_rollbacks, int) or max_rollbacks < 0:
            raise ValueError(f"spikes.max_rollbacks must be a non-negative integer, got {max_rollbacks!r}")
        if not isinstance(lr_factor, (int, float)) or not 0 < lr_factor <= 1:
            raise ValueError(f"spikes.lr_factor must be in (0, 1], got {lr_factor!r}")
        if isinstance(cooldown_steps, bool) or not isinstance(cooldown_steps, int) or cooldown_steps < 0:
            raise ValueError(f"spikes.cooldown_steps must be a non-negative integer, got {cooldown_steps!r}")
        self.policy = policy
        self.detector = SpikeDetector(factor, window, min_history)
        self.max_rollbacks = max_rollbacks
        self.lr_factor = float(lr_factor)
        self.cooldown_steps = cooldown_steps
        self.skipped_batches: set[tuple[str, int, int]] = set()
        self.rollbacks = 0
        self.spikes = 0
        self.cooldown_left = 0

    @property
    def lr_scale(self) -> float:
        """Factor applied to the learning rates of the next update (`lr_factor` during a cooldown, else 1)."""
        return self.lr_factor if self.cooldown_left > 0 else 1.0

    def applied(self) -> None:
        """An update went through: one step less of cooldown."""
        if self.cooldown_left > 0:
            self.cooldown_left -= 1

    def start_cooldown(self, batches: Iterable[tuple[str, int, int]]) -> None:
        """Record a rollback: skip `batches` from now on and lower the learning rates for a while."""
        self.rollbacks += 1
        self.skipped_batches.update((str(s), int(e), int(b)) for s, e, b in batches)
        self.cooldown_left = self.cooldown_steps

    def state_dict(self) -> dict[str, Any]:
        return {
            "detector": self.detector.state_dict(),
            "skipped_batches": sorted([list(key) for key in self.skipped_batches]),
            "rollbacks": self.rollbacks,
            "spikes": self.spikes,
            "cooldown_left": self.cooldown_left,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.detector.load_state_dict(state.get("detector") or {})
        self.skipped_batches = {(str(s), int(e), int(b)) for s, e, b in state.get("skipped_batches") or ()}
        self.rollbacks = int(state.get("rollbacks", 0))
        self.spikes = int(state.get("spikes", 0))
        self.cooldown_left = int(state.get("cooldown_left", 0))


def guard_options(config: Any, logger: Any = None, *, spikes_supported: bool = True) -> dict[str, Any]:
    """Keyword arguments of [`TorchUpdateStrategy`][danling.runners.update.strategy.TorchUpdateStrategy]
    read from a runner config's `nonfinite.*` and `spikes.*` sections (defaults when they are absent).

    Raises:
        ValueError: `spikes.policy` is set where spike detection is not supported (`spikes_supported`
            false: a pipeline, whose loss only the last stage sees).
    """
    nonfinite = config.get("nonfinite") or {}
    spikes = config.get("spikes") or {}
    check = nonfinite.get("check", "log")
    if check not in NONFINITE_CHECKS:
        raise ValueError(f"nonfinite.check must be one of {NONFINITE_CHECKS}, got {check!r}")
    options: dict[str, Any] = {
        "check_nonfinite": check == "update",
        "watch_nonfinite_loss": check == "log" and not config.get("skip_nonfinite_grad"),
        "max_nonfinite_updates": nonfinite.get("max_consecutive"),
        "logger": logger,
    }
    policy = spikes.get("policy")
    if policy and not spikes_supported:
        raise ValueError(f"spikes.policy={policy!r} is not supported with pipeline parallelism; set it to None")
    if policy:
        options["spike_guard"] = SpikeGuard(
            policy,
            factor=spikes.get("factor", 3.0),
            window=spikes.get("window", 50),
            min_history=spikes.get("min_history"),
            max_rollbacks=spikes.get("max_rollbacks", 3),
            lr_factor=spikes.get("lr_factor", 0.5),
            cooldown_steps=spikes.get("cooldown_steps", 100),
        )
    return options
