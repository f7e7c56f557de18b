"""Evaluation while training: the rows of epoch mode's evaluations and step mode's periodic ones.

[`EvaluationMixin`][danling.runners.loop.evaluation.EvaluationMixin] evaluates the evaluation
splits for a result row (each limited to `evaluate_batches` when set) and, in step mode, runs an
evaluation every `evaluate_interval` optimizer steps from inside the training pass, with the
random generators put back afterwards, so training is exactly that of a run that never evaluates.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from danling.utils import RoundDict

from .hooks import RunnerMode
from .passes import PassMixin

__all__ = ["EvaluationMixin"]


class EvaluationMixin(PassMixin):
    """Evaluations for result rows, periodic ones in step mode; mixed into `BaseRunner` via `LoopMixin`."""

    # Evaluation splits of the step-mode training under way (None: no periodic evaluation).
    _periodic_splits: list[str] | None = None
    # Global step of the newest periodic evaluation: a pass that ends right after it has no new batch.
    _evaluated_step: int | None = None

    def evaluate_for_row(self, splits: Sequence[str]) -> RoundDict:
        """Evaluate each split once for a result row: `evaluate_epoch(split)` (the whole split), or the
        first `evaluate_batches` batches of it when that limit is set."""
        result = RoundDict()
        if not splits:
            return result
        limit = self.evaluate_batches
        for split in splits:
            if limit is None:
                result[split] = self.evaluate_epoch(split)
            else:
                result[split] = self._run_split(split, RunnerMode.evaluate, max_batches=limit)[0]
        return result

    def _store_row(self, row: RoundDict, index: int) -> None:
        """Store, log and write one result row (the file writes are coalesced in the background)."""
        self._append_result(row, index=index)
        if self.logger.isEnabledFor(logging.INFO):
            text = self.bookkeeping.format_result(row)
            if self.is_step_mode:  # one grep-able line per split, like the epoch summary's
                text = "\n".join(f"step [{index}/{self.steps}] {line}" for line in text.split("\n"))
            self.logger.info(text)
        self._save_result()

    def _plan_periodic_evaluation(self, splits: list[str], budget: int) -> None:
        """Arm the periodic evaluations of a step-mode run and say in the log when they happen."""
        interval = self.evaluate_interval
        self._periodic_splits = list(splits) if splits and interval else None
        if not splits:
            return
        limit = self.evaluate_batches
        extent = "whole splits" if limit is None else f"{limit} batches of each split"
        if interval:
            origin = "config.evaluate_interval" if self.config.get("evaluate_interval") is not None else "steps // 10"
            when = f"every {interval} steps ({origin}) and after step {budget}"
        else:
            when = f"after step {budget} only (evaluate_interval=0)"
        self.logger.info("step mode: evaluating %s %s, on %s", list(splits), when, extent)

    def _evaluate_if_due(self, global_step: int) -> None:
        """Inside a step-mode training pass, after an optimizer step: evaluate when the cadence says so.

        The row holds the training split's values since the previous row and every evaluation
        split's result, at index `global_step`. The training pass then goes on where it was,
        with its meters and metrics restarted.
        """
        splits = self._periodic_splits
        if not splits or global_step % self.evaluate_interval:
            return
        split, mode = self.split, self.mode
        # Evaluation draws random numbers (a loader's base seed, at least): the generators are put
        # back afterwards, so training goes on exactly as in a run that evaluates at other steps.
        rng = self.rng_state.capture()
        round_result = self.loop_state.begin_round()
        round_result[split] = self.collect_result(split)
        row = RoundDict(round_result)
        row.update(self.evaluate_for_row(splits))
        self._store_row(row, global_step)
        round_result.clear()  # the next row holds what is trained after this one
        self._evaluated_step = global_step
        self._stopping_early = self.bookkeeping.should_stop_early()
        self.mode, self.split = mode, split
        self.meters.reset()
        self._start_metrics(mode)
        rng.restore()
