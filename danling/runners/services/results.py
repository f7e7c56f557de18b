"""Result rows, best-score bookkeeping and result files for runners.

A runner keeps one row per round in [`results`][danling.runners.base_runner.BaseRunner]: the row index is the
epoch index in epoch mode and the global step in step mode, and each row maps a split name to
that split's metrics (``{"train": {"loss": 0.31}, "val": {"loss": 0.35, "acc": 0.91}}``).

[`RunnerResults`][danling.runners.services.results.RunnerResults] holds those rows and derives
everything else from them: the split and metric used for model selection, the best row, early
stopping, and the three JSON files a run directory carries (`results.json`, `latest.json`,
`best.json`). A runner keeps one as `runner.bookkeeping`; the reference names (`best_index`,
`best_result`, `best_score`, `latest_result`, `latest_score`, `is_best`, `scores`, `patience`,
`score_split`) are thin delegations to it.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from chanfig import FlatDict

from danling.utils import BackgroundWriter, RoundDict

__all__ = ["RunnerResults", "SelectionSettings", "format_result", "pick_score_split"]

# Score names matching this pattern are minimised; everything else is maximised.
_LOWER_IS_BETTER = re.compile(r"loss|err|mse|mae|rmse|perplexity|ppl|nll|wer|cer|distance", re.IGNORECASE)
_PREFERRED_SCORE_SPLITS = ("val", "validate", "validation")
# Result files trail the newest row by at most this many seconds while a loop runs (every loop
# writes them before it returns): short epochs then cost one write per file per couple of
# seconds, not one per epoch, and the rows are in every checkpoint anyway.
RESULT_FILES_LINGER = 2.0


def format_result(result: Mapping[str, Any], format_spec: str = ".4f") -> str:
    """Render a result row as text, one line per split.

    Nested mappings (a split's metrics) are rendered on one line as ``split: name: value ...``;
    scalar entries are collected on their own line.

    Examples:
        >>> print(format_result({"train": {"loss": 0.123456}, "val": {"loss": 0.2, "acc": 0.9}}))
        train: loss: 0.1235
        val: loss: 0.2000	acc: 0.9000
        >>> format_result({"loss": 1.0, "acc": 0.5}, ".2f")
        'loss: 1.00\\tacc: 0.50'
    """
    lines, scalars = [], RoundDict()
    for key, value in result.items():
        if isinstance(value, Mapping):
            lines.append(f"{key}: {format(RoundDict(value), format_spec)}")
        else:
            dict.__setitem__(scalars, key, value)
    if scalars:
        lines.insert(0, format(scalars, format_spec))
    return "\n".join(lines)


class _ScoreSection(Protocol):
    min_delta: float


class SelectionSettings(Protocol):
    """The config keys model selection reads; a [`RunnerConfig`][danling.runners.config.RunnerConfig] has them.

    They are read at every use, so a change to the config (`config.score_name = "acc"`) applies
    to the next question asked.
    """

    score_split: str | None
    score_name: str
    score_mode: str | None
    patience: int | float | None
    score: _ScoreSection


class RunnerResults:
    """Result rows, model selection, early stopping and result files of one run.

    Args:
        selection: Where `score_split`, `score_name`, `score_mode`, `patience` and `score.min_delta`
            are read (the run's config).
        rows: The rows to start from (copied into a fresh `RoundDict`); none by default.
        evaluate_splits: Returns the run's evaluation splits; the split chosen for selection when
            `score_split` is unset comes from them (see
            [`pick_score_split`][danling.runners.services.results.pick_score_split]).
        logger: Where the one-time warnings go (a missing score metric, a NaN metric).

    Examples:
        >>> from danling.runners import RunnerConfig
        >>> results = RunnerResults(RunnerConfig(), evaluate_splits=lambda: ["val"])
        >>> for index, loss in enumerate([0.5, 0.3, 0.4]):
        ...     results.append({"val": {"loss": loss}}, index)
        >>> results.best_index, results.best_score, results.is_best
        (1, 0.3, False)
    """

    def __init__(
        self,
        selection: SelectionSettings,
        rows: Mapping[int, Mapping[str, Any]] | None = None,
        *,
        evaluate_splits: Callable[[], Sequence[str]] = tuple,
        logger: logging.Logger | None = None,
    ) -> None:
        self.selection = selection
        self.rows = RoundDict({int(index): RoundDict(row) for index, row in (rows or {}).items()})
        self.evaluate_splits = evaluate_splits
        self.logger = logger or logging.getLogger("danling.runners")
        self._chosen_split: str | None = None
        self._score_checked = False
        self._nan_warned: set[tuple[str, str]] = set()
        self._plain_rows: dict[int, tuple[Any, dict[str, Any]]] = {}
        self._writer: BackgroundWriter | None = None

    # ------------------------------------------------------------------ selection
    @property
    def score_split(self) -> str | None:
        """Split whose metric picks the best row; None when there is none to select on.

        `score_split` of the config when set; otherwise chosen once from the latest row (see
        [`pick_score_split`][danling.runners.services.results.pick_score_split]: a validation split,
        never a training split or one named `test*`) and kept until that split stops appearing.
        """
        configured = self.selection.score_split
        if configured:
            return configured
        latest = self.latest_row()
        if latest is None:
            return None
        cached = self._chosen_split
        if cached is not None and cached in latest:
            return cached
        splits = [key for key, value in latest.items() if isinstance(value, Mapping)]
        self._chosen_split = pick_score_split(splits, list(self.evaluate_splits()))
        return self._chosen_split

    def check_selection(self, evaluate_splits: Sequence[str], *, evaluate_interval: int | None = None) -> None:
        """Before training: refuse a `patience` that cannot act, and say once, loudly, when no best
        checkpoint will be selected (no validation split, and no `score_split` configured).

        Args:
            evaluate_splits: The splits training will evaluate.
            evaluate_interval: Step mode's steps between evaluations (0: after the last step
                only); `None` in epoch mode.

        Raises:
            ValueError: `patience` is set but nothing is scored, or step mode evaluates only after
                the last step (`evaluate_interval=0`).
        """
        splits = list(evaluate_splits)
        chosen = self.selection.score_split or pick_score_split(splits, splits)
        patience = self.selection.patience
        if patience is not None and chosen is None:
            raise ValueError(
                f"config.patience={patience!r} counts evaluations of a validation split, but none is evaluated "
                f"(evaluation splits: {splits}); add a `val` split, set config.score_split, or unset patience"
            )
        if patience is not None and evaluate_interval == 0:
            raise ValueError(
                f"config.patience={patience!r} counts evaluations, but config.evaluate_interval=0 evaluates only "
                "after the last step; set evaluate_interval to the steps between evaluations"
            )
        if chosen is None:
            self.logger.warning(
                "NO BEST CHECKPOINT: no validation split among the evaluation splits %s, so this run selects no "
                "best checkpoint (no best.json, no `best` alias); a split named test* is never chosen by itself: "
                "add a `val` split or name one in config.score_split",
                splits,
            )

    @property
    def score_name(self) -> str:
        """Metric name used for model selection (`score_name` of the config, default `"loss"`)."""
        return self.selection.score_name or "loss"

    @property
    def lower_is_better(self) -> bool:
        """Whether a smaller score is better.

        `score_mode` (`"min"` or `"max"`) decides when set; otherwise names that look like
        losses or errors (`loss`, `err`, `mse`, `perplexity`, ...) are minimised.
        """
        mode = self.selection.score_mode
        if mode is not None:
            if mode not in ("min", "max"):
                raise ValueError(f"config.score_mode must be 'min' or 'max', got {mode!r}")
            return mode == "min"
        return bool(_LOWER_IS_BETTER.search(self.score_name))

    @property
    def scores(self) -> FlatDict | None:
        """Mapping of row index to score, for rows that carry `score_split`/`score_name`.

        `None` when no score split can be resolved.
        """
        scores = self._score_map()
        return None if scores is None else FlatDict(scores)

    @property
    def best_index(self) -> int:
        """Index of the best row (the latest one on ties); 0 when nothing is scored yet."""
        return self._best_index(self._score_map())

    @property
    def latest_result(self) -> RoundDict | None:
        """Copy of the newest row with its `index` added, or `None` before the first row."""
        if not self.rows:
            return None
        index = next(reversed(self.rows))
        row = RoundDict(self.rows[index])
        row["index"] = index
        return row

    @property
    def best_result(self) -> RoundDict | None:
        """Copy of the best row with its `index` added, or `None` when nothing is scored."""
        scores = self._score_map()
        if not scores:
            return None
        index = self._best_index(scores)
        row = RoundDict(self.rows[index])
        row["index"] = index
        return row

    @property
    def latest_score(self) -> float | None:
        """Score of the newest row, or `None` when it has no score."""
        scores = self._score_map()
        if not scores or not self.rows:
            return None
        return scores.get(next(reversed(self.rows)))

    @property
    def best_score(self) -> float | None:
        """Best score seen so far, or `None` when nothing is scored."""
        scores = self._score_map()
        return scores[self._best_index(scores)] if scores else None

    @property
    def is_best(self) -> bool:
        """Whether the newest row is the best one, by the one tie rule of `best_index`.

        `True` before any row exists, `False` when no score can be read from the newest row (so a
        run without a usable score never publishes a "best" checkpoint), otherwise whether the
        newest row is the row `best_index` picks. Ties go to the latest row: a newest score equal
        to the best one (up to floating-point tolerance) makes the newest row the best, so
        `best_index`, `best.json` and the `best` checkpoint alias always name the same row.
        """
        if not self.rows:
            return True
        scores = self._score_map()  # read once: every row is scanned to build it
        if not scores:
            return False
        latest = next(reversed(self.rows))
        if latest not in scores or math.isnan(scores[latest]):
            return False
        return self._best_index(scores) == latest

    @property
    def patience(self) -> int | float:
        """Evaluations without improvement tolerated before early stop (`patience` of the config, default inf)."""
        patience = self.selection.patience
        if patience is None:
            return math.inf
        if isinstance(patience, bool) or not isinstance(patience, (int, float)) or patience < 0:
            raise ValueError(f"config.patience must be a non-negative number or None, got {patience!r}")
        return patience

    @property
    def min_delta(self) -> float:
        """How much a score must beat the best so far to count as an improvement (`score.min_delta`)."""
        return float(self.selection.score.min_delta or 0.0)

    def should_stop_early(self) -> bool:
        """Whether more than `patience` evaluations passed since the last one that improved the score.

        Evaluations are the scored rows (epochs in epoch mode, evaluations in step mode). A score
        improves when it beats every earlier one by more than `min_delta`; a tie is no improvement,
        so a flat score runs out of patience.
        """
        if not self.rows or math.isinf(self.patience):
            return False
        scores = self._score_map()
        if not scores:
            return False
        lower, delta = self.lower_is_better, self.min_delta
        sign = 1.0 if lower else -1.0
        best, since = None, 0
        for index in self.rows:
            if index not in scores:
                continue
            score = sign * _comparable(scores[index], lower)
            if best is None or (score < best - delta and not _ties(score, best)):
                best, since = score, 0
            else:
                since += 1
        return since > self.patience

    # ------------------------------------------------------------------ rows
    def append(self, result: Mapping[str, Any], index: int) -> None:
        """Store a copy of `result` as the row at `index` (an existing row at `index` is replaced).

        Args:
            result: Mapping of split name to that split's metrics (other scalars are allowed).
            index: Row index: the epoch index in epoch mode, the global step in step mode.

        Raises:
            ValueError: `index` is not an int, or the first row with an evaluation split lacks a
                `score_split`/`score_name` set in the config.
        """
        if not isinstance(index, int) or isinstance(index, bool):
            raise ValueError(f"result index must be an int, got {index!r}")
        self.rows[index] = RoundDict.from_flat(result)  # a copy; rows of split -> metrics skip chanfig's constructor
        if not self._score_checked:
            self._check_score_key(self.rows[index])
        self._warn_nan_metrics(self.rows[index])

    def _warn_nan_metrics(self, row: Mapping[str, Any]) -> None:
        """Log a WARNING the first time a metric of a split is NaN: a metric says NaN for input it cannot
        score (see the metrics docs) rather than raise, and a row of NaN would otherwise pass unnoticed."""
        for split, metrics in row.items():
            if not isinstance(metrics, Mapping):
                continue
            for name, value in metrics.items():
                if isinstance(value, float) and value != value and (split, name) not in self._nan_warned:
                    self._nan_warned.add((split, name))
                    self.logger.warning(
                        "metric %r of split %r is NaN: it cannot be scored from this input (multiclass targets "
                        "outside [0, num_classes), binary targets other than 0 and 1, a single class for AUROC, "
                        "no samples, or a NaN loss); warned once",
                        name,
                        split,
                    )

    def _check_score_key(self, row: Mapping[str, Any]) -> None:
        """At the first row with an evaluation split, refuse a `score_split`/`score_name` it lacks.

        Without the check such a run never picks a best checkpoint and never says why. A name set
        in the config raises `ValueError`; the default `"loss"` only warns (a run may not care).
        """
        splits = [key for key, value in row.items() if isinstance(value, Mapping)]
        evaluate_splits = list(self.evaluate_splits())
        if not splits or (evaluate_splits and not set(splits) & set(evaluate_splits)):
            return  # a training-only row: evaluation has not happened yet
        self._score_checked = True
        split = self.score_split
        if split is None:
            return  # nothing to select on: `check_selection` said so before training
        if split not in splits:
            raise ValueError(f"score_split {split!r} is not a split of the results; available splits: {splits}")
        names = sorted(key for key in row[split] if not isinstance(row[split][key], Mapping))
        if self.score_name in row[split]:
            return
        message = (
            f"score_name {self.score_name!r} is not a metric of split {split!r}, so no best checkpoint "
            f"can be picked; available metrics: {names}"
        )
        if self.score_name != "loss":  # chosen in the config: a typo must not go unnoticed
            raise ValueError(message)
        self.logger.warning("%s (set score_name to one of them)", message)

    def plain_row(self, index: int) -> dict[str, Any]:
        """Row `index` as plain dicts, converted once per stored row object (rows are never mutated
        in place by the runner; a replaced row is converted again)."""
        row = self.rows[index]
        cached = self._plain_rows.get(index)
        if cached is None or cached[0] is not row:
            cached = self._plain_rows[index] = (row, _plain_mapping(row))
        return cached[1]

    # ------------------------------------------------------------------ files
    def write_files(self, directory: str | os.PathLike, header: Mapping[str, Any], *, restored: bool = False) -> None:
        """Write `results.json` (every row), `latest.json` (the newest row with its index) and, when
        the newest row is the best, `best.json` into `directory`, each starting with `header`.

        With `restored` (the rows were just read back from a checkpoint), `best.json` is written from
        the best row even when it is not the newest: a run resumed from an older checkpoint would
        otherwise keep the files of the continuation it abandoned, naming rows it no longer has.

        The files are written by a helper thread ([`BackgroundWriter`][danling.utils.BackgroundWriter])
        from a snapshot of the rows, so the caller does not wait for the disk. They may trail the
        newest row by up to two seconds (rows arriving faster are coalesced into one write) until
        [`flush`][danling.runners.services.results.RunnerResults.flush] or `close`. They are
        replaced atomically but not fsync'ed: a reader never sees a partial file, and a runner
        stores the same rows durably in every checkpoint, so an fsync per file and epoch would buy
        nothing but latency.
        """
        if not self.rows:
            return
        index = next(reversed(self.rows))
        folder = os.path.abspath(directory)
        if self._writer is None:
            self._writer = BackgroundWriter("danling-results", linger=RESULT_FILES_LINGER)
        rows = {key: self.plain_row(key) for key in self.rows}
        self._writer.submit({**header, "results": rows}, os.path.join(folder, "results.json"), durable=False)
        payload = {**header, "index": index, **self.plain_row(index)}
        self._writer.submit(payload, os.path.join(folder, "latest.json"), durable=False)
        if self.is_best:
            self._writer.submit(payload, os.path.join(folder, "best.json"), durable=False)
        elif restored and (scores := self._score_map()):
            best = self._best_index(scores)
            best_payload = {**header, "index": best, **self.plain_row(best)}
            self._writer.submit(best_payload, os.path.join(folder, "best.json"), durable=False)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the result files submitted by `write_files` are written.

        Raises:
            OSError: Writing a result file failed.
        """
        if self._writer is not None:
            self._writer.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Write what is pending (waiting up to `timeout`) and stop the writer thread."""
        if self._writer is not None:
            self._writer.close(timeout)

    # ------------------------------------------------------------------ text
    def format_result(self, result: Mapping[str, Any], format_spec: str = ".4f") -> str:
        """Render `result` as text; see [`format_result`][danling.runners.services.results.format_result]."""
        return format_result(result, format_spec)

    def format_epoch_result(
        self, result: Mapping[str, Any], epoch: int, epochs: int | None, format_spec: str = ".4f"
    ) -> str:
        """Render a finished epoch's row as one line per split, each starting with `epoch [i/n]`.

        `epoch` is the row index (from 0) and `epochs` the budget; the line counts from 1, as the
        progress bar does, so the last epoch of 5 is `epoch [5/5]` everywhere.
        """
        total = "?" if epochs is None else epochs
        lines = format_result(result, format_spec).split("\n")
        return "\n".join(f"epoch [{epoch + 1}/{total}] {line}" for line in lines)

    def format_step_result(
        self, result: Mapping[str, Any], split: str, iteration: int, length: int | None, format_spec: str = ".4f"
    ) -> str:
        """Render one step log line: ``split [iteration/length] name: value ...``."""
        total = "?" if length is None else length
        return f"{split} [{iteration}/{total}]\t{format(RoundDict(result), format_spec)}"

    # ------------------------------------------------------------------ scores
    def _score_map(self) -> dict[int, float] | None:
        """Plain `{row index: score}` behind `scores` (`None` when no score split resolves)."""
        split = self.score_split
        if split is None:
            return None
        name, scores = self.score_name, {}
        # Rows are dicts (RoundDicts): plain keys are read with dict.get, a few microseconds less
        # than chanfig's path-resolving get, for every row at every epoch. Dotted keys go through it.
        plain = "." not in split and "." not in name
        for index, row in self.rows.items():
            metrics = dict.get(row, split) if plain and isinstance(row, dict) else row.get(split)
            if isinstance(metrics, Mapping):
                value = dict.get(metrics, name) if plain and isinstance(metrics, dict) else metrics.get(name)
            else:
                value = None
            if value is not None:
                scores[index] = float(value)
        return scores

    def _best_index(self, scores: Mapping[int, float] | None) -> int:
        if not scores:
            return 0
        lower = self.lower_is_better
        sign = 1.0 if lower else -1.0
        # The one tie rule: the best score wins, and among scores equal to it (up to floating-point
        # tolerance, as `is_best` compares) the latest row: the most trained weights of that score.
        best = min(sign * _comparable(score, lower) for score in scores.values())
        return max(index for index, score in scores.items() if _ties(sign * _comparable(score, lower), best))

    def latest_row(self) -> Mapping | None:
        """The newest row as stored (no `index` added), or `None` before the first row."""
        return self.rows[next(reversed(self.rows))] if self.rows else None


def pick_score_split(splits: list[str], evaluate_splits: list[str]) -> str | None:
    """The split a run selects on when `score_split` is not set: `val` (or `validate`/`validation`),
    else the first evaluation split not named `test*`; None when there is none.

    Examples:
        >>> pick_score_split(["train", "test", "val"], ["test", "val"]), pick_score_split(["train", "dev"], ["dev"])
        ('val', 'dev')
        >>> pick_score_split(["train", "test"], ["test"]) is None
        True
    """
    for split in _PREFERRED_SCORE_SPLITS:
        if split in splits:
            return split
    for split in evaluate_splits:
        if split in splits and not split.lower().startswith("test"):
            return split
    return None


def _plain_mapping(row: Mapping[str, Any]) -> dict[str, Any]:
    return {key: _plain_mapping(value) if isinstance(value, Mapping) else value for key, value in row.items()}


def _ties(score: float, best: float) -> bool:
    return score == best or math.isclose(score, best, rel_tol=1e-9, abs_tol=1e-12)


def _comparable(score: float, lower_is_better: bool) -> float:
    """Map NaN to the worst possible value so it never wins the best-score selection."""
    if math.isnan(score):
        return math.inf if lower_is_better else -math.inf
    return score
