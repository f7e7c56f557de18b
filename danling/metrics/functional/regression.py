"""Regression metrics for one or several outputs.

`input` and `target` are `(N,)` or `(N, D)` real tensors. Entries whose target equals
`ignore_index` (if given; `nan` leaves out NaN targets, missing values) are left out, whatever
their prediction holds. With several outputs, `average="macro"` (the default)
averages the per-output values, `"micro"` pools all outputs into one long vector and `None`
returns one value per output; a single output always gives a 0-d tensor. Results are float64;
undefined results are `nan` (no samples, or a constant input/target for the correlations;
a NaN among the counted entries makes every metric of its output `nan`).
`r2_score` of a constant target is `-inf` (or `nan` when the predictions are exact), as
scikit-learn gives with `force_finite=False`.

All metrics but `spearman` are computed from a handful of running moments per output
([`regression_moments`][danling.metrics.functional.regression.regression_moments]), merged
with Chan's parallel update, so the containers can keep them instead of the data.

Examples:
    >>> import torch
    >>> input = torch.tensor([2.5, 0.0, 2.0, 8.0])
    >>> target = torch.tensor([3.0, -0.5, 2.0, 7.0])
    >>> mse(input, target)
    tensor(0.3750, dtype=torch.float64)
    >>> r2_score(input, target)
    tensor(0.9486, dtype=torch.float64)
    >>> spearman(input, target)
    tensor(1., dtype=torch.float64)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..preprocess import preprocess_regression
from ._common import average_ranks, check_average, pearson_columns, result_dtype

__all__ = [
    "mae",
    "merge_moments",
    "mse",
    "pearson",
    "r2_score",
    "regression_moments",
    "rmse",
    "spearman",
]

# Column layout of a moments tensor (D, 12).
N, MEAN_X, MEAN_Y, M2_X, M2_Y, C_XY, SSE, SAE, MIN_X, MAX_X, MIN_Y, MAX_Y = range(12)
REGRESSION_AVERAGES = ("macro", "micro", None)


def regression_moments(input: Tensor, target: Tensor, ignore_index: float | None = None) -> Tensor:
    """Per-output count, means, centred second moments, error sums and ranges of `(N, D)` tensors."""
    dtype = result_dtype(input.device)
    x, y = input.to(dtype), target.to(dtype)
    outputs = x.shape[-1]
    if x.shape[0] == 0:
        return empty_moments(outputs, x.device)
    if ignore_index is None:
        weight = None
        n = torch.full((outputs,), float(x.shape[0]), dtype=dtype, device=x.device)
    else:
        kept = counted_targets(target, ignore_index)
        # Ignored entries are zeroed, not only weighted 0: a NaN there (a missing target, the
        # prediction beside it) would reach every sum as NaN * 0 = NaN.
        x, y = torch.where(kept, x, 0.0), torch.where(kept, y, 0.0)
        weight = kept.to(dtype)
        n = weight.sum(0)
    mean_x = _weighted_sum(x, weight) / n.clamp_min(1)
    mean_y = _weighted_sum(y, weight) / n.clamp_min(1)
    dx, dy, err = x - mean_x, y - mean_y, x - y
    if weight is not None:
        dx, dy, err = dx * weight, dy * weight, err * weight
        counted = weight > 0
        x_low, x_high = torch.where(counted, x, math.inf), torch.where(counted, x, -math.inf)
        y_low, y_high = torch.where(counted, y, math.inf), torch.where(counted, y, -math.inf)
    else:
        x_low = x_high = x
        y_low = y_high = y
    columns = [n, mean_x, mean_y, (dx * dx).sum(0), (dy * dy).sum(0), (dx * dy).sum(0), (err * err).sum(0)]
    columns += [err.abs().sum(0), x_low.amin(0), x_high.amax(0), y_low.amin(0), y_high.amax(0)]
    return torch.stack(columns, dim=-1)


def counted_targets(target: Tensor, ignore_index: float) -> Tensor:
    """Where `target` is counted: not `ignore_index`, or not NaN for `ignore_index=nan` (which equals nothing)."""
    if isinstance(ignore_index, float) and math.isnan(ignore_index):
        return ~target.isnan()
    return target != ignore_index


def empty_moments(outputs: int, device: torch.device | str | None = None) -> Tensor:
    """Moments of no data: zero counts and sums, empty ranges."""
    moments = torch.zeros((outputs, 12), dtype=result_dtype(torch.device(device or "cpu")), device=device)
    moments[:, [MIN_X, MIN_Y]] = math.inf
    moments[:, [MAX_X, MAX_Y]] = -math.inf
    return moments


def merge_moments(a: Tensor, b: Tensor) -> Tensor:
    """Combine the moments of two disjoint sets of samples (Chan et al.)."""
    na, nb = a[:, N], b[:, N]
    n = na + nb
    share = torch.where(n > 0, nb / n.clamp_min(1e-300), 0.0)
    dx, dy = b[:, MEAN_X] - a[:, MEAN_X], b[:, MEAN_Y] - a[:, MEAN_Y]
    cross = na * share
    merged = a + b
    merged[:, N] = n
    merged[:, MEAN_X] = a[:, MEAN_X] + dx * share
    merged[:, MEAN_Y] = a[:, MEAN_Y] + dy * share
    merged[:, M2_X] += dx * dx * cross
    merged[:, M2_Y] += dy * dy * cross
    merged[:, C_XY] += dx * dy * cross
    merged[:, [MIN_X, MIN_Y]] = torch.minimum(a[:, [MIN_X, MIN_Y]], b[:, [MIN_X, MIN_Y]])
    merged[:, [MAX_X, MAX_Y]] = torch.maximum(a[:, [MAX_X, MAX_Y]], b[:, [MAX_X, MAX_Y]])
    return merged


def pool_moments(moments: Tensor) -> Tensor:
    """Moments of all outputs treated as one long vector, shape `(1, 12)`."""
    n = moments[:, N]
    total = n.sum()
    share = n / total.clamp_min(1e-300)
    mean_x, mean_y = (moments[:, MEAN_X] * share).sum(), (moments[:, MEAN_Y] * share).sum()
    dx, dy = moments[:, MEAN_X] - mean_x, moments[:, MEAN_Y] - mean_y
    pooled = moments.sum(0)
    pooled[N], pooled[MEAN_X], pooled[MEAN_Y] = total, mean_x, mean_y
    pooled[M2_X] += (n * dx * dx).sum()
    pooled[M2_Y] += (n * dy * dy).sum()
    pooled[C_XY] += (n * dx * dy).sum()
    pooled[MIN_X], pooled[MIN_Y] = moments[:, MIN_X].amin(), moments[:, MIN_Y].amin()
    pooled[MAX_X], pooled[MAX_Y] = moments[:, MAX_X].amax(), moments[:, MAX_Y].amax()
    return pooled.unsqueeze(0)


def mse_from_moments(moments: Tensor, average: str | None = "macro") -> Tensor:
    return _reduce(moments, average, lambda m: m[:, SSE] / m[:, N])


def rmse_from_moments(moments: Tensor, average: str | None = "macro") -> Tensor:
    return _reduce(moments, average, lambda m: (m[:, SSE] / m[:, N]).sqrt())


def mae_from_moments(moments: Tensor, average: str | None = "macro") -> Tensor:
    return _reduce(moments, average, lambda m: m[:, SAE] / m[:, N])


def r2_from_moments(moments: Tensor, average: str | None = "macro") -> Tensor:
    def r2(m: Tensor) -> Tensor:
        # A constant target has no variance even if rounding left a tiny M2.
        variance = torch.where(m[:, MAX_Y] > m[:, MIN_Y], m[:, M2_Y], 0.0)
        return torch.where(m[:, N] > 0, 1 - m[:, SSE] / variance, math.nan)

    return _reduce(moments, average, r2)


def pearson_from_moments(moments: Tensor, average: str | None = "macro") -> Tensor:
    def pearson_(m: Tensor) -> Tensor:
        value = m[:, C_XY] / (m[:, M2_X] * m[:, M2_Y]).sqrt()
        varying = (m[:, MAX_X] > m[:, MIN_X]) & (m[:, MAX_Y] > m[:, MIN_Y])
        return torch.where(varying, value.clamp(-1, 1), math.nan)

    return _reduce(moments, average, pearson_)


def spearman_from_data(input: Tensor, target: Tensor, ignore_index: float | None = None, average="macro") -> Tensor:
    """Spearman correlation of preprocessed `(N, D)` tensors (Pearson correlation of average ranks)."""
    average = check_average(average, REGRESSION_AVERAGES)
    if average == "micro":
        input, target = input.reshape(-1, 1), target.reshape(-1, 1)
    if ignore_index is None:
        values = _spearman_columns(input, target)
    else:  # columns keep different numbers of entries: rank them one at a time
        columns = []
        for j in range(input.shape[-1]):
            keep = counted_targets(target[:, j], ignore_index)
            columns.append(_spearman_columns(input[keep, j : j + 1], target[keep, j : j + 1]))
        values = torch.cat(columns)
    return _finish(values, average)


def _spearman_columns(x: Tensor, y: Tensor) -> Tensor:
    # Sorting ranks a NaN after every number; a NaN makes the column NaN instead, as for Pearson.
    values = pearson_columns(average_ranks(x), average_ranks(y))
    return torch.where(x.isnan().any(0) | y.isnan().any(0), math.nan, values)


def _reduce(moments: Tensor, average: str | None, metric: Callable[[Tensor], Tensor]) -> Tensor:
    average = check_average(average, REGRESSION_AVERAGES)
    values = metric(pool_moments(moments) if average == "micro" else moments)
    return _finish(values, average)


def _finish(values: Tensor, average: str | None) -> Tensor:
    if values.shape[0] == 1:
        return values[0]
    return values.mean() if average == "macro" else values


def _weighted_sum(values: Tensor, weight: Tensor | None) -> Tensor:
    return values.sum(0) if weight is None else (values * weight).sum(0)


def _moments(input: Any, target: Any, num_outputs: int | None, ignore_index: float | None) -> Tensor:
    return regression_moments(*preprocess_regression(input, target, num_outputs), ignore_index)


def pearson(
    input: Any, target: Any, num_outputs: int | None = None, *, average: str | None = "macro", ignore_index=None
) -> Tensor:
    """Pearson correlation coefficient between predictions and targets."""
    return pearson_from_moments(_moments(input, target, num_outputs, ignore_index), average)


def spearman(
    input: Any, target: Any, num_outputs: int | None = None, *, average: str | None = "macro", ignore_index=None
) -> Tensor:
    """Spearman rank correlation (ties share their average rank)."""
    x, y = preprocess_regression(input, target, num_outputs)
    return spearman_from_data(x, y, ignore_index, average)


def r2_score(
    input: Any, target: Any, num_outputs: int | None = None, *, average: str | None = "macro", ignore_index=None
) -> Tensor:
    """Coefficient of determination, `1 - SSE / SST`."""
    return r2_from_moments(_moments(input, target, num_outputs, ignore_index), average)


def mse(input: Any, target: Any, num_outputs: int | None = None, *, average: str | None = "macro", ignore_index=None):
    """Mean squared error."""
    return mse_from_moments(_moments(input, target, num_outputs, ignore_index), average)


def rmse(input: Any, target: Any, num_outputs: int | None = None, *, average: str | None = "macro", ignore_index=None):
    """Root mean squared error (per output, before averaging)."""
    return rmse_from_moments(_moments(input, target, num_outputs, ignore_index), average)


def mae(input: Any, target: Any, num_outputs: int | None = None, *, average: str | None = "macro", ignore_index=None):
    """Mean absolute error."""
    return mae_from_moments(_moments(input, target, num_outputs, ignore_index), average)
