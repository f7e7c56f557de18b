"""[`StreamMetrics`][danling.metrics.StreamMetrics]: several per-batch metrics behind one `update`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .meter import AverageMeter, AverageMeters
from .metric_meter import MetricMeter, Preprocess, batch_size, metric_name
from .preprocess import base_preprocess
from .state import MetricFunc, MetricState, MetricTask

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["StreamMetrics"]


class StreamMetrics(AverageMeters):
    r"""A named set of [`MetricMeter`][danling.metrics.MetricMeter]s fed by one `update` call.

    The shared `preprocess` runs once per batch; then every meter evaluates its metric on the
    result (a `MetricMeter` with a `preprocess` of its own applies it to that result first).
    Metrics given as [`MetricFunc`][danling.metrics.MetricFunc]s of the same task share one
    [`MetricState`][danling.metrics.MetricState] per batch, so, for example, accuracy, F1 and
    MCC read a single confusion matrix. Values are averaged over batches weighted by batch
    size (exact for sample means such as accuracy or MSE, approximate for AUROC, F1 or
    correlations; use [`GlobalMetrics`][danling.metrics.GlobalMetrics] for exact values).

    Attributes:
        preprocess: Shared preprocessing of `(input, target)`.
        val: Latest local value of every meter.
        bat: Latest value of every meter, combined over the ranks of `group`.
        avg: Running average of every meter, over the ranks of `group`.
        sum: Local running sums.
        count: Local sample counts.

    Args:
        *args: Metric functions, named after their `__name__` (or `MetricFunc.name`).
        preprocess: Preprocessing applied to every batch before the metrics.
        device: Device used for collectives.
        group: Process group to reduce over (every rank when `None`); assignable later as
            `metrics.group`, which sets it on every meter.
        **meters: Named metric functions or `MetricMeter`s.

    Examples:
        >>> import torch
        >>> from danling.metrics.functional import accuracy
        >>> meters = StreamMetrics(acc=accuracy)
        >>> meters.update([0.1, 0.8, 0.6, 0.2], [0, 1, 0, 0])
        >>> round(meters.val["acc"], 4)
        0.75
        >>> round(meters.avg["acc"], 4)
        0.75
        >>> meters["acc"].update(torch.tensor([0.2, 0.8]), torch.tensor([0, 1]))
        >>> meters.count["acc"]
        6
        >>> meters.update(dict(loss=""))
        Traceback (most recent call last):
        TypeError: ...update() missing 1 required positional argument: 'target'

    See Also:
        [`AverageMeters`][danling.metrics.AverageMeters]: named meters of values you compute.
    """

    _creates_meters = False  # a state cannot rebuild a metric function: it names the metrics built here

    def __init__(
        self,
        *args: Callable | MetricFunc,
        preprocess: Preprocess | None = base_preprocess,
        device: torch.device | str | None = None,
        group: ProcessGroup | None = None,
        **meters: Callable | MetricFunc | MetricMeter,
    ) -> None:
        super().__init__(device=device, group=group)
        self.preprocess = preprocess
        for metric in args:
            self[metric_name(metric)] = metric
        for name, metric in meters.items():
            self[name] = metric

    def __setitem__(self, name: str, meter: Callable | MetricFunc | AverageMeter) -> None:
        if not isinstance(meter, AverageMeter):
            meter = MetricMeter(meter, self.preprocess, device=self.device)
            meter._shared_preprocess = True  # the container's, for use on its own: `update` runs it already
        super().__setitem__(name, meter)

    def update(self, input: Any, target: Any, *, n: int | None = None) -> None:  # type: ignore[override]
        """Evaluate every metric on one batch.

        Args:
            input: Predictions: a tensor, `NestedTensor` or nested sequence.
            target: Ground truth of the same kinds.
            n: Samples in the batch; defaults to the length of the (preprocessed) target, ignored
                targets included (counting them out would read the target on the host: pass `n`
                yourself for an exact mean over the counted ones).
        """
        preprocess = self.preprocess
        if preprocess is base_preprocess and type(input) is Tensor and type(target) is Tensor:
            # The per-batch case: what `base_preprocess` does to plain tensors, without the calls.
            if input.requires_grad:
                input = input.detach()
            if target.requires_grad:
                target = target.detach()
        elif preprocess is not None:
            input, target = preprocess(input, target)
        if n is None:  # a plain tensor (the per-batch case) is counted without the general helper
            n = (target.shape[0] if target.ndim else 1) if type(target) is Tensor else batch_size(target)
        states: dict[MetricTask, MetricState] | None = None  # made for the first MetricFunc
        for meter in self._meters.values():
            own = getattr(meter, "preprocess", None)
            if (
                own is not None
                and own is not preprocess
                and isinstance(meter, MetricMeter)
                and not meter.__dict__.get("_shared_preprocess")
            ):
                # A meter's own preprocessing, after the shared one: skipping it would silently
                # score what the meter was told not to see.
                meter.update(input, target, n=n)
                continue
            if type(meter) is MetricMeter:  # what `update_preprocessed` does, one call deep
                # (a metric counted on the host makes the meter a `_HostMetricMeter`: never this branch)
                metric = meter._metric
                if not isinstance(metric, MetricFunc):
                    AverageMeter.update(meter, metric(input, target), n)
                    continue
            if isinstance(meter, MetricMeter):
                if states is None:
                    states = {}
                meter.update_preprocessed(input, target, n=n, states=states)
            else:
                raise TypeError(f"StreamMetrics can only update MetricMeters, found {type(meter).__name__}")
