"""What the runner is doing: the [`RunnerMode`][danling.runners.loop.mode.RunnerMode] of a pass."""

from __future__ import annotations

from enum import Enum

__all__ = ["RunnerMode"]


class RunnerMode(str, Enum):
    """What the runner is doing: `train`, `evaluate` or `infer`."""

    train = "train"
    evaluate = "evaluate"
    infer = "infer"
