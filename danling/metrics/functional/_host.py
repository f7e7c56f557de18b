"""Confusion metrics of small binary and multiclass CPU batches, counted from Python lists.

On CPU reading tensor values costs nothing, and for a batch of a few hundred labels at most one
`tolist` per side and a loop in Python cost less than the two or three dozen small tensor ops of
the confusion-matrix path (each a dispatch, slowest inside a training step whose work has pushed
their code out of the caches). The results are those of the general path bit for bit: counts are
exact integers, every element-wise step is the same correctly rounded IEEE operation in Python,
and what torch does not round correctly or the same way in any order (sums over non-integer
values, MCC's square root) is left to the same torch op on a tensor of the same values.

A score comes back as a Python float (a per-class vector as a float64 tensor): containers read
it as a float, with no tensor made to be read back, and the functional API hands it out as a
float64 tensor (`as_tensor`).
"""

from __future__ import annotations

import math
import struct
from array import array
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..preprocess import _logit_threshold
from . import _common
from ._common import check_average

__all__ = [
    "HostCounts",
    "LabelHostCounts",
    "accuracy_of",
    "as_tensor",
    "balanced_accuracy_of",
    "binary_score_of",
    "class_score_of",
    "counts_of_confusion",
    "host_balanced_accuracy",
    "host_binary_counts",
    "host_class_score",
    "host_counts",
    "host_mcc",
    "host_statistics",
    "label_score_of",
    "mcc_of",
    "small_cpu_batch",
]

_FLOAT_DTYPES = (torch.float32, torch.float64)
_FLOAT32 = struct.Struct("f")
# Fewest counted samples for which products of counts (up to `total**2`, in MCC) may exceed 2**53.
_EXACT_TOTAL = 1 << 26
# Fewest counted samples for which sums of counts may exceed 2**53.
_EXACT_SUM = 1 << 53


def small_cpu_batch(input: Any, target: Any, num_classes: int | None) -> bool:
    """Float CPU scores `(N, C)` and int64 labels `(N,)` with `0 < N <= _common.HOST_CONFUSION_SIZE`."""
    return (
        type(input) is Tensor
        and type(target) is Tensor
        and input.ndim == 2
        and target.ndim == 1
        and 0 < target.shape[0] <= _common.HOST_CONFUSION_SIZE
        and input.shape[0] == target.shape[0]
        and (num_classes is None or input.shape[1] == num_classes)
        and target.dtype is torch.long
        and input.dtype in _FLOAT_DTYPES
        and target.is_cpu
        and input.is_cpu
        and "cpu" in _common.HOST_READ_DEVICES
    )


class HostCounts:
    """Per-class hits, predictions and support, as Python integers.

    Built with every list from a batch's pairs, or by `of_table` from a confusion table read on
    the host, whose `predicted` and `support` are summed on first use: accuracy reads only the
    hits and the total, and the sums of every row and column were most of a cold accuracy-only
    compute.
    """

    __slots__ = ("tp", "total", "ok", "_predicted", "_support", "_table", "_start", "_classes")

    def __init__(self, tp: Sequence[int], predicted: list[int], support: list[int], total: int, ok: bool) -> None:
        self.tp, self._predicted, self._support, self.total = tp, predicted, support, total
        self.ok = ok  # something was counted and every target was a class or ignored

    @classmethod
    def of_table(cls, table: Sequence[int], start: int, classes: int, invalid: int) -> HostCounts:
        """The statistics of the row-major `(classes, classes)` matrix at `table[start:]`."""
        end = start + classes * classes
        counts = cls.__new__(cls)
        counts.tp, counts.total = table[start : end : classes + 1], sum(table[start:end])
        counts.ok = counts.total > 0 and not invalid
        counts._predicted = counts._support = None
        counts._table, counts._start, counts._classes = table, start, classes
        return counts

    @property
    def predicted(self) -> list[int]:
        """Predictions of each class: the matrix's column sums."""
        if self._predicted is None:
            table, start, c = self._table, self._start, self._classes
            self._predicted = [sum(table[column : start + c * c : c]) for column in range(start, start + c)]
        return self._predicted

    @property
    def support(self) -> list[int]:
        """Targets of each class: the matrix's row sums."""
        if self._support is None:
            table, start, c = self._table, self._start, self._classes
            self._support = [sum(table[row : row + c]) for row in range(start, start + c * c, c)]
        return self._support


def host_counts(input: Any, target: Any, num_classes: int | None, ignore_index: Any) -> HostCounts | None:
    """The confusion statistics of a small CPU batch, or `None` where the general path applies."""
    if not small_cpu_batch(input, target, num_classes) or not (ignore_index is None or type(ignore_index) is int):
        return None
    return _counts(input.argmax(-1).tolist(), target.tolist(), input.shape[1], ignore_index)


