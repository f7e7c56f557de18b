"""How gradients become parameter updates: accumulation windows, precision, clipping, the optimizer step.

- [`Precision`][danling.runners.update.precision.Precision]: autocast context and (fp16 on CUDA)
  gradient scaling.
- [`GradientAccumulator`][danling.runners.update.accumulation.GradientAccumulator]: which
  micro-steps synchronise gradients and step the optimizer, and how each loss is normalised.
- [`OptimizerContainer`][danling.runners.update.optimizer.OptimizerContainer]: one optimizer
  update (unscale, non-finite skip, clip, step, scheduler, zero grads), with
  [`clip_gradients`][danling.runners.update.optimizer.clip_gradients] and
  [`has_nonfinite_gradients`][danling.runners.update.optimizer.has_nonfinite_gradients].
- [`UpdateStrategy`][danling.runners.update.strategy.UpdateStrategy] and
  [`TorchUpdateStrategy`][danling.runners.update.strategy.TorchUpdateStrategy]: the component a
  runner delegates every update to; [`gradient_sync_for`][danling.runners.update.gradient_sync.gradient_sync_for]
  gives the typed gradient-sync control of a (wrapped) model.
- [`EMA`][danling.runners.update.ema.EMA]: an exponential moving average of a model's weights.
"""

from .accumulation import GradientAccumulator
from .ema import EMA
from .gradient_sync import GradientSync, gradient_sync_for
from .optimizer import OptimizerContainer, clip_gradients, has_nonfinite_gradients, scale_gradients
from .precision import Precision
from .strategy import TorchUpdateStrategy, UpdateStrategy

__all__ = [
    "EMA",
    "GradientAccumulator",
    "OptimizerContainer",
    "GradientSync",
    "Precision",
    "TorchUpdateStrategy",
    "UpdateStrategy",
    "gradient_sync_for",
    "clip_gradients",
    "has_nonfinite_gradients",
    "scale_gradients",
]
