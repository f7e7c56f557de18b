"""The loops: rounds, passes, per-batch hooks, the loop position, budgets and split selection."""

from .budget import ProgressMixin, length_of
from .hooks import RunnerMode, StepHooks
from .loops import LoopMixin
from .passes import PassMixin
from .position import LoopState

__all__ = ["LoopMixin", "LoopState", "PassMixin", "ProgressMixin", "RunnerMode", "StepHooks", "length_of"]
