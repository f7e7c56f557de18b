"""How gradients become parameter updates: accumulation windows, precision, clipping, the optimizer step.

- [`Precision`][danling.runners.update.precision.Precision]: autocast context and (fp16 on CUDA)
  gradient scaling.
- [`GradientAccumulator`][danling.runners.update.accumulation.GradientAccumulator]: which
  micro-steps synchronise gradients and step the optimizer, and how each loss is normalised.
- [`OptimizerContainer`][danling.runners.update.optimizer.OptimizerContainer]: one optimizer
  update (unscale, non-finite skip, clip, step, scheduler, zero grads), with
  [`clip_gradients`][danling.runners.update.optimizer.clip_gradients] and
  [`has_nonfinite_gradients`][danling.runners.update.optimizer.has_nonfinite_gradients].
- [`EMA`][danling.runners.update.ema.EMA]: an exponential moving average of a model's weights.
"""

from .accumulation import GradientAccumulator
from .ema import EMA
from .optimizer import OptimizerContainer, clip_gradients, has_nonfinite_gradients, scale_gradients
from .precision import Precision

__all__ = [
    "EMA",
    "GradientAccumulator",
    "OptimizerContainer",
    "Precision",
    "clip_gradients",
    "has_nonfinite_gradients",
    "scale_gradients",
]