def host_binary_counts(input: Any, target: Any, threshold: float, ignore_index: Any) -> HostCounts | None:
    """The 2x2 confusion statistics of a small CPU batch of binary scores, or `None` for the general path.

    Scores are thresholded as `positive_predictions` does: as logits if any lies outside `[0, 1]`
    (the threshold moved to logit space), compared in the scores' dtype.
    """
    _common.check_threshold(threshold)  # the general path checks it too: this one runs first
    if not (
        type(input) is Tensor
        and type(target) is Tensor
        and input.ndim == 1
        and target.ndim == 1
        and 0 < target.shape[0] <= _common.HOST_CONFUSION_SIZE
        and input.shape[0] == target.shape[0]
        and target.dtype is torch.long
        and input.dtype in _FLOAT_DTYPES
        and target.is_cpu
        and input.is_cpu
        and "cpu" in _common.HOST_READ_DEVICES
        and (ignore_index is None or type(ignore_index) is int)
    ):
        return None
    scores = input.tolist()
    # Logits if any score lies outside [0, 1]: then sigmoid(x) > t exactly when x > logit(t).
    cut = _logit_threshold(threshold) if any(s < 0 or s > 1 for s in scores) else threshold
    if input.dtype is torch.float32:  # torch compares float32 scores with the threshold rounded to float32
        try:
            cut = _FLOAT32.unpack(_FLOAT32.pack(cut))[0]
        except OverflowError:  # beyond float32's range torch rounds to an infinity
            cut = math.copysign(math.inf, cut)
    return _counts([1 if s > cut else 0 for s in scores], target.tolist(), 2, ignore_index)


class LabelHostCounts:
    """Per-label statistics of multilabel counts (the positive class's, built on first use), all labels pooled."""

    __slots__ = ("table", "starts", "pooled", "_positives")

    def __init__(self, table: Sequence[int], starts: range, pooled: HostCounts) -> None:
        self.table, self.starts = table, starts  # each label's 2x2 matrix starts at one of `starts`
        self.pooled = pooled
        self._positives: tuple[list[int], list[int], list[int]] | None = None

    @property
    def positives(self) -> tuple[list[int], list[int], list[int]]:
        """Hits, predictions and targets of every label's positive class (built on first use).

        Each 2x2 cell of every label is one strided slice of the table (a label per step), so
        the three lists take three slices and one pass over the labels, not a `HostCounts` per
        label. (A plain attribute, not a `cached_property`, whose lock cost more than the lists
        on a cold read.)
        """
        if self._positives is None:
            table, start, stop, step = self.table, self.starts.start, self.starts.stop, self.starts.step
            # Row-major (target, prediction) cells: 1 predicted only, 2 missed, 3 hit.
            tps, predicted, support = [], [], []
            for t, a, m in zip(
                table[start + 3 : stop : step], table[start + 1 : stop : step], table[start + 2 : stop : step]
            ):
                tps.append(t)
                predicted.append(a + t)
                support.append(m + t)
            self._positives = tps, predicted, support
        return self._positives


def counts_of_confusion(confusion: _common.Confusion) -> HostCounts | LabelHostCounts | None:
    """The statistics of accumulated counts read on the host, or `None` where the tensor path applies.

    For the small CPU count table of a `CountedConfusion` (what `GlobalMetrics` reads) of fewer
    than 2**53 counted entries: below that every sum of counts is an integer exact in float64, so
    the tensor path's float64 arithmetic on them is exact too and both give the same floats. MCC
    also multiplies counts (`total**2` at most), which may round from 2**26 counted entries:
    `mcc_of` then rounds them as the tensor path does. Grouped (multilabel) counts give a
    `LabelHostCounts`.
    """
    if not isinstance(confusion, _common.CountedConfusion):
        return None
    held = confusion.host_counts  # read once per confusion: its metrics share the statistics
    if held is _common.NOT_READ:
        held = confusion.host_counts = host_statistics(confusion.counter, confusion.counts, confusion.view)
    return held


