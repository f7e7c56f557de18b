"""The plain default training step: what `TorchRunner`'s step hooks do in the plain case, without the calls.

A training step through the hooks is a dozen Python calls (`train_step`, `to_device`,
`train_context`, `_criterion_loss`, `update_metrics`, `backward`, `step`, `optimizer_step`,
`_apply_update`, the update strategy, the optimizer container ...), each asking again what the
configuration settled long ago; on a small model they cost a few percent of the step. When a
training pass starts that no per-batch subscriber watches, the pass engine asks the runner once
for [`plain_train_step`][danling.runners.torch_fused_step.plain_train_step]: when none of the hooks
can do anything but the plain thing (no hook overridden, and the update strategy's
[`plain_update_reason`][danling.runners.update.strategy.UpdateStrategy.plain_update_reason] is
`None`: one micro-step per update, full precision, no clipping, no non-finite checks, no spike
guard, no multi-process watchdog) and there is no EMA copy, it is one function doing the same
work on pre-bound locals, and the pass's one loop calls it in place of `train_step`; otherwise
the loop calls the hooks ([`general_step_reason`][danling.runners.torch_fused_step.general_step_reason]
says why). The result is the same to the bit: the same tensor operations in the same order, the
same counters and metric updates; the loop around the step (loss meter, step logs, checkpoints,
stops) is the same one. `runner.loop.fused_step` tells which step the last training pass took.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from danling.checkpoint.failures import CheckpointSaveError
from danling.data import split_batch
from danling.utils import to_device

__all__ = ["STEP_HOOKS", "general_step_reason", "label_range_message", "plain_train_step"]

# The hooks the default `train_step` goes through: a runner class that overrides any of them records
# it when the class is created (`TorchRunner.__init_subclass__`), and its passes keep the hooks.
STEP_HOOKS = (
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

PlainStep = Callable[[Any], tuple[None, Tensor]]
_PAIRS = (list, tuple)


def general_step_reason(runner: Any) -> str | None:
    """Why a training pass of `runner` must call its step hooks, or `None` when the plain step does the same.

    Settled once per pass: the configuration it reads does not change within a pass.
    """
    own = runner.__dict__
    overridden = next((name for name in STEP_HOOKS if name in own), None) or type(runner)._overridden_step_hook
    if overridden is not None:
        return f"{overridden} is overridden"
    if runner.model is None or runner.criterion is None or runner.ema is not None:
        return "no model, no criterion or an EMA copy"
    return runner.update.plain_update_reason(runner.optimizer, runner.scheduler)


def plain_train_step(runner: Any) -> PlainStep | None:
    """One function doing what `runner.train_step(data)` does for one batch, or `None` when the pass needs the hooks.

    Per batch it moves the batch to the device (a pair of tensors already there is taken as is),
    splits it, runs the model and the criterion, feeds the pass's metrics, back-propagates,
    counts the micro-step and applies the update (waiting for a finished asynchronous save,
    stepping the optimizer and a step-interval scheduler, zeroing the gradients, counting the
    global step), and returns `(None, detached loss)` as the default `train_step` does when the
    loop discards its output.
    """
    if general_step_reason(runner) is not None:
        return None
    model, criterion, update = runner.model, runner.criterion, runner.update
    container, accumulator = update.container, update.accumulator
    step_plain = container.step_plain
    bound_optimizer, bound_scheduler = runner.optimizer, runner.scheduler
    counters = runner.state.train.__dict__  # validated ints; increments keep them so
    device = runner.device
    on_cpu, non_blocking = device.type == "cpu", device.type == "cuda"

    def step(data: Any) -> tuple[None, Tensor]:
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
        return None, loss.detach()

    return step


def label_range_message(runner: Any, pred: Any, target: Any, err: Exception) -> str:
    """Say which split and which range, when the criterion refused a class label (checked on error only)."""
    split = getattr(runner, "split", None)
    if not (isinstance(pred, torch.Tensor) and isinstance(target, torch.Tensor) and pred.ndim >= 2):
        return f"criterion {runner.criterion!r} failed on split {split!r}: {err}"
    classes = pred.shape[1]
    found = f"targets range from {int(target.min())} to {int(target.max())}" if target.numel() else "no targets"
    return (
        f"labels out of range on split {split!r}: the criterion {type(runner.criterion).__name__} accepts class "
        f"indices in [0, {classes - 1}] for predictions of {classes} classes, and the batch's {found} ({err})"
    )
