"""Multilabel classification metrics: every sample has `L` independent 0/1 labels.

`input` holds `(N, L)` scores (probabilities, logits or hard 0/1 predictions) and `target`
`(N, L)` labels; each entry equal to `ignore_index` is left out on its own. Predictions are
positive where the probability exceeds `threshold`.

Defaults for `average`:

- `accuracy`, `balanced_accuracy`, `mcc`: `"micro"` (all label decisions pooled);
- `precision`, `recall`, `f1_score`, `auroc`, `auprc`: `"macro"`.

`"macro"` averages over the labels for which the value is defined (precision, recall and F1:
labels that are positive in the target or the predictions), `"weighted"` weights labels by
their number of positives, `None` returns one value per label. Results are float64 tensors;
undefined results are `nan`.

Examples:
    >>> import torch
    >>> input = torch.tensor([[0.9, 0.2], [0.8, 0.6], [0.1, 0.7], [0.3, 0.4]])
    >>> target = torch.tensor([[1, 0], [0, 1], [0, 1], [1, 0]])
    >>> multilabel_accuracy(input, target)
    tensor(0.7500, dtype=torch.float64)
    >>> multilabel_f1_score(input, target, average=None)
    tensor([0.5000, 1.0000], dtype=torch.float64)
    >>> multilabel_confusion_matrix(input, target)[0]
    tensor([[1, 1],
            [1, 1]])
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..preprocess import positive_predictions, preprocess_multilabel
from ._common import (
    Confusion,
    Curves,
    check_average,
    check_threshold,
    cm_accuracy,
    cm_balanced_accuracy,
    cm_mcc,
    confusion_from_labels,
    curves_from_scores,
    guard,
    label_masks,
    reduce_average,
)
from .multiclass import auprc_from_curves, auroc_from_curves

__all__ = [
    "multilabel_accuracy",
    "multilabel_auprc",
    "multilabel_auroc",
    "multilabel_balanced_accuracy",
    "multilabel_confusion",
    "multilabel_confusion_matrix",
    "multilabel_curves",
    "multilabel_f1_score",
    "multilabel_mcc",
    "multilabel_precision",
    "multilabel_recall",
]


def multilabel_confusion(
    scores: Tensor, target: Tensor, threshold: float = 0.5, ignore_index: int | None = None
) -> Confusion:
    """`(L, 2, 2)` confusion counts (`[[tn, fp], [fn, tp]]` per label) of preprocessed tensors."""
    pred = positive_predictions(scores, threshold).long()
    confusion = confusion_from_labels(pred, target, 2, ignore_index, groups=max(scores.shape[-1], 1))
    if scores.shape[-1] == 1:  # keep the label dimension for a single label
        return Confusion(confusion.matrix.unsqueeze(0), confusion.invalid)
    return confusion


def multilabel_curves(
    scores: Tensor, target: Tensor, ignore_index: int | None = None, *, micro: bool = False
) -> Curves:
    """Threshold curves, one column per label (a single pooled column if `micro`)."""
    positive, negative, invalid = label_masks(target, ignore_index)
    if micro:
        return curves_from_scores(
            scores.reshape(-1, 1), positive.reshape(-1, 1), negative.reshape(-1, 1), invalid.sum()
        )
    return curves_from_scores(scores, positive, negative, invalid)


def _per_label_or_pooled(confusion: Confusion, average: str | None, metric) -> Tensor:
    average = check_average(average)
    if average == "micro":
        return metric(confusion.pooled)
    per_label = metric(confusion)  # nan for labels without any counted entry
    support = confusion.stats.support[:, 1]
    value = reduce_average(per_label, average, active=~per_label.isnan(), weights=support)
    return guard(value, confusion.pooled.stats.ok)


def accuracy_from_confusion(confusion: Confusion, average: str | None = "micro") -> Tensor:
    return _per_label_or_pooled(confusion, average, cm_accuracy)


def balanced_accuracy_from_confusion(confusion: Confusion, average: str | None = "micro") -> Tensor:
    return _per_label_or_pooled(confusion, average, cm_balanced_accuracy)


def mcc_from_confusion(confusion: Confusion, average: str | None = "micro") -> Tensor:
    return _per_label_or_pooled(confusion, average, cm_mcc)


def precision_from_confusion(confusion: Confusion, average: str | None = "macro") -> Tensor:
    return _class_score(confusion, average, "precision")


def recall_from_confusion(confusion: Confusion, average: str | None = "macro") -> Tensor:
    return _class_score(confusion, average, "recall")


def f1_from_confusion(confusion: Confusion, average: str | None = "macro") -> Tensor:
    return _class_score(confusion, average, "f1")


def _class_score(confusion: Confusion, average: str | None, which: str) -> Tensor:
    average = check_average(average)
    if average == "micro":
        value = confusion.pooled.class_scores(which)[1]
    else:
        # Positive-class column of every label; "active" means positive in target or prediction.
        scores, active = confusion.class_scores(which)[:, 1], confusion.active[:, 1]
        value = reduce_average(scores, average, active=active, weights=confusion.stats.support[:, 1])
    return guard(value, confusion.pooled.stats.ok)


def _confusion(input: Any, target: Any, num_labels: int | None, threshold: float, ignore_index: int | None):
    check_threshold(threshold)
    scores, target = preprocess_multilabel(input, target, num_labels)
    return multilabel_confusion(scores, target, threshold, ignore_index)


def multilabel_accuracy(
    input: Any,
    target: Any,
    num_labels: int | None = None,
    *,
    threshold: float = 0.5,
    average: str | None = "micro",
    ignore_index: int | None = None,
) -> Tensor:
    """Fraction of correct label decisions (`"micro"`), or per-label accuracy averaged."""
    return accuracy_from_confusion(_confusion(input, target, num_labels, threshold, ignore_index), average)


def multilabel_balanced_accuracy(
    input: Any,
    target: Any,
    num_labels: int | None = None,
    *,
    threshold: float = 0.5,
    average: str | None = "micro",
    ignore_index: int | None = None,
) -> Tensor:
    """Mean of true-positive and true-negative rates, over pooled decisions or per label."""
    return balanced_accuracy_from_confusion(_confusion(input, target, num_labels, threshold, ignore_index), average)


def multilabel_precision(
    input: Any,
    target: Any,
    num_labels: int | None = None,
    *,
    threshold: float = 0.5,
    average: str | None = "macro",
    ignore_index: int | None = None,
) -> Tensor:
    """Share of positive predictions that are correct, per label and averaged."""
    return precision_from_confusion(_confusion(input, target, num_labels, threshold, ignore_index), average)


def multilabel_recall(
    input: Any,
    target: Any,
    num_labels: int | None = None,
    *,
    threshold: float = 0.5,
    average: str | None = "macro",
    ignore_index: int | None = None,
) -> Tensor:
    """Share of positive labels predicted positive, per label and averaged."""
    return recall_from_confusion(_confusion(input, target, num_labels, threshold, ignore_index), average)


def multilabel_f1_score(
    input: Any,
    target: Any,
    num_labels: int | None = None,
    *,
    threshold: float = 0.5,
    average: str | None = "macro",
    ignore_index: int | None = None,
) -> Tensor:
    """Harmonic mean of precision and recall, per label and averaged."""
    return f1_from_confusion(_confusion(input, target, num_labels, threshold, ignore_index), average)


def multilabel_mcc(
    input: Any,
    target: Any,
    num_labels: int | None = None,
    *,
    threshold: float = 0.5,
    average: str | None = "micro",
    ignore_index: int | None = None,
) -> Tensor:
    """Matthews correlation coefficient of pooled decisions (`"micro"`) or per label."""
    return mcc_from_confusion(_confusion(input, target, num_labels, threshold, ignore_index), average)


def multilabel_confusion_matrix(
    input: Any, target: Any, num_labels: int | None = None, *, threshold: float = 0.5, ignore_index: int | None = None
) -> Tensor:
    """`(L, 2, 2)` int64 counts, `[[tn, fp], [fn, tp]]` per label (as scikit-learn lays them out)."""
    return _confusion(input, target, num_labels, threshold, ignore_index).matrix


def multilabel_auroc(
    input: Any,
    target: Any,
    num_labels: int | None = None,
    *,
    average: str | None = "macro",
    ignore_index: int | None = None,
) -> Tensor:
    """Area under the ROC curve per label, averaged; labels with a single class are `nan`."""
    average = check_average(average)
    scores, target = preprocess_multilabel(input, target, num_labels)
    return auroc_from_curves(multilabel_curves(scores, target, ignore_index, micro=average == "micro"), average)


def multilabel_auprc(
    input: Any,
    target: Any,
    num_labels: int | None = None,
    *,
    average: str | None = "macro",
    ignore_index: int | None = None,
) -> Tensor:
    """Average precision per label, averaged; labels without positives are `nan`."""
    average = check_average(average)
    scores, target = preprocess_multilabel(input, target, num_labels)
    return auprc_from_curves(multilabel_curves(scores, target, ignore_index, micro=average == "micro"), average)
