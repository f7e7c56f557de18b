"""Per-step plumbing of pipeline schedules: agreeing on the batch shape, and running without loss or grad.

torch's pipeline stages fix the shapes of the activations they exchange on their first step;
a later batch of another shape (the short last batch of an evaluation split, another sequence
length) would be received into buffers of the old shape. So before each step the rank with the
first stage broadcasts the shapes of its inputs over the pipeline group, and every rank runs the
schedule built for exactly those shapes (see
[`ScheduleCache`][danling.distributed.pipeline_runtime.ScheduleCache]).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ScheduleCache", "broadcast_shapes", "no_grad_outside_inference", "without_loss"]

SHAPE_SLOTS = 32  # int64 entries of the broadcast shape code: room for several inputs of a few dims


def broadcast_shapes(
    args: tuple[Any, ...], *, src: int, group: Any, device: torch.device, degree: int
) -> tuple[int, ...]:
    """The shapes of the first stage's positional inputs, known to every pipeline rank.

    The code is `(number of inputs, ndim, *shape, ndim, *shape, ...)`. Ranks other than `src`
    pass empty `args` and receive it.

    Raises:
        ValueError: an input is not a tensor with a batch dimension, or the shapes need more
            than `SHAPE_SLOTS` numbers.
    """
    code = [len(args)]
    for arg in args:
        if not isinstance(arg, torch.Tensor) or arg.dim() == 0:
            raise ValueError(f"pipeline inputs must be tensors with a batch dimension, got {arg!r:.80}")
        code += [arg.dim(), *arg.shape]
    if degree == 1:
        return tuple(code)
    if len(code) > SHAPE_SLOTS:
        raise ValueError(f"pipeline inputs have too many dimensions to share ({len(code)} > {SHAPE_SLOTS} numbers)")
    buffer = torch.full((SHAPE_SLOTS,), -1, dtype=torch.long)
    if args:
        buffer[: len(code)] = torch.tensor(code)
    buffer = buffer.to(device)
    dist.broadcast(buffer, src=src, group=group)
    return tuple(value for value in buffer.tolist() if value >= 0)


class ScheduleCache:
    """The schedule to run for each input shape, built on first use and kept for the most recent shapes.

    The main schedule (the one the runner built from the config) serves the first shape whose
    batch its microbatch count divides. Any other shape gets a schedule of its own from `build`,
    with the largest microbatch count up to the main one that divides its batch (equal
    microbatches keep the mean of microbatch losses equal to the batch loss); when the schedule
    class rejects all of those, the smallest larger divisor it accepts; when it accepts none
    (1F1B needs at least as many microbatches as stages, more than a tiny batch has), `fallback`
    builds one with the first count, which computes the same losses and gradients in another order.

    Args:
        build: Builds a schedule over fresh stages for a microbatch count.
        fallback: Builds a schedule of a less demanding class (GPipe, LoopedBFS) for a count.
        capacity: Schedules kept besides the main one; the least recently used is dropped.
    """

    def __init__(
        self, build: Callable[[int], Any], fallback: Callable[[int], Any] | None = None, capacity: int = 8
    ) -> None:
        self.build = build
        self.fallback = fallback
        self.capacity = capacity
        self.main_key: tuple[int, ...] | None = None
        self.others: OrderedDict[tuple[int, ...], Any] = OrderedDict()

    def get(self, main: Any, key: tuple[int, ...]) -> Any:
        """The schedule for inputs of shape code `key` (see `broadcast_shapes`)."""
        if key == self.main_key:
            return main
        batch = key[2] if len(key) > 2 else 1
        count = main._n_microbatches
        if self.main_key is None and batch % count == 0:
            self.main_key = key
            return main
        schedule = self.others.get(key)
        if schedule is not None:
            self.others.move_to_end(key)
            return schedule
        schedule = self._build_for(batch, count)
        self.others[key] = schedule
        if len(self.others) > self.capacity:
            self.others.popitem(last=False)
        return schedule

    def _build_for(self, batch: int, limit: int) -> Any:
        divisors = [count for count in range(1, batch + 1) if batch % count == 0]
        # Prefer the most microbatches up to the configured count, then the fewest above it
        # (1F1B, for one, needs at least as many microbatches as stages).
        ordered = [c for c in reversed(divisors) if c <= limit] + [c for c in divisors if c > limit]
        error: ValueError | None = None
        for count in ordered:
            try:
                return self.build(count)
            except ValueError as rejected:
                error = rejected
        if self.fallback is not None:  # e.g. 1F1B on a batch smaller than the number of stages
            return self.fallback(ordered[0])
        raise ValueError(f"no pipeline schedule accepts any microbatch count for a batch of {batch}") from error


@contextmanager
def without_loss(schedule: Any, active: bool = True) -> Iterator[None]:
    """Run `schedule` without its loss function.

    torch's schedules compute a loss whenever they hold a loss function, and would index a
    target that an inference batch does not have.
    """
    loss_fn = schedule._loss_fn
    if active:
        schedule._loss_fn = None
    try:
        yield
    finally:
        schedule._loss_fn = loss_fn


def no_grad_outside_inference() -> AbstractContextManager:
    """No autograd, and outside inference mode.

    The stages' receive buffers outlive a step and training steps write them again, which
    tensors created in inference mode would forbid.
    """
    if torch.is_inference_mode_enabled():
        return _no_grad_normal_mode()
    return torch.no_grad()


@contextmanager
def _no_grad_normal_mode() -> Iterator[None]:
    with torch.inference_mode(False), torch.no_grad():
        yield
