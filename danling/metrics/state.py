"""Task descriptions, shared metric artifacts and artifact-based metric functions.

A [`MetricTask`][danling.metrics.MetricTask] says how to read `(input, target)`. A
[`MetricState`][danling.metrics.MetricState] holds the data of one batch (or of a whole
dataset) for a task and builds each shared artifact — confusion counts, threshold curves,
regression moments — at most once, whatever number of metrics read it. A
[`MetricFunc`][danling.metrics.MetricFunc] is a named metric computed from a state; it names
the artifacts it needs so that [`GlobalMetrics`][danling.metrics.GlobalMetrics] can store
only those.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .functional import _ranking
from .functional._common import Confusion, Curves, LabelCounter, check_threshold, label_counter
from .functional._host import as_tensor
from .functional.binary import binary_confusion, binary_curves
from .functional.binned import binned_counts, binned_invalid
from .functional.multiclass import multiclass_confusion, multiclass_curves
from .functional.multilabel import multilabel_confusion, multilabel_curves
from .functional.regression import empty_moments, regression_moments
from .global_state import NARROW_DTYPES
from .preprocess import (
    positive_predictions,
    preprocess_binary,
    preprocess_multiclass,
    preprocess_multilabel,
    preprocess_regression,
)

__all__ = ["ARTIFACTS", "MetricFunc", "MetricState", "MetricTask"]

TASK_KINDS = ("binary", "multiclass", "multilabel", "regression")
# "data" means the predictions and targets themselves; the others are built from them.
# "ranking" means the data read as an unordered set of (score, label) pairs, as AUROC and AUPRC
# read it: a store may then keep the rows in another order (binary scores grouped by label).
ARTIFACTS = ("confusion", "moments", "data", "bins", "ranking")
# Fewest scores for which `MetricState.ranking` sorts per-column copies: below it the curves'
# handful of whole-tensor calls cost less than a column-by-column pass of ten columns, and their
# memory is small. Measured after a warm-up, AUROC + AUPRC: ten columns took 1.2-1.6x the curves'
# time at 640-3,000 scores and 0.8x at 10,000; one column 0.84-0.89x from 64 scores, 0.52x at
# 10,000 (the bound was 65,536, where the ranking was already about 0.4x).
RANKING_MIN_SCORES = 1 << 13
# Device data (CUDA) of this many scores or more also takes the ranking, with tensor ops on its
# own device, a column at a time (`_ranking.tensor_ranking`): the curves of all columns at once
# took 20-22x the scores at their peak on an H200; the bound is the host's.


@dataclass(frozen=True)
class MetricTask:
    """How to read predictions and targets for one kind of task.

    Args:
        kind: `"binary"`, `"multiclass"`, `"multilabel"` or `"regression"`.
        num_classes: Classes of a multiclass task.
        num_labels: Labels of a multilabel task.
        num_outputs: Outputs of a regression task.
        threshold: Probability above which a binary or multilabel prediction is positive.
        ignore_index: Target value to leave out.
        bins: Score bins of the binned AUROC / AUPRC (classification only; `None`: exact only).

    Examples:
        >>> task = MetricTask("multiclass", num_classes=3, ignore_index=-100)
        >>> input, target = task.format([[0.2, 0.5, 0.3]], [1])
        >>> input.shape, target.tolist()
        (torch.Size([1, 3]), [1])
        >>> MetricTask("multiclass", num_labels=3)
        Traceback (most recent call last):
        ValueError: num_labels applies to multilabel tasks, not multiclass
    """

    kind: str
    num_classes: int | None = None
    num_labels: int | None = None
    num_outputs: int | None = None
    threshold: float = 0.5
    ignore_index: int | float | None = None
    bins: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in TASK_KINDS:
            raise ValueError(f"kind must be one of {', '.join(TASK_KINDS)}, got {self.kind!r}")
        for field, kind in (("num_classes", "multiclass"), ("num_labels", "multilabel"), ("num_outputs", "regression")):
            value = getattr(self, field)
            if value is None:
                continue
            if kind != self.kind:
                raise ValueError(f"{field} applies to {kind} tasks, not {self.kind}")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        if self.bins is not None and (
            isinstance(self.bins, bool) or not isinstance(self.bins, int) or self.bins < 2 or self.kind == "regression"
        ):
            raise ValueError(f"bins must be an integer of at least 2 for a classification task, got {self.bins!r}")
        check_threshold(self.threshold, 0, 1)  # a probability

    def __hash__(self) -> int:
        # The fields' hash, computed once: every container read hashes its tasks several times
        # (dict keys, caches), and hashing seven fields each time cost more than reading the
        # counts. Never pickled (see `__getstate__`): a string's hash differs between processes.
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = hash(
                (
                    self.kind,
                    self.num_classes,
                    self.num_labels,
                    self.num_outputs,
                    self.threshold,
                    self.ignore_index,
                    self.bins,
                )
            )
            object.__setattr__(self, "_hash", value)
            return value

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_hash", None)
        return state

    @property
    def size(self) -> int | None:
        """Classes, labels or outputs, whichever the task has (`None` if not given)."""
        return {"binary": 2, "multiclass": self.num_classes, "multilabel": self.num_labels}.get(
            self.kind, self.num_outputs
        )

    def format(self, input: Any, target: Any) -> tuple[Tensor, Tensor]:
        """Validate and normalise one batch (see [`danling.metrics.preprocess`][danling.metrics.preprocess])."""
        if self.kind == "binary":
            return preprocess_binary(input, target)
        if self.kind == "multiclass":
            return preprocess_multiclass(input, target, self.num_classes)
        if self.kind == "multilabel":
            return preprocess_multilabel(input, target, self.num_labels)
        return preprocess_regression(input, target, self.num_outputs)

    def confusion(self, input: Tensor, target: Tensor) -> Confusion:
        """Confusion counts of formatted data."""
        if self.kind == "binary":
            return binary_confusion(input, target, self.threshold, self.ignore_index)
        if self.kind == "multiclass":
            return multiclass_confusion(input, target, self.ignore_index)
        if self.kind == "multilabel":
            return multilabel_confusion(input, target, self.threshold, self.ignore_index)
        raise ValueError("regression tasks have no confusion counts")

    def confusion_counter(self, input: Tensor) -> tuple[LabelCounter, Tensor]:
        """The label counter of formatted scores and the predicted labels it counts.

        [`GlobalMetrics`][danling.metrics.GlobalMetrics] accumulates `counter.accumulate(counts,
        pred, target)` batch after batch and builds one `Confusion` with `counter.confusion`.
        """
        if self.kind == "multiclass":
            return label_counter(input.shape[-1], self.ignore_index), input.argmax(-1)
        if self.kind == "regression":
            raise ValueError("regression tasks have no confusion counts")
        groups = max(input.shape[-1], 1) if self.kind == "multilabel" else None
        return label_counter(2, self.ignore_index, groups), self.predicted_labels(input)

    def label_counter(self) -> LabelCounter:
        """The label counter of this task's declared size: what `confusion_counter` returns for
        every batch that `format` accepts, so a container can look it up once."""
        if self.kind == "regression":
            raise ValueError("regression tasks have no confusion counts")
        if self.size is None:
            raise ValueError(f"{self.kind} tasks need their size (num_classes / num_labels) for a fixed label counter")
        if self.kind == "multiclass":
            return label_counter(self.size, self.ignore_index)
        return label_counter(2, self.ignore_index, self.num_labels if self.kind == "multilabel" else None)

    def predicted_labels(self, input: Tensor) -> Tensor:
        """Predicted labels of formatted scores: the top class, or positive (1) / negative (0)."""
        if self.kind == "multiclass":
            return input.argmax(-1)
        if self.kind == "regression":
            raise ValueError("regression tasks have no predicted labels")
        return positive_predictions(input, self.threshold).long()

    def empty_confusion(self, device: torch.device | str | None = None) -> Confusion:
        """Confusion counts of no data (what a rank without samples contributes)."""
        size = self.size
        if size is None:
            raise ValueError(f"{self.kind} tasks need their size (num_classes / num_labels) to build empty counts")
        shape = (size, 2, 2) if self.kind == "multilabel" else (size, size)
        zero = torch.zeros((), dtype=torch.long, device=device)
        return Confusion(torch.zeros(shape, dtype=torch.long, device=device), zero)

    def moments(self, input: Tensor, target: Tensor) -> Tensor:
        """Regression moments of formatted data."""
        if self.kind != "regression":
            raise ValueError(f"{self.kind} tasks have no regression moments")
        return regression_moments(input, target, self.ignore_index)

    def empty_moments(self, device: torch.device | str | None = None) -> Tensor:
        """Regression moments of no data."""
        if self.num_outputs is None:
            raise ValueError("regression tasks need num_outputs to build empty moments")
        return empty_moments(self.num_outputs, device)

    def binned(self, input: Tensor, target: Tensor) -> Tensor:
        """Per-bin negative / positive counts of formatted data (see `functional.binned`)."""
        if self.bins is None:
            raise ValueError(f"this {self.kind} task has no bins: pass bins= to bin its scores")
        return binned_counts(input, target, self.kind, self.bins, self.ignore_index)

    def binned_invalid(self, input: Tensor, target: Tensor) -> Tensor:
        """Per-column errors the bins leave out (targets that are no label, NaN scores; see `functional.binned`)."""
        if self.bins is None:
            raise ValueError(f"this {self.kind} task has no bins: pass bins= to bin its scores")
        return binned_invalid(input, target, self.kind, self.ignore_index)

    def curves(self, input: Tensor, target: Tensor, micro: bool = False) -> Curves:
        """Threshold curves of formatted data (one column per class or label, or pooled)."""
        if self.kind == "binary":
            return binary_curves(input, target, self.ignore_index)
        if self.kind == "multiclass":
            return multiclass_curves(input, target, self.ignore_index, micro=micro)
        if self.kind == "multilabel":
            return multilabel_curves(input, target, self.ignore_index, micro=micro)
        raise ValueError("regression tasks have no threshold curves")


class MetricState:
    """Data of a batch or a dataset for one task, with artifacts built once and cached.

    Pass formatted `input`/`target` (see [`MetricTask.format`][danling.metrics.MetricTask.format]),
    or the same in `chunks` of rows (targets in any integer dtype), and/or artifacts that were
    accumulated elsewhere (`confusion`, `moments`, `bins` with their `bins_invalid`, and a `ranking` of the data: what
    [`ranking()`][danling.metrics.MetricState.ranking] returns, at any size). Artifacts that were not given are derived
    from the data on first use; chunks are concatenated only for what needs the data in one
    piece (`data`, `curves`), not for `ranking`.

    Examples:
        >>> state = MetricState.from_batch(MetricTask("binary"), [0.9, 0.2, 0.7], [1, 0, 0])
        >>> state.confusion.matrix
        tensor([[1, 1],
                [0, 1]])
        >>> state.confusion is state.confusion  # built once
        True
    """

    def __init__(
        self,
        task: MetricTask,
        input: Tensor | None = None,
        target: Tensor | None = None,
        *,
        confusion: Confusion | None = None,
        moments: Tensor | None = None,
        bins: Tensor | None = None,
        bins_invalid: Tensor | None = None,
        chunks: Sequence[tuple[Tensor, Tensor]] | None = None,
        ranking: _ranking.Ranking | None = None,
    ) -> None:
        self.task = task
        self.input = input
        self.target = target
        self.chunks = chunks
        self._cache: dict[Any, Any] = {}
        if confusion is not None:
            self._cache["confusion"] = confusion
        if moments is not None:
            self._cache["moments"] = moments
        if bins is not None:
            self._cache["bins"] = bins
        if bins_invalid is not None:
            self._cache["bins_invalid"] = bins_invalid
        if ranking is not None:
            self._cache["ranking", False] = ranking

    @classmethod
    def from_batch(cls, task: MetricTask, input: Any, target: Any) -> MetricState:
        """Format raw `input`/`target` for `task` and wrap them in a state."""
        return cls(task, *task.format(input, target))

    def cached(self, key: Any, compute: Callable[[], Any]) -> Any:
        """Return the artifact stored under `key`, computing it with `compute()` the first time."""
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def held(self, key: Any) -> Any:
        """The artifact stored under `key`, or `None` if it has not been built (nothing is built)."""
        return self._cache.get(key)

    @property
    def data(self) -> tuple[Tensor, Tensor]:
        """The formatted `(input, target)` pair."""
        if (self.input is None or self.target is None) and self.chunks is not None:
            chunks = self.chunks
            self.input = chunks[0][0] if len(chunks) == 1 else torch.cat([input for input, _ in chunks])
            target = chunks[0][1] if len(chunks) == 1 else torch.cat([target for _, target in chunks])
            # Class targets are int64 once formatted; stores keep them narrower where they fit.
            self.target = target.long() if target.dtype in NARROW_DTYPES else target
        if self.input is None or self.target is None:
            raise ValueError("this metric needs the predictions and targets, but the state only holds summaries")
        return self.input, self.target

    @property
    def confusion(self) -> Confusion:
        return self.cached("confusion", lambda: self.task.confusion(*self.data))

    @property
    def moments(self) -> Tensor:
        return self.cached("moments", lambda: self.task.moments(*self.data))

    @property
    def bins(self) -> Tensor:
        """Per-bin negative / positive score counts, `(columns, 2, bins)` (see `MetricTask.binned`)."""
        return self.cached("bins", lambda: self.task.binned(*self.data))

    @property
    def bins_invalid(self) -> Tensor | None:
        """Per-column errors the bins left out, `(columns,)`: any makes the binned AUROC / AUPRC `nan`.

        Built from the data when the state has it; `None` for a state given `bins` alone, whose
        counts are then read as having no errors.
        """
        if "bins_invalid" not in self._cache and "bins" in self._cache and self.input is None and self.chunks is None:
            return None
        return self.cached("bins_invalid", lambda: self.task.binned_invalid(*self.data))

    def curves(self, micro: bool = False) -> Curves:
        """Threshold curves (per class/label, or pooled with `micro=True`)."""
        return self.cached(("curves", micro), lambda: self.task.curves(*self.data, micro=micro))

    def ranking(self, micro: bool = False) -> _ranking.Ranking | None:
        """Per-column AUROC, average precision and positives (pooled with `micro=True`), or `None`.

        Given for data of at least `RANKING_MIN_SCORES` scores. Host data: built from one sorted
        copy of each column's positive and negative scores (`danling.metrics.functional._ranking`),
        about as much memory as the scores where the curves take about fifteen times it. Data on
        another device: the same counts with tensor ops there, one column at a time, read from the
        chunks without concatenating them (no host read). Either way the same AUROC and the same
        average precision up to float rounding. Otherwise `None`: read `curves`. A ranking given
        to the state is returned at any size.
        """
        given = self._cache.get(("ranking", micro))
        if given is not None:
            return given
        chunks = self.chunks if self.input is None else [(self.input, self.target)]
        if (
            chunks is None
            or self.task.kind == "regression"
            or sum(input.numel() for input, _ in chunks) < RANKING_MIN_SCORES
        ):
            return None
        task = self.task
        return self.cached(
            ("ranking", micro),
            lambda: _ranking.ranking(task.kind, chunks, task.size or 1, task.ignore_index, micro=micro),
        )


class MetricFunc:
    """A named metric computed from a [`MetricState`][danling.metrics.MetricState].

    Calling it with a state evaluates it; calling it with `(input, target)` builds a state
    for that batch first, so a `MetricFunc` also works as a plain metric function.

    Args:
        name: Name under which containers report the value.
        fn: Function of a state returning the metric.
        task: The task the state is built for.
        requires: Artifacts `fn` reads: any of `"confusion"`, `"moments"`, `"data"`, `"bins"`,
            `"ranking"`. A function that reads the data only as an unordered set of (score, label)
            pairs (AUROC, AUPRC) may say `"ranking"` instead of `"data"`: a `GlobalMetrics` whose
            binary metrics all say so keeps host scores grouped by label, sorted in place at each
            read, in about half the memory; the rows its states hold are then grouped by label
            (the latest batch's too), not in the order they came.

    Examples:
        >>> from danling.metrics.functional.binary import accuracy_from_confusion
        >>> acc = MetricFunc("acc", lambda s: accuracy_from_confusion(s.confusion), MetricTask("binary"), "confusion")
        >>> acc([0.9, 0.2, 0.7], [1, 0, 0])
        tensor(0.6667, dtype=torch.float64)
    """

    def __init__(
        self,
        name: str,
        fn: Callable[[MetricState], Tensor],
        task: MetricTask,
        requires: str | Iterable[str] = "data",
    ) -> None:
        requires = (requires,) if isinstance(requires, str) else tuple(requires)
        unknown = [r for r in requires if r not in ARTIFACTS]
        if unknown:
            raise ValueError(f"unknown artifacts {unknown}; choose from {', '.join(ARTIFACTS)}")
        self.name = self.__name__ = name
        self.fn = fn
        self.task = task
        self.requires = frozenset(requires)

    def __call__(self, state_or_input: MetricState | Any, target: Any = None) -> Tensor:
        if isinstance(state_or_input, MetricState):
            if target is not None:
                raise TypeError(f"{self.name}: pass either a MetricState or (input, target), not both")
            return as_tensor(self.fn(state_or_input))
        if target is None:
            raise TypeError(f"{self.name}() missing the target argument")
        return as_tensor(self.fn(MetricState.from_batch(self.task, state_or_input, target)))

    def evaluate(self, state: MetricState) -> Tensor | float:
        """The metric of `state` as `fn` gives it: a tensor, or a Python float where it was computed on the host.

        Called by `GlobalMetrics` on every read of its values (`val`, `bat`, `avg`), once per
        metric, with a state built for that read; the state's artifacts are shared by the
        metrics of its task. No side effects beyond the state's cache. An override must return
        what `fn` would (containers turn a 0-d tensor into a number and keep a float as it is)
        and must not keep the state, which holds the read's data. Calling the `MetricFunc`
        instead returns a float as a float64 tensor.
        """
        return self.fn(state)

    def __repr__(self) -> str:
        return f"MetricFunc({self.name}, task={self.task.kind})"
