"""A small typed event bus for the runner loops.

Every [`Event`][danling.runners.loop.events.Event] names the context class its subscribers
receive; the constants live on [`Events`][danling.runners.loop.events.Events]. An
[`EventBus`][danling.runners.loop.events.EventBus] holds the subscriptions, checks the context
type on [`emit`][danling.runners.loop.events.EventBus.emit], and pairs start/end events with
[`pair`][danling.runners.loop.events.EventBus.pair]. Methods marked with
[`on`][danling.runners.loop.events.on] are subscribed by
[`subscribe_object`][danling.runners.loop.events.EventBus.subscribe_object].

Handler errors: a handler that raises stops the emission and its exception propagates to the
code that emitted, except for the end event of a pair closed by an exception. There every end
handler runs, an `Exception` raised by one is logged, and the original error propagates unchanged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FunctionType, MappingProxyType
from typing import Any, Generic, TypeVar

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
    "OutOfMemoryContext",
    "PassContext",
    "QuorumContext",
    "RecoveryContext",
    "RunContext",
    "SkippedStepContext",
    "StepContext",
    "StepLogContext",
    "StopContext",
    "Subscription",
    "on",
]

logger = logging.getLogger(__name__)

C = TypeVar("C")
F = TypeVar("F", bound=Callable[..., Any])
Handler = Callable[[Any], object]
_MARK = "__danling_events__"


@dataclass(frozen=True, eq=False, slots=True, repr=False)
class Event(Generic[C]):
    """A kind of event; subscribers receive a `context_type` instance. Compared by identity."""

    name: str
    context_type: type[C]

    def __repr__(self) -> str:
        return f"Event({self.name!r}, {self.context_type.__name__})"


@dataclass(slots=True)
class RunContext:
    """A whole `train()`, `evaluate()` or `infer()` call; `error` is set only on `RUN_END`."""

    runner: Any
    mode: str
    error: BaseException | None = None


@dataclass(slots=True)
class EpochContext:
    """One training epoch; the body of the pair fills `result` before `EPOCH_END`."""

    runner: Any
    epoch: int
    split: str | None = None
    result: Mapping[str, Any] | None = None
    error: BaseException | None = None


@dataclass(slots=True)
class StepContext:
    """One batch; `loss` is what the step returned (possibly a device tensor: `.item()` syncs).

    `data` is the batch as the loader gave it (a reference: subscribers must not change it).
    """

    runner: Any
    split: str
    batch_index: int
    global_step: int
    loss: Any = None
    error: BaseException | None = None
    data: Any = None


@dataclass(slots=True)
class PassContext:
    """One pass over `split` in `mode` (`length` batches when known); the body sets `batches` before `PASS_END`."""

    runner: Any
    split: str
    mode: str
    length: int | None = None
    batches: int = 0
    error: BaseException | None = None


@dataclass(slots=True)
class LogContext:
    """Values to record at `step` (a result row, or step losses keyed `<split>_step`), for trackers."""

    runner: Any
    values: Mapping[str, Any]
    step: int


@dataclass(slots=True)
class StepLogContext:
    """A step log of `split` in `mode` about to be written at global step `step`.

    Subscribers may add entries to `values` (the step log line and the trackers show them). Under
    several processes every rank emits it at the same batch, so a subscriber may run a collective.
    """

    runner: Any
    split: str
    mode: str
    values: Any
    step: int


@dataclass(slots=True)
class SkippedStepContext:
    """An optimizer step skipped because the gradients were not finite."""

    runner: Any
    global_step: int
    skipped_steps: int


@dataclass(slots=True)
class OutOfMemoryContext:
    """A training micro-batch ran out of memory on `ranks` (`oom.policy`), at `global_step`, in `phase`.

    `action` is what every rank did: `skipped` (the update was dropped), `split` (the micro-batch is
    run again as `pieces` pieces) or `stopped`. `count` is the run's out-of-memory errors so far,
    `consecutive` those in a row.
    """

    runner: Any
    global_step: int
    ranks: list[int]
    phase: str
    action: str
    pieces: int
    count: int
    consecutive: int


@dataclass(slots=True)
class EvaluationContext:
    """One evaluation pass over `split`; the body fills `result` before `EVALUATION_END`."""

    runner: Any
    split: str
    result: Mapping[str, Any] | None = None
    error: BaseException | None = None


@dataclass(slots=True)
class CheckpointContext:
    """A checkpoint written or read at `path`.

    For `CHECKPOINT_FALLBACK`, `path` is the checkpoint used instead of `requested`, and `error`
    says why `requested` was rejected.
    """

    runner: Any
    path: str | os.PathLike[str]
    name: str | None = None
    requested: str | os.PathLike[str] | None = None
    error: BaseException | None = None


@dataclass(slots=True)
class StopContext:
    """A request to stop early: `reason` in words, `signal` the signal number if one caused it."""

    runner: Any
    reason: str
    signal: int | None = None


@dataclass(slots=True)
class InferenceContext:
    """An `infer(split, output=...)` run writing `output`; `record` is this rank's progress record.

    `batches` and `rows` are the batches consumed and outputs kept so far (as of the latest commit
    for `INFERENCE_PROGRESS` and `INFERENCE_RESUMED`); `resumed` says whether the run continued an
    earlier one. The start/end pair shares one context.
    """

    runner: Any
    split: str
    output: str
    record: str | None = None
    batches: int = 0
    rows: int = 0
    resumed: bool = False
    error: BaseException | None = None


@dataclass(slots=True)
class QuorumContext:
    """A TorchFT quorum at optimizer step `step`: `replicas` replica groups take part, `previous` did before.

    For `REPLICA_UNCOMMITTED`, `reason` says why the step's update was dropped.
    """

    runner: Any
    step: int
    replicas: int
    previous: int
    reason: str | None = None


@dataclass(slots=True)
class RecoveryContext:
    """This replica group loaded the live state of a peer at step `step`; it had reached `from_step`.

    `steps_missed` is `step - from_step`: the updates the group did not take part in.
    """

    runner: Any
    step: int
    from_step: int
    steps_missed: int


@dataclass(slots=True)
class FailureContext:
    """The run is failing with `error`, before the error leaves the runner."""

    runner: Any
    error: BaseException


class Events:
    """The events the runner loops emit. A start/end pair shares one context object.

    | Event | Context | Emitted |
    | --- | --- | --- |
    | `RUN_START`, `RUN_END` | `RunContext` | around a whole `train()`, `evaluate()` or `infer()` |
    | `EPOCH_START`, `EPOCH_END` | `EpochContext` | around each training epoch |
    | `PASS_START`, `PASS_END` | `PassContext` | around each pass over one split (training or evaluation) |
    | `STEP_START`, `STEP_END` | `StepContext` | around each batch |
    | `LOG` | `LogContext` | when step values or a result row are recorded (trackers listen) |
    | `STEP_LOG` | `StepLogContext` | before a step log is written (subscribers may add values) |
    | `OPTIMIZER_STEP_SKIPPED` | `SkippedStepContext` | when non-finite gradients drop an optimizer step |
    | `OUT_OF_MEMORY` | `OutOfMemoryContext` | `oom.policy`: a micro-batch ran out of memory on some rank |
    | `EVALUATION_START`, `EVALUATION_END` | `EvaluationContext` | around each evaluation pass |
    | `CHECKPOINT_SAVED`, `CHECKPOINT_LOADED` | `CheckpointContext` | after a checkpoint is written or read |
    | `CHECKPOINT_FALLBACK` | `CheckpointContext` | when resuming skips `requested` for an older one |
    | `STOP_REQUESTED` | `StopContext` | when a signal, early stopping or a budget stops the loop |
    | `FAILURE` | `FailureContext` | when an exception is about to leave the runner |
    | `INFERENCE_START`, `INFERENCE_END` | `InferenceContext` | around `infer(split, output=...)` |
    | `INFERENCE_PROGRESS` | `InferenceContext` | after each committed inference progress record |
    | `INFERENCE_RESUMED` | `InferenceContext` | when `infer(split, output=...)` continues an earlier run |
    | `QUORUM_CHANGED` | `QuorumContext` | TorchFT (`ft.enabled`): the number of live replica groups changed |
    | `REPLICA_LEFT`, `REPLICA_JOINED` | `QuorumContext` | TorchFT: fewer / more groups than at the last quorum |
    | `REPLICA_RECOVERED` | `RecoveryContext` | TorchFT: this group loaded a peer's live state (`steps_missed`) |
    | `REPLICA_UNCOMMITTED` | `QuorumContext` | TorchFT: the replica groups did not agree to commit a step |
    """

    RUN_START = Event("run_start", RunContext)
    RUN_END = Event("run_end", RunContext)
    EPOCH_START = Event("epoch_start", EpochContext)
    EPOCH_END = Event("epoch_end", EpochContext)
    PASS_START = Event("pass_start", PassContext)
    PASS_END = Event("pass_end", PassContext)
    STEP_START = Event("step_start", StepContext)
    STEP_END = Event("step_end", StepContext)
    OPTIMIZER_STEP_SKIPPED = Event("optimizer_step_skipped", SkippedStepContext)
    OUT_OF_MEMORY = Event("out_of_memory", OutOfMemoryContext)
    EVALUATION_START = Event("evaluation_start", EvaluationContext)
    EVALUATION_END = Event("evaluation_end", EvaluationContext)
    CHECKPOINT_SAVED = Event("checkpoint_saved", CheckpointContext)
    CHECKPOINT_LOADED = Event("checkpoint_loaded", CheckpointContext)
    CHECKPOINT_FALLBACK = Event("checkpoint_fallback", CheckpointContext)
    STOP_REQUESTED = Event("stop_requested", StopContext)
    FAILURE = Event("failure", FailureContext)
    LOG = Event("log", LogContext)
    STEP_LOG = Event("step_log", StepLogContext)
    INFERENCE_START = Event("inference_start", InferenceContext)
    INFERENCE_END = Event("inference_end", InferenceContext)
    INFERENCE_PROGRESS = Event("inference_progress", InferenceContext)
    INFERENCE_RESUMED = Event("inference_resumed", InferenceContext)
    QUORUM_CHANGED = Event("quorum_changed", QuorumContext)
    REPLICA_LEFT = Event("replica_left", QuorumContext)
    REPLICA_JOINED = Event("replica_joined", QuorumContext)
    REPLICA_RECOVERED = Event("replica_recovered", RecoveryContext)
    REPLICA_UNCOMMITTED = Event("replica_uncommitted", QuorumContext)


@dataclass(frozen=True, slots=True)
class Subscription:
    """Handle returned by [`EventBus.subscribe`][danling.runners.loop.events.EventBus.subscribe]."""

    bus: EventBus
    event: Event
    handler: Handler

    def unsubscribe(self) -> None:
        """Remove the handler; does nothing if it is no longer subscribed."""
        if self.handler in self.bus.handlers(self.event):
            self.bus.unsubscribe(self.event, self.handler)


class EventBus:
    """Subscriptions per event; handlers run in subscription order.

    Handlers are stored as tuples replaced on every (un)subscription, so a handler may
    (un)subscribe while an event is emitted; the change applies from the next emission.

    Attributes:
        subscribed: A live read-only view, event -> handlers, of the events anyone listens to:
            `event in bus.subscribed` asks what `has_subscribers` does without a function call,
            for the loop's paths that must cost nothing while nobody listens.
    """

    __slots__ = ("_handlers", "subscribed")

    def __init__(self) -> None:
        self._handlers: dict[Event, tuple[Handler, ...]] = {}
        self.subscribed: Mapping[Event, tuple[Handler, ...]] = MappingProxyType(self._handlers)

    def subscribe(self, event: Event[C], handler: Callable[[C], object]) -> Subscription:
        """Call `handler(context)` on every `event`; a handler may be subscribed to an event once.

        Raises:
            TypeError: `event` is not an `Event` or `handler` is not callable.
            ValueError: `handler` is already subscribed to `event`.
        """
        _check_event(event)
        if not callable(handler):
            raise TypeError(f"handler must be callable, got {handler!r}")
        handlers = self._handlers.get(event, ())
        if handler in handlers:
            raise ValueError(f"{handler!r} is already subscribed to {event!r}")
        self._handlers[event] = (*handlers, handler)
        return Subscription(self, event, handler)

    def unsubscribe(self, event: Event, handler: Handler) -> None:
        """Remove `handler` from `event`; `ValueError` if it is not subscribed."""
        handlers = self._handlers.get(event, ())
        if handler not in handlers:
            raise ValueError(f"{handler!r} is not subscribed to {event!r}")
        remaining = tuple(h for h in handlers if h != handler)
        if remaining:
            self._handlers[event] = remaining
        else:
            del self._handlers[event]  # keeps has_subscribers a plain membership test

    def has_subscribers(self, event: Event) -> bool:
        """Whether anyone listens to `event`: loops skip building contexts when nobody does."""
        return event in self._handlers

    def handlers(self, event: Event) -> tuple[Handler, ...]:
        """The handlers of `event` in call order (empty tuple if none)."""
        return self._handlers.get(event, ())

    def emit(self, event: Event[C], context: C) -> None:
        """Call the handlers of `event` with `context`; a handler's exception propagates.

        Raises:
            TypeError: `context` is not an instance of `event.context_type`.
        """
        if not isinstance(context, event.context_type):
            raise TypeError(_wrong_context(event, context))
        for handler in self._handlers.get(event, ()):
            handler(context)

    def pair(self, start: Event[C], end: Event[C], context: C) -> _Pair[C]:
        """Context manager: emit `start`, run the body, then always emit `end` with `context`.

        `context.error` is set to the exception that ended the body (or `None`) before `end`.
        A start handler that raises skips the body, but `end` still fires with that error, so
        every handler that saw `start` sees `end`. After an error, failing end handlers are
        logged and the original error propagates unchanged. `with` yields `context`.

        Raises:
            TypeError: `context` does not fit `start` or `end`.
        """
        for event in (start, end):
            if not isinstance(context, event.context_type):
                raise TypeError(_wrong_context(event, context))
        if not hasattr(context, "error"):
            raise TypeError(f"{type(context).__name__} has no `error` field, so it cannot close a pair")
        return _Pair(self, start, end, context)

    def subscribe_object(self, obj: object) -> list[Subscription]:
        """Subscribe the bound methods of `obj` marked with [`on`][danling.runners.loop.events.on].

        Methods are found across the class MRO, base classes first, each in definition order.
        An override keeps the place and the events of the method it overrides unless it carries
        its own `on` marks, which then replace them; an override set to `None` is skipped.
        On error, the subscriptions made so far are undone.
        """
        subscriptions: list[Subscription] = []
        try:
            for name, events in _marked_methods(type(obj)).items():
                for event in events:
                    subscriptions.append(self.subscribe(event, getattr(obj, name)))
        except BaseException:
            for subscription in subscriptions:
                subscription.unsubscribe()
            raise
        return subscriptions


class _Pair(Generic[C]):
    """The context manager behind `EventBus.pair`."""

    __slots__ = ("bus", "start", "end", "context")

    def __init__(self, bus: EventBus, start: Event[C], end: Event[C], context: C) -> None:
        self.bus, self.start, self.end, self.context = bus, start, end, context

    def __enter__(self) -> C:
        try:
            self.bus.emit(self.start, self.context)
        except BaseException as error:
            self._close(error)
            raise
        return self.context

    def __exit__(self, exc_type: object, error: BaseException | None, tb: object) -> None:
        self._close(error)  # returns None: the body's exception is never suppressed

    def _close(self, error: BaseException | None) -> None:
        self.context.error = error  # type: ignore[attr-defined]
        if error is None:
            self.bus.emit(self.end, self.context)
            return
        for handler in self.bus.handlers(self.end):
            try:
                handler(self.context)
            except Exception:  # the body's error wins; KeyboardInterrupt/SystemExit still escape
                logger.exception("handler %r of %r failed while handling %r", handler, self.end, error)


def on(*events: Event) -> Callable[[F], F]:
    """Mark a method as a handler of `events`; stackable. See `EventBus.subscribe_object`.

    Raises:
        TypeError: an argument is not an `Event`.
        ValueError: no events are given, or the method is already marked for one of them.
    """
    if not events:
        raise ValueError("on() needs at least one event, e.g. on(Events.EPOCH_END)")
    for event in events:
        _check_event(event)

    def mark(method: F) -> F:
        marked = _function_of(method)
        if marked is None:
            raise TypeError(f"on() decorates functions, staticmethods or classmethods, got {method!r}")
        existing: tuple[Event, ...] = marked.__dict__.get(_MARK, ())
        # Decorators apply bottom-up; prepending keeps the events in the order they are written.
        merged = (*events, *existing)
        if len(set(merged)) != len(merged):
            raise ValueError(f"{marked.__qualname__} is marked twice for the same event: {merged}")
        setattr(marked, _MARK, merged)
        return method

    return mark


def _function_of(value: object) -> FunctionType | None:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    return value if isinstance(value, FunctionType) else None


def _marked_methods(cls: type) -> dict[str, tuple[Event, ...]]:
    """Method name -> events, base classes first; the most derived marks of a name win."""
    found: dict[str, tuple[Event, ...]] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            function = _function_of(value)
            marks = function.__dict__.get(_MARK) if function is not None else None
            if marks is not None:
                found[name] = marks  # an existing key keeps its position
            elif value is None and name in found:
                del found[name]
    return found


def _check_event(event: object) -> None:
    if not isinstance(event, Event):
        raise TypeError(f"expected an Event such as Events.EPOCH_END, got {event!r}")


def _wrong_context(event: Event, context: object) -> str:
    expected = event.context_type.__name__
    return f"{event!r} expects a {expected} context, got {type(context).__name__}"
