"""Binned (histogram) AUROC and AUPRC: constant memory, with a stated error.

The exact AUROC and AUPRC need every score. These keep, per class or label, how many positive
and how many negative samples have a probability in each of `bins` equal-width bins of `[0, 1]`
(a `(columns, 2, bins)` integer tensor: row 0 negatives, row 1 positives). The counts of many
batches, or of many ranks, add up, so memory is `O(bins x columns)` whatever the number of
samples, and a distributed read is one all-reduce of the counts.

Scores are read as probabilities: logits (any score outside `[0, 1]`) go through a sigmoid, or
a softmax over classes for multiclass, as the exact rankings do
([`probabilities`][danling.metrics.preprocess.probabilities]).

Error. The binned AUROC treats two scores in one bin as a tie (half credit), and is exact for
every other positive-negative pair. So, per column with `P` positives and `N` negatives,

    |binned - exact| <= 0.5 * sum_b pos_b * neg_b / (P * N)
                     <= 0.5 * min(max_b neg_b / N, max_b pos_b / P),

half the largest share of either class in one bin: about `0.5 / bins` for scores spread evenly
(1000 bins: under 5e-4). [`binned_auroc_bound`][danling.metrics.functional.binned.binned_auroc_bound]
computes the first form from the counts; macro and weighted averages are off by at most the same
average of the column bounds. Scores piled up in one narrow range (a very confident model) put
many pairs in one bin: the bound then says so. The binned AUPRC is the average precision with
every bin as one threshold; it has no comparably simple bound (measured on 1e6 samples with
1000 bins: 2.7e-4 from the exact value for scores spread over `[0, 1]`, 2.2e-3 for confident
ones; the docs' metrics page tables more).

Examples:
    >>> import torch
    >>> counts = binned_counts(torch.tensor([0.9, 0.2, 0.7, 0.4]), torch.tensor([1, 0, 0, 1]), "binary", bins=10)
    >>> counts.shape
    torch.Size([1, 2, 10])
    >>> binned_auroc(counts), binned_auprc(counts)
    (tensor(0.7500, dtype=torch.float64), tensor(0.8333, dtype=torch.float64))
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..preprocess import probabilities
from ._common import bincount
from .multiclass import column_average, defined_columns

__all__ = ["binned_auprc", "binned_auroc", "binned_auroc_bound", "binned_counts", "binned_invalid"]


def binned_counts(
    scores: Tensor, target: Tensor, kind: str, bins: int, ignore_index: int | float | None = None
) -> Tensor:
    """Per-bin negative and positive counts of formatted scores: a `(columns, 2, bins)` int64 tensor.

    `kind` is `"binary"` (one column), `"multiclass"` (one column per class, one-vs-rest) or
    `"multilabel"` (one column per label). Only samples whose target is a label (0 or 1; a class
    for multiclass) and whose score is a number are counted: targets equal to `ignore_index` are
    left out, and so are the errors [`binned_invalid`][danling.metrics.functional.binned.binned_invalid]
    counts (pass those to `binned_auroc` / `binned_auprc`, which then give `nan`).
    """
    # No boolean indexing and no torch.bincount: both read values on the host, which would
    # stall an accelerator on every update. Samples left out go to one extra, dropped slot.
    labelled, scored = _counted(scores, target, kind)
    if kind == "multiclass":
        columns = scores.shape[-1]
        probs = probabilities(scores, softmax=True)
        positive = target.unsqueeze(-1) == torch.arange(columns, device=scores.device)
        keep = (labelled & scored).unsqueeze(-1)
    else:
        probs = probabilities(scores, softmax=False).reshape(scores.shape[0], -1)
        columns = probs.shape[-1]
        positive = target.reshape(target.shape[0], -1) == 1
        keep = labelled & scored
    # NaN scores are left out above; the cast of their bin index would be undefined.
    index = (probs.double().nan_to_num(0.0) * bins).long().clamp_(0, bins - 1)  # bin b holds [b / bins, (b + 1) / bins)
    column = torch.arange(columns, device=probs.device)
    flat = (column * 2 + positive.long()) * bins + index
    size = columns * 2 * bins
    flat = torch.where(keep, flat, size)
    counts = bincount(flat, size + 1)[:size]
    return counts.view(columns, 2, bins)


def binned_invalid(scores: Tensor, target: Tensor, kind: str, ignore_index: int | float | None = None) -> Tensor:
    """Per-column count of the samples `binned_counts` leaves out as errors: a `(columns,)` int64 tensor.

    An error is a target that is neither a label nor `ignore_index` (a label counts as a label
    whatever `ignore_index` says), or a NaN score of a labelled sample. The exact AUROC and AUPRC
    are `nan` for such data; pass these counts to `binned_auroc` / `binned_auprc` to get the same.
    A multiclass error counts in every column: one row's target or softmax touches them all.
    """
    labelled, scored = _counted(scores, target, kind)
    ignored = _equal(target if kind == "multiclass" else target.reshape(target.shape[0], -1), ignore_index) & ~labelled
    errors = (~labelled & ~ignored) | (labelled & ~scored)
    if kind == "multiclass":
        return errors.sum().expand(scores.shape[-1]).clone()
    return errors.reshape(target.shape[0], -1).sum(0)


def _counted(scores: Tensor, target: Tensor, kind: str) -> tuple[Tensor, Tensor]:
    # Which targets are labels, and which rows / entries have number scores (a multiclass row with
    # any NaN logit is NaN in every column of its softmax).
    if kind == "multiclass":
        return (target >= 0) & (target < scores.shape[-1]), ~scores.isnan().any(-1)
    labels = target.reshape(target.shape[0], -1)
    return (labels == 0) | (labels == 1), ~scores.reshape(target.shape[0], -1).isnan()


def _equal(target: Tensor, value: int | float | None) -> Tensor:
    if value is None:
        return torch.zeros_like(target, dtype=torch.bool)
    return target == value


def _poisoned(values: Tensor, invalid: Tensor | None, average: str | None) -> Tensor:
    # Columns with errors are nan, and so is any average over the columns (as for the exact values).
    if invalid is None:
        return values
    bad = invalid.to(values.device).reshape(-1) > 0
    if values.ndim == 0:
        return torch.where(bad.any(), torch.full_like(values, math.nan), values)
    return values.masked_fill(bad, math.nan)


def _pooled(counts: Tensor, average: str | None) -> Tensor:
    return counts.sum(0, keepdim=True) if average == "micro" else counts


def _columns_auroc(counts: Tensor) -> Tensor:
    negatives, positives = counts.double().unbind(1)
    # Positives in strictly higher bins, plus half of those in the same bin, for each negative.
    above = positives.flip(-1).cumsum(-1).flip(-1) - positives
    wins = (negatives * (above + 0.5 * positives)).sum(-1)
    return wins / (positives.sum(-1) * negatives.sum(-1))  # nan where a class is missing


def _columns_auprc(counts: Tensor) -> Tensor:
    negatives, positives = counts.double().unbind(1)
    true = positives.flip(-1).cumsum(-1).flip(-1)  # positives at or above each bin's threshold
    predicted = true + negatives.flip(-1).cumsum(-1).flip(-1)
    precision = torch.where(predicted > 0, true / predicted.clamp(min=1), torch.zeros_like(true))
    return (positives * precision).sum(-1) / positives.sum(-1)


def binned_auroc(counts: Tensor, average: str | None = "macro", invalid: Tensor | None = None) -> Tensor:
    """AUROC from [`binned_counts`][danling.metrics.functional.binned.binned_counts] (trapezoid over the bins).

    `average` combines the columns as the exact AUROC does (`"macro"`, `"weighted"` by
    positives, `"micro"` on the pooled counts, `None` per column); one column gives its value.
    `invalid`, per column (see [`binned_invalid`][danling.metrics.functional.binned.binned_invalid]),
    makes every column with an error `nan`, and any average over them.
    """
    return _poisoned(_binned(_columns_auroc, "auroc", counts, average), invalid, average)


def binned_auprc(counts: Tensor, average: str | None = "macro", invalid: Tensor | None = None) -> Tensor:
    """Average precision from [`binned_counts`][danling.metrics.functional.binned.binned_counts], a bin a threshold.

    `average` and `invalid` as for [`binned_auroc`][danling.metrics.functional.binned.binned_auroc].
    """
    return _poisoned(_binned(_columns_auprc, "auprc", counts, average), invalid, average)


def _binned(columns: Any, which: str, counts: Tensor, average: str | None) -> Tensor:
    values = columns(_pooled(counts, average))
    if counts.shape[0] == 1 and average != "micro":
        return values[0]
    positives, negatives = counts[:, 1].sum(-1), counts[:, 0].sum(-1)
    return column_average(values, positives, average, defined_columns(which, positives, negatives))


def binned_auroc_bound(counts: Tensor) -> Tensor:
    """Per-column bound on `|binned AUROC - exact AUROC|`: half the share of positive-negative pairs in one bin."""
    negatives, positives = counts.double().unbind(1)
    return 0.5 * (negatives * positives).sum(-1) / (positives.sum(-1) * negatives.sum(-1))
