"""Task-independent building blocks shared by the functional metrics and the metric containers.

Everything here is synchronisation-free: counts are built with fixed-size bincounts, curves
and ranks are computed for all columns at once without boolean indexing, and undefined results
(no samples, a class without positives, ...) come out as `nan` rather than raising.
"""

from __future__ import annotations

import math
import numbers
from bisect import bisect_right
from collections.abc import Sequence
from functools import cached_property, lru_cache
from typing import Any, NamedTuple

import numpy
import torch
from torch import Tensor

__all__ = [
    "AVERAGES",
    "Confusion",
    "CountedConfusion",
    "ConfusionStats",
    "Curves",
    "LabelCounter",
    "average_ranks",
    "bincount",
    "check_average",
    "check_threshold",
    "confusion_from_labels",
    "class_masks",
    "curves_from_scores",
    "guard",
    "label_counter",
    "label_masks",
    "reduce_average",
    "result_dtype",
    "zero_nan",
]

AVERAGES = ("micro", "macro", "weighted", None)
# Devices where torch.bincount is both fast and free of synchronisation (it reads the maximum).
HOST_BINCOUNT_DEVICES = ("cpu",)
# CPU batches of this many targets or more are counted with int32 positions (see `LabelCounter.index`).
NARROW_POSITIONS = 1 << 12
# A counter whose boundaries span at most this many target values sends targets to their rows
# through a table of that span (a clamp and one gather) instead of `bucketize` (a binary search a
# target): 9 against 68-77 us for 10,000 int64 targets with `ignore_index=-100`, where a whole
# 10-class update took about 380 us.
ROW_TABLE_SPAN = 1 << 12
# Devices whose tensors live in host memory: reading a value there (`.item()`) waits for nothing,
# so a per-batch check may branch in Python instead of adding device ops.
HOST_READ_DEVICES = ("cpu",)
# `CountedConfusion.host_counts` before the host has read the counts (`None` means it cannot).
NOT_READ: Any = object()
# Largest CPU batches whose labels per-batch metrics read as Python lists: up to them one `tolist`
# per side and a loop in Python cost less than the tensor ops they replace (each a dispatch,
# slowest inside a training step, whose work has pushed their code out of the caches); above them
# Python's cost per label wins. Accuracy replaces three ops (`HOST_COUNT_SIZE`), the confusion
# metrics (precision, recall, F1, balanced accuracy, MCC) about thirty (`HOST_CONFUSION_SIZE`).
HOST_COUNT_SIZE = 64
HOST_CONFUSION_SIZE = 256
# Largest flat count tables (`LabelCounter.size`) whose accumulated counts metrics read as Python
# lists: one `tolist` and sums in Python cost less than shaping the counts and the dozen tensor
# ops per metric up to about sixty classes or three hundred labels.
HOST_TABLE_SIZE = 4096


class ConfusionStats(NamedTuple):
    """Float per-class counts of confusion counts `(..., C, C)`, and where results are defined."""

    tp: Tensor
    predicted: Tensor
    support: Tensor
    total: Tensor
    ok: Tensor  # something was counted and no invalid target was seen


class Confusion:
    """Confusion counts with rows for targets and columns for predictions.

    `matrix` is `(C, C)` (binary: `C = 2`) or `(L, 2, 2)` for multilabel tasks. `invalid`
    counts targets that were neither ignored nor a valid class; metrics computed from counts
    with `invalid > 0` are `nan`, which flags bad labels without a host synchronisation.
    Derived statistics are computed once and shared by every metric that reads them.
    """

    def __init__(self, matrix: Tensor, invalid: Tensor) -> None:
        self.matrix = matrix
        self.invalid = invalid

    def __add__(self, other: Confusion) -> Confusion:
        return Confusion(self.matrix + other.matrix, self.invalid + other.invalid)

    def __repr__(self) -> str:
        return f"Confusion(matrix={self.matrix}, invalid={self.invalid})"

    @cached_property
    def stats(self) -> ConfusionStats:
        matrix = self.matrix.to(result_dtype(self.matrix.device))
        tp = matrix.diagonal(dim1=-2, dim2=-1)
        support = matrix.sum(-1)
        total = support.sum(-1)
        ok = (total > 0) & (self.invalid == 0)
        return ConfusionStats(tp, matrix.sum(-2), support, total, ok)

    @cached_property
    def precision(self) -> Tensor:
        """Per-class precision (0 for classes never predicted)."""
        return zero_nan(self.stats.tp / self.stats.predicted)

    @cached_property
    def recall(self) -> Tensor:
        """Per-class recall (0 for classes absent from the target)."""
        return zero_nan(self.stats.tp / self.stats.support)

    @cached_property
    def f1(self) -> Tensor:
        """Per-class F1 score, `2 tp / (predicted + support)`."""
        return zero_nan(2 * self.stats.tp / (self.stats.predicted + self.stats.support))

    @cached_property
    def active(self) -> Tensor:
        """Classes that occur in the target or the predictions."""
        return (self.stats.predicted + self.stats.support) > 0

    def class_scores(self, name: str) -> Tensor:
        """Per-class `"precision"`, `"recall"` or `"f1"`."""
        return getattr(self, name)

    @cached_property
    def pooled(self) -> Confusion:
        """Counts of all groups (multilabel labels) added together."""
        return Confusion(self.matrix.sum(0), self.invalid)


