"""A terminal progress bar fed by the loop's events (main process, interactive terminals only)."""

from __future__ import annotations

import contextlib
from typing import Any

from tqdm.auto import tqdm

from ..loop.events import EventBus, Events, PassContext, StepContext

__all__ = ["ProgressBar"]


def describe(context: PassContext) -> str:
    """`split epoch i/n` in epoch mode, `split step i/n` in step mode (what the bar is titled)."""
    runner, split = context.runner, context.split
    state = getattr(runner, "train_state", None)
    if state is None:
        return split
    if getattr(runner, "is_step_mode", False):
        total = getattr(runner, "steps", None)
        return f"{split} step {state.global_step}/{'?' if total is None else total}"
    epochs = getattr(runner, "epochs", None)
    if epochs is None:
        return f"{split} epoch {state.epoch + 1}/?"
    # an evaluation after the last epoch evaluates that epoch's weights (not an epoch past the end)
    return f"{split} epoch {min(state.epoch + 1, epochs)}/{epochs}"


def postfix(context: StepContext) -> dict[str, str]:
    """Loss of the step and the learning rate of the first parameter group, formatted for the bar."""
    values: dict[str, str] = {}
    loss = context.loss
    if loss is not None:
        with contextlib.suppress(TypeError, ValueError):  # a loss that is not a number (a dict of losses)
            values["loss"] = f"{float(loss):.4g}"
    optimizer = getattr(context.runner, "optimizer", None)
    groups = getattr(optimizer, "param_groups", None)
    if groups:
        values["lr"] = f"{float(groups[0]['lr']):.3g}"
    return values


class ProgressBar:
    """One tqdm bar per pass: opened on `PASS_START`, advanced on `STEP_END`, closed on `PASS_END`.

    The bar names the split and where training stands (`train epoch 2/10`, `train step
    120/1000`, `val epoch 2/10`) and shows the loss of the latest step and the learning rate of
    the first parameter group. They are read only when the bar redraws (at most every 0.1 s by
    default), so a device loss costs one synchronisation per redraw, not per step.

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
        self._mode: str | None = None  # mode of the pass the bar shows
        self._outer: list[tuple[Any, str | None]] = []  # training bars a nested evaluation pass interrupted

    def attach(self, bus: EventBus) -> ProgressBar:
        """Subscribe to `bus`; returns self."""
        bus.subscribe(Events.PASS_START, self.open)
        bus.subscribe(Events.STEP_END, self.advance)
        bus.subscribe(Events.PASS_END, self.close)
        return self

    def open(self, context: PassContext) -> None:
        if self.bar is not None and self._mode == "train" and context.mode != "train":
            self._outer.append((self.bar, self._mode))  # an evaluation inside a training pass (step mode)
        else:
            self.close()
        self._mode = context.mode
        self.bar = tqdm(total=context.length, desc=describe(context), **self.options)

    def advance(self, context: StepContext) -> None:
        bar = self.bar
        if bar is not None and bar.update(1):  # True when it redrew: refresh what the next redraw shows
            bar.set_postfix(postfix(context), refresh=False)

    def close(self, context: PassContext | None = None) -> None:
        bar = self.bar
        self.bar, self._mode = self._outer.pop() if self._outer else (None, None)
        if bar is not None:
            bar.close()
