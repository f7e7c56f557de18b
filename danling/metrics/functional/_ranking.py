"""Exact AUROC and average precision of large score columns in little memory (host tensors).

[`curves_from_scores`][danling.metrics.functional._common.curves_from_scores] sorts every column
of the whole `(N, K)` score matrix with its int64 order and keeps several `(K, N)` int64 count
tensors: about fifteen times the size of the scores at its peak, which decides whether an
evaluation set fits in memory at all. The functions here give the same integer counts, and so the
same AUROC (the same float) and the same average precision (summed in another order):

- each column's scores are copied once, in pieces of rows, into two flat arrays: the scores of
  its positives and those of its negatives (labels then need no storage: the array says it);
- both arrays are sorted in place by numpy, which needs neither an index tensor nor a buffer
  (`torch.sort` always returns an int64 order, twice the size of float32 scores);
- one binary search per positive into the sorted negatives gives everything both metrics need:
  the negatives below it and tied with it (the AUROC's pairs, integers) and those at or above
  it (the false positives at its threshold). Its true positives come from its run of ties in
  the sorted positives. The searches run in blocks of positives, so their int64 results never
  exist for a whole column.

The copies of all columns exist at once (a softmax of logits is taken row by row, for every class
together): as much memory as the scores, so with the kept scores and targets the peak stays near
2x the scores. Values are read on the host (counts, numpy views), so this path serves CPU tensors
only.

Data on another device (CUDA) takes [`tensor_ranking`][danling.metrics.functional._ranking.tensor_ranking]:
the curves' counts, one column at a time and in int32, in tensor ops on that device with no host
read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from ..preprocess import is_logit
from ._common import class_masks, label_masks, result_dtype

__all__ = ["Ranking", "column_sums", "ranking", "ranking_from_sums", "tensor_ranking"]

# Scores of a piece of rows: the unit in which scores are checked for logits, put through the
# softmax, split into positives and negatives and copied. Its temporaries are a softmax and, per
# column, two 1-byte masks and the int64 positions `np.compress` takes of the kept entries: about
# 10 bytes an entry where the masks cover every score (binary, pooled `micro`), so there a piece
# is a `PIECES`th of the data within these bounds (binary AUROC over 1e5 scores held 0.64 MiB
# above the kept data with pieces of 65,536, 1.7x the scores, where its sorted copy is 1x), and
# `ELEMENTS` elsewhere (masks of one row each: a few bytes a row, beside the scores' own copy).
MIN_ELEMENTS, ELEMENTS = 1 << 13, 1 << 16
PIECES = 16
# Positives searched at once: the block's int64 and float64 temporaries (about 60 bytes a
# positive) are what the counting adds on top of the sorted arrays. A column uses blocks of a
# 32nd of its scores within these bounds, so small columns stay small too.
MIN_BLOCK, MAX_BLOCK = 1 << 10, 1 << 14


# The data as pieces of rows, `(scores, targets)` each.
Chunks = Sequence[tuple[Tensor, Tensor]]


class Ranking(NamedTuple):
    """Per-column AUROC, average precision and counts of positives and negatives (all `(K,)`, float64 / int64)."""

    auroc: Tensor
    auprc: Tensor
    positives: Tensor
    negatives: Tensor


# Rank sums of one column: twice the AUROC's numerator in units of one positive-negative pair
# (an integer), the sum over positives of the precision at their threshold, the counts of
# positives and negatives, and whether every counted score was a number.
Sums = tuple[int, float, int, int, bool]


def column_sums(positives: np.ndarray, negatives: np.ndarray) -> Sums:
    """Rank sums of one column from the float scores of its positives and of its negatives.

    Both arrays are sorted in place (ascending; numpy orders `nan` last and compares `-0.0`
    equal to `0.0`, as the curves do).
    """
    positives.sort()
    negatives.sort()
    tps, fps = positives.size, negatives.size
    if (tps and np.isnan(positives[-1])) or (fps and np.isnan(negatives[-1])):
        return 0, 0.0, tps, fps, False
    twice_area, precision_sum = 0, 0.0
    block = min(max((tps + fps) // 128, MIN_BLOCK), MAX_BLOCK)
    run_start = 0  # where the run of ties holding the previous block's last positive starts
    for start in range(0, tps, block):
        values = positives[start : start + block]
        below = np.searchsorted(negatives, values, side="left")  # negatives scored below each positive
        if fps:
            # A negative tied with a positive counts one half: only values equal to the negative
            # at their insertion point have any, so only those need the second search.
            tied = np.flatnonzero(negatives[np.minimum(below, fps - 1)] == values)
            ties = int((np.searchsorted(negatives, values[tied], side="right") - below[tied]).sum()) if tied.size else 0
            twice_area += 2 * int(below.sum()) + ties
        # Positives at or above a value: all from the start of its run of ties in the sorted array.
        first = np.empty(values.size, dtype=bool)
        first[0] = start == 0 or positives[start - 1] != values[0]
        np.not_equal(values[1:], values[:-1], out=first[1:])
        runs = np.where(first, np.arange(start, start + values.size), 0)
        if not first[0]:
            runs[0] = run_start
        np.maximum.accumulate(runs, out=runs)
        run_start = int(runs[-1])
        true_positives = tps - runs
        # Each positive's precision at its own threshold; tied positives share it, as the curves'
        # one step per threshold weighs it by their number.
        precision_sum += float((true_positives / (true_positives + (fps - below))).sum())
    return twice_area, precision_sum, tps, fps, True


def ranking_from_sums(sums: Sequence[Sums], invalid: Tensor) -> Ranking:
    """AUROC and average precision per column from `column_sums`; `nan` where undefined.

    `invalid` counts, per column (or once for all), targets that were neither a label nor
    ignored: any of them makes the column `nan`, as it does for the curves.
    """
    auroc, auprc, positives, negatives = [], [], [], []
    for twice_area, precision_sum, tps, fps, finite in sums:
        pairs = 2 * tps * fps
        # The curves divide the same integers as float64: the same float, bit for bit.
        auroc.append(float(twice_area) / float(pairs) if finite and pairs else math.nan)
        auprc.append(precision_sum / float(tps) if finite and tps else math.nan)
        positives.append(tps)
        negatives.append(fps)
    bad = invalid.reshape(-1) != 0
    auroc_t = torch.tensor(auroc, dtype=torch.float64).masked_fill(bad, math.nan)
    auprc_t = torch.tensor(auprc, dtype=torch.float64).masked_fill(bad, math.nan)
    return Ranking(
        auroc_t, auprc_t, torch.tensor(positives, dtype=torch.long), torch.tensor(negatives, dtype=torch.long)
    )


def _ignored(labels: np.ndarray, ignore_index: int | float | None, labelled: int, axis: int | None = None) -> Any:
    """How many `labels` equal `ignore_index` (per column with `axis=0`), unless it is a label.

    A label in `[0, labelled)` is counted as a label whatever `ignore_index` says, as the curves do.
    """
    if (
        ignore_index is None
        or 0 <= ignore_index < labelled
        or ignore_index != int(ignore_index)
        or not np.iinfo(labels.dtype).min <= ignore_index <= np.iinfo(labels.dtype).max
    ):
        return 0  # a label, or a value no label of this dtype can equal
    return np.count_nonzero(labels == int(ignore_index), axis=axis)


def _piece_elements(chunks: Chunks, flat_masks: bool) -> int:
    """Scores per piece of `chunks`, whose masks cover every score if `flat_masks` (see `PIECES`)."""
    if not flat_masks:
        return ELEMENTS
    return min(max(sum(scores.numel() for scores, _ in chunks) // PIECES, MIN_ELEMENTS), ELEMENTS)


def _pieces(
    chunks: Sequence[tuple[Tensor, Tensor]], softmax: bool | None, elements: int
) -> Iterator[tuple[np.ndarray | None, np.ndarray]]:
    """The rows of the data, about `elements` scores at a time, as numpy `(scores, labels)`.

    `softmax=None` leaves the scores out (`None`): the counting pass reads only the labels.
    numpy, not torch, does the element work below: its comparisons and `compress` are several
    times faster on these 1-byte labels and boolean masks.
    """
    for scores, target in chunks:
        rows = max(1, elements // max(1, scores[:1].numel()))
        for part, labels in zip(scores.split(rows), target.split(rows)):
            if softmax is None:
                yield None, labels.numpy()
                continue
            values = part.softmax(-1) if softmax else part
            if values.dtype not in (torch.float32, torch.float64):  # formatted scores never are
                values = values.double()
            yield values.numpy(), labels.numpy()


def _masks(
    kind: str, labels: np.ndarray, column: int, micro: bool, num_columns: int, counted: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Positive and negative masks of one column of a piece (flat for the pooled `micro` column).

    `counted` marks a multiclass piece's rows whose target is a class (taken once per piece).
    """
    if kind == "binary":
        return labels == 1, labels == 0
    if kind == "multilabel":
        labels = labels.reshape(-1) if micro else labels[:, column]
        return labels == 1, labels == 0
    if micro:  # row-major, as the scores are read: every class of a row in turn
        positive = labels[:, None] == np.arange(num_columns)
        return positive.reshape(-1), (counted[:, None] & ~positive).reshape(-1)
    positive = labels == column
    return positive, counted & ~positive


