"""The fused default training pass: what `TorchRunner`'s hooks do in the plain case, without the calls.

A training step through the hooks is a dozen Python calls (`train_step`, `to_device`,
`train_context`, `_criterion_loss`, `update_metrics`, `backward`, `step`, `optimizer_step`,
`_apply_update`, the update strategy, the optimizer container ...), each asking again what the
configuration settled long ago; on a small model they cost a few percent of the step. When a
training pass starts that no per-batch subscriber watches,
[`fused_train_pass`][danling.runners.torch_fused_step.fused_train_pass] checks once that none of
them can do anything but the plain thing (no hook overridden, one micro-step per update, full
precision, no clipping, no non-finite checks, no spike guard, no multi-process watchdog, no EMA) and returns
one loop doing the same work on pre-bound locals; otherwise the pass calls the hooks
([`general_step_reason`][danling.runners.torch_fused_step.general_step_reason] says why). The
result is the same to the bit: the same tensor operations in the same order, the same counters,
metric and loss-meter updates, step logs, checkpoints and stops. `runner.fused_step` tells which
path the last training pass took.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import islice
from typing import Any

from torch import Tensor

from danling.checkpoint.failures import CheckpointSaveError
from danling.data import split_batch
from danling.utils import to_device

from .update import GradientAccumulator, OptimizerContainer, TorchUpdateStrategy

__all__ = ["fused_train_pass", "general_step_reason"]

# The hooks the default `train_step` goes through: overriding any of them keeps the general path.
_STEP_HOOKS = (
    "train_step",
    "to_device",
    "train_context",
    "forward_context",
    "_criterion_loss",
    "update_metrics",
    "_metrics_for",
    "backward",
    "step",
    "optimizer_step",
    "_apply_update",
    "checkpoint_save_failed",
)

_TORCH_RUNNER: type | None = None
FusedPass = Callable[..., tuple[int, bool]]
_PAIRS = (list, tuple)
_HELD_LOSSES = 64  # batches whose losses are held back at most before they reach the loss meter


def general_step_reason(runner: Any) -> str | None:
    """Why a training pass of `runner` must call its step hooks, or `None` when the fused step does the same.

    Settled once per pass: the configuration it reads does not change within a pass.
    """
    cls, own, defaults = type(runner), runner.__dict__, _defaults()
    for name in _STEP_HOOKS:
        if name in own or getattr(cls, name) is not getattr(defaults, name):
            return f"{name} is overridden"
    if runner.model is None or runner.criterion is None or runner.ema is not None:
        return "no model, no criterion or an EMA copy"
    update = runner.update
    if type(update) is not TorchUpdateStrategy or type(update.accumulator) is not GradientAccumulator:
        return f"update strategy {type(update).__name__}"
    if update.accum_steps != 1 or not update.plain_backward or update.fixed_context is None:
        return "gradient accumulation, mixed precision, a spike guard or a multi-process watchdog"
    if update._multiplier is not None or update._weight is not None or update.spike_guard is not None:
        return "an open window"
    container = update.container
    if type(container) is not OptimizerContainer or container.optimizer is not runner.optimizer:
        return "no optimizer bound yet"
    if container.scheduler is not runner.scheduler or container.scaler is not None:
        return "a scheduler to bind or a gradient scaler"
    if container.max_grad_norm is not None or container.max_grad_value is not None or container.lr_scale != 1.0:
        return "gradient clipping or a lowered learning rate"
    if container.skip_nonfinite_grad or container.check_nonfinite:
        return "non-finite gradient checks"
    return None


def _defaults() -> type:
    """`TorchRunner`, whose hooks the fused step replays (imported on first use: it imports this module)."""
    global _TORCH_RUNNER
    if _TORCH_RUNNER is None:
        from .torch_runner import TorchRunner

        _TORCH_RUNNER = TorchRunner
    return _TORCH_RUNNER


def fused_train_pass(runner: Any) -> FusedPass | None:
    """One function running this training pass as the hooks would, or `None` when the pass needs the hooks.

    Per batch it moves the batch to the device (a pair of tensors already there is taken as is),
    splits it, runs the model and the criterion, feeds the pass's metrics, back-propagates,
    counts the micro-step and applies the update (waiting for a finished asynchronous save,
    stepping the optimizer and a step-interval scheduler, zeroing the gradients, counting the
    global step); then it paces step logs, step-cadence work, stop requests and the budget as the
    general loop of [`PassMixin`][danling.runners.loop.passes.PassMixin] does. The losses reach
    the loss meter in the same updates, in the same order, but in groups: before anything that
    reads the meters (a step log, step-cadence work, the end of the pass, an error) and every
    `_HELD_LOSSES` batches; an update costs less in a run of them than between two steps.
    """
    if general_step_reason(runner) is not None:
        return None
    model, criterion, update = runner.model, runner.criterion, runner.update
    container, accumulator, position = update.container, update.accumulator, runner.loop_state
    step_plain = container.step_plain
    bound_optimizer, bound_scheduler = runner.optimizer, runner.scheduler
    counters = runner.state.train.__dict__  # validated ints; increments keep them so
    device = runner.device
    on_cpu, non_blocking = device.type == "cpu", device.type == "cuda"

    def run(batches: Iterable, *pace: Any) -> tuple[int, bool]:
        held, supervisor, count = _HeldLosses(runner.meters), runner.supervisor, 0
        paced = _Pacing(runner, held, *pace) if _is_paced(*pace) else None
        try:
            for data in batches:
                if type(data) in _PAIRS and len(data) == 2:
                    input, target = data
                    if not (
                        on_cpu and type(input) is Tensor and type(target) is Tensor and input.is_cpu and target.is_cpu
                    ):
                        input, target = split_batch(to_device(data, device, non_blocking=non_blocking))
                else:
                    input, target = split_batch(to_device(data, device, non_blocking=non_blocking))
                pred = model(input)
                try:
                    loss = criterion(pred, target)
                except (IndexError, RuntimeError) as err:
                    runner._criterion_failed(pred, target, err)
                    raise
                if loss is None:
                    raise ValueError(f"criterion {criterion!r} returned None; train_step needs a loss tensor")
                if target is not None:
                    metrics = runner._active_metrics
                    if metrics is None:
                        metrics = runner._metrics_for(runner.mode)
                    if metrics is not None:  # what `update_metrics` hands over (the flag read without `getattr`)
                        grad = pred.requires_grad if type(pred) is Tensor else getattr(pred, "requires_grad", False)
                        metrics.update(pred.detach() if grad else pred, target)
                # The output is not needed past here: dropping it lets a criterion that saves only its own
                # result (log_softmax, as in cross-entropy) free the logits before the backward pass.
                pred = None
                try:
                    loss.backward()
                except RuntimeError as err:  # free until raised: the hot path pays no shape check
                    if getattr(loss, "ndim", 0):
                        raise runner._non_scalar_loss(loss) from err
                    raise
                counters["micro_step"] += 1
                accumulator.position += 1  # one micro-step per window: every micro-step closes its window
                if runner.optimizer is not bound_optimizer or runner.scheduler is not bound_scheduler:
                    runner.optimizer_step()  # reassigned during the pass: the hook binds them
                else:  # `optimizer_step` with nothing to check, clip or rescale
                    try:
                        runner.checkpoint_manager.maybe_wait_for_staging()
                    except CheckpointSaveError as err:
                        runner._save_failed(err)
                    step_plain()
                    counters["global_step"] += 1
                    if not runner._train_timeout_applied:
                        runner.apply_train_timeout()
                # What the general loop does after `train_step`.
                loss = loss.detach()
                held.losses.append(loss)
                count += 1
                # A loss of another shape than () may be refused by the meter: that error belongs to this batch.
                if not count % _HELD_LOSSES or loss.ndim:
                    held.record()
                if paced is not None:
                    if paced.stops(count):
                        return count, False
                else:
                    position.batch += 1
                    if runner._stop_latched or supervisor.stop_requested:
                        runner._stop_latched = True
                        return count, False  # every batch closes its window: stop now
            return count, True
        finally:
            held.record()

    return run


def _is_paced(
    split: str, length: int | None, interval: int, track_progress: bool, budget: Any, poll: Any, _: Any
) -> bool:
    """Whether a pass does more per batch than count its position and read the stop flag."""
    return bool(interval or track_progress or budget is not None or poll is not None)


class _HeldLosses:
    """Losses held back from the loss meter, handed over (`record`) as the general loop's updates would be."""

    def __init__(self, meters: Any) -> None:
        self.meters, self.meter, self.losses = meters, None, []

    def record(self) -> None:
        losses = self.losses
        if not losses:
            return
        start = 0
        if self.meter is None:  # the first loss of the pass goes through `meters.update`, as in the loop
            self.meters.update(loss=losses[0])
            self.meter, start = self.meters["loss"], 1
        update = self.meter.update
        for loss in islice(losses, start, None):
            update(loss)
        losses.clear()


class _Pacing:
    """What the general loop does after a batch besides counting: step logs, step-cadence work, stops, budget."""

    def __init__(self, runner: Any, held: _HeldLosses, *pace: Any) -> None:
        self.runner, self.held = runner, held
        self.split, self.length, self.interval, self.track_progress, self.budget, self.poll, self.agree = pace
        self.counters = runner.state.train.__dict__

    def stops(self, count: int) -> bool:
        """Pace batch `count` (from 1); whether the pass stops after it."""
        runner, interval, length, budget = self.runner, self.interval, self.length, self.budget
        if interval and (count % interval == 0 or count == length):
            self.held.record()
            runner._log_step(self.split, count, length, True)
        runner.loop_state.batch += 1
        if self.track_progress and self.counters["global_step"] != runner._seen_step:
            self.held.record()
            runner._after_optimizer_progress(budget)  # may evaluate: after the step log
        poll = self.poll
        if runner._stop_latched or (
            runner.supervisor.stop_requested if poll is None else runner._stop_now(poll, self.agree and count == length)
        ):
            runner._stop_latched = True
            return True  # every batch closes its window: stop now
        return budget is not None and (self.counters["global_step"] >= budget or runner._stopping_early)
