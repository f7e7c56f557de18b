"""The typed event bus of the runner loops: order, pairs, decorators, type checks."""

import dataclasses
import logging

import pytest

from danling.runners.loop import (
    CheckpointContext,
    EpochContext,
    EvaluationContext,
    Event,
    EventBus,
    Events,
    FailureContext,
    OutOfMemoryContext,
    RunContext,
    SkippedStepContext,
    StepContext,
    StopContext,
    on,
)


def recorder(log, label):
    def handler(context):
        log.append((label, context))

    return handler


def test_events_are_typed_constants():
    expected = {
        "RUN_START": RunContext,
        "RUN_END": RunContext,
        "EPOCH_START": EpochContext,
        "EPOCH_END": EpochContext,
        "STEP_START": StepContext,
        "STEP_END": StepContext,
        "OPTIMIZER_STEP_SKIPPED": SkippedStepContext,
        "OUT_OF_MEMORY": OutOfMemoryContext,
        "EVALUATION_START": EvaluationContext,
        "EVALUATION_END": EvaluationContext,
        "CHECKPOINT_SAVED": CheckpointContext,
        "CHECKPOINT_LOADED": CheckpointContext,
        "CHECKPOINT_FALLBACK": CheckpointContext,
        "STOP_REQUESTED": StopContext,
        "FAILURE": FailureContext,
    }
    for attribute, context_type in expected.items():
        event = getattr(Events, attribute)
        assert isinstance(event, Event)
        assert event.context_type is context_type
        assert event.name == attribute.lower()
    for context_type in set(expected.values()):
        assert "__slots__" in vars(context_type) and dataclasses.is_dataclass(context_type)
    # Distinct events never compare equal, even with the same context type.
    assert Events.EPOCH_START != Events.EPOCH_END
    with pytest.raises(dataclasses.FrozenInstanceError):
        Events.RUN_END.name = "other"


def test_handlers_run_in_subscription_order():
    bus, log = EventBus(), []
    first, second, third = (recorder(log, label) for label in "abc")
    handle = bus.subscribe(Events.EPOCH_END, first)
    bus.subscribe(Events.EPOCH_END, second)
    bus.subscribe(Events.EPOCH_START, third)
    context = EpochContext("runner", epoch=3)
    bus.emit(Events.EPOCH_END, context)
    assert log == [("a", context), ("b", context)]
    handle.unsubscribe()
    bus.subscribe(Events.EPOCH_END, first)  # back in, now last
    log.clear()
    bus.emit(Events.EPOCH_END, context)
    assert [label for label, _ in log] == ["b", "a"]
    assert bus.handlers(Events.EPOCH_END) == (second, first)


def test_handler_error_propagates_and_stops_emission():
    bus, log = EventBus(), []

    def broken(context):
        raise RuntimeError("handler broke")

    bus.subscribe(Events.STEP_END, broken)
    bus.subscribe(Events.STEP_END, recorder(log, "after"))
    with pytest.raises(RuntimeError, match="handler broke"):
        bus.emit(Events.STEP_END, StepContext("runner", "train", 0, 1, loss=0.5))
    assert log == []


def test_unsubscribe_and_has_subscribers():
    bus, log = EventBus(), []
    handler = recorder(log, "x")
    assert not bus.has_subscribers(Events.STEP_END)
    assert bus.handlers(Events.STEP_END) == ()
    handle = bus.subscribe(Events.STEP_END, handler)
    assert bus.has_subscribers(Events.STEP_END)
    assert not bus.has_subscribers(Events.STEP_START)
    with pytest.raises(ValueError, match="already subscribed"):
        bus.subscribe(Events.STEP_END, handler)
    bus.unsubscribe(Events.STEP_END, handler)
    assert not bus.has_subscribers(Events.STEP_END)
    handle.unsubscribe()  # already gone: no-op
    with pytest.raises(ValueError, match="not subscribed"):
        bus.unsubscribe(Events.STEP_END, handler)
    bus.emit(Events.STEP_END, StepContext("runner", "train", 0, 1))
    assert log == []


def test_unsubscribing_during_emission_applies_from_the_next_one():
    bus, log = EventBus(), []

    def once(context):
        log.append("once")
        subscription.unsubscribe()

    subscription = bus.subscribe(Events.RUN_START, once)
    bus.subscribe(Events.RUN_START, lambda context: log.append("other"))
    bus.emit(Events.RUN_START, RunContext("runner", "train"))
    bus.emit(Events.RUN_START, RunContext("runner", "train"))
    assert log == ["once", "other", "other"]


