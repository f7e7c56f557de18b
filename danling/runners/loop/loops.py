"""Backend-free loop skeletons: training, evaluation and inference over the bound dataloaders.

[`LoopMixin`][danling.runners.loop.loops.LoopMixin] drives training, evaluation and inference over
`self.dataloaders[split]` and calls the step hooks (`train_step`, `evaluate_step`,
`infer_step`). It updates the progress counters, result rows and checkpoints, honours early stop
and graceful-stop requests, and feeds step logs to the logger and the trackers. It never touches
a tensor library: backends plug in through the hooks (`optimizer_step`, `inference_context`,
`collect_result`, the `mode` property, ...).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from enum import Enum
from itertools import islice
from typing import TYPE_CHECKING, Any, NoReturn

from tqdm.auto import tqdm

from danling.utils import RoundDict

from .budget import length_of

if TYPE_CHECKING:
    from ..config import RunnerConfig

__all__ = ["LoopMixin", "RunnerMode"]


class RunnerMode(str, Enum):
    """What the runner is doing: `train`, `evaluate` or `infer`."""

    train = "train"
    evaluate = "evaluate"
    infer = "infer"


class LoopMixin:
    """Training, evaluation and inference loops; mixed into `BaseRunner`."""

    config: RunnerConfig
    split: str | None = None
    # Loop bookkeeping; instances shadow these defaults on first assignment.
    _mode: RunnerMode = RunnerMode.train
    _pending_micro_steps: int = 0  # micro-steps in the current, not yet applied accumulation window
    _loop_depth: int = 0
    _training: bool = False
    # The loop cursor; backends save it in checkpoints so a resumed run continues where this one stopped.
    # Train split whose pass is under way (cleared when the pass runs to its end): a resumed run
    # continues with that split instead of restarting the round.
    _train_cursor: str | None = None
    # Whether the training part of the current round is over (the round is evaluating): a resumed
    # run goes straight on with evaluation instead of training the epoch again.
    _round_trained: bool = False
    # Results of the splits finished in the current round, so the resumed round's row is complete.
    _round_result: RoundDict | None = None
    # A stop request was seen; the loop exits at the next accumulation-window boundary.
    _stop_latched: bool = False

    # ------------------------------------------------------------------ mode
    @property
    def mode(self) -> RunnerMode:
        """Current [`RunnerMode`][danling.runners.loop.loops.RunnerMode]; backends override the setter to
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

    def backward(self, loss: Any) -> None:
        """Back-propagate one micro-step loss, scaled by `1 / accum_steps`.

        The default works for any loss object with a `backward()` method (autograd tensors);
        backends override it for loss scaling or engine-managed backward passes.
        """
        if not callable(getattr(loss, "backward", None)):
            raise TypeError(f"backward() needs a loss with a backward() method, got {type(loss).__name__}")
        if self.accum_steps > 1:
            loss = loss / self.accum_steps
        loss.backward()

    def step(self) -> None:
        """Count one micro-step and call `optimizer_step` when the accumulation window is full.

        Call once per micro-batch from `train_step`, after `backward`. A partial window left at
        the end of a split is applied by the loop.
        """
        self.train_state.micro_step += 1
        self._pending_micro_steps += 1
        if self._pending_micro_steps >= self.accum_steps:
            self._pending_micro_steps = 0
            self.optimizer_step()

    def optimizer_step(self) -> bool:
        """Apply one parameter update; return whether it was applied.

        The base runner has no parameters, so it only counts the update. Backends override this to
        clip, check for non-finite gradients, step optimizer and scheduler, and zero gradients;
        they must increment `train_state.global_step` exactly when an update is applied.
        """
        self.train_state.global_step += 1
        return True

    def _flush_pending_optimizer_step(self) -> bool:
        """Apply a partially filled accumulation window, if any (end of split, shutdown)."""
        if not self._pending_micro_steps:
            return False
        self._pending_micro_steps = 0
        return self.optimizer_step()

    def inference_context(self) -> AbstractContextManager:
        """Context for evaluation and inference; backends disable autograd here.

        An evaluation pass runs entirely inside one such context (loader iteration, steps, meter
        updates); inference enters it around each `infer_step`, since its batches are yielded to
        the caller in between.
        """
        return nullcontext()

    def collect_result(self, split: str) -> RoundDict:
        """Build the result of the split just run; the default reports the averaged step losses.

        Backends extend it with metric values and reduce across processes.
        """
        return self.meters.avg

    def advance_schedulers(self, result: Mapping[str, Any]) -> None:
        """Called once per epoch with the epoch's row, before it is stored; backends step
        epoch-interval and metric-driven schedulers here. The base runner has none."""

    # ------------------------------------------------------------------ training
    def train(
        self, train_splits: Sequence[str] | None = None, evaluate_splits: Sequence[str] | None = None
    ) -> RoundDict:
        """Train until the budget is spent: epoch mode when `epochs` is set, step mode otherwise.

        Args:
            train_splits: Splits to train on; defaults to `self.train_splits`.
            evaluate_splits: Splits to evaluate; defaults to `self.evaluate_splits`.

        Returns:
            All result rows (`self.results`).

        Raises:
            ValueError: A requested split has no dataloader, or there is no training split.
        """
        train_splits = self._resolve_splits(train_splits, self.train_splits, "train")
        if not train_splits:
            raise ValueError(
                f"no training split among dataloaders {list(self.dataloaders)}: "
                "name one 'train' or set config.train_splits"
            )
        evaluate_splits = self._resolve_splits(evaluate_splits, self.evaluate_splits, "evaluate")
        self.logger.info("training on %s; evaluating on %s", train_splits, evaluate_splits or "nothing")
        if self.is_step_mode:
            return self.train_steps(train_splits, evaluate_splits)
        return self.train_epochs(train_splits, evaluate_splits)

    def train_epochs(
        self, train_splits: Sequence[str] | None = None, evaluate_splits: Sequence[str] | None = None
    ) -> RoundDict:
        """Run epochs from `train_state.epoch` up to `epochs`.

        Each epoch trains every train split, evaluates every evaluation split, stores and writes
        the row (index = epoch index), then saves a checkpoint at the configured cadence (always
        after the last epoch). Stops early once `patience` epochs pass without a new best score.

        Raises:
            ValueError: `epochs` is not configured.
        """
        if self.epochs is None:
            raise ValueError(
                "train_epochs() needs config.epochs; for a step budget set config.steps and use train_steps()"
            )
        train_splits = self._resolve_splits(train_splits, self.train_splits, "train")
        evaluate_splits = self._resolve_splits(evaluate_splits, self.evaluate_splits, "evaluate")
        with self._loop_scope(training=True):
            for epoch in range(self.train_state.epoch, self.epochs):
                result = self._begin_round()
                if not self._round_trained:
                    for split in self._splits_from_cursor(train_splits):
                        result[split] = self.train_epoch(split)
                    self._round_trained = True
                for split in evaluate_splits:
                    result[split] = self.evaluate_epoch(split)
                self.advance_schedulers(result)
                self.append_result(result, index=epoch)
                if self.logger.isEnabledFor(logging.INFO):  # formatting a row costs more than the check
                    self.logger.info(self.format_epoch_result(result, epoch))
                self.save_result()
                self.train_state.epoch = epoch + 1
                self._end_round()
                stop_early = self.should_stop_early()
                self.save_checkpoint(epochs=epoch, last_step=stop_early or epoch + 1 == self.epochs)
                if stop_early:
                    self.logger.info("early stop: no better %s in %s epochs", self.score_name, self.patience)
                    break
        return self.results

    def train_epoch(self, split: str = "train") -> RoundDict:
        """One full pass over `self.dataloaders[split]` in training mode; returns the split's result."""
        return self._run_split(split, RunnerMode.train)[0]

    def train_steps(
        self, train_splits: Sequence[str] | None = None, evaluate_splits: Sequence[str] | None = None
    ) -> RoundDict:
        """Train until `train_state.global_step` reaches `steps`, then evaluate briefly.

        Train splits are consumed in sorted order, round after round (`train_state.epoch` counts
        full rounds, and `advance_schedulers` is called after each with the round's training
        results); step-cadence checkpoints are saved along the way. At the end one row
        indexed by the global step is stored and written, and a final checkpoint is saved.

        Raises:
            ValueError: No step budget can be resolved.
            RuntimeError: A full round over the train splits applied no optimizer step.
        """
        budget = self.steps
        if budget is None:
            raise ValueError("train_steps() needs config.steps, or config.epochs with sized train dataloaders")
        train_splits = sorted(self._resolve_splits(train_splits, self.train_splits, "train"))
        evaluate_splits = self._resolve_splits(evaluate_splits, self.evaluate_splits, "evaluate")
        with self._loop_scope(training=True):
            result = self._begin_round()
            while self.train_state.global_step < budget:
                start = self.train_state.global_step
                for split in self._splits_from_cursor(train_splits):
                    result[split] = self._run_split(split, RunnerMode.train, budget=budget)[0]
                    if self.train_state.global_step >= budget:
                        break
                else:
                    self.train_state.epoch += 1
                    self.advance_schedulers(result)  # an epoch-interval scheduler steps once per round
                if self.train_state.global_step == start:
                    raise RuntimeError(
                        f"a full round over {train_splits} applied no optimizer step: the loaders are empty "
                        "or train_step does not call self.step()"
                    )
            for split in evaluate_splits:
                length = length_of(self.dataloaders[split])
                steps = max(budget // 20, 1) if length is None else min(max(budget // 20, 1), length)
                result[split] = self.evaluate_steps(split, steps)
            self.append_result(result, index=self.train_state.global_step)
            if self.logger.isEnabledFor(logging.INFO):
                self.logger.info(self.format_result(result))
            self.save_result()
            self._end_round()
            self.save_checkpoint(last_step=True)
        return self.results

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, evaluate_splits: Sequence[str] | None = None) -> RoundDict:
        """Evaluate each split once and return `{split: result}`; the row is also sent to the trackers.

        Raises:
            ValueError: A requested split has no dataloader, or there is nothing to evaluate.
        """
        splits = self._resolve_splits(evaluate_splits, self.evaluate_splits, "evaluate")
        if not splits:
            raise ValueError(f"nothing to evaluate: dataloaders are {list(self.dataloaders)}")
        result = RoundDict()
        with self._loop_scope(training=False):
            for split in splits:
                result[split] = self.evaluate_epoch(split)
        self.logger.info(self.format_result(result))
        self.trackers.log(result.dict(), step=self.train_state.global_step)  # one x-axis for every tracker log
        return result

    def evaluate_epoch(self, split: str = "val") -> RoundDict:
        """One full pass over `self.dataloaders[split]` in evaluation mode; returns the split's result."""
        return self._run_split(split, RunnerMode.evaluate)[0]

    def evaluate_steps(self, split: str = "val", steps: int | None = None) -> RoundDict:
        """Evaluate the first `steps` batches of `split` (default `max(self.steps // 20, 1)`).

        Raises:
            ValueError: `steps` is negative, cannot be inferred, or the loader runs out first.
        """
        if steps is None:
            if self.steps is None:
                raise ValueError("evaluate_steps() needs steps when no step budget is configured")
            steps = max(self.steps // 20, 1)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps must be a non-negative int, got {steps!r}")
        result, batches = self._run_split(split, RunnerMode.evaluate, max_batches=steps)
        if batches < steps:
            raise ValueError(f"split {split!r} ran out after {batches} batches; {steps} were requested")
        return result

    # ------------------------------------------------------------------ inference
    def infer(
        self, split: str = "infer", *, steps: int | None = None, stream: bool | None = None
    ) -> list[Any] | Iterator[list[Any]]:
        """Predict on `split`: a flat list of outputs, or an iterator of per-batch lists.

        Args:
            split: Split to read.
            steps: Stop after this many batches.
            stream: Return a lazy iterator of batch outputs. By default only loaders without a
                length (and no `steps`) are streamed.

        Raises:
            ValueError: `steps` is negative, or a flat list is requested from an unsized loader
                without `steps`.
        """
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise ValueError(f"steps must be a non-negative int or None, got {steps!r}")
        if split not in self.dataloaders:
            raise ValueError(f"infer split {split!r} has no dataloader; available: {list(self.dataloaders)}")
        loader = self.dataloaders[split]
        sized = length_of(loader) is not None
        if stream is None:
            stream = not sized and steps is None
        if not stream and not sized and steps is None:
            raise ValueError(f"split {split!r} has no length: pass steps=... or stream=True")
        batches = self._iter_infer_batches(loader, split, steps)
        if stream:
            return batches
        with self._loop_scope(training=False):
            return [item for batch in batches for item in batch]

    def _iter_infer_batches(self, loader: Iterable, split: str, steps: int | None) -> Iterator[list[Any]]:
        self.mode = RunnerMode.infer
        self.split = split
        for data in islice(loader, steps):
            with self.inference_context():
                outputs = self.infer_step(data)
            yield outputs
            if self._stop_requested():
                self._shutdown()

    # ------------------------------------------------------------------ internals
    def _run_split(
        self, split: str, mode: RunnerMode, *, budget: int | None = None, max_batches: int | None = None
    ) -> tuple[RoundDict, int]:
        """Iterate one split in `mode`; return its result and the number of batches consumed."""
        loader = self.dataloaders[split]
        self.mode, self.split = mode, split
        self.meters.reset()
        length = length_of(loader)
        training = mode is RunnerMode.train
        if training:
            self._train_cursor = split
        self._start_split(split, mode, length)
        if max_batches is not None:
            length = max_batches if length is None else min(length, max_batches)
        interval = self._log_interval_for(length)
        state = self.train_state
        self._seen_step = state.global_step
        # Looked up once per pass rather than once per batch; none of them is rebound by a step.
        meters, supervisor = self.meters, self.supervisor
        # Per-batch services that are off by default are skipped outright rather than called per batch.
        beat = supervisor.beat if supervisor.heartbeat_dir is not None else None
        track_progress = training and (budget is not None or supervisor.gc_interval is not None)
        step = self._batch_step(mode)
        stop_poll = self._stop_poll()
        batches, loss_meter = 0, None
        # An evaluation pass runs in one inference context (entering it per batch costs more than
        # some small models' forward passes); it is left before a stop saves its checkpoint.
        with nullcontext() if training else self.inference_context():
            for data in self._progress_bar(islice(loader, max_batches), split, length):
                _, loss = step(data)
                batches += 1
                if loss is not None:
                    if loss_meter is None:
                        meters.update(loss=loss)
                        loss_meter = meters["loss"]  # then updated directly: this runs every batch
                    else:
                        loss_meter.update(loss)
                if track_progress and state.global_step != self._seen_step:
                    self._after_optimizer_progress(budget)
                if beat is not None:
                    beat(state.global_step, state.epoch, split)
                if batches % interval == 0 or batches == length:
                    self._log_step(split, batches, length, training)
                if self._stop_latched or (supervisor.stop_requested if stop_poll is None else stop_poll()):
                    # Stop only at a window boundary: applying a partial window (or dropping its
                    # gradients) would make the resumed run diverge from an uninterrupted one.
                    self._stop_latched = True
                    if not (training and self._pending_micro_steps):
                        break  # the stop below shuts down
                if budget is not None and self.train_state.global_step >= budget:
                    break
            else:
                if training:
                    self._train_cursor = None  # the pass ran to its end
        if training and self._flush_pending_optimizer_step():
            self._after_optimizer_progress(budget)
        if self._stop_latched:  # at a window boundary (the break above) or at the end of the pass
            self._shutdown()
        return self.collect_result(split), batches

    def _start_split(self, split: str, mode: RunnerMode, length: int | None) -> None:
        """Called when a pass over `split` begins (after `mode` is set); backends reset per-pass state here."""

    def _batch_step(self, mode: RunnerMode) -> Any:
        """The callable a pass in `mode` runs on every batch (after `_start_split`).

        `train_step` or `evaluate_step`; backends may return an equivalent that does the same
        work through fewer calls when none of the hooks it stands for is overridden.
        """
        return self.train_step if mode is RunnerMode.train else self.evaluate_step

    def _begin_round(self) -> RoundDict:
        """The result of the current round: the restored partial one of a resumed round, else a new one."""
        if self._round_result is None:
            self._round_result = RoundDict()
        return self._round_result

    def _end_round(self) -> None:
        """The round's row is stored: the next round starts with training and an empty result."""
        self._round_result = None
        self._round_trained = False

    def _loop_state(self) -> dict[str, Any]:
        """Where the loops are inside the current round; backends store it in checkpoints.

        `split` is the train split whose pass is under way, `trained` whether the round's training
        is over (it was evaluating), and `round` the results of the splits already finished.
        """
        round_result = self._round_result
        return {
            "split": self._train_cursor,
            "trained": self._round_trained,
            "round": None if not round_result else round_result.dict(),
        }

    def _load_loop_state(self, state: Mapping[str, Any]) -> None:
        """Restore what `_loop_state` returned."""
        self._train_cursor = state.get("split")
        self._round_trained = bool(state.get("trained", False))
        round_result = state.get("round")
        self._round_result = RoundDict(round_result) if round_result else None
        self._pending_micro_steps = 0

    def _splits_from_cursor(self, splits: Sequence[str]) -> list[str]:
        """`splits` starting at the one whose pass was interrupted, if any (a resumed mid-round run)."""
        cursor = self._train_cursor
        splits = list(splits)
        return splits[splits.index(cursor) :] if cursor in splits else splits

    def _after_optimizer_progress(self, budget: int | None) -> None:
        """GC pacing and step-cadence checkpoints, once per applied optimizer step."""
        global_step = self.train_state.global_step
        if global_step == self._seen_step:
            return
        self._seen_step = global_step
        self.supervisor.gc_step(global_step)
        # The final step-mode checkpoint is saved by train_steps itself.
        if budget is not None and global_step < budget:
            self.save_checkpoint()

    def _log_step(self, split: str, iteration: int, length: int | None, training: bool) -> None:
        to_log, to_track = self.logger.isEnabledFor(logging.INFO), training and len(self.trackers) > 0
        if not (to_log or to_track or self.distributed):
            # Nobody reads the values: skip the read, which synchronises with the device. Under
            # several processes the read is a collective every rank joins, whatever it logs.
            return
        values = self.meters.avg  # the one place step values are read back
        if to_log:
            self.logger.info(self.format_step_result(values, split, iteration, length))
        if to_track and values:
            self.trackers.log({f"{split}_step": values.dict()}, step=self.train_state.global_step)

    def _progress_bar(self, iterable: Iterable, split: str, length: int | None) -> Iterable:
        show = self.is_main_process and sys.stdout.isatty()
        if not show:
            return iterable
        return tqdm(iterable, total=length, desc=split, leave=False, dynamic_ncols=True)

    def _stop_requested(self) -> bool:
        """Whether a graceful stop was requested; distributed backends override this to agree across ranks."""
        return self.supervisor.stop_requested

    def _stop_poll(self) -> Any:
        """What a pass asks after each batch: `_stop_requested`, or None when the supervisor's flag
        alone answers (then the loop reads the flag instead of making a call per batch)."""
        return None if type(self)._stop_requested is LoopMixin._stop_requested else self._stop_requested

    @contextmanager
    def _loop_scope(self, *, training: bool) -> Iterator[None]:
        """Keep stop-signal handlers installed while a loop runs (outermost loop only)."""
        depth = self._loop_depth
        self._loop_depth = depth + 1
        if depth == 0:
            self._training = training
            self.supervisor.install_signal_handlers()
        try:
            if depth == 0 and self._stop_requested():
                self._shutdown()
            yield
            if depth == 0:
                self.flush_results()  # a finished loop leaves its result files complete on disk
        finally:
            self._loop_depth = depth
            if depth == 0:
                self._training = False
                if not self.__dict__.get("_closed", False):
                    self.supervisor.restore_signal_handlers()

    def _shutdown(self) -> NoReturn:
        """Save a `shutdown` checkpoint (when training), close the runner and exit.

        The training loops call it only at an accumulation-window boundary (a stop request that
        arrives inside a window lets the window finish first), with the loop cursor describing
        where the round stood, so a run resumed from the checkpoint ends exactly as an
        uninterrupted one. The exit status is 128 + the signal number, or 0 when the stop was requested in code
        (`supervisor.request_stop()`) rather than by a signal.
        """
        code = self.supervisor.exit_code
        state = self.train_state
        self.logger.warning(
            "stopping on request at epoch %d, global step %d (exit code %d)", state.epoch, state.global_step, code
        )
        if self._training:
            self.prepare_for_shutdown_checkpoint()
            self.save_checkpoint(name="shutdown", force=True, save_best=False)
        self.close()
        raise SystemExit(code)