class CountedConfusion(Confusion):
    """The `Confusion` of a `LabelCounter`'s flat counts, shaped into tensors on first use.

    Metrics that read the counts on the host (`danling.metrics.functional._host`) never shape
    them: the counts read as Python integers (`LabelCounter.host_table`) replace the view,
    slice and sums.
    """

    def __init__(self, counter: LabelCounter, counts: Tensor, view: Sequence[int] | None = None) -> None:
        # matrix, invalid: lazy
        self.counter = counter
        self.counts = counts
        self.view = view  # `counter.host_view(counts)`, where the owner of the counts keeps one
        # What `_host.counts_of_confusion` read from these counts (`None`: the tensor path applies),
        # kept here because every metric of a read shares this object and reads the same statistics.
        self.host_counts: Any = NOT_READ

    @cached_property
    def _shaped(self) -> Confusion:
        return self.counter.shape(self.counts)

    @property
    def matrix(self) -> Tensor:  # type: ignore[override]
        return self._shaped.matrix

    @property
    def invalid(self) -> Tensor:  # type: ignore[override]
        return self._shaped.invalid


class Curves(NamedTuple):
    """Per-threshold counts of columns of scores sorted in decreasing order.

    Each run of tied scores is one threshold ("group"). All count tensors are `(K, N)` int64
    with groups in decreasing score order along dim 1, padded with zero-count groups:
    `positives` / `negatives` count the samples of each group, `tps` / `fps` are their running
    sums. `invalid` counts targets that were neither ignored nor 0/1, per column.
    """

    positives: Tensor
    negatives: Tensor
    tps: Tensor
    fps: Tensor
    invalid: Tensor


def result_dtype(device: torch.device) -> torch.dtype:
    """Floating dtype of metric results: float64, except on MPS which lacks it."""
    return torch.float32 if device.type == "mps" else torch.float64


def check_threshold(threshold: Any, low: float = -math.inf, high: float = math.inf) -> None:
    """Refuse a `threshold` that is no number (a string, `None`, NaN) or lies outside `[low, high]`.

    The functions take any number (beyond `[0, 1]` every prediction is one class); a task
    (`MetricTask`) takes probabilities, `[0, 1]`.
    """
    if type(threshold) is float and low <= threshold <= high:  # the usual case, without the ABC check
        return
    try:
        valid = isinstance(threshold, (numbers.Real, Tensor)) and low <= threshold <= high  # NaN fails here
    except RuntimeError:  # a tensor of several values
        valid = False
    if not valid:
        bounds = "" if (low, high) == (-math.inf, math.inf) else f" in [{low:g}, {high:g}]"
        raise ValueError(f"threshold must be a number{bounds}, got {threshold!r}")


def check_average(average: str | None, allowed: tuple = AVERAGES) -> str | None:
    """Validate an `average` argument; `"none"` is accepted as an alias of `None`."""
    if average == "none":
        average = None
    if average not in allowed:
        choices = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"average must be one of {choices}, got {average!r}")
    return average


