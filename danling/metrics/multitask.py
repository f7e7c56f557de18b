"""[`MultiTaskMetrics`][danling.metrics.MultiTaskMetrics]: one metric container per task or dataset."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union

import torch
from torch import Tensor

from danling.utils import RoundDict

from .distributed import pack_group, unpack_group
from .global_metrics import GlobalMetrics
from .meter import AverageMeter, MetersBase
from .metric_meter import MetricMeter, metric_name

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

try:  # Python 3.11+
    from typing import Self
except ImportError:  # pragma: no cover - Python 3.10
    from typing_extensions import Self

__all__ = ["MultiTaskBase", "MultiTaskMetrics"]

AGGREGATES = ("macro", "micro", "weighted", None)
AGGREGATE_KEY = "aggregate"
Container = Union[MetersBase, GlobalMetrics, AverageMeter, "MultiTaskBase"]  # a forward reference


class MultiTaskBase:
    """Named task containers with attribute and item access, in insertion order.

    A task is a [`StreamMetrics`][danling.metrics.StreamMetrics],
    [`AverageMeters`][danling.metrics.AverageMeters] or
    [`GlobalMetrics`][danling.metrics.GlobalMetrics], a single meter
    ([`MetricMeter`][danling.metrics.MetricMeter] or [`AverageMeter`][danling.metrics.AverageMeter]),
    a nested `MultiTaskBase`, or a metric function of `(input, target)`, which is wrapped in a
    `MetricMeter`. Assigning one as an attribute or item adds a task.

    `group` is the process group the tasks reduce over (`None`, the default, is every rank).
    Assigning it sets it on every task, and while it is set a task added later takes it over,
    so that all tasks combine the same ranks.
    """

    _group: ProcessGroup | None = None

    def __init__(self, **tasks: Container | Callable) -> None:
        object.__setattr__(self, "_tasks", {})
        for name, container in tasks.items():
            self[name] = container

    @property
    def group(self) -> ProcessGroup | None:
        """Process group the tasks reduce over (`None`: every rank); assigning it updates every task."""
        return self._group

    @group.setter
    def group(self, group: ProcessGroup | None) -> None:
        object.__setattr__(self, "_group", group)
        for container in self._tasks.values():
            container.group = group

    def __setitem__(self, name: str, container: Container | Callable) -> None:
        if not isinstance(container, TASK_TYPES):
            if not callable(container):
                raise TypeError(
                    f"task {name!r} must be a StreamMetrics, AverageMeters, GlobalMetrics, MetricMeter, "
                    f"MultiTaskMetrics or a metric function, got {type(container).__name__}"
                )
            container = MetricMeter(container)
        if container is self:
            raise ValueError(f"task {name!r} cannot be the collection itself")
        if name == AGGREGATE_KEY:
            raise ValueError(f"{AGGREGATE_KEY!r} is reserved for the aggregate across tasks")
        if self._group is not None:
            container.group = self._group
        self._tasks[name] = container

    def __getitem__(self, name: str) -> Container:
        return self._tasks[name]

    def __delitem__(self, name: str) -> None:
        del self._tasks[name]

    def __setattr__(self, name: str, value: Any) -> None:
        # Private names and class attributes (`group`, say) stay attributes; anything else that
        # can be a task becomes one, as `self[name] = value` would.
        if name.startswith("_") or hasattr(type(self), name) or not (isinstance(value, TASK_TYPES) or callable(value)):
            object.__setattr__(self, name, value)
        else:
            self[name] = value

    def __getattr__(self, name: str) -> Container:
        tasks = self.__dict__.get("_tasks", {})
        if name in tasks:
            return tasks[name]
        raise AttributeError(f"{type(self).__name__} has no attribute or task {name!r}")

    def __contains__(self, name: object) -> bool:
        return name in self._tasks

    def __iter__(self) -> Iterator[str]:
        return iter(self._tasks)

    def __len__(self) -> int:
        return len(self._tasks)

    def keys(self):
        return self._tasks.keys()

    def items(self):
        return self._tasks.items()

    def reset(self) -> Self:
        """Reset every task container; returns the collection."""
        for container in self._tasks.values():
            container.reset()
        return self

    def state_dict(self) -> dict[str, Any]:
        """This rank's state of every task container, by task name (see their `state_dict`)."""
        return {name: container.state_dict() for name, container in self._tasks.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue every task from `state`, written by a collection of the same tasks.

        Raises:
            ValueError: `state` names other tasks than this collection holds.
        """
        if not isinstance(state, Mapping) or set(state) != set(self._tasks):
            found = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"the state holds tasks {found}, but {type(self).__name__} has {sorted(self._tasks)}")
        for name, container in self._tasks.items():
            container.load_state_dict(state[name])

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={container!r}" for name, container in self._tasks.items())
        return f"{type(self).__name__}({inner})"

    def __getstate__(self) -> dict[str, Any]:
        return pack_group(self.__dict__.copy(), "_group")

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(unpack_group(state, "_group"))


TASK_TYPES = (MetersBase, GlobalMetrics, AverageMeter, MultiTaskBase)


class MultiTaskMetrics(MultiTaskBase):
    r"""Metrics of several tasks (or datasets) updated together, with an optional aggregate.

    `val`, `bat` and `avg` map each task name to its container's values; with `aggregate`
    set they also hold an `"aggregate"` entry that combines, for every metric path found in the
    tasks (`"acc"`, `"nested.acc"`), the tasks that have it: `"macro"` gives each such task the
    same weight, `"micro"` weights them by their sample counts, `"weighted"` by
    `aggregate_weights`; a task of weight 0 (under `"micro"`, one without samples yet) is left
    out rather than adding its NaN. A task that is a single meter or a metric function counts as one metric
    named after its function (the task's name for a lambda or an `AverageMeter`), so
    `metrics.a = accuracy` and `metrics.b = accuracy` combine into `aggregate["accuracy"]`. The
    text format lists one task per line and leaves the aggregate out.

    Args:
        aggregate: How to combine tasks, or `None` for no aggregate.
        aggregate_weights: Weight of each task for `aggregate="weighted"`.
        **tasks: Task containers by name (more can be assigned as attributes later).

    Examples:
        >>> from danling.metrics import StreamMetrics
        >>> from danling.metrics.functional import accuracy
        >>> metrics = MultiTaskMetrics(aggregate="macro")
        >>> metrics.dataset1 = StreamMetrics(acc=accuracy)
        >>> metrics.dataset2 = StreamMetrics(acc=accuracy)
        >>> metrics.update({
        ...     "dataset1": {"input": [0.2, 0.4, 0.6, 0.7], "target": [0, 1, 0, 1]},
        ...     "dataset2": ([0.1, 0.4, 0.6, 0.8], [1, 0, 0, 0]),
        ... })
        >>> f"{metrics:.4f}"
        'dataset1: acc: 0.5000 (0.5000)\ndataset2: acc: 0.2500 (0.2500)'
        >>> metrics.update({
        ...     "dataset1": ([0.1, 0.4, 0.6, 0.8], [0, 0, 1, 0]),
        ...     "dataset2": {"input": [0.2, 0.3, 0.6, 0.7], "target": [0, 0, 0, 1]},
        ... })
        >>> round(metrics.avg["aggregate"]["acc"], 4)
        0.5625
        >>> metrics.update(dict(loss=""))
        Traceback (most recent call last):
        ValueError: Task loss not found in ...

    See Also:
        [`GlobalMetrics`][danling.metrics.GlobalMetrics] and
        [`StreamMetrics`][danling.metrics.StreamMetrics]: the per-task containers.
    """

    def __init__(
        self,
        *,
        aggregate: str | None = None,
        aggregate_weights: Mapping[str, float] | None = None,
        **tasks: Container,
    ) -> None:
        if aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {', '.join(map(repr, AGGREGATES))}, got {aggregate!r}")
        if aggregate == "weighted" and not aggregate_weights:
            raise ValueError('aggregate="weighted" needs aggregate_weights, a mapping from task names to weights')
        super().__init__(**tasks)
        object.__setattr__(self, "aggregate", aggregate)
        object.__setattr__(self, "aggregate_weights", dict(aggregate_weights or {}))

    def update(self, values: Mapping[str, Mapping[str, Any] | Sequence]) -> None:
        """Update several task containers at once.

        Args:
            values: Task name to payload. A mapping payload is passed as keyword arguments to
                the container's `update`, a sequence payload as positional arguments.

        Raises:
            ValueError: If a task name is unknown (nothing is updated then).
        """
        for name in values:
            if name not in self._tasks:
                raise ValueError(f"Task {name} not found in {self!r}; known tasks: {', '.join(self._tasks)}")
        for name, payload in values.items():
            task = self._tasks[name]
            if isinstance(task, MultiTaskBase):  # a nested collection takes its own mapping of tasks
                task.update(payload)
            elif isinstance(payload, Mapping):
                task.update(**payload)
            elif isinstance(payload, Sequence) and not isinstance(payload, str):
                task.update(*payload)
            else:
                raise TypeError(f"payload of task {name} must be a mapping or a sequence, got {type(payload).__name__}")

    @property
    def val(self) -> RoundDict:
        return self.read("val")

    @property
    def bat(self) -> RoundDict:
        return self.read("bat")

    @property
    def avg(self) -> RoundDict:
        return self.read("avg")

    def read(self, kind: str) -> RoundDict:
        """Values of kind `"val"`, `"bat"` or `"avg"` for every task, plus the aggregate.

        A single-meter task reads as one value; in the aggregate it counts as the metric named
        after its metric function (`MetricFunc.name` or `__name__`), or after the task when the
        function has no name (a lambda) or the task is an `AverageMeter`. A nested collection
        reads as its own mapping, aggregate included.
        """
        return self.read_with_counts(kind)[0]

    def read_with_counts(self, kind: str) -> tuple[RoundDict, dict[str, Any]]:
        """[`read`][danling.metrics.MultiTaskMetrics.read] with the weight behind each value."""
        results, counts = {}, {}
        for name, container in self._tasks.items():
            results[name], counts[name] = _read_task(container, kind)
        output = RoundDict({name: values for name, values in results.items()})
        if self.aggregate is not None and results:
            output[AGGREGATE_KEY] = RoundDict.from_flat(self._aggregate(results, counts))
        return output, counts

    def _aggregate(self, results: Mapping[str, Any], counts: Mapping[str, Any]) -> dict[str, Any]:
        # Metrics are matched by their path below the task ("acc", "nested.acc"); a nested
        # collection's own aggregate is not a task of it and is left out. A single meter is one
        # metric whose path is its name (see `_meter_path`).
        flat, flat_counts = {}, {}
        for task, values in results.items():
            if isinstance(values, Mapping):
                flat[task], flat_counts[task] = _flatten(values), _flatten(counts[task])
            else:
                path = _meter_path(task, self._tasks[task])
                flat[task], flat_counts[task] = {path: values}, {path: counts[task]}
        combined: dict[str, Any] = {}
        names = list(dict.fromkeys(key for values in flat.values() for key in values))
        for key in names:
            entries = [(task, values[key]) for task, values in flat.items() if key in values]
            if self.aggregate == "macro":
                weights = [1.0] * len(entries)
            elif self.aggregate == "micro":
                weights = [float(flat_counts[task][key]) for task, _ in entries]
            else:
                missing = [task for task, _ in entries if task not in self.aggregate_weights]
                if missing:
                    raise ValueError(f"aggregate_weights has no weight for tasks {missing}")
                weights = [float(self.aggregate_weights[task]) for task, _ in entries]
            shapes = {task: tuple(getattr(value, "shape", ())) for task, value in entries}
            if len(set(shapes.values())) > 1:  # per-class values of tasks with different classes, say
                found = ", ".join(f"{task} {shape}" for task, shape in shapes.items())
                raise ValueError(f"cannot aggregate {key!r} over tasks of different shapes: {found}")
            combined[key] = _weighted_mean([value for _, value in entries], weights)
        return combined

    def __format__(self, format_spec: str) -> str:
        return "\n".join(f"{name}: {format(container, format_spec)}" for name, container in self._tasks.items())


def _read_task(task: Container, kind: str) -> tuple[Any, Any]:
    """One task's values of `kind` and their weights, whatever kind of container it is."""
    if isinstance(task, MultiTaskMetrics):
        return task.read_with_counts(kind)
    if isinstance(task, AverageMeter):
        if kind == "val":
            return task.val, task._n
        if kind not in ("bat", "avg"):
            raise ValueError(f"kind must be 'val', 'bat' or 'avg', got {kind!r}")
        synced = task.sync()
        return (synced.bat, synced.bat_count) if kind == "bat" else (synced.avg, synced.count)
    return task.read(kind)


def _meter_path(task: str, meter: AverageMeter) -> str:
    """The metric path of a single-meter task: its metric's name, so that tasks of the same metric
    (and containers holding it under that name) are combined; the task name when it has none."""
    return metric_name(meter.metric, default=task) if isinstance(meter, MetricMeter) else task


def _flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if prefix == "" and key == AGGREGATE_KEY and isinstance(value, Mapping):
            continue
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{path}."))
        else:
            flat[path] = value
    return flat


def _weighted_mean(values: list[Any], weights: list[float]) -> Any:
    # A task of weight 0 (no samples yet under "micro", a weight of 0 under "weighted") adds
    # nothing; multiplying its value (NaN, for a task without samples) by 0 would still give NaN.
    kept = [(value, weight) for value, weight in zip(values, weights) if weight]
    values, weights = [value for value, _ in kept], [weight for _, weight in kept]
    total = sum(weights)
    if total == 0:
        return float("nan")
    if any(isinstance(v, Tensor) for v in values):
        stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in values])
        return (stacked * torch.tensor(weights, dtype=torch.float64).view(-1, *[1] * (stacked.ndim - 1))).sum(0) / total
    return sum(v * w for v, w in zip(values, weights)) / total
