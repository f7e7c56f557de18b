"""Turn whatever a model and a dataset produce into the tensors metric code expects.

[`base_preprocess`][danling.metrics.preprocess.base_preprocess] is the one generic step: lists,
NumPy arrays, scalars and `NestedTensor`s become detached tensors. The per-task functions then
validate shapes and dtypes and arrange the data; they never look at tensor *values* on the host,
so they are safe on the update path (no synchronisation with an accelerator).

Each per-task function returns `(input, target)`:

| task | input | target |
| --- | --- | --- |
| binary | `(N,)` float scores | `(N,)` int64 |
| multiclass | `(N, C)` float scores | `(N,)` int64 |
| multilabel | `(N, L)` float scores | `(N, L)` int64 |
| regression | `(N, D)` float | `(N, D)` float |

Scores may be probabilities or logits: a tensor with any value outside `[0, 1]` is taken as
logits. The decision is made on the device ([`is_logit`][danling.metrics.preprocess.is_logit]),
and scores are only transformed where it matters: thresholds are moved to logit space
([`positive_predictions`][danling.metrics.preprocess.positive_predictions]) and multiclass
rankings use softmax probabilities ([`probabilities`][danling.metrics.preprocess.probabilities]).
Targets equal to `ignore_index` are kept in place and skipped by the metrics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from danling.tensors import NestedTensor

__all__ = [
    "base_preprocess",
    "is_logit",
    "positive_predictions",
    "preprocess_binary",
    "preprocess_multiclass",
    "preprocess_multilabel",
    "preprocess_regression",
    "probabilities",
    "to_tensor",
]


def to_tensor(data: Any, *, name: str = "input") -> Tensor:
    """Convert one input or target to a detached tensor.

    A `NestedTensor` contributes only its valid elements, concatenated along the ragged
    dimension (`.concat`); padding never reaches a metric. A list of tensors of one shape (per-sample
    outputs) is stacked.

    Raises:
        TypeError: If `data` cannot be turned into a numeric tensor.
    """
    if type(data) is Tensor:  # the per-batch case, ahead of the subclass checks
        return data.detach() if data.requires_grad else data
    if isinstance(data, NestedTensor):  # before Tensor: a NestedTensor is a Tensor subclass
        data = data.concat
    if isinstance(data, Tensor):
        return data.detach() if data.requires_grad else data
    if isinstance(data, (Sequence, np.ndarray, int, float, bool, np.number)) and not isinstance(data, (str, bytes)):
        try:
            return torch.as_tensor(np.asarray(data) if isinstance(data, np.ndarray) else data)
        except (TypeError, ValueError, RuntimeError) as exc:
            stacked = _stacked_tensors(data, name)  # per-sample outputs collected in a list
            if stacked is not None:
                return stacked
            raise TypeError(f"{name} could not be converted to a tensor ({exc}); got {_describe(data)}") from None
    raise TypeError(f"{name} must be a Tensor, NestedTensor, sequence or array of numbers, got {_describe(data)}")


def _stacked_tensors(data: Any, name: str) -> Tensor | None:
    """A list of tensors of one shape stacked (torch converts only 0-d ones), or `None` for other data.

    Raises:
        TypeError: If the tensors differ in shape, naming the first two shapes.
    """
    if not isinstance(data, Sequence) or not data or not all(type(item) is Tensor for item in data):
        return None
    shapes = list(dict.fromkeys(tuple(item.shape) for item in data))
    if len(shapes) > 1:
        raise TypeError(
            f"{name} is a list of tensors of different shapes {shapes[0]} and {shapes[1]}; pass a NestedTensor "
            "of them, or one tensor"
        )
    return torch.stack([item.detach() for item in data])


def base_preprocess(input: Any, target: Any) -> tuple[Tensor, Tensor]:
    """Convert `input` and `target` to detached tensors (see [`to_tensor`][danling.metrics.preprocess.to_tensor])."""
    return to_tensor(input, name="input"), to_tensor(target, name="target")


def preprocess_binary(input: Any, target: Any) -> tuple[Tensor, Tensor]:
    """Flatten binary scores and labels.

    `input` and `target` must have the same number of elements arranged the same way; a
    trailing dimension of size 1 on `input` is dropped. `input` may hold probabilities, logits
    or hard 0/1 predictions; `target` may be integer, boolean or floating 0/1 labels.

    Raises:
        ValueError: On mismatched shapes or non-numeric dtypes, naming both shapes.
    """
    input, target = base_preprocess(input, target)
    if input.ndim == target.ndim + 1 and input.shape[-1] == 1:
        input = input.squeeze(-1)
    if input.shape != target.shape:
        raise ValueError(
            "binary metrics need input and target of the same shape, got input "
            f"{tuple(input.shape)} and target {tuple(target.shape)}"
        )
    return _scores(input.reshape(-1), "binary"), _labels(target.reshape(-1), "binary")


def preprocess_multiclass(input: Any, target: Any, num_classes: int | None = None) -> tuple[Tensor, Tensor]:
    """Arrange multiclass scores as `(N, C)` and targets as `(N,)` class indices.

    Accepted layouts: scores `(N, C)` with target `(N,)`; scores `(..., C)` with target `(...)`
    (class dimension last, e.g. tokens); scores `(N, C, ...)` with target `(N, ...)` (class
    dimension second, as `torch.nn.CrossEntropyLoss`); or predicted labels of the target's shape
    (integer dtype, needs `num_classes`), which become one-hot scores.

    Raises:
        ValueError: On shapes that fit none of these, a class count different from
            `num_classes`, or a floating-point target; the message names the shapes.
    """
    if _plain_multiclass(input, target, num_classes):
        return input.detach() if input.requires_grad else input, target
    input, target = base_preprocess(input, target)
    target = _labels(target, "multiclass", allow_float=False)
    if target.ndim == input.ndim > 1 and target.shape[-1] == 1 and input.shape[:-1] == target.shape[:-1]:
        target = target.squeeze(-1)  # (N, 1) class indices next to (N, C) scores
    if input.shape == target.shape and not input.is_floating_point():
        if num_classes is None:
            raise ValueError(
                f"multiclass metrics on predicted labels of shape {tuple(input.shape)} need num_classes; "
                "pass num_classes or class scores of shape (N, C)"
            )
        scores = torch.nn.functional.one_hot(input.long().clamp(0, num_classes - 1), num_classes)
        # Out-of-range predictions must not look like a valid class: zero their row.
        inside = (input >= 0) & (input < num_classes)
        return (scores * inside.unsqueeze(-1)).reshape(-1, num_classes).to(_float_dtype(input)), target.reshape(-1)
    if input.ndim == target.ndim + 1 and input.shape[:-1] == target.shape:
        scores = input
    elif input.ndim == target.ndim + 1 and input.ndim > 2 and input.shape[:1] + input.shape[2:] == target.shape:
        scores = input.movedim(1, -1)
    else:
        raise ValueError(
            "multiclass metrics need scores of shape (N, C) with target (N,) (or (..., C) with target (...)), "
            f"got input {tuple(input.shape)} and target {tuple(target.shape)}"
        )
    if num_classes is not None and scores.shape[-1] != num_classes:
        raise ValueError(
            f"num_classes={num_classes} does not match the class dimension of input {tuple(input.shape)} "
            f"(target {tuple(target.shape)})"
        )
    scores = scores.reshape(-1, scores.shape[-1])
    return _scores(scores, "multiclass"), target.reshape(-1)


def _plain_multiclass(input: Any, target: Any, num_classes: int | None) -> bool:
    """The per-batch common case, already in final form: float `(N, C)` scores and int64 `(N,)` labels."""
    return (
        type(input) is Tensor
        and type(target) is Tensor
        and input.dtype in _FLOAT_DTYPES
        and target.dtype is torch.long
        and input.ndim == 2
        and target.ndim == 1
        and input.shape[0] == target.shape[0]
        and (num_classes is None or input.shape[1] == num_classes)
    )


def preprocess_multilabel(input: Any, target: Any, num_labels: int | None = None) -> tuple[Tensor, Tensor]:
    """Arrange multilabel scores and 0/1 targets as `(N, L)`.

    Extra leading dimensions are flattened into `N`; the label dimension is last.

    Raises:
        ValueError: On mismatched shapes, a label count different from `num_labels`, or
            non-numeric dtypes, naming the shapes.
    """
    input, target = base_preprocess(input, target)
    if input.shape != target.shape or input.ndim < 2:
        raise ValueError(
            "multilabel metrics need input and target of the same shape (N, L), got input "
            f"{tuple(input.shape)} and target {tuple(target.shape)}"
        )
    if num_labels is not None and input.shape[-1] != num_labels:
        raise ValueError(
            f"num_labels={num_labels} does not match the label dimension of input {tuple(input.shape)} "
            f"(target {tuple(target.shape)})"
        )
    labels = input.shape[-1]
    scores = _scores(input.reshape(-1, labels), "multilabel")
    return scores, _labels(target.reshape(-1, labels), "multilabel")


def preprocess_regression(input: Any, target: Any, num_outputs: int | None = None) -> tuple[Tensor, Tensor]:
    """Arrange regression predictions and targets as floating `(N, D)` tensors.

    `(N,)` becomes `(N, 1)`; with several outputs the output dimension is last. A trailing
    dimension of size 1 on only one side is tolerated.

    Raises:
        ValueError: On mismatched shapes, an output count different from `num_outputs`, or
            non-numeric dtypes, naming the shapes.
    """
    input, target = base_preprocess(input, target)
    if input.shape != target.shape:
        if input.ndim == target.ndim + 1 and input.shape[-1] == 1 and input.shape[:-1] == target.shape:
            input = input.squeeze(-1)
        elif target.ndim == input.ndim + 1 and target.shape[-1] == 1 and target.shape[:-1] == input.shape:
            target = target.squeeze(-1)
        else:
            raise ValueError(
                "regression metrics need input and target of the same shape, got input "
                f"{tuple(input.shape)} and target {tuple(target.shape)}"
            )
    outputs = input.shape[-1] if input.ndim > 1 else 1
    if num_outputs is not None and outputs != num_outputs:
        raise ValueError(
            f"num_outputs={num_outputs} does not match input {tuple(input.shape)} and target {tuple(target.shape)}"
        )
    for tensor, name in ((input, "input"), (target, "target")):
        if tensor.is_complex() or tensor.dtype == torch.bool:
            raise ValueError(f"regression {name} must be real numbers, got dtype {tensor.dtype}")
    dtype = torch.promote_types(_float_dtype(input), _float_dtype(target))
    return input.reshape(-1, outputs).to(dtype), target.reshape(-1, outputs).to(dtype)


def is_logit(scores: Tensor) -> Tensor:
    """0-d boolean tensor, on the scores' device: do they hold logits (any value outside `[0, 1]`)?"""
    return ((scores < 0) | (scores > 1)).any()