def bincount(index: Tensor, length: int) -> Tensor:
    """Count occurrences of each value of `index` (all in `[0, length)`) without a host sync."""
    index = index.reshape(-1)
    if index.device.type in HOST_BINCOUNT_DEVICES:
        return torch.bincount(index, minlength=length)
    # CUDA's bincount reads the maximum on the host; a scatter into a fixed-size buffer does not.
    index = index.long()  # scatter_add_ takes int64 positions only (CPU ones may be int32)
    return torch.zeros(length, dtype=torch.long, device=index.device).scatter_add_(0, index, torch.ones_like(index))


class LabelCounter:
    """Confusion counts of integer labels from one row lookup and one count per batch.

    A sorted table of boundaries sends each target to a row: one row per class, one for
    `ignore_index` and catch-all rows for everything else (invalid targets). The rows of every
    value between the boundaries' ends are tabulated (`row_table`), so a batch is sent by a clamp
    and one gather; counters spanning more than `ROW_TABLE_SPAN` values `bucketize`. Counting
    `row * num_classes + pred` then fills every row at once, so the hot path needs no masks,
    comparisons or `where`. `count` returns the raw flat counts of one batch, `accumulate`
    adds a batch to a running table in place, and `confusion` turns counts into a
    `Confusion`.
    An `ignore_index` that is itself a class cannot share the classes' boundaries; such counters
    send it to an extra last row (its entry of the table, or a masked fill after `bucketize`).

    Args:
        num_classes: Classes of the labels (`C`).
        ignore_index: Target value to skip, or `None`.
        groups: `None` for `(N,)` labels; otherwise labels are `(N, groups)` and one `(C, C)`
            matrix is kept per column (`groups=1` keeps the leading group dimension).
    """

    def __init__(self, num_classes: int, ignore_index: int | float | None, groups: int | None = None) -> None:
        self.num_classes = num_classes
        self.groups = groups
        if isinstance(ignore_index, float):  # a fractional value never equals an integer target
            ignore_index = int(ignore_index) if ignore_index.is_integer() else None
        self.mask_ignored = ignore_index is not None and 0 <= ignore_index < num_classes
        self.ignore_index = ignore_index
        extra = () if ignore_index is None or self.mask_ignored else (ignore_index, ignore_index + 1)
        # bucketize(right=True) sends v to bucket i when points[i - 1] <= v < points[i].
        self.points = tuple(sorted({*range(num_classes + 1), *extra}))
        self.first = self.points.index(0) + 1
        self.ignored_row = self.points.index(ignore_index) + 1 if extra else None
        self.rows = len(self.points) + 1 + (1 if self.mask_ignored else 0)
        # Row of every target value from one below the first boundary to the last: what
        # bucketize(right=True) gives, that is the number of boundaries at or below the value.
        # Values outside clamp to the ends, whose rows are those of everything beyond them. An
        # ignored class goes straight to its last row here (bucketize needs a masked fill after).
        self.low, self.high = self.points[0] - 1, self.points[-1]
        self.row_table: tuple[int, ...] | None = None
        if self.high - self.low + 1 <= ROW_TABLE_SPAN:
            table = [bisect_right(self.points, v) for v in range(self.low, self.high + 1)]
            if self.mask_ignored:
                table[ignore_index - self.low] = self.rows - 1
            self.row_table = tuple(table)
        self.size = (groups or 1) * self.rows * num_classes
        # Rows of targets that are neither a class nor ignored: their total is the invalid count.
        skipped = {self.ignored_row, self.rows - 1 if self.mask_ignored else None}
        valid = range(self.first, self.first + num_classes)
        self.invalid_rows = tuple(r for r in range(self.rows) if r not in valid and r not in skipped)
        self._invalid_rows: dict[torch.device, Tensor] = {}
        self._invalid_slices: list[slice] | None = None  # where `invalid_rows` lie in the flat table, for `host_table`
        self._boundaries: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        self._row_tables: dict[tuple[torch.device, torch.dtype, bool], Tensor | None] = {}
        self._offsets: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        self._ones: dict[tuple[torch.device, int, torch.dtype], Tensor] = {}

    def index(self, pred: Tensor, target: Tensor) -> Tensor:
        """Flat position in the count table of every `(pred, target)` pair (1-D).

        CPU batches of `NARROW_POSITIONS` targets or more get int32 positions, written over the
        int32 rows: the count's temporaries are then the rows alone, at half of int64's bytes (at
        evaluation-set batch sizes they were the largest allocations of a confusion-only update).
        Smaller batches, and other devices (`scatter_add_` takes int64 only), get int64 positions:
        mixing int64 predictions with int32 rows costs about a microsecond more per call.
        """
        narrow = target.is_cpu and target.numel() >= NARROW_POSITIONS
        table = self._row_table(target, narrow)
        if table is not None:
            # The clamp is this call's own tensor: shifted in place to the table's positions.
            positions = target.clamp(self.low, self.high).sub_(self.low)
            rows = table.index_select(0, positions.reshape(-1)).view(positions.shape)
            del positions
        else:
            if not target.is_floating_point() and target.dtype is not torch.int64:
                # Boundaries in a narrower or unsigned dtype would overflow or wrap (-100 as
                # uint8 is 156): int64 holds every boundary and every integer target.
                target = target.long()
            key = (target.device, target.dtype)
            boundaries = self._boundaries.get(key)
            if boundaries is None:
                boundaries = self._boundaries[key] = torch.tensor(self.points, dtype=target.dtype, device=target.device)
            rows = torch.bucketize(target, boundaries, right=True, out_int32=narrow)
            if self.mask_ignored:  # the ignored value is a class: send it to the last row
                rows.masked_fill_(target == self.ignore_index, self.rows - 1)
        # `rows` is this call's own tensor: narrow positions are written over it, not into a new
        # one (int64 predictions cast to int32: positions stay far below 2**31).
        out = rows if narrow and pred.shape == rows.shape else None
        index = torch.add(pred, rows, alpha=self.num_classes, out=out)
        if self.groups is not None and self.groups > 1:
            key = (index.device, index.dtype)  # int64 offsets would widen int32 positions
            offsets = self._offsets.get(key)
            if offsets is None:
                step = self.rows * self.num_classes
                offsets = self._offsets[key] = torch.arange(self.groups, dtype=index.dtype, device=index.device) * step
            index = index.add_(offsets)
        return index.reshape(-1) if index.ndim != 1 else index

    def _row_table(self, target: Tensor, narrow: bool) -> Tensor | None:
        """The rows of `row_table` on `target`'s device (int32 if `narrow`), or `None`: bucketize.

        Only int32 and int64 targets (what `format` gives) whose dtype holds both ends of the
        table take it: a clamp of an unsigned or narrower target to a negative end would wrap.
        """
        key = (target.device, target.dtype, narrow)
        if key in self._row_tables:
            return self._row_tables[key]
        table = None
        if self.row_table is not None and target.dtype in (torch.int32, torch.int64):
            bounds = torch.iinfo(target.dtype)
            if bounds.min <= self.low and self.high <= bounds.max:
                dtype = torch.int32 if narrow else torch.int64
                table = torch.tensor(self.row_table, dtype=dtype, device=target.device)
        self._row_tables[key] = table
        return table

    def count(self, pred: Tensor, target: Tensor) -> Tensor:
        """Flat int64 counts of one batch; add the counts of several batches before `confusion`."""
        return bincount(self.index(pred, target), self.size)

    def accumulate(self, counts: Tensor, pred: Tensor, target: Tensor) -> Tensor:
        """Add the counts of one batch to `counts` in place (one scatter, no host sync); returns `counts`."""
        index = self.index(pred, target)
        key = (index.device, index.shape[0], counts.dtype)
        ones = self._ones.get(key)
        if ones is None:
            if len(self._ones) > 16:  # a few batch sizes are typical; do not grow without bound
                self._ones.clear()
            if index.is_cpu:  # one element seen N times: a cached batch size holds no memory
                ones = torch.ones(1, dtype=counts.dtype).expand(index.shape[0])
            else:
                ones = torch.ones_like(index)
            self._ones[key] = ones
        if counts.is_cpu:  # same sums, less per-call overhead than scatter_add_ on CPU
            return counts.index_add_(0, index, ones)
        return counts.scatter_add_(0, index, ones)

    def host_table(self, counts: Tensor, view: Sequence[int] | None = None) -> tuple[Sequence[int], range, int] | None:
        """The counts as Python integers, where each group's `(C, C)` matrix starts, the invalid count.

        The integers are `view` (a `host_view` of `counts`) where given, else one `tolist`. A view
        reads the live table: what is read from it belongs to one read, with no update between.

        For CPU count tables of at most `HOST_TABLE_SIZE` entries (`None` otherwise): on the
        host, reading a few hundred counts costs less than the tensor ops that shape them. Each
        matrix is row-major (a row per target class) from its start.
        """
        # Counts of this counter hold `size` entries: the size is checked without asking the tensor.
        if self.size > HOST_TABLE_SIZE or "cpu" not in HOST_READ_DEVICES:
            return None
        if view is not None:  # a view is made only for a CPU table (`host_view`)
            table = view
        elif counts.is_cpu:
            table = counts.tolist()
        else:
            return None
        c, width = self.num_classes, self.rows * self.num_classes
        parts = self._invalid_slices
        if parts is None:
            parts = self._invalid_slices = _invalid_slices(self.invalid_rows, c, width, self.groups or 1)
        invalid = 0
        for part in parts:  # a loop, not a generator: resuming one per slice cost more than the sums
            invalid += sum(table[part])
        return table, range(self.first * c, (self.groups or 1) * width, width), invalid

    def empty(self, device: torch.device | str | None = None) -> Tensor:
        """Zero counts to `accumulate` into."""
        return torch.zeros(self.size, dtype=torch.long, device=device)

    def host_view(self, counts: Tensor) -> Sequence[int] | None:
        """What `host_table` can read `counts` through instead of `tolist`, for a table kept across reads.

        A `memoryview` of the table's memory (int64 items): it follows in-place adds, and its
        slices and sums make one Python integer at a time, each freed before the next is made.
        A copy into a tuple of integers (`tolist`, or a struct unpacking) allocates one object per
        count, and on a cold read (one an epoch, after the updates pushed this code and its data
        out of the caches) copying and summing a 10-class table took a third of an accuracy-only
        read; the view's sums take about a third of that. Made once, where the table is made,
        since making it costs more than one `tolist`. `None` for tables `host_table` does not
        read (not small, not contiguous int64 on CPU).
        """
        small = counts.is_cpu and counts.numel() <= HOST_TABLE_SIZE
        if not small or counts.dtype != torch.long or not counts.is_contiguous():
            return None
        # DLPack gives NumPy a view that keeps the table's storage alive; nothing is read here,
        # so an update that makes the table stays free of host reads. The casts give the items
        # the format `q` (int64) whatever name the platform's NumPy exports them under.
        return memoryview(numpy.from_dlpack(counts)).cast("B").cast("q")

    def confusion(self, counts: Tensor, *, copy: bool = False, view: Sequence[int] | None = None) -> Confusion:
        """The `Confusion` of flat counts from `count` (or a sum of them).

        The matrix is a view of `counts` unless `copy=True` (for counts that keep being updated).
        `view` is a `host_view` of `counts`, for a host read of the counts.
        """
        if not copy:
            return CountedConfusion(self, counts, view)
        return self.shape(counts, copy=True)

    def shape(self, counts: Tensor, *, copy: bool = False) -> Confusion:
        """`confusion`, shaped now: the matrix and invalid count as tensors."""
        c = self.num_classes
        table = counts.view(self.groups or 1, self.rows, c)
        matrix = table[:, self.first : self.first + c]
        if copy:
            matrix = matrix.clone()
        rows = self._invalid_rows.get(counts.device)
        if rows is None:
            rows = self._invalid_rows[counts.device] = torch.tensor(
                self.invalid_rows, dtype=torch.long, device=counts.device
            )
        invalid = table.index_select(1, rows).sum()
        return Confusion(matrix[0] if self.groups is None else matrix.contiguous(), invalid)


