"""Building blocks of the runner loops.

[`events`][danling.runners.loop.events]: typed events, their contexts and the
[`EventBus`][danling.runners.loop.events.EventBus] the loops emit them on.
"""

from .events import (
    CheckpointContext,
    EpochContext,
    EvaluationContext,
    Event,
    EventBus,
    Events,
    FailureContext,
    RunContext,
    SkippedStepContext,
    StepContext,
    StopContext,
    Subscription,
    on,
)

__all__ = [
    "CheckpointContext",
    "EpochContext",
    "EvaluationContext",
    "Event",
    "EventBus",
    "Events",
    "FailureContext",
    "RunContext",
    "SkippedStepContext",
    "StepContext",
    "StopContext",
    "Subscription",
    "on",
]
