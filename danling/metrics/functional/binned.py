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

import torch
from torch import Tensor

from ..preprocess import probabilities
from ._common import bincount
from .multiclass import column_average, defined_columns

__all__ = ["binned_auprc", "binned_auroc", "binned_auroc_bound", "binned_counts"]


def binned_counts(
    scores: Tensor, target: Tensor, kind: str, bins: int, ignore_index: int | float | None = None
) -> Tensor:
    """Per-bin negative and positive counts of formatted scores: a `(columns, 2, bins)` int64 tensor.

    `kind` is `"binary"` (one column), `"multiclass"` (one column per class, one-vs-rest) or
    `"multilabel"` (one column per label); targets equal to `ignore_index` are left out.
    """
    # No boolean indexing and no torch.bincount: both read values on the host, which would
    # stall an accelerator on every update. Ignored entries go to one extra, dropped slot.
    if kind == "multiclass":
        columns = scores.shape[-1]
        probs = probabilities(scores, softmax=True)
        labels = target.unsqueeze(-1)
        positive = labels == torch.arange(columns, device=scores.device)
        keep = (labels != ignore_index) if ignore_index is not None else None
    else:
        probs = probabilities(scores, softmax=False).reshape(scores.shape[0], -1)
        labels = target.reshape(target.shape[0], -1)
        columns = probs.shape[-1]
        positive = labels == 1
        keep = (labels != ignore_index) if ignore_index is not None else None
    index = (probs.double() * bins).long().clamp_(0, bins - 1)  # bin b holds [b / bins, (b + 1) / bins)
    column = torch.arange(columns, device=probs.device)
    flat = (column * 2 + positive.long()) * bins + index
    size = columns * 2 * bins
    if keep is not None:
        flat = torch.where(keep, flat, size)
    counts = bincount(flat, size + 1)[:size]
    return counts.view(columns, 2, bins)


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


def binned_auroc(counts: Tensor, average: str | None = "macro") -> Tensor:
    """AUROC from [`binned_counts`][danling.metrics.functional.binned.binned_counts] (trapezoid over the bins).

    `average` combines the columns as the exact AUROC does (`"macro"`, `"weighted"` by
    positives, `"micro"` on the pooled counts, `None` per column); one column gives its value.
    """
    values = _columns_auroc(_pooled(counts, average))
    if counts.shape[0] == 1 and average != "micro":
        return values[0]
    positives, negatives = counts[:, 1].sum(-1), counts[:, 0].sum(-1)
    return column_average(values, positives, average, defined_columns("auroc", positives, negatives))


def binned_auprc(counts: Tensor, average: str | None = "macro") -> Tensor:
    """Average precision from [`binned_counts`][danling.metrics.functional.binned.binned_counts], a bin a threshold."""
    values = _columns_auprc(_pooled(counts, average))
    if counts.shape[0] == 1 and average != "micro":
        return values[0]
    positives, negatives = counts[:, 1].sum(-1), counts[:, 0].sum(-1)
    return column_average(values, positives, average, defined_columns("auprc", positives, negatives))


def binned_auroc_bound(counts: Tensor) -> Tensor:
    """Per-column bound on `|binned AUROC - exact AUROC|`: half the share of positive-negative pairs in one bin."""
    negatives, positives = counts.double().unbind(1)
    return 0.5 * (negatives * positives).sum(-1) / (positives.sum(-1) * negatives.sum(-1))
