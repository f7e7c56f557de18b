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

from danling.checkpoint.failures import CheckpointSaveError
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

        Called by the training loops once per batch of `self.dataloaders[split]`. Implementations
        compute the loss, call `self.backward(loss)` (when there are gradients) and then
        `self.step()`, which advances the accumulation window and the optimizer. Return
        `(pred, None)` when there is no loss to record. Do not touch `train_state`, save
        checkpoints or zero gradients here: the loop and `optimizer_step` own those.
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

        Runs inside `inference_context()`; must not step the optimizer or change counters.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement evaluate_step(data) -> (pred, loss)")

    def infer_step(self, data: Any) -> list[Any]:
        """Return the predictions for one batch as a list (one entry per example).

        Runs inside `inference_context()`; must not update metrics or counters.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement infer_step(data) -> list")

    def build_update_strategy(self) -> UpdateStrategy:
        """The [`UpdateStrategy`][danling.runners.update.strategy.UpdateStrategy] that turns losses into updates.

        Called once by `__post_init__`, after the model, optimizer and scheduler are built. The
        base runner's strategy only counts accumulation windows; backends return theirs (torch:
        precision, gradient-sync suppression, clipping, the optimizer step).
        """
        return UpdateStrategy(self.accum_steps)

    def backward(self, loss: Any, weight: Any = None) -> None:
        """Back-propagate one micro-step loss through the update strategy.

        The loss is divided by the size of its accumulation window. With `weight` (e.g. the number
        of valid tokens the loss averages over), it is weighted instead, and the update applies
        the weight-normalised mean gradient over the window and the ranks. Do not step the
        optimizer or change counters here.
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
        `optimizer_step`. A window left open at the end of a pass is applied by the loop.
        """
        state = self.state.train
        # The counters are validated ints; an increment keeps them so, so it bypasses the check.
        state.__dict__["micro_step"] = state.micro_step + 1
        if self.update.advance():
            self.optimizer_step()

    def optimizer_step(self) -> bool:
        """Apply one parameter update; return whether it was applied.

        Waits until a pending asynchronous checkpoint no longer reads the state, then lets the
        update strategy apply the window (a non-finite window may be skipped). An applied update
        increments `train_state.global_step`; a skipped one does not. Overrides call `super()`
        and add what follows an update (the torch runner refreshes the EMA copy).
        """
        return self._apply_update()

    def checkpoint_save_failed(self, error: CheckpointSaveError) -> None:
        """Handle a save that failed (a full disk, ...): stop the run, or go on when configured.

        By default the error propagates and the run stops; the checkpoint before it stays
        loadable. With `checkpoint.continue_on_save_error` the error is logged and training goes
        on; the next save the cadence asks for tries again.
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

        An evaluation pass runs entirely inside one such context (loader iteration, steps, meter
        updates); inference enters it around each `infer_step`, since its batches are yielded to
        the caller in between.
        """
        return nullcontext()

    def advance_schedulers(self, result: Mapping[str, Any]) -> None:
        """Called once per epoch with the epoch's row, before it is stored; backends step
        epoch-interval and metric-driven schedulers here. The base runner has none."""

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
        if metrics is not None:
            metrics.update(pred.detach() if getattr(pred, "requires_grad", False) else pred, target)

    def collect_result(self, split: str) -> RoundDict:
        """The split's averaged step losses plus the values of its metrics.

        Reading meters and metrics synchronises ranks, so every rank calls this together (the
        loops do, at the end of each split).
        """
        result = dict(self.meters.avg)
        metrics, self._active_metrics = self._active_metrics, None
        if metrics is not None:
            result.update(metrics.avg)
        return RoundDict.from_flat(result)  # flat results skip chanfig's generic constructor