def positive_predictions(scores: Tensor, threshold: float) -> Tensor:
    """Where the probability behind `scores` exceeds `threshold`, without computing a sigmoid.

    For logits the threshold moves to logit space: `sigmoid(x) > t` exactly when `x > logit(t)`.
    """
    if scores.numel() == 0:
        return scores > threshold
    return torch.where(is_logit(scores), scores > _logit_threshold(threshold), scores > threshold)


def _logit_threshold(threshold: float) -> float:
    """The logit `x` with `sigmoid(x) > threshold` exactly when `x` exceeds it."""
    if threshold <= 0:
        return -math.inf
    if threshold >= 1:
        return math.inf
    return math.log(threshold) - math.log1p(-threshold)


def probabilities(scores: Tensor, *, softmax: bool) -> Tensor:
    """Scores as probabilities: logits go through a softmax (over the last dim) or a sigmoid."""
    if scores.numel() == 0:
        return scores
    normalised = scores.softmax(dim=-1) if softmax else scores.sigmoid()
    return torch.where(is_logit(scores), normalised, scores)


def _scores(scores: Tensor, task: str) -> Tensor:
    if scores.is_complex():
        raise ValueError(f"{task} input must be real scores, got dtype {scores.dtype}")
    return scores.to(_float_dtype(scores))


def _labels(target: Tensor, task: str, *, allow_float: bool = True) -> Tensor:
    if target.is_complex() or (target.is_floating_point() and not allow_float):
        raise ValueError(
            f"{task} target must hold integer class indices, got dtype {target.dtype} with shape {tuple(target.shape)}"
        )
    return target.long()


_FLOAT_DTYPES = (torch.float32, torch.float64)


def _float_dtype(tensor: Tensor) -> torch.dtype:
    if tensor.dtype in _FLOAT_DTYPES:
        return tensor.dtype
    return torch.float32


def _describe(data: Any) -> str:
    text = repr(data)
    return f"{type(data).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