def _invalid_slices(rows: tuple[int, ...], columns: int, width: int, groups: int) -> list[slice]:
    """Slices of the flat table that together cover `rows` of every group's table once.

    Adjacent rows of a group make one contiguous slice; with several groups, each cell of those
    rows across every group is one strided slice instead, where that takes fewer slices (a
    multilabel table of ten labels: six slices, not thirty).
    """
    spans: list[tuple[int, int]] = []
    for row in rows:
        begin = row * columns
        if spans and spans[-1][1] == begin:
            spans[-1] = (spans[-1][0], begin + columns)
        else:
            spans.append((begin, begin + columns))
    contiguous = [slice(base + begin, base + end) for base in range(0, groups * width, width) for begin, end in spans]
    strided = [slice(cell, groups * width, width) for begin, end in spans for cell in range(begin, end)]
    return strided if len(strided) < len(contiguous) else contiguous


@lru_cache(maxsize=256)
def label_counter(num_classes: int, ignore_index: int | float | None, groups: int | None = None) -> LabelCounter:
    """A shared `LabelCounter` for these arguments (built once per argument tuple)."""
    return LabelCounter(num_classes, ignore_index, groups)


def confusion_from_labels(
    pred: Tensor, target: Tensor, num_classes: int, ignore_index: int | None, groups: int = 1
) -> Confusion:
    """Confusion counts of predicted and target labels in `[0, num_classes)`.

    With `groups > 1`, `pred` and `target` are `(N, groups)` and one `(C, C)` matrix is built
    per column (multilabel: `C = 2`). Targets equal to `ignore_index` are skipped; other
    out-of-range targets are counted in `invalid`.
    """
    counter = label_counter(num_classes, ignore_index, groups if groups > 1 else None)
    return counter.confusion(counter.count(pred, target))


