"""A terminal progress bar fed by the loop's events (main process, interactive terminals only)."""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm

from ..loop.events import EventBus, Events, PassContext, StepContext

__all__ = ["ProgressBar"]


class ProgressBar:
    """One tqdm bar per pass: opened on `PASS_START`, advanced on `STEP_END`, closed on `PASS_END`.

    It is a subscriber like any other, so a runner that has no terminal to draw on simply does
    not subscribe it, and its batches carry no per-step event at all.

    Examples:
        >>> from danling.runners.loop.events import EventBus
        >>> bus = EventBus()
        >>> bar = ProgressBar().attach(bus)
        >>> bus.has_subscribers(Events.STEP_END)
        True
    """

    def __init__(self, **options: Any) -> None:
        self.options = {"leave": False, "dynamic_ncols": True, **options}
        self.bar: Any = None

    def attach(self, bus: EventBus) -> ProgressBar:
        """Subscribe to `bus`; returns self."""
        bus.subscribe(Events.PASS_START, self.open)
        bus.subscribe(Events.STEP_END, self.advance)
        bus.subscribe(Events.PASS_END, self.close)
        return self

    def open(self, context: PassContext) -> None:
        self.close()
        self.bar = tqdm(total=context.length, desc=context.split, **self.options)

    def advance(self, context: StepContext) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self, context: PassContext | None = None) -> None:
        bar, self.bar = self.bar, None
        if bar is not None:
            bar.close()
