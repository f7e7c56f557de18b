"""The loops: training, evaluation and inference passes, budgets and split selection."""

from .budget import ProgressMixin, length_of
from .loops import LoopMixin, RunnerMode

__all__ = ["LoopMixin", "ProgressMixin", "RunnerMode", "length_of"]
