"""The loops: rounds, passes, per-batch hooks, the loop position, typed events, budgets and split selection.

[`events`][danling.runners.loop.events]: typed events, their contexts and the
[`EventBus`][danling.runners.loop.events.EventBus] the loops emit them on.
"""

from .budget import length_of
from .events import (
    CheckpointContext,
    EpochContext,
    EvaluationContext,
    Event,
    EventBus,
    Events,
    FailureContext,
    InferenceContext,
    LogContext,
    OutOfMemoryContext,
    PassContext,
    QuorumContext,
    RecoveryContext,
    RunContext,
    SkippedStepContext,
    StepContext,
    StepLogContext,
    StopContext,
    Subscription,
    on,
)
from .hooks import StepHooks
from .host import LoopHost
from .loops import Loop
from .mode import RunnerMode
from .passes import PassEngine

__all__ = [
    "CheckpointContext",
    "EpochContext",
    "EvaluationContext",
    "Event",
    "EventBus",
    "Events",
    "FailureContext",
    "InferenceContext",
    "LogContext",
    "Loop",
    "LoopHost",
    "PassContext",
    "QuorumContext",
    "RecoveryContext",
    "PassEngine",
    "RunContext",
    "RunnerMode",
    "OutOfMemoryContext",
    "SkippedStepContext",
    "StepContext",
    "StepHooks",
    "StepLogContext",
    "StopContext",
    "Subscription",
    "length_of",
    "on",
]
