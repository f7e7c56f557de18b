"""Training, evaluation and inference loops over the bound dataloaders.

[`LoopMixin`][danling.runners.loop.loops.LoopMixin] drives rounds (epochs, or step budgets) over
`self.dataloaders[split]`: it stores result rows, saves checkpoints at the configured cadence,
honours early stop and graceful-stop requests, and leaves the per-batch work to the hooks of
[`StepHooks`][danling.runners.loop.hooks.StepHooks] and the pass engine of
[`PassMixin`][danling.runners.loop.passes.PassMixin]. It never touches a tensor library.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from danling.utils import RoundDict

from ..update.spikes import LossSpike
from .budget import length_of
from .dry_run import DryRunMixin
from .events import EpochContext, Events, StopContext
from .hooks import RunnerMode

if TYPE_CHECKING:
    from ..config import RunnerConfig

__all__ = ["LoopMixin", "RunnerMode"]


class LoopMixin(DryRunMixin):
    """Training, evaluation and inference loops; mixed into `BaseRunner`."""

    config: RunnerConfig

    # ------------------------------------------------------------------ training
    def train(
        self, train_splits: Sequence[str] | None = None, evaluate_splits: Sequence[str] | None = None
    ) -> RoundDict:
        """Train until the budget is spent: epoch mode when `epochs` is set, step mode otherwise.

        With `config.dry_run` set, run [`dry_run`][danling.runners.loop.dry_run.DryRunMixin.dry_run]
        instead: a few batches of every split and one checkpoint round trip.

        Args:
            train_splits: Splits to train on; defaults to `self.train_splits`.
            evaluate_splits: Splits to evaluate; defaults to `self.evaluate_splits`.

        Returns:
            All result rows (`self.results`).

        With `spikes.policy` set to `"rollback"`, a loss spike reloads the newest checkpoint that
        verifies and training goes on from there (see
        [`roll_back`][danling.runners.loop.passes.PassMixin.roll_back]).

        Raises:
            ValueError: A requested split has no dataloader, there is no training split, or the
                budget or data would train nothing (see `check_training_budget`).
            TrainingDivergedError: Non-finite updates or loss spikes came too often (`nonfinite.*`, `spikes.*`).
        """
        train_splits = self._resolve_splits(train_splits, self.train_splits, "train")
        if not train_splits:
            raise ValueError(
                f"no training split among dataloaders {list(self.dataloaders)}: "
                "name one 'train' or set config.train_splits"
            )
        evaluate_splits = self._resolve_splits(evaluate_splits, self.evaluate_splits, "evaluate")
        self.check_training_budget(train_splits, evaluate_splits)
        self._check_selection(evaluate_splits)
        if self.dry_run_batches:
            return self.dry_run(train_splits, evaluate_splits)
        if self.budget_spent():  # a resumed run whose budget was not raised
            return self.results
        if self.bookkeeping.should_stop_early():  # a resumed run that stopped early, its patience not raised
            self.logger.info("early stop: already out of patience (%s evaluations); nothing to train", self.patience)
            return self.results
        self.logger.info("training on %s; evaluating on %s", train_splits, evaluate_splits or "nothing")
        while True:
            try:
                if self.is_step_mode:
                    return self.train_steps(train_splits, evaluate_splits)
                return self.train_epochs(train_splits, evaluate_splits)
            except LossSpike as spike:  # spikes.policy=rollback: reload, then carry on from there
                self.roll_back(spike)

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
                with self.events.pair(Events.EPOCH_START, Events.EPOCH_END, EpochContext(self, epoch)) as context:
                    result = self.loop_state.begin_round()
                    if not self.loop_state.trained:
                        for split in self.loop_state.splits_from_cursor(list(train_splits)):
                            result[split] = self.train_epoch(split)
                        self.loop_state.trained = True
                    result.update(self.evaluate_for_row(evaluate_splits))
                    self.advance_schedulers(result)
                    self._append_result(result, index=epoch)
                    if self.logger.isEnabledFor(logging.INFO):  # formatting a row costs more than the check
                        self.logger.info(self.bookkeeping.format_epoch_result(result, epoch, self.epochs))
                    self._save_result()
                    self.train_state.epoch = epoch + 1
                    self.loop_state.end_round()
                    context.result = result
                stop_early = self.bookkeeping.should_stop_early()
                self._watch_phase("checkpoint save")
                self.save_checkpoint(epochs=epoch, last_step=stop_early or epoch + 1 == self.epochs)
                if stop_early:
                    self.logger.info(
                        "early stop: no better %s in %s evaluations", self.config.score_name, self.patience
                    )
                    self.events.emit(Events.STOP_REQUESTED, StopContext(self, "early stop"))
                    break
        return self.results

    def train_epoch(self, split: str = "train") -> RoundDict:
        """One full pass over `self.dataloaders[split]` in training mode; returns the split's result."""
        return self._run_split(split, RunnerMode.train)[0]

    def train_steps(
        self, train_splits: Sequence[str] | None = None, evaluate_splits: Sequence[str] | None = None
    ) -> RoundDict:
        """Train until `train_state.global_step` reaches `steps`, evaluating along the way and at the end.

        Train splits are consumed in sorted order, round after round (`train_state.epoch` counts
        full rounds, and `advance_schedulers` is called after each with the round's training
        results). Every `evaluate_interval` optimizer steps the evaluation splits are evaluated
        from inside the training pass (whole, or `evaluate_batches` of each) and one row indexed
        by the global step is stored and written; the step-cadence checkpoint of that step follows
        it. After the last step a final evaluation stores the last row and a final checkpoint is
        saved. Each row's training values cover the batches since the previous row. Once more than
        `patience` evaluations pass without a better score, training stops after that evaluation.

        Raises:
            ValueError: No step budget can be resolved.
            RuntimeError: A full round over the train splits applied no optimizer step.
        """
        budget = self.steps
        if budget is None:
            raise ValueError("train_steps() needs config.steps, or config.epochs with sized train dataloaders")
        train_splits = sorted(self._resolve_splits(train_splits, self.train_splits, "train"))
        evaluate_splits = self._resolve_splits(evaluate_splits, self.evaluate_splits, "evaluate")
        step = self.train_state.global_step
        # Resumed from the final checkpoint, the run is complete: evaluating again would replace its
        # last row with one that lacks the training values of its last steps.
        finished = step >= budget and any(int(index) == step for index in self.results)
        self._plan_periodic_evaluation(evaluate_splits, budget)
        self._stopping_early = False
        try:
            with self._loop_scope(training=True):
                if finished:
                    return self.results
                result = self.loop_state.begin_round()
                while self.train_state.global_step < budget and not self._stopping_early:
                    self._train_round(train_splits, result, budget)
                self._periodic_splits = None
                if not self._stopping_early:  # else the evaluation that ran out of patience is the last row
                    result.update(self.evaluate_for_row(evaluate_splits))
                    self._store_row(result, self.train_state.global_step)
                self.loop_state.end_round()
                self._watch_phase("checkpoint save")
                self.save_checkpoint(last_step=True)
                if self._stopping_early:
                    self.logger.info(
                        "early stop: no better %s in %s evaluations", self.config.score_name, self.patience
                    )
                    self.events.emit(Events.STOP_REQUESTED, StopContext(self, "early stop"))
        finally:
            self._periodic_splits = None
            self._stopping_early = False
        return self.results

    def _train_round(self, train_splits: list[str], result: RoundDict, budget: int) -> None:
        """One round over the train splits in step mode, stopping at the budget."""
        start, skipped = self.train_state.global_step, self.update.skipped_steps
        # A checkpoint written after a pass's last batch resumes into a round with nothing left to
        # train: its steps were applied before the checkpoint, so an empty remainder is no error.
        continuing = self.loop_state.split in train_splits and self.loop_state.batch > 0
        for split in self.loop_state.splits_from_cursor(list(train_splits)):
            split_result = self._run_split(split, RunnerMode.train, budget=budget)[0]
            if self._evaluated_step != self.train_state.global_step:  # else no batch since that row
                result[split] = split_result
            if self.train_state.global_step >= budget or self._stopping_early:
                # A budget met on the last batch of the round still completes the round.
                completed = split == train_splits[-1] and self._pass_completed(split)
                break
        else:
            completed = True
        if completed:
            self.train_state.epoch += 1
            # An epoch-interval scheduler steps once per round; a round whose values all went into a
            # periodic evaluation's row gives a metric scheduler that row instead.
            self.advance_schedulers(result or self.bookkeeping.latest_row() or result)
        if self.train_state.global_step == start and not continuing:
            skipped = self.update.skipped_steps - skipped
            why = (
                f"all {skipped} updates were skipped for non-finite (NaN/inf) gradients: check the loss and the "
                "data (nonfinite.* decides what a non-finite update does)"
                if skipped
                else "the loaders are empty or train_step does not call self.step()"
            )
            raise RuntimeError(f"a full round over {train_splits} applied no optimizer step: {why}")

    def _pass_completed(self, split: str) -> bool:
        """Whether the training pass over `split` that just stopped reached the end of its loader."""
        position = self.loop_state
        if position.split is None:
            return True
        length = length_of(self.dataloaders[split])
        return position.split == split and length is not None and position.batch >= length

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
        self.logger.info(self.bookkeeping.format_result(result))
        self.log_values(result.dict())  # at the global step: one x-axis for every tracker log
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
        self,
        split: str = "infer",
        *,
        steps: int | None = None,
        stream: bool | None = None,
        output: str | os.PathLike[str] | None = None,
        resume: bool | None = None,
    ) -> list[Any] | Iterator[list[Any]] | Path:
        """Predict on `split`: a flat list of outputs, an iterator of per-batch lists, or a file.

        With `output` (or `config.inference.output`), every batch's outputs are streamed into that
        file, through the sink its suffix selects (see [`sink_for`][danling.runners.inference.sinks.sink_for]),
        and a progress record is committed every `config.inference.progress_interval` batches. Calling
        `infer` again with the same `output` after a crash continues from the last record and ends
        with the same bytes as an uninterrupted run; under data parallelism each rank writes its
        shard and the shards are merged into dataset order. See the Inference guide.

        Args:
            split: Split to read.
            steps: Stop after this many batches.
            stream: Return a lazy iterator of batch outputs. By default only loaders without a
                length (and no `steps`) are streamed. Not used with `output`.
            output: File to write the outputs into; the path is returned once it is complete.
            resume: With `output`: continue an earlier run into the same file (default
                `config.inference.resume`, True), or start over when False.

        Raises:
            ValueError: `steps` is negative, or a flat list is requested from an unsized loader
                without `steps`; with `output`, see
                [`run_inference`][danling.runners.inference.writer.run_inference].
        """
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise ValueError(f"steps must be a non-negative int or None, got {steps!r}")
        if split not in self.dataloaders:
            raise ValueError(f"infer split {split!r} has no dataloader; available: {list(self.dataloaders)}")
        section = self.config.get("inference") or {}
        output = output if output is not None else section.get("output")
        if output is not None:
            if stream:
                raise ValueError("infer(output=...) writes a file; stream=True cannot be combined with it")
            resume = section.get("resume", True) if resume is None else resume
            return self._infer_to_output(split, output, steps=steps, resume=bool(resume))
        loader = self.dataloaders[split]
        sized = length_of(loader) is not None
        if stream is None:
            stream = not sized and steps is None
        if not stream and not sized and steps is None:
            raise ValueError(f"split {split!r} has no length: pass steps=... or stream=True")
        batches = self._iter_infer_batches(loader, split, steps)
        if stream:
            return batches
        with self._loop_scope(training=False, mode=RunnerMode.infer):
            return [item for batch in batches for item in batch]

    def _infer_to_output(self, split: str, output: str | os.PathLike[str], *, steps: int | None, resume: bool) -> Path:
        from ..inference import run_inference  # imports torch and numpy, which this module stays free of

        with self._loop_scope(training=False, mode=RunnerMode.infer):
            return run_inference(self, split, output, steps=steps, resume=resume)

    def _iter_infer_batches(self, loader: Iterable, split: str, steps: int | None) -> Iterator[list[Any]]:
        self.mode = RunnerMode.infer
        self.split = split
        for data in islice(loader, steps):
            with self.inference_context():
                outputs = self.infer_step(data)
            yield outputs
            if self._stop_requested():
                self._shutdown()
