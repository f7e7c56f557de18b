"""Optimisation: learning-rate schedules, optimizer/scheduler registries and parameter groups.

- [`LRScheduler`][danling.optim.LRScheduler]: warmup, decay curve and cooldown in one scheduler.
- [`PhaseScheduler`][danling.optim.PhaseScheduler]: piecewise multiplier schedules from configuration.
- [`OPTIMIZERS`][danling.optim.OPTIMIZERS], [`SCHEDULERS`][danling.optim.SCHEDULERS]: name -> class
  registries; [`build_optimizer`][danling.optim.build_optimizer] and
  [`build_scheduler`][danling.optim.build_scheduler] build from a config section.
- [`build_param_groups`][danling.optim.build_param_groups]: regex parameter groups.
"""

from .builders import OPTIMIZERS, SCHEDULERS, build_optimizer, build_scheduler, is_metric_scheduler
from .lr_scheduler import LR_METHODS, LRScheduler
from .param_groups import build_param_groups
from .phases import PHASE_CURVES, Phase, PhaseScheduler

__all__ = [
    "LR_METHODS",
    "OPTIMIZERS",
    "PHASE_CURVES",
    "SCHEDULERS",
    "LRScheduler",
    "Phase",
    "PhaseScheduler",
    "build_optimizer",
    "build_param_groups",
    "build_scheduler",
    "is_metric_scheduler",
]
