"""Dry runs: a few batches of every split and one checkpoint round trip, before a long job.

With `config.dry_run: N`, [`train`][danling.runners.loop.loops.LoopMixin.train] runs
[`dry_run`][danling.runners.loop.dry_run.DryRunMixin.dry_run] instead of the budget: `N`
batches of each train split, `N` of each evaluation split, one result row, one checkpoint saved
and loaded back, and it returns. `dry_run` is part of the config's identity and the run directory
gets a `-dry-run` suffix, so a dry run never writes into the history of the real run.
"""

from __future__ import annotations

from collections.abc import Sequence

from danling.distributed import barrier
from danling.utils import RoundDict

from .evaluation import EvaluationMixin
from .hooks import RunnerMode

__all__ = ["DryRunMixin"]


class DryRunMixin(EvaluationMixin):
    """The dry-run loop; mixed into `BaseRunner` via `LoopMixin`."""

    @property
    def dry_run_batches(self) -> int | None:
        """Batches per split of a dry run (`config.dry_run`), or `None` when this is no dry run."""
        value = self.config.get("dry_run")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"dry_run must be a positive int (batches per split) or None, got {value!r}")
        return value

    def dry_run(self, train_splits: Sequence[str], evaluate_splits: Sequence[str]) -> RoundDict:
        """Run `dry_run_batches` batches of each split, save one checkpoint and load it back.

        Every hook a long job calls runs at least once (`train_step` with the optimizer step,
        `evaluate_step`, the result row and its files, the checkpoint payload, its write, its
        verification and its restore), so their errors surface in seconds. The row is stored at
        the usual index; no step-cadence checkpoint is written.

        Returns:
            All result rows (`self.results`).
        """
        batches = self.dry_run_batches
        self.logger.info(
            "dry run: %d batch(es) of %s and of %s, then one checkpoint save and load, in %s",
            batches,
            list(train_splits),
            list(evaluate_splits) or "no evaluation split",
            self.workspace.path,
        )
        with self._loop_scope(training=True):
            result = RoundDict()
            for split in train_splits:
                result[split] = self._run_split(split, RunnerMode.train, max_batches=batches)[0]
            result.update(self.evaluate_for_row(evaluate_splits))  # capped at `batches` too
            self._store_row(result, self._row_index())
            if self.checkpoint_manager.load_only:
                self.logger.warning("dry run: checkpoint.load_only is set, so no checkpoint was saved or loaded")
            else:
                path = self.save_checkpoint(force=True)
                self.checkpoint_manager.wait()
                barrier()  # under several processes, the main one may still be publishing what the others read
                self.load_checkpoint(self.checkpoint_manager.resolve("latest") if path is None else path)
        self.logger.info("dry run passed: every split ran %d batch(es) and the checkpoint loaded back", batches)
        return self.results
