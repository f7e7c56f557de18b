"""Per-class multiclass scores of small CPU batches, counted from Python lists.

On CPU reading tensor values costs nothing, and for a batch of a few dozen labels one `tolist`
per side and a loop in Python cost less than the two dozen small tensor ops of the confusion
matrix path (each a dispatch, slowest inside a training step whose work has pushed their code
out of the caches). The results are those of the general path bit for bit: counts are exact
integers, every element-wise step is the same correctly rounded IEEE operation in Python, and
the one reduction over non-integer values (the macro or weighted average) is left to the same
torch reduction on a tensor of the same values.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from . import _common
from ._common import check_average

__all__ = ["host_class_score", "small_cpu_batch"]

_FLOAT_DTYPES = (torch.float32, torch.float64)


def small_cpu_batch(input: Any, target: Any, num_classes: int | None) -> bool:
    """Float CPU scores `(N, C)` and int64 labels `(N,)` with `0 < N <= _common.HOST_COUNT_SIZE`."""
    return (
        type(input) is Tensor
        and type(target) is Tensor
        and input.ndim == 2
        and target.ndim == 1
        and 0 < target.shape[0] <= _common.HOST_COUNT_SIZE
        and input.shape[0] == target.shape[0]
        and (num_classes is None or input.shape[1] == num_classes)
        and target.dtype is torch.long
        and input.dtype in _FLOAT_DTYPES
        and target.is_cpu
        and input.is_cpu
        and "cpu" in _common.HOST_READ_DEVICES
    )


def host_class_score(
    input: Any, target: Any, num_classes: int | None, average: str | None, ignore_index: Any, which: str
) -> Tensor | None:
    """`"precision"`, `"recall"` or `"f1"` of a small CPU batch, or `None` where the general path applies.

    Equals `_class_score(_confusion(input, target, num_classes, ignore_index), average, which)`.
    """
    if not small_cpu_batch(input, target, num_classes) or not (ignore_index is None or type(ignore_index) is int):
        return None
    average = check_average(average)
    classes = input.shape[1]
    tp, predicted, support, invalid = _counts(input.argmax(-1).tolist(), target.tolist(), classes, ignore_index)
    total = sum(support)
    if not total or invalid:  # nothing counted, or a target that is neither a class nor ignored
        nan = math.nan
        return torch.full((classes,), nan, dtype=torch.float64) if average is None else _scalar(nan)
    if average == "micro":  # one label per sample: pooled precision = recall = F1 = accuracy
        return _scalar(sum(tp) / total)
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
    weighted = torch.tensor([v * w for v, w in zip(values, weights)], dtype=torch.float64)
    return _scalar(weighted.nansum(-1).item() / sum(weights))


def _counts(
    pred: list[int], labels: list[int], classes: int, ignore_index: int | None
) -> tuple[list[int], list[int], list[int], int]:
    """Per-class hits, predictions and support of the counted pairs, and the invalid targets."""
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
    return tp, predicted, support, invalid


def _scalar(value: float) -> Tensor:
    return torch.scalar_tensor(value, dtype=torch.float64)
