"""[`MetricMeter`][danling.metrics.MetricMeter]: a running average of a metric evaluated per batch."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .functional import value_on_host
from .meter import AverageMeter
from .preprocess import to_tensor
from .state import MetricFunc, MetricState, MetricTask

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

try:  # Python 3.11+
    from typing import Self
except ImportError:  # pragma: no cover - Python 3.10
    from typing_extensions import Self

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
    dimensions (per-class values, say) are averaged element-wise. A meter of the functional
    `accuracy` keeps small CPU batches and counts up to 64 of them at once (one `argmax` for all);
    any read counts the kept ones first, so the values are those of counting each batch at once.

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
        if self.__dict__.get("_deferred"):  # batches kept for the previous metric are its own
            self._settle()
        self._metric = metric
        # Its value as a Python float where it is counted on the host (accuracy of CPU labels): added
        # without making a tensor of it, as `AverageMeter.update_float64` does, to the same bits.
        self._on_host = value_on_host(metric)
        if type(self) in (MetricMeter, _HostMetricMeter):  # a subclass of yours keeps its class
            self.__class__ = MetricMeter if self._on_host is None else _HostMetricMeter
            self.__dict__.setdefault("_deferred", [])

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
            number = on_host.one(input, target)
            if number is not None:
                self.update_float64(number, batch_size(target) if n is None else n)
                return
        value = evaluate_metric(self._metric, input, target, states)
        AverageMeter.update(self, value, batch_size(target) if n is None else n)

    def _settle(self) -> None:
        """Add the batches kept for later (only `_HostMetricMeter` keeps any)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({_shown_name(self.metric)})"


# Small CPU batches a `_HostMetricMeter` keeps before it counts them together.
DEFERRED_BATCHES = 64
# The running state of `AverageMeter`: every access to it in a `_HostMetricMeter` counts the kept batches first.
_STATE_FIELDS = ("_val", "_n", "_total", "_pending", "_pending_n", "_count", "_updated", "_aside")


class _HostMetricMeter(MetricMeter):
    """A `MetricMeter` of a metric counted on the host (see `value_on_host`: accuracy) that counts its
    small CPU batches up to 64 at a time.

    Per batch it only keeps the scores and labels; every 64 batches, before a batch of another kind
    and before anything reads its running state, it counts the kept ones with one `argmax` and one
    read per side (in a training step a tensor call costs several microseconds: the per-batch
    `argmax` was about 1.5% of a small model's step) and adds their values in order, one
    `update_float64` each. Every field of that state is a property that counts the kept batches
    first, so every reading, internal or yours, is what counting each batch at once would give,
    to the bit. The kept tensors are read later: do not change them in place after `update`.
    `MetricMeter` picks this class itself; it reports itself as a `MetricMeter`.
    """

    def reset(self, *, device: torch.device | str | None = None) -> Self:
        self.__dict__["_deferred"] = []  # kept batches are dropped with the rest
        return super().reset(device=device)

    def update_preprocessed(
        self, input: Any, target: Any, *, n: int | None = None, states: dict[MetricTask, MetricState] | None = None
    ) -> None:
        on_host = self._on_host
        kind = on_host.kind(input, target)  # type: ignore[union-attr]
        if kind is not None and (n is None or (type(n) is int and n > 0)):
            state = self.__dict__
            deferred = state["_deferred"]
            if deferred:
                if kind != state["_deferred_kind"]:
                    self._settle()
                    deferred = state["_deferred"]
            elif self._shape_set():  # a meter of shaped values refuses the batch now, not when counting
                super().update_preprocessed(input, target, n=n, states=states)
                return
            state["_deferred_kind"] = kind
            if input.requires_grad:  # keep the scores, never the graph behind them
                input = input.detach()
            deferred.append((input, target, target.shape[0] if n is None else n))
            if len(deferred) >= DEFERRED_BATCHES:
                self._settle()
            return
        super().update_preprocessed(input, target, n=n, states=states)

    def _settle(self) -> None:
        state = self.__dict__
        batches = state["_deferred"]
        if not batches:
            return
        inputs, targets = [batch[0] for batch in batches], [batch[1] for batch in batches]
        values = self._on_host.many(inputs, targets, state["_deferred_kind"])  # type: ignore[union-attr]
        state["_deferred"] = []  # before the updates below, which read the state through the properties
        for (_, _, n), value in zip(batches, values):
            self.update_float64(value, n)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.__dict__["_deferred"] = []  # the state replaces everything, kept batches included
        super().load_state_dict(state)

    def __getstate__(self) -> dict[str, Any]:
        self._settle()
        return super().__getstate__()

    def __repr__(self) -> str:
        return f"MetricMeter({_shown_name(self.metric)})"


def _settling(name: str) -> property:
    def get(self: _HostMetricMeter) -> Any:
        state = self.__dict__
        if state["_deferred"]:
            self._settle()
        return state[name]

    def set(self: _HostMetricMeter, value: Any) -> None:
        self.__dict__[name] = value

    return property(get, set)


for _field in _STATE_FIELDS:
    setattr(_HostMetricMeter, _field, _settling(_field))


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


def metric_name(metric: Callable, default: str | None = None) -> str:
    """Name a metric is reported under: `MetricFunc.name`, else the function's `__name__`.

    A metric without a usable name (a lambda, a callable object) gets `default`; without one
    that is an error.
    """
    name = getattr(metric, "name", None) or getattr(metric, "__name__", None)
    if isinstance(name, str) and name != "<lambda>":
        return name
    if default is not None:
        return default
    raise ValueError(f"cannot name metric {metric!r}; pass it as a keyword argument, e.g. acc=...")


def _shown_name(metric: Callable) -> str:
    """How a meter's repr shows its metric: its name, `<lambda>`, or the callable's type."""
    anonymous = "<lambda>" if getattr(metric, "__name__", None) == "<lambda>" else type(metric).__name__
    return metric_name(metric, default=anonymous)
