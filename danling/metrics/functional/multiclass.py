"""Multiclass (single-label) classification metrics.

`input` holds class scores `(N, C)`: probabilities or logits (values outside `[0, 1]` trigger a
softmax), or predicted labels of the target's shape when `num_classes` is given. `target`
holds class indices `(N,)`. See
[`preprocess_multiclass`][danling.metrics.preprocess.preprocess_multiclass] for the other
accepted layouts. `num_classes` defaults to the size of the class dimension.

Defaults for `average`:

- `accuracy`: `"micro"` (the plain fraction of correct predictions);
- `precision`, `recall`, `f1_score`, `auroc`, `auprc`: `"macro"`.

`"macro"` averages over the classes that occur in the target or the predictions (for
`auroc`/`auprc`: the classes for which the value is defined), `"weighted"` weights classes by
their support, `"micro"` pools all decisions, `None` returns one value per class. Results are
float64 tensors; undefined results are `nan`.

Examples:
    >>> import torch
    >>> input = torch.tensor([[2.0, 0.1, 0.3], [0.1, 1.5, 0.2], [1.2, 0.2, 0.1], [0.1, 0.2, 3.0], [0.2, 1.0, 0.9]])
    >>> target = torch.tensor([0, 1, 2, 2, 1])
    >>> multiclass_accuracy(input, target)
    tensor(0.8000, dtype=torch.float64)
    >>> multiclass_recall(input, target, average=None)
    tensor([1.0000, 1.0000, 0.5000], dtype=torch.float64)
    >>> multiclass_auroc(input, target)
    tensor(0.9444, dtype=torch.float64)
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..preprocess import preprocess_multiclass, probabilities
from . import _common
from ._common import (
    Confusion,
    Curves,
    check_average,
    class_masks,
    cm_accuracy,
    cm_balanced_accuracy,
    cm_mcc,
    confusion_from_labels,
    curves_from_scores,
    guard,
    reduce_average,
    result_dtype,
)
from ._common import auprc_from_curves as columns_auprc
from ._common import auroc_from_curves as columns_auroc
from ._host import host_balanced_accuracy, host_class_score, host_mcc

__all__ = [
    "multiclass_accuracy",
    "multiclass_auprc",
    "multiclass_auroc",
    "multiclass_balanced_accuracy",
    "multiclass_confusion",
    "multiclass_confusion_matrix",
    "multiclass_curves",
    "multiclass_f1_score",
    "multiclass_mcc",
    "multiclass_precision",
    "multiclass_recall",
]


def multiclass_confusion(scores: Tensor, target: Tensor, ignore_index: int | None = None) -> Confusion:
    """`(C, C)` confusion counts of preprocessed `(N, C)` scores and `(N,)` targets."""
    return confusion_from_labels(scores.argmax(-1), target, scores.shape[-1], ignore_index)


def multiclass_curves(
    scores: Tensor, target: Tensor, ignore_index: int | None = None, *, micro: bool = False
) -> Curves:
    """One-vs-rest threshold curves, one column per class (a single pooled column if `micro`).

    Logits are turned into softmax probabilities first: one-vs-rest rankings depend on it.
    """
    num_classes = scores.shape[-1]
    scores = probabilities(scores, softmax=True)
    counted, invalid = class_masks(target, num_classes, ignore_index)
    one_hot = target.unsqueeze(-1) == torch.arange(num_classes, device=target.device)
    positive = one_hot & counted.unsqueeze(-1)
    negative = ~one_hot & counted.unsqueeze(-1)
    if micro:
        scores, positive, negative = scores.reshape(-1, 1), positive.reshape(-1, 1), negative.reshape(-1, 1)
    return curves_from_scores(scores, positive, negative, invalid)


def accuracy_from_confusion(confusion: Confusion, average: str | None = "micro") -> Tensor:
    average = check_average(average)
    if average in ("micro", "weighted"):  # support-weighted recall is the plain accuracy
        return cm_accuracy(confusion)
    return recall_from_confusion(confusion, average)


def balanced_accuracy_from_confusion(confusion: Confusion) -> Tensor:
    return cm_balanced_accuracy(confusion)


def mcc_from_confusion(confusion: Confusion) -> Tensor:
    return cm_mcc(confusion)


def precision_from_confusion(confusion: Confusion, average: str | None = "macro") -> Tensor:
    return _class_score(confusion, average, "precision")


def recall_from_confusion(confusion: Confusion, average: str | None = "macro") -> Tensor:
    return _class_score(confusion, average, "recall")


def f1_from_confusion(confusion: Confusion, average: str | None = "macro") -> Tensor:
    return _class_score(confusion, average, "f1")


def _class_score(confusion: Confusion, average: str | None, which: str) -> Tensor:
    average = check_average(average)
    if average == "micro":  # one label per sample: pooled precision = recall = F1 = accuracy
        return cm_accuracy(confusion)
    scores = confusion.class_scores(which)
    value = reduce_average(scores, average, active=confusion.active, weights=confusion.stats.support)
    return guard(value, confusion.stats.ok)


def auroc_from_curves(curves: Curves, average: str | None = "macro") -> Tensor:
    """Average the per-column AUROC of one-vs-rest curves (pooled curves for `"micro"`)."""
    return curve_average(curves, average, columns_auroc)


def auprc_from_curves(curves: Curves, average: str | None = "macro") -> Tensor:
    """Average the per-column average precision of one-vs-rest curves (pooled for `"micro"`)."""
    return curve_average(curves, average, columns_auprc)


def curve_average(curves: Curves, average: str | None, per_column: Callable[[Curves], Tensor]) -> Tensor:
    """Reduce per-column curve metrics; `curves` must be the pooled ones when `average == "micro"`."""
    values = per_column(curves)
    counted = curves.tps.shape[1]
    support = curves.tps[:, -1] if counted else torch.zeros(values.shape, dtype=torch.long, device=values.device)
    negatives = curves.fps[:, -1] if counted else support
    which = "auroc" if per_column is columns_auroc else "auprc"
    return column_average(values, support, average, defined=defined_columns(which, support, negatives))


def defined_columns(which: str, positives: Tensor, negatives: Tensor) -> Tensor:
    """Columns whose `which` (`"auroc"` or `"auprc"`) their classes define: positives, and for AUROC negatives too."""
    return (positives > 0) & (negatives > 0) if which == "auroc" else positives > 0


def column_average(values: Tensor, support: Tensor, average: str | None, defined: Tensor | None = None) -> Tensor:
    """Reduce per-column AUROC or average precision; `values` must be the pooled one for `"micro"`.

    `"macro"` averages the columns where the value is defined, `"weighted"` weights them by
    `support` (their positives). With `defined` (see `defined_columns`), a column whose classes
    define it but whose value is `nan` (a NaN score or a target that is no label among its counted
    samples) makes the average `nan`, as it makes a single column's value; without it, every
    `nan` column is left out.
    """
    average = check_average(average)
    if average == "micro":
        return values[0]
    if average is None:
        return values
    missing = values.isnan()
    value = reduce_average(values, average, active=~missing, weights=support)
    if defined is None:
        return value
    return torch.where((missing & defined).any(-1), math.nan, value)


def _confusion(input: Any, target: Any, num_classes: int | None, ignore_index: int | None) -> Confusion:
    scores, target = preprocess_multiclass(input, target, num_classes)
    return multiclass_confusion(scores, target, ignore_index)


def multiclass_accuracy(
    input: Any,
    target: Any,
    num_classes: int | None = None,
    *,
    average: str | None = "micro",
    ignore_index: int | None = None,
) -> Tensor:
    """Fraction of correct top-1 predictions; `"macro"` gives the mean per-class recall."""
    average = check_average(average)
    if average in ("micro", "weighted"):  # one comparison per sample: no confusion matrix needed
        scores, target = preprocess_multiclass(input, target, num_classes)
        return _top1_accuracy(scores.argmax(-1), target, scores.shape[-1], ignore_index)
    return accuracy_from_confusion(_confusion(input, target, num_classes, ignore_index), average)


def _top1_accuracy(pred: Tensor, target: Tensor, num_classes: int, ignore_index: int | float | None) -> Tensor:
    """The value `accuracy_from_confusion` gives for micro averaging, without building the matrix.

    Targets outside `[0, num_classes)` that are not `ignore_index` make the result `nan`, as do
    batches where nothing is counted; the dtype is that of every metric result. A prediction
    always is a class, so it can only equal a valid target: hits need no validity mask.
    """
    if ignore_index is None and target.dtype is torch.long and target.numel():
        return _top1_accuracy_all_counted(pred, target, num_classes)
    valid = (target >= 0) & (target < num_classes)
    hits = pred == target
    if ignore_index is None:
        total, expected = valid.sum(), target.numel()  # every target must be a class
    elif 0 <= ignore_index < num_classes:  # the ignored value is a class: mask it out
        kept = target != ignore_index
        hits = hits & kept
        total, expected = (valid & kept).sum(), target.numel() - (~kept).sum()
    else:  # the ignored value is never a class: every kept target must be one
        total, expected = valid.sum(), (target != ignore_index).sum()
    value = hits.sum(dtype=result_dtype(target.device)) / total
    return torch.where(total == expected, value, math.nan)


def _top1_accuracy_all_counted(pred: Tensor, target: Tensor, num_classes: int) -> Tensor:
    """`_top1_accuracy` of a non-empty int64 target with nothing ignored, in the fewest ops.

    Every target counts, so the value is hits over the batch size (the same float as hits over
    the count of valid targets, which must equal it), or `nan` if some target is not a class.
    """
    if target.is_cpu and "cpu" in _common.HOST_READ_DEVICES:  # reading numbers on the host costs nothing here
        return torch.scalar_tensor(_top1_value_on_host(pred, target, num_classes), dtype=torch.float64)
    # On an accelerator the check stays on the device: the clamp moves exactly the invalid targets.
    value = (pred == target).sum(dtype=result_dtype(target.device)).div_(target.numel())
    return torch.where((target.clamp(0, num_classes - 1) == target).all(), value, math.nan)


def _top1_value_on_host(pred: Tensor, target: Tensor, num_classes: int) -> float:
    """`_top1_accuracy_all_counted` of a CPU target as the Python float its result holds.

    An exact integer count divided on the host: the correctly rounded float64 quotient that
    `mean(dtype=torch.float64)` gives, without a cast or a division on the device.
    """
    size = target.shape[0]
    if size <= _common.HOST_COUNT_SIZE:  # a few labels: compare them in Python rather than in three tensor ops
        return _listed_accuracy(pred.tolist(), target.tolist(), num_classes)
    low, high = torch.aminmax(target)
    if low.item() < 0 or high.item() >= num_classes:
        return math.nan
    return torch.eq(pred, target).count_nonzero().item() / size


def _listed_accuracy(pred: list[int], labels: list[int], num_classes: int) -> float:
    """Hits over the number of labels of one batch given as lists, or `nan` if a label is not a class."""
    if min(labels) < 0 or max(labels) >= num_classes:
        return math.nan
    return sum(map(operator.eq, pred, labels)) / len(labels)


def _top1_values_on_host(inputs: list[Tensor], targets: list[Tensor], num_classes: int) -> list[float]:
    """`_top1_value_on_host` of each of several small CPU batches of `num_classes` scores, with one
    `argmax` and one read per side for all of them (row-wise, so each batch's predictions are its own)."""
    scores = inputs[0] if len(inputs) == 1 else torch.cat(inputs)
    pred = scores.argmax(-1).tolist()
    labels = (targets[0] if len(targets) == 1 else torch.cat(targets)).tolist()
    values, start = [], 0
    for target in targets:
        stop = start + target.shape[0]
        values.append(_listed_accuracy(pred[start:stop], labels[start:stop], num_classes))
        start = stop
    return values


def multiclass_balanced_accuracy(
    input: Any, target: Any, num_classes: int | None = None, *, ignore_index: int | None = None
) -> Tensor:
    """Mean recall over the classes present in the target."""
    value = host_balanced_accuracy(input, target, num_classes, ignore_index)
    if value is not None:  # a small CPU batch, counted from Python lists
        return value
    return balanced_accuracy_from_confusion(_confusion(input, target, num_classes, ignore_index))


def multiclass_precision(
    input: Any,
    target: Any,
    num_classes: int | None = None,
    *,
    average: str | None = "macro",
    ignore_index: int | None = None,
) -> Tensor:
    """Share of predictions of each class that are correct, averaged as `average` says."""
    value = host_class_score(input, target, num_classes, average, ignore_index, "precision")
    if value is not None:  # a small CPU batch, counted from Python lists
        return value
    return precision_from_confusion(_confusion(input, target, num_classes, ignore_index), average)


def multiclass_recall(
    input: Any,
    target: Any,
    num_classes: int | None = None,
    *,
    average: str | None = "macro",
    ignore_index: int | None = None,
) -> Tensor:
    """Share of samples of each class predicted as that class, averaged as `average` says."""
    value = host_class_score(input, target, num_classes, average, ignore_index, "recall")
    if value is not None:  # a small CPU batch, counted from Python lists
        return value
    return recall_from_confusion(_confusion(input, target, num_classes, ignore_index), average)


def multiclass_f1_score(
    input: Any,
    target: Any,
    num_classes: int | None = None,
    *,
    average: str | None = "macro",
    ignore_index: int | None = None,
) -> Tensor:
    """Per-class harmonic mean of precision and recall, averaged as `average` says."""
    value = host_class_score(input, target, num_classes, average, ignore_index, "f1")
    if value is not None:  # a small CPU batch, counted from Python lists
        return value
    return f1_from_confusion(_confusion(input, target, num_classes, ignore_index), average)


def multiclass_mcc(
    input: Any, target: Any, num_classes: int | None = None, *, ignore_index: int | None = None
) -> Tensor:
    """Multiclass Matthews correlation coefficient (Gorodkin's R_K statistic)."""
    value = host_mcc(input, target, num_classes, ignore_index)
    if value is not None:  # a small CPU batch, counted from Python lists
        return value
    return mcc_from_confusion(_confusion(input, target, num_classes, ignore_index))


def multiclass_confusion_matrix(
    input: Any, target: Any, num_classes: int | None = None, *, ignore_index: int | None = None
) -> Tensor:
    """`(C, C)` int64 counts, rows indexed by target and columns by prediction."""
    return _confusion(input, target, num_classes, ignore_index).matrix


def multiclass_auroc(
    input: Any,
    target: Any,
    num_classes: int | None = None,
    *,
    average: str | None = "macro",
    ignore_index: int | None = None,
) -> Tensor:
    """One-vs-rest area under the ROC curve; classes without positives or negatives are `nan`."""
    average = check_average(average)
    scores, target = preprocess_multiclass(input, target, num_classes)
    return auroc_from_curves(multiclass_curves(scores, target, ignore_index, micro=average == "micro"), average)


def multiclass_auprc(
    input: Any,
    target: Any,
    num_classes: int | None = None,
    *,
    average: str | None = "macro",
    ignore_index: int | None = None,
) -> Tensor:
    """One-vs-rest average precision; classes without positives are `nan`."""
    average = check_average(average)
    scores, target = preprocess_multiclass(input, target, num_classes)
    return auprc_from_curves(multiclass_curves(scores, target, ignore_index, micro=average == "micro"), average)
