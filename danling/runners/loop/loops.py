"""The training, evaluation and inference loops of a runner, as one component.

[`Loop`][danling.runners.loop.loops.Loop] drives rounds (epochs, or step budgets) over the
runner's `dataloaders[split]`: it stores result rows, saves checkpoints at the configured
cadence, runs periodic evaluations in step mode and dry runs, honours early stop and
graceful-stop requests, and leaves each pass to its [`PassEngine`][danling.runners.loop.passes.PassEngine]
and the per-batch work to the runner's step hooks. It reaches the runner only through the
[`LoopHost`][danling.runners.loop.host.LoopHost] protocol and never touches a tensor library.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

from danling.distributed import barrier, is_distributed
from danling.utils import RoundDict

from ..update.spikes import LossSpike, RollbackRequest, TrainingDivergedError
from .budget import _why_empty, checked_count, length_of
from .events import EpochContext, EventBus, Events, StopContext
from .host import LoopHost
from .mode import RunnerMode
from .passes import PassEngine

__all__ = ["Loop"]


class Loop:
    """Training, evaluation, inference and dry-run loops over the dataloaders of one runner.

    Args:
        host: The runner whose hooks, state and services the loops use (see
            [`LoopHost`][danling.runners.loop.host.LoopHost]).
        events: The bus the loops announce runs, epochs, passes and steps on.

    Attributes:
        passes: The [`PassEngine`][danling.runners.loop.passes.PassEngine] running each pass.
    """

    def __init__(self, host: LoopHost, events: EventBus) -> None:
        self.host, self.events = host, events
        self.passes = PassEngine(host, events, on_optimizer_step=self._evaluate_if_due)
        # Evaluation splits of the step-mode training under way (None: no periodic evaluation).
        self._periodic_splits: list[str] | None = None
        # Global step of the newest periodic evaluation: a pass that ends right after it has no new batch.
        self._evaluated_step: int | None = None

    @property
    def fused_step(self) -> bool:
        """Whether the last training pass called the backend's plain default step instead of `train_step`."""
        return self.passes.fused_step

    def check_training_budget(self, train_splits: Sequence[str], evaluate_splits: Sequence[str] = ()) -> None:
        """Refuse a training budget or data that would train nothing (or score nothing), before the first step.

        Called when: by `train`, once per call, after the splits are resolved and before anything runs.
        Holds on entry: every split has a dataloader; `train_state` holds the progress to resume from.
        Side effects: logs a warning when `steps` and `epochs` are both set; nothing else.
        Overrides must not: accept a budget of 0 or an empty split (the run would end with no row).

        Raises:
            ValueError: `epochs` or `steps` is 0 (without progress to resume past it), or a train
                or evaluation split's loader yields no batch (an empty dataset, or `drop_last` with
                a batch larger than the dataset: an evaluation split would give rows of NaN); the
                message names the value and what is accepted.
        """
        config, state = self.host.config, self.host.train_state
        for key, value, done in (("epochs", config.epochs, state.epoch), ("steps", config.steps, state.global_step)):
            if value == 0 and done == 0 and (key == "epochs" or config.epochs is None):
                raise ValueError(f"{key}=0 trains nothing: set {key} to a positive int (or call evaluate())")
        if config.steps is not None and config.epochs is not None:
            self.host.logger.warning(
                "steps=%s and epochs=%s are both set: epochs selects epoch mode, and steps is not a budget "
                "there (it only paces progress and logging); set one of them",
                config.steps,
                config.epochs,
            )
        for split in train_splits:
            if length_of(self.host.dataloaders[split]) == 0:
                raise ValueError(
                    f"training split {split!r} yields no batch: {_why_empty(self.host.dataloaders[split])}"
                )
        for split in evaluate_splits:
            loader = self.host.dataloaders[split]
            if length_of(loader) == 0:
                raise ValueError(
                    f"evaluation split {split!r} yields no batch: {_why_empty(loader)}; its result "
                    "rows would hold NaN: give it data or leave it out of evaluate_splits"
                )

    def budget_spent(self) -> bool:
        """Whether a resumed run has already trained its whole budget; if so, say so in the log.

        The budget (`epochs`, `steps`) is not part of the run's identity: raising it continues the
        run for what is new, and lowering it to or below what is done finishes at once. Epoch mode
        compares the finished epochs with `epochs`; step mode compares `global_step` with the step
        budget and also needs the final row of that step stored (a run killed between its last
        step and its final evaluation still evaluates).

        Called when: by `train`, once per call, after the budget checks and before the first pass.
        Holds on entry: a checkpoint (if any) is restored, so `train_state` and `results` are the run's.
        Side effects: logs that the budget is spent (a warning when it was lowered below progress).
        Overrides must not: report a run as finished whose final step-mode row is missing.
        """
        state = self.host.train_state
        if self.host.epochs is not None:
            key, budget, done, finished = "epochs", self.host.epochs, state.epoch, state.epoch
        else:
            budget = self.host.steps
            key, done, finished = "steps", state.global_step, state.global_step in self.host.results
        if budget is None or done == 0 or done < budget or not finished:
            return False
        unit = "epochs" if key == "epochs" else "optimizer steps"
        log = self.host.logger.warning if done > budget else self.host.logger.info
        log(
            "training budget already spent: %d %s are done and %s=%d, so there is nothing to train; "
            "raise %s above %d to train more (the run continues where it stopped)",
            done,
            unit,
            key,
            budget,
            key,
            done,
        )
        return True

    # ------------------------------------------------------------------ training
    def train(
        self, train_splits: Sequence[str] | None = None, evaluate_splits: Sequence[str] | None = None
    ) -> RoundDict:
        """Train until the budget is spent: epoch mode when `epochs` is set, step mode otherwise.

        With `config.dry_run` set, run [`dry_run`][danling.runners.loop.loops.Loop.dry_run]
        instead: a few batches of every split and one checkpoint round trip.

        Args:
            train_splits: Splits to train on; defaults to `runner.train_splits`.
            evaluate_splits: Splits to evaluate; defaults to `runner.evaluate_splits`.

        Returns:
            All result rows (`runner.results`).

        With `spikes.policy` set to `"rollback"`, a loss spike reloads the newest checkpoint that
        verifies and training goes on from there (see
        [`roll_back`][danling.runners.loop.loops.Loop.roll_back]).

        Raises:
            ValueError: A requested split has no dataloader, there is no training split, or the
                budget or data would train nothing (see `check_training_budget`).
            TrainingDivergedError: Non-finite updates or loss spikes came too often (`nonfinite.*`, `spikes.*`).

        Called when: by `runner.train()`, once per call.
        Holds on entry: the runner is fully constructed (and restored, when the config asked).
        Side effects: trains, evaluates, stores and writes rows, saves checkpoints; may roll back.
        Overrides must not: call `train_epochs`/`train_steps` other than through the runner (a
            runner override of those would be bypassed).
        """
        if not self.host.checkpointing.restored:
            # A BaseRunner subclass that never called auto_restore(): without it `resume` and
            # `auto_resume` would do nothing, the run would train from scratch in the directory chosen
            # for continuing (over the earlier run's checkpoints), and hold no run-directory lock.
            self.host.auto_restore()
        train_splits = self.host._resolve_splits(train_splits, self.host.train_splits, "train")
        if not train_splits:
            raise ValueError(
                f"no training split among dataloaders {list(self.host.dataloaders)}: "
                "name one 'train' or set config.train_splits"
            )
        evaluate_splits = self.host._resolve_splits(evaluate_splits, self.host.evaluate_splits, "evaluate")
        self.check_training_budget(train_splits, evaluate_splits)
        self.host._check_selection(evaluate_splits)
        if self.dry_run_batches:
            return self.dry_run(train_splits, evaluate_splits)
        if self.budget_spent():  # a resumed run whose budget was not raised
            return self.host.results
        if self.host.bookkeeping.should_stop_early():  # a resumed run that stopped early, its patience not raised
            self.host.logger.info(
                "early stop: already out of patience (%s evaluations); nothing to train", self.host.patience
            )
            return self.host.results
        self.host.logger.info("training on %s; evaluating on %s", train_splits, evaluate_splits or "nothing")
        while True:
            try:
                if self.host.is_step_mode:
                    return self.host.train_steps(train_splits, evaluate_splits)
                return self.host.train_epochs(train_splits, evaluate_splits)
            except LossSpike as spike:  # spikes.policy=rollback: reload, then carry on from there
                self.roll_back(spike)
            except RollbackRequest as request:  # a plug-in's rollback (consistency.policy=rollback)
                self._reload(request)

    def train_epochs(
        self, train_splits: Sequence[str] | None = None, evaluate_splits: Sequence[str] | None = None
    ) -> RoundDict:
        """Run epochs from `train_state.epoch` up to `epochs`.

        Each epoch trains every train split, evaluates every evaluation split, stores and writes
        the row (index = epoch index), then saves a checkpoint at the configured cadence (always
        after the last epoch). Stops early once `patience` epochs pass without a new best score.

        Called when: by `runner.train_epochs` (which `train` calls in epoch mode), once per run.
        Holds on entry: `train_state.epoch` is the first epoch to run (the resumed position).
        Side effects: advances `train_state.epoch`, stores a row per epoch, saves checkpoints.
        Overrides must not: store a row before the epoch's evaluation, or save before the row is
            stored (a checkpoint must hold the scored state).

        Raises:
            ValueError: `epochs` is not configured.
        """
        if self.host.epochs is None:
            raise ValueError(
                "train_epochs() needs config.epochs; for a step budget set config.steps and use train_steps()"
            )
        train_splits = self.host._resolve_splits(train_splits, self.host.train_splits, "train")
        evaluate_splits = self.host._resolve_splits(evaluate_splits, self.host.evaluate_splits, "evaluate")
        with self.passes.scope(training=True):
            for epoch in range(self.host.train_state.epoch, self.host.epochs):
                with self.events.pair(Events.EPOCH_START, Events.EPOCH_END, EpochContext(self.host, epoch)) as context:
                    result = self.host.loop_state.begin_round()
                    if not self.host.loop_state.trained:
                        for split in self.host.loop_state.splits_from_cursor(list(train_splits)):
                            result[split] = self.host.train_epoch(split)
                        self.host.loop_state.trained = True
                    result.update(self.evaluate_for_row(evaluate_splits))
                    self.host.advance_schedulers(result)
                    self.host._append_result(result, index=epoch)
                    if self.host.logger.isEnabledFor(logging.INFO):  # formatting a row costs more than the check
                        self.host.logger.info(
                            self.host.bookkeeping.format_epoch_result(result, epoch, self.host.epochs)
                        )
                    self.host._save_result()
                    self.host.train_state.epoch = epoch + 1
                    self.host.loop_state.end_round()
                    context.result = result
                stop_early = self.host.bookkeeping.should_stop_early()
                self.passes.watch_phase("checkpoint save")
                self.host.save_checkpoint(epochs=epoch, last_step=stop_early or epoch + 1 == self.host.epochs)
                if stop_early:
                    self.host.logger.info(
                        "early stop: no better %s in %s evaluations", self.host.config.score_name, self.host.patience
                    )
                    self.events.emit(Events.STOP_REQUESTED, StopContext(self.host, "early stop"))
                    break
        return self.host.results

    def train_epoch(self, split: str = "train") -> RoundDict:
        """One full pass over `runner.dataloaders[split]` in training mode; returns the split's result.

        Called when: by `runner.train_epoch`, once per train split and epoch.
        Holds on entry: inside a training scope (`train_epochs`, or a user's own loop).
        Side effects: runs `train_step` per batch, updates the loop position, meters and counters.
        Overrides must not: bypass the pass engine (graceful stops and resumable positions live there).
        """
        return self.passes.run_split(split, RunnerMode.train)[0]

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

        Called when: by `runner.train_steps` (which `train` calls in step mode), once per run.
        Holds on entry: `train_state.global_step` is the resumed position; `steps` resolves.
        Side effects: advances the counters, stores rows by global step, saves checkpoints.
        Overrides must not: evaluate at other steps than the cadence's (the checkpoint of a step
            must follow its row).

        Raises:
            ValueError: No step budget can be resolved.
            RuntimeError: A full round over the train splits applied no optimizer step.
        """
        budget = self.host.steps
        if budget is None:
            raise ValueError("train_steps() needs config.steps, or config.epochs with sized train dataloaders")
        train_splits = sorted(self.host._resolve_splits(train_splits, self.host.train_splits, "train"))
        evaluate_splits = self.host._resolve_splits(evaluate_splits, self.host.evaluate_splits, "evaluate")
        step = self.host.train_state.global_step
        # Resumed from the final checkpoint, the run is complete: evaluating again would replace its
        # last row with one that lacks the training values of its last steps.
        finished = step >= budget and any(int(index) == step for index in self.host.results)
        self._plan_periodic_evaluation(evaluate_splits, budget)
        self.passes.stopping_early = False
        try:
            with self.passes.scope(training=True):
                if finished:
                    return self.host.results
                result = self.host.loop_state.begin_round()
                while self.host.train_state.global_step < budget and not self.passes.stopping_early:
                    self._train_round(train_splits, result, budget)
                self._periodic_splits = None
                if not self.passes.stopping_early:  # else the evaluation that ran out of patience is the last row
                    result.update(self.evaluate_for_row(evaluate_splits))
                    self._store_row(result, self.host.train_state.global_step)
                self.host.loop_state.end_round()
                self.passes.watch_phase("checkpoint save")
                self.host.save_checkpoint(last_step=True)
                if self.passes.stopping_early:
                    self.host.logger.info(
                        "early stop: no better %s in %s evaluations", self.host.config.score_name, self.host.patience
                    )
                    self.events.emit(Events.STOP_REQUESTED, StopContext(self.host, "early stop"))
        finally:
            self._periodic_splits = None
            self.passes.stopping_early = False
        return self.host.results

    def _train_round(self, train_splits: list[str], result: RoundDict, budget: int) -> None:
        """One round over the train splits in step mode, stopping at the budget."""
        start, skipped = self.host.train_state.global_step, self.host.update.skipped_steps
        # A checkpoint written after a pass's last batch resumes into a round with nothing left to
        # train: its steps were applied before the checkpoint, so an empty remainder is no error.
        continuing = self.host.loop_state.split in train_splits and self.host.loop_state.batch > 0
        for split in self.host.loop_state.splits_from_cursor(list(train_splits)):
            split_result = self.passes.run_split(split, RunnerMode.train, budget=budget)[0]
            if self._evaluated_step != self.host.train_state.global_step:  # else no batch since that row
                result[split] = split_result
            if self.host.train_state.global_step >= budget or self.passes.stopping_early:
                # A budget met on the last batch of the round still completes the round.
                completed = split == train_splits[-1] and self._pass_completed(split)
                break
        else:
            completed = True
        if completed:
            self.host.train_state.epoch += 1
            # An epoch-interval scheduler steps once per round; a round whose values all went into a
            # periodic evaluation's row gives a metric scheduler that row instead.
            self.host.advance_schedulers(result or self.host.bookkeeping.latest_row() or result)
        if self.host.train_state.global_step == start and not continuing:
            skipped = self.host.update.skipped_steps - skipped
            why = (
                f"all {skipped} updates were skipped for non-finite (NaN/inf) gradients: check the loss and the "
                "data (nonfinite.* decides what a non-finite update does)"
                if skipped
                else "the loaders are empty or train_step does not call self.step()"
            )
            raise RuntimeError(f"a full round over {train_splits} applied no optimizer step: {why}")

    def _pass_completed(self, split: str) -> bool:
        """Whether the training pass over `split` that just stopped reached the end of its loader."""
        position = self.host.loop_state
        if position.split is None:
            return True
        length = length_of(self.host.dataloaders[split])
        return position.split == split and length is not None and position.batch >= length

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, evaluate_splits: Sequence[str] | None = None) -> RoundDict:
        """Evaluate each split once and return `{split: result}`; the row is also sent to the trackers.

        Called when: by `runner.evaluate`, once per call (not by training, which uses `evaluate_for_row`).
        Holds on entry: the runner is constructed; no training pass is open.
        Side effects: runs `evaluate_epoch` per split; logs the result; stores no row.
        Overrides must not: store the result as a row (rows belong to training progress).

        Raises:
            ValueError: A requested split has no dataloader, or there is nothing to evaluate.
            RuntimeError: A training pass is under way (called from a step hook).
        """
        self.passes.refuse_inside_training("evaluate()")
        splits = self.host._resolve_splits(evaluate_splits, self.host.evaluate_splits, "evaluate")
        if not splits:
            raise ValueError(f"nothing to evaluate: dataloaders are {list(self.host.dataloaders)}")
        result = RoundDict()
        with self.passes.scope(training=False):
            for split in splits:
                result[split] = self.host.evaluate_epoch(split)
        self.host.logger.info(self.host.bookkeeping.format_result(result))
        self.host.log_values(result.dict())  # at the global step: one x-axis for every tracker log
        return result

    def evaluate_epoch(self, split: str = "val") -> RoundDict:
        """One full pass over `runner.dataloaders[split]` in evaluation mode; returns the split's result.

        Called when: by `runner.evaluate_epoch`, once per evaluation split of `evaluate` or of a row.
        Holds on entry: no training pass is open on `split`.
        Side effects: runs `evaluate_step` per batch inside `inference_context()`.
        Overrides must not: change `train_state` (a periodic evaluation runs in the middle of training).
        """
        return self.passes.run_split(split, RunnerMode.evaluate)[0]

    def evaluate_steps(self, split: str = "val", steps: int | None = None) -> RoundDict:
        """Evaluate the first `steps` batches of `split` (default `max(runner.steps // 20, 1)`).

        Called when: by `runner.evaluate_steps`, once per call.
        Holds on entry: `split` has a dataloader.
        Side effects: runs `evaluate_step` on `steps` batches; stores no row.
        Overrides must not: return a result over fewer batches than asked without raising.

        Raises:
            ValueError: `steps` is negative, cannot be inferred, or the loader runs out first.
        """
        if steps is None:
            if self.host.steps is None:
                raise ValueError("evaluate_steps() needs steps when no step budget is configured")
            steps = max(self.host.steps // 20, 1)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps must be a non-negative int, got {steps!r}")
        result, batches = self.passes.run_split(split, RunnerMode.evaluate, max_batches=steps)
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
            RuntimeError: A training pass is under way (called from a step hook).

        Called when: by `runner.infer`, once per call (a stream runs as it is read).
        Holds on entry: the runner is constructed; no pass is open.
        Side effects: runs `infer_step` per batch; with `output`, writes and commits the file.
        Overrides must not: update metrics or counters (inference leaves the run's state alone).
        """
        self.passes.refuse_inside_training("infer()")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise ValueError(f"steps must be a non-negative int or None, got {steps!r}")
        if split not in self.host.dataloaders:
            raise ValueError(f"infer split {split!r} has no dataloader; available: {list(self.host.dataloaders)}")
        section = self.host.config.inference
        output = output if output is not None else section.output
        if output is not None:
            if stream:
                raise ValueError("infer(output=...) writes a file; stream=True cannot be combined with it")
            resume = section.resume if resume is None else resume
            return self._infer_to_output(split, output, steps=steps, resume=bool(resume))
        loader = self.host.dataloaders[split]
        sized = length_of(loader) is not None
        if stream is None:
            stream = not sized and steps is None
        if not stream and not sized and steps is None:
            raise ValueError(f"split {split!r} has no length: pass steps=... or stream=True")
        batches = self._iter_infer_batches(loader, split, steps)
        if stream:
            return batches
        with self.passes.scope(training=False, mode=RunnerMode.infer):
            return [item for batch in batches for item in batch]

    def _infer_to_output(self, split: str, output: str | os.PathLike[str], *, steps: int | None, resume: bool) -> Path:
        from ..inference import run_inference  # imports torch and numpy, which this module stays free of

        with self.passes.scope(training=False, mode=RunnerMode.infer):
            return run_inference(self.host, split, output, steps=steps, resume=resume)

    def _iter_infer_batches(self, loader: Iterable, split: str, steps: int | None) -> Iterator[list[Any]]:
        self.host.mode = RunnerMode.infer
        self.host.split = split
        for data in islice(loader, steps):
            with self.host.inference_context():
                outputs = self.host.infer_step(data)
            self.passes.inference_progress()
            yield outputs
            if self.host._stop_requested():
                self.passes.shutdown()

    # ------------------------------------------------------------------ rows and periodic evaluation
    def evaluate_for_row(self, splits: Sequence[str]) -> RoundDict:
        """Evaluate each split once for a result row: `evaluate_epoch(split)` (the whole split), or the
        first `evaluate_batches` batches of it when that limit is set.

        Called when: once per row: after each epoch, at each periodic and the final step-mode
            evaluation, and in a dry run.
        Holds on entry: inside a training scope; the row's training values are collected.
        Side effects: runs the evaluation passes; stores nothing (the caller stores the row).
        Overrides must not: change `train_state` or the training meters.
        """
        result = RoundDict()
        if not splits:
            return result
        limit = self.evaluate_batches
        for split in splits:
            if limit is None:
                result[split] = self.host.evaluate_epoch(split)
            else:
                result[split] = self.passes.run_split(split, RunnerMode.evaluate, max_batches=limit)[0]
        return result

    def _store_row(self, row: RoundDict, index: int) -> None:
        """Store, log and write one result row (the file writes are coalesced in the background)."""
        self.host._append_result(row, index=index)
        if self.host.logger.isEnabledFor(logging.INFO):
            text = self.host.bookkeeping.format_result(row)
            if self.host.is_step_mode:  # one grep-able line per split, like the epoch summary's
                text = "\n".join(f"step [{index}/{self.host.steps}] {line}" for line in text.split("\n"))
            self.host.logger.info(text)
        self.host._save_result()

    def _plan_periodic_evaluation(self, splits: list[str], budget: int) -> None:
        """Arm the periodic evaluations of a step-mode run and say in the log when they happen."""
        interval = self.host.evaluate_interval
        self._periodic_splits = list(splits) if splits and interval else None
        if not splits:
            return
        limit = self.evaluate_batches
        extent = "whole splits" if limit is None else f"{limit} batches of each split"
        if interval:
            origin = "config.evaluate_interval" if self.host.config.evaluate_interval is not None else "steps // 10"
            when = f"every {interval} steps ({origin}) and after step {budget}"
        else:
            when = f"after step {budget} only (evaluate_interval=0)"
        self.host.logger.info("step mode: evaluating %s %s, on %s", list(splits), when, extent)

    def _evaluate_if_due(self, global_step: int) -> None:
        """Inside a step-mode training pass, after an optimizer step: evaluate when the cadence says so.

        The row holds the training split's values since the previous row and every evaluation
        split's result, at index `global_step`. The training pass then goes on where it was,
        with its meters and metrics restarted.
        """
        splits = self._periodic_splits
        if not splits or global_step % self.host.evaluate_interval:
            return
        split, mode = self.host.split, self.host.mode
        # Evaluation draws random numbers (a loader's base seed, at least): the generators are put
        # back afterwards, so training goes on exactly as in a run that evaluates at other steps.
        rng = self.host.rng_state.capture()
        round_result = self.host.loop_state.begin_round()
        round_result[split] = self.host.collect_result(split)
        row = RoundDict(round_result)
        row.update(self.evaluate_for_row(splits))
        self._store_row(row, global_step)
        round_result.clear()  # the next row holds what is trained after this one
        self._evaluated_step = global_step
        self.passes.stopping_early = self.host.bookkeeping.should_stop_early()
        self.host.mode, self.host.split = mode, split
        self.host.meters.reset()
        self.host._start_metrics(mode)
        rng.restore()

    # ------------------------------------------------------------------ dry run and rollback
    @property
    def evaluate_batches(self) -> int | None:
        """Batches of each evaluation split in an evaluation run while training (`None`: the whole split).

        `config.evaluate_batches`; a dry run (`config.dry_run`) caps it at its batch count.
        """
        config = self.host.config
        limits = [config.evaluate_batches, config.dry_run]
        for value in limits:
            checked_count("evaluate_batches and dry_run", value, minimum=1, accepted="positive ints or None")
        given = [value for value in limits if value is not None]
        return min(given) if given else None

    @property
    def dry_run_batches(self) -> int | None:
        """Batches per split of a dry run (`config.dry_run`), or `None` when this is no dry run."""
        value = self.host.config.dry_run
        return checked_count("dry_run", value, minimum=1, accepted="a positive int (batches per split) or None")

    def dry_run(self, train_splits: Sequence[str], evaluate_splits: Sequence[str]) -> RoundDict:
        """Run `dry_run_batches` batches of each split, save one checkpoint and load it back.

        Every hook a long job calls runs at least once (`train_step` with the optimizer step,
        `evaluate_step`, the result row and its files, the checkpoint payload, its write, its
        verification and its restore), so their errors surface in seconds. The row is stored at
        the usual index; no step-cadence checkpoint is written.

        Called when: by `train` in place of training, when `config.dry_run` is set.
        Holds on entry: the splits are resolved and the budget checked.
        Side effects: trains a few batches, stores one row, saves and reloads one checkpoint.
        Overrides must not: write step-cadence checkpoints or skip the reload (its errors are the point).

        Returns:
            All result rows (`runner.results`).
        """
        batches = self.dry_run_batches
        self.host.logger.info(
            "dry run: %d batch(es) of %s and of %s, then one checkpoint save and load, in %s",
            batches,
            list(train_splits),
            list(evaluate_splits) or "no evaluation split",
            self.host.workspace.path,
        )
        with self.passes.scope(training=True):
            result = RoundDict()
            for split in train_splits:
                result[split] = self.passes.run_split(split, RunnerMode.train, max_batches=batches)[0]
            result.update(self.evaluate_for_row(evaluate_splits))  # capped at `batches` too
            self._store_row(result, self.host._row_index())
            if self.host.checkpoint_manager.load_only:
                self.host.logger.warning("dry run: checkpoint.load_only is set, so no checkpoint was saved or loaded")
            else:
                path = self.host.save_checkpoint(force=True)
                self.host.checkpoint_manager.wait()
                barrier()  # under several processes, the main one may still be publishing what the others read
                self.host.load_checkpoint(self.host.checkpoint_manager.resolve("latest") if path is None else path)
        self.host.logger.info("dry run passed: every split ran %d batch(es) and the checkpoint loaded back", batches)
        return self.host.results

    def _reload(self, request: RollbackRequest) -> None:
        """Reload the checkpoint a plug-in's
        [`RollbackRequest`][danling.runners.update.spikes.RollbackRequest] names."""
        self.host.checkpoint_manager.wait()  # the checkpoint to return to may still be being written
        if is_distributed():
            barrier()  # the main process's save is on disk before any rank reads it
        self.host.load_checkpoint(request.path)
        self.host.logger.warning("%s; rolled back to %s", request, request.path)

    def roll_back(self, spike: LossSpike) -> None:
        """Recover from a loss spike: reload the newest checkpoint that verifies, skip the spiked batches
        from now on and lower the learning rates for a cooldown (see `spikes.*`).

        Called when: by `train` when a loss spike is raised under `spikes.policy=rollback`, once per spike.
        Holds on entry: the training scope has been left; a save may still be in flight.
        Side effects: reloads the checkpoint, keeps the spike guard's history, starts its cooldown.
        Overrides must not: load a checkpoint that does not verify, or forget the skipped batches.

        Raises:
            TrainingDivergedError: there is no checkpoint to roll back to.
        """
        guard = self.host.update.spike_guard
        manager = self.host.checkpoint_manager
        manager.wait()  # a save still being written may be the one to return to
        if is_distributed():
            barrier()  # the main process's save is on disk before any rank looks for it
        path = manager.latest_valid()
        if path is None:
            raise TrainingDivergedError(
                f"loss spike at global step {spike.step} ({spike}) and no checkpoint in {manager.directory} "
                "to roll back to; save earlier (checkpoint.interval) or use spikes.policy=skip"
            ) from spike
        seen = guard.state_dict()
        self.host.load_checkpoint(path)
        guard.skipped_batches.update((s, e, b) for s, e, b in seen["skipped_batches"])
        guard.rollbacks, guard.spikes = seen["rollbacks"], seen["spikes"]
        guard.start_cooldown(spike.batches)
        self.host.logger.warning(
            "%s at global step %s; rolled back to %s (rollback %d of at most %d), skipping batches %s, "
            "learning rates x%g for %d steps",
            spike,
            spike.step,
            path,
            guard.rollbacks,
            guard.max_rollbacks,
            spike.batches,
            guard.lr_factor,
            guard.cooldown_steps,
        )