def test_bad_arguments_are_rejected():
    bus = EventBus()
    with pytest.raises(TypeError, match="expected an Event"):
        bus.subscribe("epoch_end", print)
    with pytest.raises(TypeError, match="callable"):
        bus.subscribe(Events.EPOCH_END, "not a function")


def test_wrong_context_type_raises_naming_event_and_type():
    bus, log = EventBus(), []
    bus.subscribe(Events.EPOCH_END, recorder(log, "x"))
    with pytest.raises(TypeError, match=r"epoch_end.*expects a EpochContext context, got StepContext"):
        bus.emit(Events.EPOCH_END, StepContext("runner", "train", 0, 1))
    with pytest.raises(TypeError, match="step_end"):  # checked even when nobody listens
        bus.emit(Events.STEP_END, {"loss": 1.0})
    with (
        pytest.raises(TypeError, match="evaluation_start"),
        bus.pair(Events.EVALUATION_START, Events.EVALUATION_END, EpochContext("runner", 0)),
    ):
        pass
    assert log == []


def test_pair_emits_start_body_end():
    bus, log = EventBus(), []
    bus.subscribe(Events.EVALUATION_START, lambda c: log.append(("start", c.result, c.error)))
    bus.subscribe(Events.EVALUATION_END, lambda c: log.append(("end", c.result, c.error)))
    context = EvaluationContext("runner", "val")
    with bus.pair(Events.EVALUATION_START, Events.EVALUATION_END, context) as entered:
        log.append("body")
        entered.result = {"loss": 0.25}
    assert entered is context
    assert log == [("start", None, None), "body", ("end", {"loss": 0.25}, None)]


def test_pair_end_fires_with_the_body_error_which_propagates_unchanged():
    bus, seen = EventBus(), []
    bus.subscribe(Events.EPOCH_END, lambda c: seen.append(c.error))
    error = ValueError("body failed")
    with pytest.raises(ValueError) as raised, bus.pair(Events.EPOCH_START, Events.EPOCH_END, EpochContext("runner", 1)):
        raise error
    assert raised.value is error
    assert seen == [error]


def test_failing_end_handler_does_not_hide_the_body_error(caplog):
    bus, seen = EventBus(), []

    def broken(context):
        raise RuntimeError("end handler broke")

    bus.subscribe(Events.RUN_END, broken)
    bus.subscribe(Events.RUN_END, lambda c: seen.append(c.error))  # still runs
    error = KeyError("body")
    caplog.set_level(logging.ERROR, logger="danling.runners.loop.events")
    with (
        pytest.raises(KeyError) as raised,
        bus.pair(Events.RUN_START, Events.RUN_END, RunContext("runner", "train")),
    ):
        raise error
    assert raised.value is error
    assert seen == [error]
    assert "end handler broke" in caplog.text and "run_end" in caplog.text


def test_failing_end_handler_propagates_when_the_body_succeeded():
    bus = EventBus()

    def broken(context):
        raise RuntimeError("end handler broke")

    bus.subscribe(Events.RUN_END, broken)
    with (
        pytest.raises(RuntimeError, match="end handler broke"),
        bus.pair(Events.RUN_START, Events.RUN_END, RunContext("runner", "evaluate")),
    ):
        pass


def test_failing_start_handler_skips_body_but_still_fires_end():
    bus, log = EventBus(), []
    error = RuntimeError("start handler broke")

    def broken(context):
        raise error

    bus.subscribe(Events.EPOCH_START, lambda c: log.append("start ok"))
    bus.subscribe(Events.EPOCH_START, broken)
    bus.subscribe(Events.EPOCH_END, lambda c: log.append(("end", c.error)))
    with (
        pytest.raises(RuntimeError) as raised,
        bus.pair(Events.EPOCH_START, Events.EPOCH_END, EpochContext("runner", 0)),
    ):
        log.append("body")
    assert raised.value is error
    assert log == ["start ok", ("end", error)]


def test_pair_needs_a_context_with_an_error_field():
    with pytest.raises(TypeError, match="no `error` field"):
        EventBus().pair(Events.STOP_REQUESTED, Events.STOP_REQUESTED, StopContext("runner", "signal", 15))


