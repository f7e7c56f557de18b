"""Binary classification metrics.

`input` holds one score per sample: probabilities, logits (any value outside `[0, 1]` makes
the whole call treat them as logits) or hard 0/1 predictions. `target` holds 0/1 labels.
Threshold-based metrics predict the positive class where the probability is above
`threshold`. Samples whose target equals `ignore_index` are left out. Results are 0-d float64
tensors; anything undefined (no samples, a single class for AUROC) is `nan`.

Examples:
    >>> import torch
    >>> input = torch.tensor([0.9, 0.2, 0.7, 0.4, 0.6])
    >>> target = torch.tensor([1, 0, 0, 1, -100])
    >>> binary_accuracy(input, target, ignore_index=-100)
    tensor(0.5000, dtype=torch.float64)
    >>> binary_auroc(input, target, ignore_index=-100)
    tensor(0.7500, dtype=torch.float64)
    >>> binary_confusion_matrix(input, target, ignore_index=-100)
    tensor([[1, 1],
            [1, 1]])
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..preprocess import positive_predictions, preprocess_binary
from . import _common, _host
from ._common import (
    Confusion,
    Curves,
    auprc_from_curves,
    auroc_from_curves,
    cm_accuracy,
    cm_balanced_accuracy,
    cm_mcc,
    confusion_from_labels,
    curves_from_scores,
    guard,
    label_masks,
)

__all__ = [
    "binary_accuracy",
    "binary_auprc",
    "binary_auroc",
    "binary_balanced_accuracy",
    "binary_confusion",
    "binary_confusion_matrix",
    "binary_curves",
    "binary_f1_score",
    "binary_mcc",
    "binary_precision",
    "binary_recall",
]


def binary_confusion(
    scores: Tensor, target: Tensor, threshold: float = 0.5, ignore_index: int | None = None
) -> Confusion:
    """2x2 confusion counts of preprocessed scores and labels (rows: target, columns: prediction)."""
    return confusion_from_labels(positive_predictions(scores, threshold).long(), target, 2, ignore_index)


def binary_curves(scores: Tensor, target: Tensor, ignore_index: int | None = None) -> Curves:
    """Threshold curves of preprocessed scores and labels (one column).

    Rankings do not change under a sigmoid, so logits are used as they are.
    """
    positive, negative, invalid = label_masks(target.unsqueeze(-1), ignore_index)
    return curves_from_scores(scores.unsqueeze(-1), positive, negative, invalid)


def accuracy_from_confusion(confusion: Confusion) -> Tensor:
    return cm_accuracy(confusion)


def balanced_accuracy_from_confusion(confusion: Confusion) -> Tensor:
    return cm_balanced_accuracy(confusion)


def mcc_from_confusion(confusion: Confusion) -> Tensor:
    return cm_mcc(confusion)


def precision_from_confusion(confusion: Confusion) -> Tensor:
    return guard(confusion.precision[1], confusion.stats.ok)


def recall_from_confusion(confusion: Confusion) -> Tensor:
    return guard(confusion.recall[1], confusion.stats.ok)


def f1_from_confusion(confusion: Confusion) -> Tensor:
    return guard(confusion.f1[1], confusion.stats.ok)


def _confusion(input: Any, target: Any, threshold: float, ignore_index: int | None) -> Confusion:
    _common.check_threshold(threshold)
    scores, target = preprocess_binary(input, target)
    return binary_confusion(scores, target, threshold, ignore_index)


def binary_accuracy(input: Any, target: Any, *, threshold: float = 0.5, ignore_index: int | None = None) -> Tensor:
    """Fraction of samples whose thresholded prediction equals the label."""
    counts = _host.host_binary_counts(input, target, threshold, ignore_index)
    if counts is not None:  # a small CPU batch, counted from Python lists
        return _host.as_tensor(_host.accuracy_of(counts))
    return accuracy_from_confusion(_confusion(input, target, threshold, ignore_index))


def binary_balanced_accuracy(
    input: Any, target: Any, *, threshold: float = 0.5, ignore_index: int | None = None
) -> Tensor:
    """Mean of the true-positive and true-negative rates (only the classes present in the target)."""
    counts = _host.host_binary_counts(input, target, threshold, ignore_index)
    if counts is not None:  # a small CPU batch, counted from Python lists
        return _host.as_tensor(_host.balanced_accuracy_of(counts))
    return balanced_accuracy_from_confusion(_confusion(input, target, threshold, ignore_index))


def binary_precision(input: Any, target: Any, *, threshold: float = 0.5, ignore_index: int | None = None) -> Tensor:
    """Share of positive predictions that are correct (0 when nothing is predicted positive)."""
    counts = _host.host_binary_counts(input, target, threshold, ignore_index)
    if counts is not None:  # a small CPU batch, counted from Python lists
        return _host.as_tensor(_host.binary_score_of(counts, "precision"))
    return precision_from_confusion(_confusion(input, target, threshold, ignore_index))


def binary_recall(input: Any, target: Any, *, threshold: float = 0.5, ignore_index: int | None = None) -> Tensor:
    """Share of positive samples predicted positive (0 when there are no positives)."""
    counts = _host.host_binary_counts(input, target, threshold, ignore_index)
    if counts is not None:  # a small CPU batch, counted from Python lists
        return _host.as_tensor(_host.binary_score_of(counts, "recall"))
    return recall_from_confusion(_confusion(input, target, threshold, ignore_index))


def binary_f1_score(input: Any, target: Any, *, threshold: float = 0.5, ignore_index: int | None = None) -> Tensor:
    """Harmonic mean of precision and recall (0 when both are 0)."""
    counts = _host.host_binary_counts(input, target, threshold, ignore_index)
    if counts is not None:  # a small CPU batch, counted from Python lists
        return _host.as_tensor(_host.binary_score_of(counts, "f1"))
    return f1_from_confusion(_confusion(input, target, threshold, ignore_index))


def binary_mcc(input: Any, target: Any, *, threshold: float = 0.5, ignore_index: int | None = None) -> Tensor:
    """Matthews correlation coefficient (0 when predictions or labels are all one class)."""
    counts = _host.host_binary_counts(input, target, threshold, ignore_index)
    if counts is not None:  # a small CPU batch, counted from Python lists
        return _host.as_tensor(_host.mcc_of(counts))
    return mcc_from_confusion(_confusion(input, target, threshold, ignore_index))


def binary_confusion_matrix(
    input: Any, target: Any, *, threshold: float = 0.5, ignore_index: int | None = None
) -> Tensor:
    """2x2 counts `[[tn, fp], [fn, tp]]` as an int64 tensor (invalid labels are not counted)."""
    return _confusion(input, target, threshold, ignore_index).matrix


def binary_auroc(input: Any, target: Any, *, ignore_index: int | None = None) -> Tensor:
    """Area under the ROC curve; ties count one half. `nan` unless both classes occur."""
    scores, target = preprocess_binary(input, target)
    return auroc_from_curves(binary_curves(scores, target, ignore_index))[0]


def binary_auprc(input: Any, target: Any, *, ignore_index: int | None = None) -> Tensor:
    """Average precision (step-wise area under the precision-recall curve). `nan` without positives."""
    scores, target = preprocess_binary(input, target)
    return auprc_from_curves(binary_curves(scores, target, ignore_index))[0]
