"""[`MetricMeter`][danling.metrics.MetricMeter]: a running average of a metric evaluated per batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .functional import value_on_host
from .meter import AverageMeter
from .preprocess import to_tensor
from .state import MetricFunc, MetricState, MetricTask

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["MetricMeter", "batch_size", "evaluate_metric", "metric_name"]

Preprocess = Callable[[Any, Any], tuple[Any, Any]]


class MetricMeter(AverageMeter):
    r"""Evaluate a metric on every batch and keep its batch-size-weighted running average.

    Only running sums are stored, never predictions, so memory stays constant. The average of
    per-batch values equals the dataset value only for metrics that are means over samples
    (accuracy, MSE, ...); for others (AUROC, F1, correlations) it is an approximation, and
    [`GlobalMetrics`][danling.metrics.GlobalMetrics] gives the exact value.

    `metric` is either a plain function of `(input, target)` (it receives the preprocessed
    tensors) or a [`MetricFunc`][danling.metrics.MetricFunc], which receives a
    [`MetricState`][danling.metrics.MetricState] built from the batch. Tensor results with
    dimensions (per-class values, say) are averaged element-wise.

    Attributes:
        metric: The metric evaluated on each batch.
        preprocess: Function applied to `(input, target)` first, or `None`.
        val: Metric of the latest batch on this rank.
        bat: Metric of the latest batch, combined over the ranks of `group`.
        avg: Batch-size-weighted average over all batches and the ranks of `group`.
        sum: Running sum of metric × batch size on this rank.
        count: Running number of samples on this rank.

    Args:
        metric: Metric function or `MetricFunc`.
        preprocess: Preprocessing applied before the metric; by default the metric gets the
            inputs as given (the built-in metric functions convert them themselves).
        device: Device used for collectives.
        group: Process group to reduce over; every rank when `None`.

    Examples:
        >>> import torch
        >>> from danling.metrics.functional import accuracy
        >>> meter = MetricMeter(accuracy)
        >>> meter.update(torch.tensor([0.1, 0.8, 0.6, 0.2]), torch.tensor([0, 1, 0, 0]))
        >>> meter.val
        0.75
        >>> meter.avg
        0.75
        >>> meter.update(torch.tensor([0.1, 0.7, 0.3, 0.2, 0.8, 0.4]), torch.tensor([0, 1, 1, 0, 0, 1]))
        >>> meter.val
        0.5
        >>> meter.avg
        0.6
        >>> meter.sum
        6.0
        >>> meter.count
        10
        >>> meter.reset()
        MetricMeter(accuracy)
        >>> meter.val
        nan
        >>> meter.avg
        nan

    See Also:
        [`AverageMeter`][danling.metrics.AverageMeter]: the same for values you compute yourself.
    """

    def __init__(
        self,
        metric: Callable | MetricFunc,
        preprocess: Preprocess | None = None,
        *,
        device: torch.device | str | None = None,
        group: ProcessGroup | None = None,
    ) -> None:
        self.metric = metric
        self.preprocess = preprocess
        super().__init__(device=device, group=group)

    @property
    def metric(self) -> Callable | MetricFunc:
        """The metric evaluated on each batch."""
        return self._metric

    @metric.setter
    def metric(self, metric: Callable | MetricFunc) -> None:
        if not callable(metric):
            raise TypeError(f"metric must be callable, got {type(metric).__name__}")
        self._metric = metric
        # Its value as a Python float where it is counted on the host (accuracy of CPU labels): added
        # without making a tensor of it, as `AverageMeter.update_float64` does, to the same bits.
        self._on_host = value_on_host(metric)

    def update(self, input: Any, target: Any, *, n: int | None = None) -> None:  # type: ignore[override]
        """Evaluate the metric on one batch and add it with weight `n`.

        Args:
            input: Predictions: a tensor, `NestedTensor` or nested sequence.
            target: Ground truth of the same kinds.
            n: Samples in the batch; defaults to the length of the (preprocessed) target.
        """
        if self.preprocess is not None:
            input, target = self.preprocess(input, target)
        self.update_preprocessed(input, target, n=n)

    def update_preprocessed(
        self, input: Any, target: Any, *, n: int | None = None, states: dict[MetricTask, MetricState] | None = None
    ) -> None:
        """Update from data that has already been preprocessed, sharing `states` between meters."""
        on_host = self._on_host
        if on_host is not None:
            number = on_host(input, target)
            if number is not None:
                self.update_float64(number, batch_size(target) if n is None else n)
                return
        value = evaluate_metric(self._metric, input, target, states)
        AverageMeter.update(self, value, batch_size(target) if n is None else n)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({metric_name(self.metric)})"


def evaluate_metric(
    metric: Callable, input: Any, target: Any, states: dict[MetricTask, MetricState] | None = None
) -> Tensor | float:
    """Apply `metric` to a batch; `MetricFunc`s share one state per task through `states`."""
    if not isinstance(metric, MetricFunc):
        return metric(input, target)
    if states is None:
        states = {}
    state = states.get(metric.task)
    if state is None:
        state = states[metric.task] = MetricState.from_batch(metric.task, input, target)
    return metric(state)


def batch_size(target: Any) -> int:
    """Number of samples in a batch: the length of its first dimension (1 for a scalar).

    A `NestedTensor` counts its valid elements along the ragged dimension.
    """
    if isinstance(target, Tensor):
        target = to_tensor(target, name="target")
        return target.shape[0] if target.ndim else 1
    try:
        return len(target)
    except TypeError:
        return 1


def metric_name(metric: Callable) -> str:
    """Name a metric is reported under: `MetricFunc.name`, else the function's `__name__`."""
    name = getattr(metric, "name", None) or getattr(metric, "__name__", None)
    if not isinstance(name, str) or name == "<lambda>":
        raise ValueError(f"cannot name metric {metric!r}; pass it as a keyword argument, e.g. acc=...")
    return name