class Base:
    def __init__(self):
        self.log = []

    @on(Events.EPOCH_END)
    def record_epoch(self, context):
        self.log.append(("base.record_epoch", context.epoch))

    @on(Events.EPOCH_START, Events.EPOCH_END)
    def both(self, context):
        self.log.append(("base.both", context.epoch))

    @on(Events.EPOCH_END)
    def dropped(self, context):
        self.log.append(("base.dropped", context.epoch))

    @on(Events.RUN_START)
    def retargeted(self, context):
        self.log.append("base.retargeted")

    def plain(self, context):
        self.log.append("plain")


class Child(Base):
    @on(Events.EPOCH_END)
    def own(self, context):
        self.log.append(("child.own", context.epoch))

    @on(Events.EPOCH_END)
    def record_epoch(self, context):  # decorated override: subscribed once, in the base's place
        self.log.append(("child.record_epoch", context.epoch))

    def both(self, context):  # undecorated override: keeps the base's events
        self.log.append(("child.both", context.epoch))

    dropped = None  # opts out

    @on(Events.RUN_END)
    def retargeted(self, context):  # its own marks replace the base's
        self.log.append("child.retargeted")


def test_subscribe_object_finds_marked_methods_base_first():
    bus, child = EventBus(), Child()
    subscriptions = bus.subscribe_object(child)
    assert [(s.event, s.handler.__name__) for s in subscriptions] == [
        (Events.EPOCH_END, "record_epoch"),
        (Events.EPOCH_START, "both"),
        (Events.EPOCH_END, "both"),
        (Events.RUN_END, "retargeted"),
        (Events.EPOCH_END, "own"),
    ]
    bus.emit(Events.EPOCH_END, EpochContext(child, 2))
    bus.emit(Events.RUN_START, RunContext(child, "train"))
    bus.emit(Events.RUN_END, RunContext(child, "train"))
    assert child.log == [("child.record_epoch", 2), ("child.both", 2), ("child.own", 2), "child.retargeted"]
    for subscription in subscriptions:
        subscription.unsubscribe()
    assert not any(bus.has_subscribers(event) for event in (Events.EPOCH_START, Events.EPOCH_END, Events.RUN_END))


def test_subscribe_object_binds_each_instance_and_follows_the_mro():
    class Mixin:
        @on(Events.FAILURE)
        def mixin_failure(self, context):
            context.runner.append(("mixin", self.name))

    class Runner(Base, Mixin):
        def __init__(self, name):
            super().__init__()
            self.name = name

        @on(Events.FAILURE)
        def runner_failure(self, context):
            context.runner.append(("runner", self.name))

    bus, log = EventBus(), []
    bus.subscribe_object(Runner("first"))
    bus.subscribe_object(Runner("second"))
    bus.emit(Events.FAILURE, FailureContext(log, RuntimeError("boom")))
    # Reversed MRO: object, Mixin, Base, Runner, so the mixin's handler comes first.
    assert log == [("mixin", "first"), ("runner", "first"), ("mixin", "second"), ("runner", "second")]


def test_static_and_class_methods_can_be_marked():
    class Handlers:
        @on(Events.STOP_REQUESTED)
        @staticmethod
        def static(context):
            context.runner.append("static")

        @on(Events.STOP_REQUESTED)
        @classmethod
        def klass(cls, context):
            context.runner.append(cls.__name__)

    bus, log = EventBus(), []
    bus.subscribe_object(Handlers())
    bus.emit(Events.STOP_REQUESTED, StopContext(log, "signal", signal=15))
    assert log == ["static", "Handlers"]


def test_subscribe_object_rolls_back_on_error():
    bus, child = EventBus(), Child()
    bus.subscribe(Events.EPOCH_END, child.own)  # subscribe_object will collide on it
    with pytest.raises(ValueError, match="already subscribed"):
        bus.subscribe_object(child)
    assert bus.handlers(Events.EPOCH_END) == (child.own,)
    assert not bus.has_subscribers(Events.EPOCH_START)


def test_on_validates_its_arguments():
    with pytest.raises(ValueError, match="at least one event"):
        on()
    with pytest.raises(TypeError, match="expected an Event"):
        on("epoch_end")
    with pytest.raises(TypeError, match="decorates functions"):
        on(Events.EPOCH_END)(print)
    with pytest.raises(ValueError, match="marked twice"):

        @on(Events.EPOCH_END)
        @on(Events.EPOCH_START, Events.EPOCH_END)
        def handler(context):
            pass
