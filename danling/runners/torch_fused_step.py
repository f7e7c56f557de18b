"""The fused default training step: what `TorchRunner.train_step` does in the plain case, in one call.

A training step through the hooks is a dozen Python calls (`to_device`, `train_context`,
`_criterion_loss`, `_update_metrics`, `backward`, `step`, `optimizer_step`, `_apply_update`, the
update strategy, the optimizer container ...), each asking again what the configuration
settled long ago. On a small model those calls cost a few percent of the step. When a training
pass starts, [`fused_train_step`][danling.runners.torch_fused_step.fused_train_step] checks once
that none of them can do anything but the plain thing (no hook overridden, one micro-step per
update, full precision, no clipping, no non-finite checks, no spike guard, no watchdog, no EMA)
and then returns one function doing the same work on pre-bound locals. Anything else keeps the
hooks. The result is the same to the bit: the same tensor operations in the same order, and the
same counters, metrics, losses and checkpoint waits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
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
    "_update_metrics",
    "_metrics_for",
    "backward",
    "step",
    "optimizer_step",
    "_apply_update",
    "checkpoint_save_failed",
)

FusedPass = Callable[..., tuple[int, bool]]
_PAIRS = (list, tuple)


def general_step_reason(runner: Any) -> str | None:
    """Why a training pass of `runner` must call its step hooks, or `None` when the fused step does the same.

    Settled once per pass: the configuration it reads does not change within a pass.
    """
    from .torch_runner import TorchRunner  # the defaults the fused step replays

    cls, own = type(runner), runner.__dict__
    for name in _STEP_HOOKS:
        if name in own or getattr(cls, name) is not getattr(TorchRunner, name):
            return f"{name} is overridden"
    if runner.model is None or runner.criterion is None or runner.ema is not None:
        return "no model, no criterion or an EMA copy"
    update = runner.update
    if type(update) is not TorchUpdateStrategy or type(update.accumulator) is not GradientAccumulator:
        return f"update strategy {type(update).__name__}"
    if update.accum_steps != 1 or not update.plain_backward or update.fixed_context is None:
        return "gradient accumulation, mixed precision, a spike guard or a watchdog"
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


def fused_train_pass(runner: Any) -> FusedPass | None:
    """One function running this training pass as the hooks would, or `None` when the pass needs the hooks.

    Per batch it moves the batch to the device (a pair of tensors already there is taken as is),
    splits it, runs the model and the criterion, feeds the pass's metrics, back-propagates,
    counts the micro-step and applies the update (waiting for a finished asynchronous save,
    stepping the optimizer and a step-interval scheduler, zeroing the gradients, counting the
    global step); then it records the loss and paces step logs, step-cadence work, stop requests
    and the budget as the general loop of
    [`PassMixin`][danling.runners.loop.passes.PassMixin] does.
    """
    if general_step_reason(runner) is not None:
        return None
    model, criterion, meters, supervisor = runner.model, runner.criterion, runner.meters, runner.supervisor
    container, accumulator = runner.update.container, runner.update.accumulator
    optimizer, position = container.optimizer, runner.loop_state
    scheduler = container.scheduler if container.scheduler_interval == "step" else None
    bound_optimizer, bound_scheduler = runner.optimizer, runner.scheduler
    counters = runner.state.train.__dict__  # validated ints; increments keep them so
    device = runner.device
    on_cpu, non_blocking = device.type == "cpu", device.type == "cuda"

    def run(
        batches: Iterable,
        split: str,
        length: int | None,
        interval: int,
        track_progress: bool,
        budget: int | None,
        stop_poll: Callable[[], bool] | None,
        agree: bool,
    ) -> tuple[int, bool]:
        count, loss_meter = 0, None
        for data in batches:
            if type(data) in _PAIRS and len(data) == 2:
                input, target = data
                if not (on_cpu and type(input) is Tensor and type(target) is Tensor and input.is_cpu and target.is_cpu):
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
                if metrics is not None:
                    metrics.update(pred.detach() if getattr(pred, "requires_grad", False) else pred, target)
            loss.backward()
            counters["micro_step"] += 1
            accumulator.position += 1  # one micro-step per window: every micro-step closes its window
            if runner.optimizer is not bound_optimizer or runner.scheduler is not bound_scheduler:
                runner.optimizer_step()  # reassigned during the pass: the hook binds them
            else:  # `optimizer_step` with nothing to check, clip or rescale
                try:
                    runner.checkpoint_manager.maybe_wait_for_staging()
                except CheckpointSaveError as err:
                    runner.checkpoint_save_failed(err)
                container.consecutive_nonfinite, container.last_grad_norm = 0, None
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                counters["global_step"] += 1
                if not runner._train_timeout_applied:
                    runner._apply_train_timeout()
            # What the general loop does after `train_step`.
            count += 1
            loss = loss.detach()
            if loss_meter is None:
                meters.update(loss=loss)
                loss_meter = meters["loss"]
            else:
                loss_meter.update(loss)
            if interval and (count % interval == 0 or count == length):
                runner._log_step(split, count, length, True)
            position.batch += 1
            if track_progress and counters["global_step"] != runner._seen_step:
                runner._after_optimizer_progress(budget)
            if runner._stop_latched or (
                supervisor.stop_requested
                if stop_poll is None
                else runner._stop_now(stop_poll, agree and count == length)
            ):
                runner._stop_latched = True
                return count, False  # every batch closes its window: stop now
            if budget is not None and counters["global_step"] >= budget:
                return count, False
        return count, True

    return run
