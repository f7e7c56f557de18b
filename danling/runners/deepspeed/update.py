"""The update strategy of a DeepSpeed engine: danling keeps the windows, the engine does backward and step.

[`DeepSpeedUpdateStrategy`][danling.runners.deepspeed.update.DeepSpeedUpdateStrategy] reuses the
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

Nothing here imports DeepSpeed at import time: the engine is duck-typed, and
[`gathered_parameters`][danling.runners.deepspeed.update.gathered_parameters] imports it only under ZeRO-3.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from danling.distributed import is_distributed

from ..update.gradient_sync import OwnsAccumulationBoundary, gradient_sync_for
from ..update.precision import Precision
from ..update.strategy import TorchUpdateStrategy

__all__ = ["DeepSpeedUpdateStrategy", "gathered_parameters"]

_logger = logging.getLogger("danling.runners")


class DeepSpeedUpdateStrategy(TorchUpdateStrategy):
    """Accumulation windows over a DeepSpeed engine that owns backward, reduction and the optimizer step.

    Args:
        engine: The `DeepSpeedEngine` (anything with `backward`, `step` and
            `set_gradient_accumulation_boundary`).
        accum_steps: Micro-steps per window (the engine's own `gradient_accumulation_steps` must be 1).
        precision: The runner's [`Precision`][danling.runners.update.precision.Precision]; only its
            autocast is used (the engine owns loss scaling).
        group: Process group of the gradient domain, over which window weights are summed
            (`None`: the default group).

    Raises:
        TypeError: `engine` cannot be told where a window ends.
    """

    steps_bound_optimizer = False  # the engine steps its own optimizer: `bind` binds nothing

    def __init__(
        self, engine: Any, accum_steps: int = 1, *, precision: Precision | None = None, group: Any = None
    ) -> None:
        if not isinstance(engine, OwnsAccumulationBoundary):
            raise TypeError(
                f"DeepSpeedUpdateStrategy needs an engine with set_gradient_accumulation_boundary(), "
                f"got {type(engine).__name__}"
            )
        super().__init__(accum_steps, precision=precision, gradient_sync=gradient_sync_for(engine), group=group)
        self.engine = engine
        self._warned_partial = False

    @property
    def zero_stage(self) -> int:
        """The engine's ZeRO stage (0 when it has none)."""
        stage = getattr(self.engine, "zero_optimization_stage", None)
        return int(stage()) if callable(stage) else 0

    def bind(self, optimizer: Any, scheduler: Any = None, interval: str = "step", outside: Any = None) -> None:
        """Nothing to bind: the engine steps its own optimizer (and the scheduler it was given)."""

    @property
    def skipped_steps(self) -> int:
        """Updates the engine skipped (fp16 overflow)."""
        return int(getattr(self.engine, "skipped_steps", 0))

    def backward(self, loss: torch.Tensor, weight: Any = None) -> None:
        """Back-propagate one micro-step loss through `engine.backward`: divided by its window size, or times `weight`.

        A weighted window's gradient is divided by its total weight (summed over the window and
        the ranks of the gradient group) when it is applied, as in
        [`TorchUpdateStrategy`][danling.runners.update.strategy.TorchUpdateStrategy].

        Raises:
            ValueError: a window mixes weighted and unweighted micro-steps, or `weight` is given
                with fp16 (the engine's dynamic loss scale cannot carry the window's weight).
        """
        if weight is not None:
            if self._weight is None and self.accumulator.pending:
                raise ValueError("a window mixes weighted and unweighted micro-steps; pass weight= to every backward")
            if _call(self.engine, "fp16_enabled"):
                raise ValueError(f"weighted micro-steps (weight={weight!r}) are not supported with DeepSpeed fp16")
            self._weight = weight if self._weight is None else self._weight + weight
            loss = loss * weight
        elif self._weight is not None:
            raise ValueError("a window mixes weighted and unweighted micro-steps; pass weight= to every backward")
        else:
            loss = self.accumulator.normalize(loss)
        self.engine.backward(loss, scale_wrt_gas=False)

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
        if window != pending and self._weight is None and not self._warned_partial:
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
        """Step the engine at danling's window boundary; `True` when the engine applied the update.

        The engine skips a step whose gradients are not finite (every rank agrees, through its
        reduced gradient norm); such a step returns `False`.
        """
        engine = self.engine
        self.gradient_sync.context(True)
        weight, self._weight = self._weight, None
        if weight is None:
            engine.step()
        else:
            self._step_weighted(weight)
        applied = getattr(engine, "was_step_applied", None)
        return bool(applied()) if callable(applied) else True

    def _step_weighted(self, weight: Any) -> None:
        """`engine.step()` with the window's gradient divided by `total weight / ranks`.

        The engine averages gradients over the ranks, so the reduced gradient of `weight`-scaled
        losses is `sum(w * g) / ranks`. A ZeRO optimizer divides its gradients by its loss scale
        when it steps, so the divisor goes there for this one step (bf16/fp32 keep a static scale
        of 1 otherwise); without ZeRO the reduced `.grad` tensors are divided directly.
        """
        engine = self.engine
        divisor = self._total_weight(weight) / _group_size(self.group)
        optimizer = getattr(engine, "optimizer", None)
        if _call(engine, "zero_optimization") and hasattr(optimizer, "loss_scale"):
            previous = optimizer.loss_scale
            optimizer.loss_scale = previous * divisor
            try:
                engine.step()
            finally:
                optimizer.loss_scale = previous
            return
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, divisor)
        engine.step()

    def _total_weight(self, weight: Any) -> float:
        """The window's weight summed over the ranks of the gradient group (one all-reduce)."""
        device = getattr(self.engine, "device", None) or "cpu"
        total = torch.as_tensor(weight, dtype=torch.float64, device=device).detach().clone()
        if is_distributed():
            dist.all_reduce(total, group=self.group)
        return float(total)

    def state_dict(self) -> dict[str, Any]:
        """Nothing: the engine's checkpoint holds its optimizer, scaler and skip counter."""
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Nothing to restore (see `state_dict`)."""


def _call(obj: Any, name: str) -> Any:
    method = getattr(obj, name, None)
    return method() if callable(method) else None


def _group_size(group: Any) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def gathered_parameters(
    engine: Any, parameters: Iterable[Any], modifier_rank: int | None = None
) -> AbstractContextManager:
    """A block in which ZeRO-3's partitioned `parameters` are whole on every rank; a no-op below stage 3.

    Under ZeRO-3 every rank must enter it (it all-gathers). With `modifier_rank`, what that rank
    writes into the parameters is partitioned back to all ranks on exit.
    """
    stage = getattr(engine, "zero_optimization_stage", None)
    if not callable(stage) or int(stage()) < 3:
        return nullcontext()
    from deepspeed.runtime.zero import GatheredParameters

    return GatheredParameters(list(parameters), modifier_rank=modifier_rank)
