"""Metric functions of `(input, target)` for binary, multiclass, multilabel and regression tasks.

The task-specific functions (`binary_auroc`, `multiclass_f1_score`, `mse`, ...) live in one
module per task. The generic names below (`accuracy`, `auroc`, ...) pick the task for you:

- `task=` wins when given (`"binary"`, `"multiclass"` or `"multilabel"`);
- otherwise `num_classes` means multiclass and `num_labels` multilabel;
- otherwise scores with one more dimension than the target (class scores) mean multiclass,
  and anything else is binary.

`average` applies to multiclass and multilabel metrics; leaving it unset uses the task
module's default (documented there). All functions accept tensors, nested sequences, NumPy
arrays and `NestedTensor`s, never synchronise with the device, and return `nan` where a value
is undefined (for example on empty input).

Examples:
    >>> import torch
    >>> accuracy(torch.tensor([0.1, 0.8, 0.6, 0.2]), torch.tensor([0, 1, 0, 0]))
    tensor(0.7500, dtype=torch.float64)
    >>> f1_score([[0.7, 0.2, 0.1], [0.1, 0.2, 0.7], [0.2, 0.6, 0.2]], [0, 2, 2])
    tensor(0.5556, dtype=torch.float64)
    >>> auroc([[0.9, 0.1], [0.2, 0.6]], [[1, 0], [0, 1]], task="multilabel")
    tensor(1., dtype=torch.float64)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..preprocess import _FLOAT_DTYPES, base_preprocess
from . import _common
from . import binary as _binary
from . import multiclass as _multiclass
from . import multilabel as _multilabel
from .binary import (
    binary_accuracy,
    binary_auprc,
    binary_auroc,
    binary_balanced_accuracy,
    binary_confusion_matrix,
    binary_f1_score,
    binary_mcc,
    binary_precision,
    binary_recall,
)
from .multiclass import (
    _top1_accuracy_all_counted,
    _top1_value_on_host,
    _top1_values_on_host,
    multiclass_accuracy,
    multiclass_auprc,
    multiclass_auroc,
    multiclass_balanced_accuracy,
    multiclass_confusion_matrix,
    multiclass_f1_score,
    multiclass_mcc,
    multiclass_precision,
    multiclass_recall,
)
from .multilabel import (
    multilabel_accuracy,
    multilabel_auprc,
    multilabel_auroc,
    multilabel_balanced_accuracy,
    multilabel_confusion_matrix,
    multilabel_f1_score,
    multilabel_mcc,
    multilabel_precision,
    multilabel_recall,
)
from .regression import mae, mse, pearson, r2_score, rmse, spearman

__all__ = [
    "accuracy",
    "auprc",
    "auroc",
    "balanced_accuracy",
    "binary_accuracy",
    "binary_auprc",
    "binary_auroc",
    "binary_balanced_accuracy",
    "binary_confusion_matrix",
    "binary_f1_score",
    "binary_mcc",
    "binary_precision",
    "binary_recall",
    "confusion_matrix",
    "f1_score",
    "mae",
    "mcc",
    "mse",
    "multiclass_accuracy",
    "multiclass_auprc",
    "multiclass_auroc",
    "multiclass_balanced_accuracy",
    "multiclass_confusion_matrix",
    "multiclass_f1_score",
    "multiclass_mcc",
    "multiclass_precision",
    "multiclass_recall",
    "multilabel_accuracy",
    "multilabel_auprc",
    "multilabel_auroc",
    "multilabel_balanced_accuracy",
    "multilabel_confusion_matrix",
    "multilabel_f1_score",
    "multilabel_mcc",
    "multilabel_precision",
    "multilabel_recall",
    "pearson",
    "precision",
    "r2_score",
    "recall",
    "rmse",
    "spearman",
]

TASKS = ("binary", "multiclass", "multilabel")


def infer_task(
    input: Any, target: Any, task: str | None = None, num_classes: int | None = None, num_labels: int | None = None
) -> str:
    """Name the classification task that `input`/`target` describe (see the module docs)."""
    if task is not None:
        if task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
        return task
    if num_classes is not None:
        return "multiclass"
    if num_labels is not None:
        return "multilabel"
    input, target = base_preprocess(input, target)
    if input.ndim == target.ndim + 1 and input.shape[-1] > 1:
        return "multiclass"
    return "binary"


def _is_multiclass(input: Any, target: Any, task: str | None, num_classes: int | None, num_labels: int | None) -> bool:
    """Whether `infer_task` names a multiclass task, decided without converting plain tensors."""
    if task is not None:
        return task == "multiclass"
    if num_classes is not None or num_labels is not None:
        return num_classes is not None and num_labels is None
    return type(input) is Tensor and type(target) is Tensor and input.ndim == target.ndim + 1 and input.shape[-1] > 1


def _dispatch(name: str, input: Any, target: Any, options: dict[str, Any]) -> Tensor:
    task = infer_task(input, target, options.pop("task"), options["num_classes"], options["num_labels"])
    module = {"binary": _binary, "multiclass": _multiclass, "multilabel": _multilabel}[task]
    function: Callable[..., Tensor] = getattr(module, f"{task}_{name}")
    num_classes, num_labels = options.pop("num_classes"), options.pop("num_labels")
    average = options.pop("average", "default")
    if task == "multiclass":
        options.pop("threshold", None)
        options["num_classes"] = num_classes
    elif task == "multilabel":
        options["num_labels"] = num_labels
    if task != "binary" and average != "default":
        options["average"] = average
    return function(input, target, **options)


def accuracy(
    input: Any,
    target: Any,
    *,
    task: str | None = None,
    num_classes: int | None = None,
    num_labels: int | None = None,
    threshold: float = 0.5,
    average: str | None = "default",
    ignore_index: int | None = None,
) -> Tensor:
    """Accuracy of the inferred task (see `binary_accuracy`, `multiclass_accuracy`, `multilabel_accuracy`)."""
    if task is None and num_classes is None and num_labels is None and ignore_index is None and average == "default":
        classes = _top1_classes(input, target)
        if classes:
            return _top1_accuracy_all_counted(input.argmax(-1), target, classes)
    options = dict(
        task=task,
        num_classes=num_classes,
        num_labels=num_labels,
        threshold=threshold,
        average=average,
        ignore_index=ignore_index,
    )
    return _dispatch("accuracy", input, target, options)


def _top1_classes(input: Any, target: Any) -> int:
    """The number of classes when `(input, target)` is the per-batch call of a training loop (float
    class scores `(N, C)`, int64 labels `(N,)`, `N > 0`), else 0. Checked inline: every call pays for it."""
    if type(input) is Tensor and type(target) is Tensor and input.ndim == 2 and target.ndim == 1:
        rows, classes = input.shape
        long_labels, float_scores = target.dtype is torch.long, input.dtype in _FLOAT_DTYPES
        if rows and classes > 1 and rows == target.shape[0] and long_labels and float_scores:
            return classes
    return 0


def _accuracy_on_host(input: Any, target: Any) -> float | None:
    """`accuracy(input, target)` as the Python float it holds when it is counted on the host (labels
    on the CPU), else `None`: a running mean adds the number without making a tensor of it."""
    classes = _top1_classes(input, target)
    if classes and target.is_cpu and "cpu" in _common.HOST_READ_DEVICES:
        return _top1_value_on_host(input.argmax(-1), target, classes)
    return None


def _accuracy_kind(input: Any, target: Any) -> Any:
    """What batches of `accuracy` may be counted together with this one (their number of classes and
    score dtype), or `None` when it is no small CPU batch: up to `HOST_COUNT_SIZE` labels and 4096 scores."""
    classes = _top1_classes(input, target)
    if classes and target.is_cpu and input.is_cpu and "cpu" in _common.HOST_READ_DEVICES:
        rows = target.shape[0]
        if rows <= _common.HOST_COUNT_SIZE and rows * classes <= _SCORES_PER_BATCH:
            return classes, input.dtype
    return None


def _accuracies_on_host(inputs: list[Tensor], targets: list[Tensor], kind: Any) -> list[float]:
    """`_accuracy_on_host` of each batch of one kind (see `_accuracy_kind`), counted together."""
    return _top1_values_on_host(inputs, targets, kind[0])


class HostValue(NamedTuple):
    """How a metric function called without options is counted on the host (see `value_on_host`).

    Attributes:
        one: `(input, target)` -> the metric's value as the Python float its 0-d float64 result
            holds, or `None` where it is not counted on the host.
        kind: `(input, target)` -> what batches may be counted together with this one, or `None`.
        many: `(inputs, targets, kind)` -> the values of several batches of one kind, in order.
    """

    one: Callable[[Any, Any], float | None]
    kind: Callable[[Any, Any], Any]
    many: Callable[[list[Tensor], list[Tensor], Any], list[float]]


_SCORES_PER_BATCH = 4096  # kept batches hold at most 64 x 4096 scores (2 MiB of float64)
# Metric functions whose value a running mean may read as a Python float (see `value_on_host`).
_ON_HOST: dict[Callable, HostValue] = {accuracy: HostValue(_accuracy_on_host, _accuracy_kind, _accuracies_on_host)}


def value_on_host(metric: Callable) -> HostValue | None:
    """How `metric`, called without options, is counted on the host, or `None` for other metrics.

    [`MetricMeter`][danling.metrics.MetricMeter] adds such values as it would add the 0-d float64
    tensor the metric returns, so the running values are the same to the bit.
    """
    if type(metric).__hash__ is None:  # a callable object comparing by value: never one of ours
        return None
    return _ON_HOST.get(metric)


def balanced_accuracy(
    input: Any,
    target: Any,
    *,
    task: str | None = None,
    num_classes: int | None = None,
    num_labels: int | None = None,
    threshold: float = 0.5,
    average: str | None = "default",
    ignore_index: int | None = None,
) -> Tensor:
    """Balanced accuracy of the inferred task."""
    if _is_multiclass(input, target, task, num_classes, num_labels):  # what `_dispatch` calls, without its checks
        return _multiclass.multiclass_balanced_accuracy(input, target, num_classes, ignore_index=ignore_index)
    options = locals_without(locals())
    if infer_task(input, target, task, num_classes, num_labels) == "multiclass":
        options.pop("average")  # multiclass balanced accuracy has a single definition
    return _dispatch("balanced_accuracy", input, target, options)


def precision(
    input: Any,
    target: Any,
    *,
    task: str | None = None,
    num_classes: int | None = None,
    num_labels: int | None = None,
    threshold: float = 0.5,
    average: str | None = "default",
    ignore_index: int | None = None,
) -> Tensor:
    """Precision of the inferred task."""
    if _is_multiclass(input, target, task, num_classes, num_labels):  # what `_dispatch` calls, without its checks
        options = {} if average == "default" else {"average": average}
        return _multiclass.multiclass_precision(input, target, num_classes, ignore_index=ignore_index, **options)
    return _dispatch("precision", input, target, locals_without(locals()))


def recall(
    input: Any,
    target: Any,
    *,
    task: str | None = None,
    num_classes: int | None = None,
    num_labels: int | None = None,
    threshold: float = 0.5,
    average: str | None = "default",
    ignore_index: int | None = None,
) -> Tensor:
    """Recall of the inferred task."""
    if _is_multiclass(input, target, task, num_classes, num_labels):  # what `_dispatch` calls, without its checks
        options = {} if average == "default" else {"average": average}
        return _multiclass.multiclass_recall(input, target, num_classes, ignore_index=ignore_index, **options)
    return _dispatch("recall", input, target, locals_without(locals()))


def f1_score(
    input: Any,
    target: Any,
    *,
    task: str | None = None,
    num_classes: int | None = None,
    num_labels: int | None = None,
    threshold: float = 0.5,
    average: str | None = "default",
    ignore_index: int | None = None,
) -> Tensor:
    """F1 score of the inferred task."""
    if _is_multiclass(input, target, task, num_classes, num_labels):  # what `_dispatch` calls, without its checks
        options = {} if average == "default" else {"average": average}
        return _multiclass.multiclass_f1_score(input, target, num_classes, ignore_index=ignore_index, **options)
    return _dispatch("f1_score", input, target, locals_without(locals()))


def mcc(
    input: Any,
    target: Any,
    *,
    task: str | None = None,
    num_classes: int | None = None,
    num_labels: int | None = None,
    threshold: float = 0.5,
    average: str | None = "default",
    ignore_index: int | None = None,
) -> Tensor:
    """Matthews correlation coefficient of the inferred task."""
    if _is_multiclass(input, target, task, num_classes, num_labels):  # what `_dispatch` calls, without its checks
        return _multiclass.multiclass_mcc(input, target, num_classes, ignore_index=ignore_index)
    options = locals_without(locals())
    if infer_task(input, target, task, num_classes, num_labels) == "multiclass":
        options.pop("average")
    return _dispatch("mcc", input, target, options)


def auroc(
    input: Any,
    target: Any,
    *,
    task: str | None = None,
    num_classes: int | None = None,
    num_labels: int | None = None,
    average: str | None = "default",
    ignore_index: int | None = None,
) -> Tensor:
    """Area under the ROC curve of the inferred task."""
    return _dispatch("auroc", input, target, locals_without(locals()))


def auprc(
    input: Any,
    target: Any,
    *,
    task: str | None = None,
    num_classes: int | None = None,
    num_labels: int | None = None,
    average: str | None = "default",
    ignore_index: int | None = None,
) -> Tensor:
    """Average precision (area under the precision-recall curve) of the inferred task."""
    return _dispatch("auprc", input, target, locals_without(locals()))


def confusion_matrix(
    input: Any,
    target: Any,
    *,
    task: str | None = None,
    num_classes: int | None = None,
    num_labels: int | None = None,
    threshold: float = 0.5,
    ignore_index: int | None = None,
) -> Tensor:
    """Confusion counts of the inferred task: `(2, 2)`, `(C, C)` or `(L, 2, 2)`."""
    return _dispatch("confusion_matrix", input, target, locals_without(locals()))


def locals_without(namespace: dict[str, Any]) -> dict[str, Any]:
    """Keyword options of a dispatcher: its locals minus the data arguments."""
    return {key: value for key, value in namespace.items() if key not in ("input", "target")}