def zero_nan(value: Tensor) -> Tensor:
    """Replace the `nan` of `0 / 0` by 0 (scikit-learn's zero_division=0), keeping infinities."""
    return torch.nan_to_num(value, nan=0.0, posinf=math.inf, neginf=-math.inf)


def guard(value: Tensor, ok: Tensor) -> Tensor:
    """`value` where `ok`, `nan` elsewhere (nothing counted, or invalid targets seen)."""
    return torch.where(ok, value, math.nan)


def reduce_average(values: Tensor, average: str | None, *, active: Tensor, weights: Tensor) -> Tensor:
    """Average per-class values: `macro` over `active` classes, `weighted` by `weights`, `None` keeps all."""
    if average is None:
        return values
    if average == "macro":
        active = active.to(values.dtype)
        return (values * active).nansum(-1) / active.sum(-1)
    if average == "weighted":  # classes whose value is undefined carry no weight
        weights = weights.to(values.dtype) * active.to(values.dtype)
        return (values * weights).nansum(-1) / weights.sum(-1)
    raise ValueError(f"reduce_average handles 'macro', 'weighted' and None, got {average!r}")


def cm_accuracy(confusion: Confusion) -> Tensor:
    """Fraction of correct predictions."""
    tp, _, _, total, ok = confusion.stats
    return guard(tp.sum(-1) / total, ok)