def host_statistics(
    counter: _common.LabelCounter, counts: Tensor, view: Sequence[int] | None = None
) -> HostCounts | LabelHostCounts | None:
    """`counts_of_confusion` of the counter's flat `counts` (read through `view`, a `host_view` of
    them, where given), with no `CountedConfusion` made for them: what a reader that holds the
    counts and reads each statistic once calls."""
    read = counter.host_table(counts, view)
    if read is None:
        return None
    table, starts, invalid = read
    classes = counter.num_classes
    if counter.groups is None:
        statistics = HostCounts.of_table(table, starts[0], classes, invalid)
        return statistics if statistics.total < _EXACT_SUM else None
    if classes != 2:  # every grouped counter danling makes counts labels (2 classes); others: the tensor path
        return None
    # Every label's 2x2 matrix added cell by cell: the pooled statistics of all decisions, written
    # out. A cell of every label is one strided slice of the table.
    start, stop, step = starts.start, starts.stop, starts.step
    tn, fp = sum(table[start:stop:step]), sum(table[start + 1 : stop : step])
    fn, tp = sum(table[start + 2 : stop : step]), sum(table[start + 3 : stop : step])
    total = tn + fp + fn + tp
    pooled_counts = HostCounts([tn, tp], [tn + fn, fp + tp], [tn + fp, fn + tp], total, total > 0 and not invalid)
    return LabelHostCounts(table, starts, pooled_counts) if pooled_counts.total < _EXACT_SUM else None


def label_score_of(counts: LabelHostCounts, average: str | None, which: str) -> float | Tensor:
    """Multilabel `"precision"`, `"recall"` or `"f1"` of the positive class of every label.

    `micro` scores the pooled counts; `macro` averages over labels positive in the target or the
    predictions, `weighted` by the labels' positives; `None` keeps one value per label.
    """
    average = check_average(average)
    if average == "micro":
        return binary_score_of(counts.pooled, which)
    tps, predicted, support = counts.positives
    if not counts.pooled.ok:
        return torch.full((len(tps),), math.nan, dtype=torch.float64) if average is None else math.nan
    if average is None:
        return torch.tensor([_score(t, p, s, which) for t, p, s in zip(tps, predicted, support)], dtype=torch.float64)
    # Each label's score times its weight, every label in its place (a label in neither the
    # target nor the predictions weighs 0): the tensor path sums this same vector.
    macro, products, total = average == "macro", [], 0
    for t, p, s in zip(tps, predicted, support):
        weight = (1 if macro else s) if p + s else 0
        products.append(_score(t, p, s, which) * weight)
        total += weight
    # No weight at all: the tensor path divides 0 by 0.
    return _torch_sum(products, nan=True) / total if total else math.nan


def binary_score_of(counts: HostCounts, which: str) -> float:
    """Binary `"precision"`, `"recall"` or `"f1"` of the counts: the positive class's score."""
    return _positive_score(counts, which) if counts.ok else math.nan


def _positive_score(counts: HostCounts, which: str) -> float:
    # The positive class's score; 0 where it was never predicted / never a target (zero_nan).
    return _score(counts.tp[1], counts.predicted[1], counts.support[1], which)


def _score(t: int, p: int, s: int, which: str) -> float:
    # One class's score from its hits, predictions and targets; 0 where its denominator is 0.
    if which == "precision":
        return t / p if p else 0.0
    if which == "recall":
        return t / s if s else 0.0
    return 2 * t / (p + s) if p + s else 0.0


def host_class_score(
    input: Any, target: Any, num_classes: int | None, average: str | None, ignore_index: Any, which: str
) -> Tensor | None:
    """`"precision"`, `"recall"` or `"f1"` of a small CPU batch, or `None` where the general path applies.

    Equals `_class_score(_confusion(input, target, num_classes, ignore_index), average, which)`.
    """
    counts = host_counts(input, target, num_classes, ignore_index)
    return None if counts is None else as_tensor(class_score_of(counts, average, which))


def host_balanced_accuracy(input: Any, target: Any, num_classes: int | None, ignore_index: Any) -> Tensor | None:
    """`cm_balanced_accuracy` of a small CPU batch, or `None` where the general path applies."""
    counts = host_counts(input, target, num_classes, ignore_index)
    return None if counts is None else as_tensor(balanced_accuracy_of(counts))


def host_mcc(input: Any, target: Any, num_classes: int | None, ignore_index: Any) -> Tensor | None:
    """`cm_mcc` of a small CPU batch, or `None` where the general path applies."""
    counts = host_counts(input, target, num_classes, ignore_index)
    return None if counts is None else as_tensor(mcc_of(counts))


def accuracy_of(counts: HostCounts, average: Any = None) -> float:
    """`cm_accuracy` of the counts: hits over the counted targets (`average` is taken and left, as
    by every host metric without classes to average over: the catalogue calls them all alike)."""
    return sum(counts.tp) / counts.total if counts.ok else math.nan


