"""The per-batch hooks every runner implements, and the metric bookkeeping of a pass.

[`StepHooks`][danling.runners.loop.hooks.StepHooks] is the contract between the loops and a
backend: the loops call `train_step` / `evaluate_step` / `infer_step` once per batch, the steps
call `backward` and `step`, and `step` calls `optimizer_step` when an accumulation window closes.
How a loss becomes an update is the business of the runner's update strategy (`self.update`),
so these hooks stay the same for every backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from danling.checkpoint.failures import CheckpointSaveError
from danling.tensors import NestedTensor
from danling.utils import RoundDict

from ..update import UpdateStrategy
from .events import Events, SkippedStepContext
from .mode import RunnerMode

__all__ = ["RunnerMode", "StepHooks"]


class StepHooks:
    """Per-batch hooks and pass metrics; mixed into `BaseRunner`."""

    update: UpdateStrategy
    metrics: Any = None
    train_metrics: Any = None
    evaluate_metrics: Any = None
    _mode: RunnerMode = RunnerMode.train
    # Whether the hooked training pass under way discards what `train_step` returns as its output (no
    # subscriber watches the steps); the default torch step then lets the output go before backward.
    _step_output_unused: bool = False
    _active_metrics: Any = None  # the metric container of the pass under way (None outside a pass)
    # Samples at the end of the evaluation batch under way that the sampler repeated to pad the ranks'
    # shards to one length; `update_metrics` leaves them out (set by the pass, 0 for other batches).
    _repeated_tail: int = 0

    # ------------------------------------------------------------------ mode
    @property
    def mode(self) -> RunnerMode:
        """Current [`RunnerMode`][danling.runners.loop.mode.RunnerMode]; backends override the setter to
        switch their modules between training and evaluation behaviour."""
        return self._mode

    @mode.setter
    def mode(self, mode: RunnerMode | str) -> None:
        self._mode = RunnerMode(mode)

    # ------------------------------------------------------------------ step hooks
    def train_step(self, data: Any) -> tuple[Any, Any]:
        """Process one training micro-batch and return `(prediction, loss)`.

        Implementations compute the loss, call `self.backward(loss)` (when there are gradients) and
        then `self.step()`, which advances the accumulation window and the optimizer. Return
        `(pred, None)` when there is no loss to record.

        Called when: by the training loops, once per batch of `self.dataloaders[split]`.
        Holds on entry: `self.mode == "train"`, `self.split` is the split; its meters and metrics were
            reset when the pass opened (or restored, when it resumes a pass a checkpoint interrupted).
        Side effects: whatever `backward` and `step` do (gradients, possibly an update that advances
            `train_state.global_step`); the loop records the returned loss in `self.meters`.
        Overrides must not: touch `train_state`, save checkpoints, zero gradients or call
            `optimizer_step` (the loop and `step` own those).

        Examples:
            >>> from danling.runners import BaseRunner
            >>> class Runner(BaseRunner):
            ...     def train_step(self, data):
            ...         loss = self.model(data).mean()
            ...         self.backward(loss)
            ...         self.step()
            ...         return None, loss.detach()
        """
        raise NotImplementedError(f"{type(self).__name__} must implement train_step(data) -> (pred, loss)")

    def _plain_train_step(self) -> Any:
        """A backend's one-call equivalent of `train_step` for this pass, or `None` (here: always).

        Asked once when a training pass starts that no per-batch subscriber, watchdog or spike
        guard watches; the pass's loop then calls the returned `step(data) -> (None, loss)` in
        place of `train_step`.
        """
        return None

    def evaluate_step(self, data: Any) -> tuple[Any, Any]:
        """Process one evaluation batch and return `(prediction, loss or None)`.

        Called when: by the evaluation passes (`evaluate`, each round's evaluation, step-mode periodic
            evaluation), once per batch of the evaluated split.
        Holds on entry: `self.mode == "evaluate"`, inside `inference_context()`; the pass's meters and
            metrics were reset when it opened.
        Side effects: may update the evaluation metrics; the loop records the returned loss.
        Overrides must not: call `backward`/`step`, step the optimizer or change `train_state`
            (a periodic evaluation runs in the middle of training).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement evaluate_step(data) -> (pred, loss)")

    def infer_step(self, data: Any) -> list[Any]:
        """Return the predictions for one batch as a list (one entry per example).

        Called when: by `infer`, once per batch of the inferred split (lazily, as a stream is read).
        Holds on entry: `self.mode == "infer"`, inside `inference_context()`.
        Side effects: none expected.
        Overrides must not: update metrics or counters, or return something other than a list
            (outputs are concatenated and written per example).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement infer_step(data) -> list")

    def loss_weight(self, data: Any) -> int | float:
        """The weight of one batch's loss in the loss of its pass: the number of samples in `data` by default.

        The pass adds each step's loss to the `loss` meter with this weight, so the split's `loss`
        (and each step log) is a mean over samples, not over batches: with 100 samples in batches
        of 32, the last batch's 4 samples weigh 4/100, not 1/4. That is the split's mean loss per
        sample when each step's loss is a mean over its batch (a torch loss with `reduction="mean"`).

        The default counts the samples of `data` as the loader yielded it: a tensor holds as many
        as its first dimension, a `NestedTensor` as many tensors as it packs, a 0-d tensor or a
        plain number one; a mapping, list or tuple holds as many as the first dimension all the
        tensors in it (nested ones included, 0-d ones left out) share. A batch this rule cannot
        count is refused, never given a guessed weight: one with no such tensor, tensors whose first
        dimensions differ (a table the batch shares, samples of different sizes left uncollated), or
        another type. Override the hook for such batches, for a list of uncollated samples (whose
        tensors' shared first dimension is not the number of samples), and when the loss is a mean
        over something else, such as tokens: return what it averages over, as `backward(loss,
        weight=...)` takes it. On the last batch of an evaluation shard that a `DistributedSampler`
        padded with repeated samples, the pass cuts the weight to the batch's own samples.

        Called when: by the training and evaluation passes, once per batch whose step returned a
            loss, right after the step.
        Holds on entry: `data` is the batch the step received (as the loader yielded it).
        Side effects: none.
        Overrides must not: return a tensor, a negative or a non-finite number (the meter refuses
            them; a Python number is read without a device synchronisation).

        Raises:
            ValueError: The default cannot count the samples of `data`.

        Examples:
            >>> from danling.runners import BaseRunner
            >>> class TokenRunner(BaseRunner):
            ...     def loss_weight(self, data):  # the loss is a mean over the labelled tokens
            ...         return int((data["labels"] != -100).sum())
        """
        if type(data) is tuple or type(data) is list:
            # The usual batch, `(input, target)` of plain tensors, counted without the general walk
            # below: this runs once per batch.
            size = -1
            for item in data:
                if type(item) is not torch.Tensor or not item.ndim or (size >= 0 and item.shape[0] != size):
                    break
                size = item.shape[0]
            else:
                if size >= 0:
                    return size
        try:
            return _samples_in(data)
        except ValueError as error:
            raise ValueError(
                f"{error}; override loss_weight(data) on {type(self).__name__} to return the weight of the batch's "
                "loss (the number of samples, or of tokens, it averages over)"
            ) from None

    def build_update_strategy(self) -> UpdateStrategy:
        """The [`UpdateStrategy`][danling.runners.update.strategy.UpdateStrategy] that turns losses into updates.

        The base runner's strategy only counts accumulation windows; backends return theirs (torch:
        precision, gradient-sync suppression, clipping, the optimizer step).

        Called when: once, in `__post_init__` (after model, optimizer and scheduler are built), unless
            `self.update` is already set.
        Holds on entry: `accum_steps` and the rest of the config are final; the model is materialized.
        Side effects: none here; the result becomes `self.update`, which `backward`, `step` and
            `optimizer_step` go through.
        Overrides must not: return a strategy whose window size differs from `accum_steps` (budgets
            and resumes count updates with it).
        """
        return UpdateStrategy(self.accum_steps)

    def backward(self, loss: Any, weight: Any = None) -> None:
        """Back-propagate one micro-step loss through the update strategy.

        The loss is divided by the size of its accumulation window. With `weight` (e.g. the number
        of valid tokens the loss averages over), it is weighted instead, and the update applies
        the weight-normalised mean gradient over the window and the ranks.

        Called when: by `train_step`, once per micro-batch, before `step()`.
        Holds on entry: `loss` is a scalar of this micro-batch; inside a training pass.
        Side effects: accumulates gradients (gradient sync follows the strategy's window).
        Overrides must not: step the optimizer, change counters, or bypass `self.update` (scaling,
            sync suppression and weighting live there).

        Raises:
            ValueError: `loss` is not a single number.
        """
        update = self.update
        try:
            if weight is None and update.plain_backward:
                loss.backward()  # what the strategy would do, one call sooner
                return
            update.backward(loss, weight)
        except RuntimeError as error:
            if getattr(loss, "ndim", 0) and "scalar outputs" in str(error):
                raise ValueError(
                    f"backward() got a loss of shape {tuple(loss.shape)}, not one number: reduce it to a scalar "
                    "per batch (reduction='mean' for torch losses, or .mean()) before calling backward"
                ) from error
            raise

    def step(self) -> None:
        """Count one micro-step and call `optimizer_step` when it closes its accumulation window.

        Call exactly once per micro-batch from `train_step`, after `backward`; never together with
        `optimizer_step`. A window left open at the end of a pass is applied by the loop. Not a hook:
        the accumulation state machine must count every micro-step; change updates in `optimizer_step`.
        """
        state = self.state.train
        # The counters are validated ints; an increment keeps them so, so it bypasses the check.
        state.__dict__["micro_step"] = state.micro_step + 1
        if self.update.advance():
            self.optimizer_step()

    def optimizer_step(self) -> bool:
        """Apply one parameter update; return whether it was applied.

        Waits until a pending asynchronous checkpoint no longer reads the state, then lets the
        update strategy apply the window (a non-finite window may be skipped).

        Called when: by `step()` when a micro-step closes its window, and by the loop for a window a
            pass (or a graceful stop) leaves open; once per update.
        Holds on entry: the window's gradients are accumulated; inside a training pass.
        Side effects: an applied update increments `train_state.global_step` (a skipped one emits
            `OPTIMIZER_STEP_SKIPPED` instead).
        Overrides must not: skip `super()` or increment `global_step` themselves; add what follows an
            update after it (the torch runner refreshes the EMA copy).
        """
        return self._apply_update()

    def checkpoint_save_failed(self, error: CheckpointSaveError) -> None:
        """Handle a save that failed (a full disk, ...): stop the run, or go on when configured.

        By default the error propagates and the run stops; the checkpoint before it stays
        loadable. With `checkpoint.continue_on_save_error` the error is logged and training goes
        on; the next save the cadence asks for tries again.

        Called when: by `save_checkpoint`, or at the next optimizer step for an asynchronous save,
            once per failed save, on the rank that saw the failure.
        Holds on entry: the failed checkpoint was not published; the previous one is intact.
        Side effects: raises `error`, or logs it and returns.
        Overrides must not: retry the save themselves or swallow the error without a record.
        """
        if not self.config.checkpoint.continue_on_save_error:
            raise error
        self.logger.error("%s; continuing (checkpoint.continue_on_save_error), retrying at the next save", error)

    def _apply_update(self) -> bool:
        """The update every `optimizer_step` applies, whichever class's hook asked for it."""
        try:
            self.checkpoint_manager.maybe_wait_for_staging()
        except CheckpointSaveError as err:  # an async save failed since the last step
            self._save_failed(err)
        applied = self.update.apply()
        state = self.state.train
        if applied:
            state.__dict__["global_step"] = state.global_step + 1  # a validated int stays one
        else:
            skipped = SkippedStepContext(self, state.global_step, self.update.skipped_steps)
            self.events.emit(Events.OPTIMIZER_STEP_SKIPPED, skipped)
        return applied

    def _close_window(self) -> bool:
        """Apply a window the pass left open (a pass of unknown length ended, or a shutdown)."""
        return self.update.close_window() and self.optimizer_step()

    def inference_context(self) -> AbstractContextManager:
        """Context for evaluation and inference; backends disable autograd here.

        Called when: once around each evaluation pass (loader iteration, steps, meter updates), and
            around each `infer_step` (inference yields its batches to the caller in between).
        Holds on entry: `self.mode` is `evaluate` or `infer`.
        Side effects: none here (a `nullcontext`).
        Overrides must not: enable gradients or switch the mode (the pass owns it).
        """
        return nullcontext()

    def advance_schedulers(self, result: Mapping[str, Any]) -> None:
        """Step epoch-interval and metric-driven schedulers with the round's row; the base runner has none.

        Called when: once per round: after each epoch's evaluation (epoch mode), or after each full
            round over the train splits (step mode), before the row is stored.
        Holds on entry: `result` maps each split of the round to its metrics.
        Side effects: backends step their schedulers (the torch runner: epoch-interval ones).
        Overrides must not: modify `result` (it is stored as the round's row) or step step-interval
            schedulers (the update strategy steps those).
        """

    # ------------------------------------------------------------------ metrics of a pass
    def _metrics_for(self, mode: RunnerMode) -> Any:
        if mode is RunnerMode.train:
            return self.train_metrics if self.train_metrics is not None else self.metrics
        if mode is RunnerMode.evaluate:
            return self.evaluate_metrics if self.evaluate_metrics is not None else self.metrics
        return None

    def _start_metrics(self, mode: RunnerMode) -> None:
        metrics = self._active_metrics = self._metrics_for(mode)
        group = self.topology.group("metrics")  # None: the default group (plain data parallelism)
        if group is not None:
            self.meters.group = group
        if metrics is not None:
            if group is not None:
                metrics.group = group
            metrics.reset()

    def update_metrics(self, pred: Any, target: Any) -> None:
        """Feed one batch to the metrics of the pass under way (by mode outside a pass).

        Called when: once per batch by `train_step`/`evaluate_step` (and the pipeline steps, on the
            ranks with the last stage), after the forward pass.
        Holds on entry: `pred` is the batch's output, `target` its target (`None`: nothing is fed).
        Side effects: updates the active metrics (train or evaluate) with the detached prediction.
        Overrides must not: keep `pred` with its graph (it would hold the whole backward's memory),
            or skip batches on some ranks only (metrics synchronise across ranks when read).
        """
        if target is None:
            return
        metrics = self._active_metrics if self._active_metrics is not None else self._metrics_for(self.mode)
        if metrics is None:
            return
        if self._repeated_tail:
            own = self._own_samples(pred, target)
            if own is None:
                return  # nothing but repeats: every sample of this batch was fed already
            pred, target = own
        metrics.update(pred.detach() if getattr(pred, "requires_grad", False) else pred, target)

    def _own_samples(self, pred: Any, target: Any) -> tuple[Any, Any] | None:
        """`pred` and `target` without the repeats at the end of this batch (`_repeated_tail`); `None` when
        the batch holds nothing else. Unchanged outside the last batch of a padded evaluation shard."""
        tail = self._repeated_tail
        if not tail:
            return pred, target
        if _rows(target) <= tail:
            return None
        return _drop_tail(pred, tail), _drop_tail(target, tail)

    def collect_result(self, split: str) -> RoundDict:
        """The split's averaged step losses plus the values of its metrics.

        Called when: at the end of each pass over a split, and for the training values of a step-mode
            row before a periodic evaluation; on every rank together.
        Holds on entry: `self.meters` and the pass's metrics hold the pass's batches.
        Side effects: reading meters and metrics synchronises ranks; the pass's metrics are released.
        Overrides must not: skip the read on some ranks (the others would wait), or reset the meters
            (the loop does).
        """
        result = dict(self.meters.avg)
        metrics, self._active_metrics = self._active_metrics, None
        if metrics is not None:
            result.update(metrics.avg)
        return RoundDict.from_flat(result)  # flat results skip chanfig's generic constructor


def _rows(value: Any) -> int:
    """The number of samples in a batch's prediction or target (of a mapping, of its first entry)."""
    while isinstance(value, Mapping) and value:
        value = next(iter(value.values()))
    return len(value)


def _drop_tail(value: Any, count: int) -> Any:
    """`value` (a tensor, a sequence, or a mapping of them, as in multi-task runs) without its last `count` samples."""
    if isinstance(value, Mapping):
        return {key: _drop_tail(item, count) for key, item in value.items()}
    return value[: len(value) - count]


def _samples_in(data: Any) -> int:
    """The samples of a batch by the rule `StepHooks.loss_weight` documents.

    Raises:
        ValueError: The rule does not give one number for `data`.
    """
    if isinstance(data, torch.Tensor):
        size = _tensor_samples(data)
        return 1 if size is None else size  # a 0-d tensor is one sample
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        return 1
    if not isinstance(data, (Mapping, list, tuple)):
        raise ValueError(f"cannot count the samples of a batch of type {type(data).__name__}")
    sizes = set()
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            size = _tensor_samples(value)
            if size is not None:
                sizes.add(size)
        elif isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    if len(sizes) == 1:
        return sizes.pop()
    if not sizes:
        raise ValueError(f"cannot count the samples of a batch of type {type(data).__name__}: it holds no tensor")
    raise ValueError(
        f"cannot count the samples of a batch whose tensors differ in their first dimension ({sorted(sizes)})"
    )


def _tensor_samples(tensor: torch.Tensor) -> int | None:
    """The first dimension of `tensor` (`None` for a 0-d tensor); a `NestedTensor`'s number of tensors,
    which is its first dimension only when it is batch-first."""
    if isinstance(tensor, NestedTensor):
        return len(tensor)
    return int(tensor.shape[0]) if tensor.ndim else None