def ranking(
    kind: str,
    chunks: Chunks,
    num_columns: int,
    ignore_index: int | float | None = None,
    *,
    micro: bool = False,
) -> Ranking:
    """Per-column (pooled with `micro`) AUROC and average precision of formatted data.

    `chunks` hold the data as pieces of rows: binary `(n,)` scores and labels, multiclass
    `(n, C)` scores (logits anywhere make every row a softmax, as for the curves) with `(n,)`
    class indices, multilabel `(n, L)` scores and labels. Targets may use any integer dtype.
    Host data is ranked here, with numpy; data on another device by `tensor_ranking`, whose
    results stay on that device.
    """
    if kind not in ("binary", "multiclass", "multilabel"):
        raise ValueError(f"{kind} tasks have no ranking metrics")
    chunks = [(scores.detach(), target.detach()) for scores, target in chunks]
    if any(scores.device.type != "cpu" or target.device.type != "cpu" for scores, target in chunks):
        return tensor_ranking(kind, chunks, num_columns, ignore_index, micro)
    chunks = [(scores, target) for scores, target in chunks if scores.shape[0]]
    columns = 1 if kind == "binary" or micro else num_columns
    elements = _piece_elements(chunks, kind == "binary" or micro)
    # First pass, labels only: how many positives and negatives each column has (each side's
    # array is then allocated once, at its final size: growing it would copy it) and how many
    # targets are neither a label nor ignored.
    positives = np.zeros(columns, dtype=np.int64)
    negatives = np.zeros(columns, dtype=np.int64)
    invalid = np.zeros(num_columns if kind == "multilabel" and not micro else 1, dtype=np.int64)
    for _, labels in _pieces(chunks, None, elements):
        if kind == "multiclass":
            counted = (labels >= 0) & (labels < num_columns)
            kept = int(np.count_nonzero(counted))
            per_class = np.bincount(labels[counted].astype(np.intp), minlength=num_columns)
            if micro:
                positives += kept
                negatives += kept * (num_columns - 1)
            else:
                positives += per_class
                negatives += kept - per_class
            invalid += labels.size - kept - _ignored(labels, ignore_index, num_columns)
            continue
        axis = 0 if kind == "multilabel" and not micro else None  # per label, or all pooled
        positive = np.count_nonzero(labels == 1, axis=axis)
        negative = np.count_nonzero(labels == 0, axis=axis)
        positives += positive
        negatives += negative
        rows = labels.shape[0] if axis == 0 else labels.size
        invalid += rows - positive - negative - _ignored(labels, ignore_index, 2, axis)
    # The two sides of every column, in the scores' dtype (float64 if any chunk has it).
    dtype = np.float64 if any(scores.dtype is not torch.float32 for scores, _ in chunks) else np.float32
    sides = [
        [np.empty(int(n), dtype=dtype) for n in positives.tolist()],
        [np.empty(int(n), dtype=dtype) for n in negatives.tolist()],
    ]
    filled = np.zeros((2, columns), dtype=np.int64).tolist()
    # Logits anywhere make every row a softmax, decided as the curves decide it (`is_logit`), a
    # piece at a time so that its comparison masks stay small.
    softmax = kind == "multiclass" and any(
        bool(is_logit(part)) for scores, _ in chunks for part in scores.split(max(1, elements // num_columns))
    )
    for values, labels in _pieces(chunks, softmax, elements):
        counted = (labels >= 0) & (labels < num_columns) if kind == "multiclass" else None
        for column in range(columns):
            if kind == "binary" or micro:
                scores = values.reshape(-1)
            else:
                scores = values[:, column]
            for side, mask in enumerate(_masks(kind, labels, column, micro, num_columns, counted)):
                count = int(np.count_nonzero(mask))
                offset = filled[side][column]
                np.compress(mask, scores, out=sides[side][column][offset : offset + count])
                filled[side][column] = offset + count
    sums = []
    for column in range(columns):
        sums.append(column_sums(sides[0][column], sides[1][column]))
        sides[0][column] = sides[1][column] = None  # this column's copies go before the next is read
    return ranking_from_sums(sums, torch.from_numpy(invalid))


def tensor_ranking(
    kind: str, chunks: Chunks, num_columns: int, ignore_index: int | float | None, micro: bool
) -> Ranking:
    """`ranking` with tensor ops on the data's own device (CUDA), one column at a time.

    `ranking` checks `kind` and hands data off the host here (the tests call it with host data).

    The same integer counts as the curves, so the same AUROC, and the same average precision up to
    float rounding, without reading a value on the host. The curves sort every column at once and
    keep four `(K, N)` int64 count tensors; here only one column's working set exists at a time
    (about ten times that column's float32 scores at the sort, whose buffers count on CUDA), and
    the data is not concatenated: each column is gathered from the chunks, a multiclass softmax
    recomputed a chunk at a time.
    """
    if not chunks:
        raise ValueError("tensor_ranking needs at least one chunk (it runs on the chunks' device)")
    # Targets stay as kept (often narrowed) and are widened a chunk at a time where compared: a
    # narrow dtype would wrap an `ignore_index` it cannot hold, and a widened copy of every
    # chunk's targets would take twice the scores (multilabel).
    chunks = [(scores.detach(), target.detach()) for scores, target in chunks]
    device = chunks[0][0].device
    softmax = None
    if kind == "multiclass":
        # Logits anywhere make every row a softmax, as for the curves: a 0-d device tensor, no host read.
        softmax = torch.stack([is_logit(scores) for scores, _ in chunks]).any()
    columns = 1 if kind == "binary" or micro else num_columns
    auroc, auprc, positives, negatives = [], [], [], []
    dtype = result_dtype(device)
    for column in range(columns):
        values, positive, negative = [], [], []
        invalid = torch.zeros((), dtype=torch.long, device=device)  # of this column: any makes it nan
        for scores, target in chunks:
            target = target.long()
            if kind == "multiclass":
                scores = torch.where(softmax, scores.softmax(-1), scores)
                counted, wrong = class_masks(target, num_columns, ignore_index)
                invalid += wrong
                if micro:  # row-major, as the pooled curves flatten `(N, C)`
                    hit = target.unsqueeze(-1) == torch.arange(num_columns, device=device)
                    values.append(scores.reshape(-1))
                    positive.append((hit & counted.unsqueeze(-1)).reshape(-1))
                    negative.append((~hit & counted.unsqueeze(-1)).reshape(-1))
                    continue
                values.append(scores[:, column].contiguous())  # not a view keeping the chunk's softmax
                positive.append((target == column) & counted)
                negative.append((target != column) & counted)
                continue
            if kind == "multilabel":
                scores, target = (
                    (scores.reshape(-1), target.reshape(-1)) if micro else (scores[:, column], target[:, column])
                )
            is_positive, is_negative, wrong = label_masks(target, ignore_index)
            values.append(scores)
            positive.append(is_positive)
            negative.append(is_negative)
            invalid += wrong
        area, precision_sum, tps, fps, nans = _column_counts(values, positive, negative, dtype)
        bad = nans + invalid
        auroc.append(torch.where(bad == 0, area.to(dtype) / (2 * tps * fps).to(dtype), math.nan))
        auprc.append(torch.where(bad == 0, precision_sum.to(dtype) / tps.to(dtype), math.nan))
        positives.append(tps)
        negatives.append(fps)
    return Ranking(torch.stack(auroc), torch.stack(auprc), torch.stack(positives), torch.stack(negatives))


def _column_counts(
    values: list[Tensor], positive: list[Tensor], negative: list[Tensor], dtype: torch.dtype
) -> tuple[Tensor, ...]:
    """Twice the AUROC's pair count, the summed precision of the positives, their count, the
    negatives' count and the counted `nan` scores of one column given in pieces, as 0-d tensors.

    The curves' counts for one column, narrower: sorted ascending, each run of tied scores is a
    threshold (a `nan` is a run of its own, which counts nothing unless its sample is counted, and
    then the column is `nan`). The positives and negatives of every run are added up by run
    index, and running sums give those strictly below it. A run adds `pos * (2 * neg_below + neg)`
    to the pair count (a tie counts one half) and `pos` times its precision, `tp / (tp + fp)` with
    the counts at or above its score. Run indices and counts are int32 below 2**30 elements (so a
    sum of two stays below 2**31); precisions are `dtype` (float64 where the device has it). The
    lists are emptied as their pieces are joined, so that no piece outlives its copy.
    """
    scores = torch.cat(values)
    values.clear()
    positives, negatives = torch.cat(positive), torch.cat(negative)
    positive.clear()
    negative.clear()
    nans = (scores.isnan() & (positives | negatives)).sum()
    tps, fps = positives.sum(), negatives.sum()
    n = scores.numel()
    if n == 0:
        return torch.zeros_like(tps), torch.zeros((), dtype=dtype, device=tps.device), tps, fps, nans
    counts = torch.int32 if n < 2**30 else torch.long
    ordered, order = scores.sort()
    del scores
    positives, negatives = positives[order], negatives[order]
    del order
    first = torch.ones(n, dtype=torch.bool, device=ordered.device)
    torch.ne(ordered[1:], ordered[:-1], out=first[1:])
    del ordered
    run = first.cumsum(0, dtype=counts).sub_(1)
    del first
    # Runs are numbered from 0; the slots past the last run stay zero and add nothing.
    run_pos = torch.zeros(n, dtype=counts, device=run.device).index_add_(0, run, positives.to(counts))
    del positives
    run_neg = torch.zeros(n, dtype=counts, device=run.device).index_add_(0, run, negatives.to(counts))
    del negatives, run
    pos_below = run_pos.cumsum(0, dtype=counts).sub_(run_pos)
    neg_below = run_neg.cumsum(0, dtype=counts).sub_(run_neg)
    true_positives = tps - pos_below  # at or above each run's score
    del pos_below
    # true_positives + false_positives, in place of the false positives
    denominator = (fps - neg_below).add_(true_positives)
    precision = true_positives.to(dtype).div_(denominator).mul_(run_pos)
    del true_positives, denominator
    precision_sum = precision.masked_fill_(run_pos == 0, 0.0).sum()  # runs without positives: 0 / 0
    del precision
    # int64 products: they pass 2**31
    area = run_pos.long().mul_(neg_below.mul_(2).add_(run_neg)).sum()
    return area, precision_sum, tps, fps, nans
