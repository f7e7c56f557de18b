"""The update strategy of a DeepSpeed engine: danling keeps the windows, the engine does backward and step.

[`DeepSpeedUpdateStrategy`][danling.runners.update.deepspeed.DeepSpeedUpdateStrategy] reuses the
windows and loss normalisation of
[`TorchUpdateStrategy`][danling.runners.update.strategy.TorchUpdateStrategy] and hands the rest to
the engine:

- the engine runs with `gradient_accumulation_steps: 1`, and danling tells it which micro-step
  closes a window through `set_gradient_accumulation_boundary` (the
  [`OwnsAccumulationBoundary`][danling.runners.update.gradient_sync.OwnsAccumulationBoundary]
  protocol): ZeRO 0/1 then reduce only at the boundary, ZeRO 2/3 reduce-scatter every micro-step
  as their gradient partitioning requires, and no `no_sync` is ever entered;
- `backward` goes through `engine.backward` (the engine applies its own loss scaling);
- `apply` calls `engine.step()`, which clips, steps the optimizer and the step-interval
  scheduler it was given, and zeroes the gradients.

Nothing here imports DeepSpeed: the engine is duck-typed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from .gradient_sync import OwnsAccumulationBoundary, gradient_sync_for
from .precision import Precision
from .strategy import TorchUpdateStrategy

__all__ = ["DeepSpeedUpdateStrategy"]

_logger = logging.getLogger("danling.runners")


class DeepSpeedUpdateStrategy(TorchUpdateStrategy):
    """Accumulation windows over a DeepSpeed engine that owns backward, reduction and the optimizer step.

    Args:
        engine: The `DeepSpeedEngine` (anything with `backward`, `step` and
            `set_gradient_accumulation_boundary`).
        accum_steps: Micro-steps per window (the engine's own `gradient_accumulation_steps` must be 1).
        precision: The runner's [`Precision`][danling.runners.update.precision.Precision]; only its
            autocast is used (the engine owns loss scaling).

    Raises:
        TypeError: `engine` cannot be told where a window ends.
    """

    def __init__(self, engine: Any, accum_steps: int = 1, *, precision: Precision | None = None) -> None:
        if not isinstance(engine, OwnsAccumulationBoundary):
            raise TypeError(
                f"DeepSpeedUpdateStrategy needs an engine with set_gradient_accumulation_boundary(), "
                f"got {type(engine).__name__}"
            )
        super().__init__(accum_steps, precision=precision, gradient_sync=gradient_sync_for(engine))
        self.engine = engine
        self._warned_partial = False

    @property
    def zero_stage(self) -> int:
        """The engine's ZeRO stage (0 when it has none)."""
        stage = getattr(self.engine, "zero_optimization_stage", None)
        return int(stage()) if callable(stage) else 0

    def bind(self, optimizer: Any, scheduler: Any = None, interval: str = "step") -> None:
        """Nothing to bind: the engine steps its own optimizer (and the scheduler it was given)."""

    @property
    def skipped_steps(self) -> int:
        """Updates the engine skipped (fp16 overflow)."""
        return int(getattr(self.engine, "skipped_steps", 0))

    def backward(self, loss: torch.Tensor, weight: Any = None) -> None:
        """Back-propagate one micro-step loss through `engine.backward`, divided by its window size.

        Raises:
            ValueError: `weight` is given (token-weighted windows are not supported with DeepSpeed yet).
        """
        if weight is not None:
            raise ValueError(f"DeepSpeedUpdateStrategy does not support weighted micro-steps (weight={weight!r})")
        self.engine.backward(self.accumulator.normalize(loss), scale_wrt_gas=False)

    def close_window(self) -> bool:
        """Close a window the pass left open: mark the boundary and let ZeRO 0/1 reduce what they kept local.

        The engine's partitioned gradients cannot be rescaled from outside, so an open window of an
        unknown-length pass is applied with its losses divided by `accum_steps` (logged once).
        """
        accumulator = self.accumulator
        pending = accumulator.pending
        if not pending:
            return False
        window = accumulator.window_size
        accumulator.finish()
        self.gradient_sync.context(True)  # the engine's boundary flag: the next step() applies
        if self.zero_stage < 2:
            self.engine.allreduce_gradients()
        if window != pending and not self._warned_partial:
            self._warned_partial = True
            _logger.warning(
                "applying a partial accumulation window of %d of %d micro-steps with DeepSpeed: its gradient "
                "is scaled by %d/%d (give the loader a length so windows are sized exactly)",
                pending,
                window,
                pending,
                window,
            )
        return True

    def apply(self) -> bool:
        """Step the engine at danling's window boundary; `True` when the engine applied the update."""
        engine = self.engine
        self.gradient_sync.context(True)
        engine.step()
        applied = getattr(engine, "was_step_applied", None)
        return bool(applied()) if callable(applied) else True

    def state_dict(self) -> dict[str, Any]:
        """Nothing: the engine's checkpoint holds its optimizer, scaler and skip counter."""
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Nothing to restore (see `state_dict`)."""