def cm_balanced_accuracy(confusion: Confusion) -> Tensor:
    """Mean recall over the classes that occur in the target."""
    recall, support = confusion.recall, confusion.stats.support
    present = (support > 0).to(recall.dtype)
    return guard((recall * present).sum(-1) / present.sum(-1), confusion.stats.ok)


def cm_mcc(confusion: Confusion) -> Tensor:
    """Matthews correlation coefficient (0 when all targets or all predictions are one class)."""
    tp, predicted, support, total, ok = confusion.stats
    cov_tp = tp.sum(-1) * total - (support * predicted).sum(-1)
    cov_pp = total * total - (predicted * predicted).sum(-1)
    cov_tt = total * total - (support * support).sum(-1)
    # A zero denominator comes with a zero covariance: 0 / 0 becomes 0, as in scikit-learn.
    return guard(zero_nan(cov_tp / (cov_tt * cov_pp).sqrt()), ok)


def class_masks(target: Tensor, num_classes: int, ignore_index: int | None) -> tuple[Tensor, Tensor]:
    """Which class targets are counted (a class in `[0, num_classes)`), and how many are invalid
    (neither a class nor ignored; any makes one-vs-rest curve metrics `nan`)."""
    counted = (target >= 0) & (target < num_classes)
    invalid = ~counted
    if ignore_index is not None:
        invalid &= target != ignore_index
    return counted, invalid.sum()