def class_score_of(counts: HostCounts, average: str | None, which: str) -> float | Tensor:
    """`_class_score` of the counts (`which`: `"precision"`, `"recall"` or `"f1"`)."""
    average = check_average(average)
    tp, total, ok = counts.tp, counts.total, counts.ok
    if not ok:
        return torch.full((len(tp),), math.nan, dtype=torch.float64) if average is None else math.nan
    if average == "micro":  # one label per sample: pooled precision = recall = F1 = accuracy
        return sum(tp) / total
    predicted, support = counts.predicted, counts.support
    if which == "precision":
        values = [t / p if p else 0.0 for t, p in zip(tp, predicted)]
    elif which == "recall":
        values = [t / s if s else 0.0 for t, s in zip(tp, support)]
    else:  # 2 tp / (predicted + support); a class in neither scores 0, as zero_nan makes it
        values = [2 * t / (p + s) if p + s else 0.0 for t, p, s in zip(tp, predicted, support)]
    if average is None:
        return torch.tensor(values, dtype=torch.float64)
    if average == "macro":  # over classes in the target or the predictions
        weights = [1 if p + s else 0 for p, s in zip(predicted, support)]
    else:  # weighted by support; a class with support is active
        weights = support
    return _torch_sum([v * w for v, w in zip(values, weights)], nan=True) / sum(weights)


def balanced_accuracy_of(counts: HostCounts, average: Any = None) -> float:
    """`cm_balanced_accuracy` of the counts: mean recall over the classes in the target (`average` left)."""
    tp, support, ok = counts.tp, counts.support, counts.ok
    if not ok:
        return math.nan
    recalls = [t / s if s else 0.0 for t, s in zip(tp, support)]  # absent classes weigh 0
    return _torch_sum(recalls) / sum(1 for s in support if s)


def mcc_of(counts: HostCounts, average: Any = None) -> float:
    """`cm_mcc` of the counts (`average` left).

    The covariances are formed as `cm_mcc` forms them: float64 products of the counts (exact in
    float64 below 2**53) and sums of those products. Below 2**26 counted samples every product
    and sum is an integer exact in float64, so Python's sum gives torch's value in any order;
    from there the products round, and the sums are torch's own reduction of the same values.
    Divisions are correctly rounded in Python as in torch. The square root is torch's own: its
    CPU kernel is not always correctly rounded, so Python's could differ in the last bit.
    """
    if not counts.ok:
        return math.nan
    tp, predicted, support, total = counts.tp, counts.predicted, counts.support, counts.total
    add = sum if total < _EXACT_TOTAL else _torch_sum
    t = float(total)
    cov_tp = float(sum(tp)) * t - add([float(s) * float(p) for s, p in zip(support, predicted)])
    cov_pp = t * t - add([float(p) * float(p) for p in predicted])
    cov_tt = t * t - add([float(s) * float(s) for s in support])
    denominator = torch.scalar_tensor(cov_tt * cov_pp, dtype=torch.float64).sqrt().item()
    if denominator:
        return cov_tp / denominator
    # zero_nan: 0 / 0 is 0, as in scikit-learn; a nonzero covariance over 0 stays infinite.
    return math.copysign(math.inf, cov_tp) if cov_tp else 0.0


def _counts(pred: list[int], labels: list[int], classes: int, ignore_index: int | None) -> HostCounts:
    """Per-class hits, predictions and support of the counted pairs; targets neither a class nor ignored spoil `ok`."""
    tp, predicted, support = [0] * classes, [0] * classes, [0] * classes
    invalid = 0
    for p, t in zip(pred, labels):
        if 0 <= t < classes:
            if t == ignore_index:
                continue
            support[t] += 1
            predicted[p] += 1
            if p == t:
                tp[t] += 1
        elif t != ignore_index:
            invalid += 1
    total = sum(support)
    return HostCounts(tp, predicted, support, total, total > 0 and not invalid)


def _torch_sum(values: list[float], *, nan: bool = False) -> float:
    # A sum of non-integer values must round as the general path's torch reduction does: the
    # same reduction (`nansum` or `sum`) over the same float64 values; Python's could differ.
    if not values or (not nan and len(values) <= 2):  # one rounding at most, in any order: torch's too (from +0.0)
        return sum(values, 0.0)
    # The floats handed over as a buffer of doubles: on a cold read, parsing the list in
    # `torch.tensor` cost about twice as much (12 us more of a call of about 55).
    tensor = torch.frombuffer(array("d", values), dtype=torch.float64)
    return (tensor.nansum(-1) if nan else tensor.sum(-1)).item()


def as_tensor(value: Any) -> Any:
    """A score as the functional API and a called `MetricFunc` return it: a float as a 0-d float64 tensor.

    Anything else (a tensor, or what a user's metric function returns) is returned as it is.
    """
    return torch.scalar_tensor(value, dtype=torch.float64) if type(value) is float else value