def label_masks(target: Tensor, ignore_index: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """Positive and negative masks of 0/1 targets, and the count of invalid targets per column."""
    positive, negative = target == 1, target == 0
    invalid = ~(positive | negative)
    if ignore_index is not None:
        invalid = invalid & (target != ignore_index)
    return positive, negative, invalid.sum(0)


def curves_from_scores(scores: Tensor, positive: Tensor, negative: Tensor, invalid: Tensor) -> Curves:
    """Build `Curves` for `(N, K)` scores.

    `positive` / `negative` mark the samples counted as each class per column; samples in
    neither (ignored ones) still take part in the sort but move no count, which equals dropping
    them without a data-dependent shape.
    """
    if scores.is_floating_point():
        # A nan score of a counted sample has no rank: the column is `nan`, as on the host path for
        # large data (`_ranking`); sorting it to one end gave a number that depended on where nan sorts.
        invalid = invalid + (scores.isnan() & (positive | negative)).sum(0)
    sorted_scores, order = scores.T.sort(dim=1, descending=True)
    k, n = sorted_scores.shape
    starts = torch.ones((k, n), dtype=torch.bool, device=scores.device)
    starts[:, 1:] = sorted_scores[:, 1:] != sorted_scores[:, :-1]
    group = starts.cumsum(1) - 1
    del sorted_scores, starts
    counts = []
    for mask in (positive, negative):
        per_group = torch.zeros((k, n), dtype=torch.long, device=scores.device)
        counts.append(per_group.scatter_add_(1, group, mask.T.gather(1, order).long()))
    positives, negatives = counts
    return Curves(positives, negatives, positives.cumsum(1), negatives.cumsum(1), invalid.expand(k))


def auroc_from_curves(curves: Curves) -> Tensor:
    """Area under the ROC curve per column (`nan` without both classes or with invalid targets).

    Each negative scores one for every positive ranked above it and one half for every tied
    positive; the sum is exact in integers.
    """
    positives, negatives, tps, fps, invalid = curves
    dtype = result_dtype(tps.device)
    if tps.shape[1] == 0:
        return torch.full((tps.shape[0],), math.nan, dtype=dtype, device=tps.device)
    twice_area = (negatives * (2 * tps - positives)).sum(1)
    value = twice_area.to(dtype) / (2 * tps[:, -1] * fps[:, -1]).to(dtype)
    return torch.where(invalid == 0, value, math.nan)


def auprc_from_curves(curves: Curves) -> Tensor:
    """Average precision per column (`nan` without positives or with invalid targets)."""
    positives, _, tps, fps, invalid = curves
    dtype = result_dtype(tps.device)
    if tps.shape[1] == 0:
        return torch.full((tps.shape[0],), math.nan, dtype=dtype, device=tps.device)
    precision = zero_nan(tps.to(dtype) / (tps + fps).to(dtype))
    value = (positives * precision).sum(1) / tps[:, -1].to(dtype)
    return torch.where(invalid == 0, value, math.nan)


def average_ranks(values: Tensor) -> Tensor:
    """Ranks (1-based, ties share their mean rank) of each column of `(N, D)` values."""
    n, d = values.shape
    columns = values.T
    sorted_values, order = columns.sort(dim=1)
    position = torch.arange(n, device=values.device).expand(d, n)
    starts = torch.ones_like(sorted_values, dtype=torch.bool)
    starts[:, 1:] = sorted_values[:, 1:] != sorted_values[:, :-1]
    ends = torch.ones_like(starts)
    ends[:, :-1] = starts[:, 1:]
    first = torch.where(starts, position, 0).cummax(dim=1).values
    last = torch.where(ends, position, n).flip(1).cummin(dim=1).values.flip(1)
    dtype = result_dtype(values.device)
    ranks = torch.empty((d, n), dtype=dtype, device=values.device)
    ranks.scatter_(1, order, (first + last).to(dtype) / 2 + 1)
    return ranks.T


def pearson_columns(x: Tensor, y: Tensor) -> Tensor:
    """Pearson correlation of matching columns of `(N, D)` tensors (`nan` for constant columns)."""
    dtype = result_dtype(x.device)
    x, y = x.to(dtype), y.to(dtype)
    dx, dy = x - x.mean(0), y - y.mean(0)
    value = (dx * dy).sum(0) / ((dx * dx).sum(0) * (dy * dy).sum(0)).sqrt()
    if x.shape[0] == 0:
        return value
    constant = (x.amax(0) == x.amin(0)) | (y.amax(0) == y.amin(0))
    return torch.where(constant, math.nan, value)
