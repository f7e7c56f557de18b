"""Checkpointable local state of [`GlobalMetrics`][danling.metrics.GlobalMetrics].

What a `GlobalMetrics` keeps per task (confusion counts, regression moments, the predictions and
targets themselves, the latest batch) is saved as it is on this rank, with tensors as tensors.
Loading it and then feeding the same further batches gives the same values as the container
that wrote it: counts are integers (whatever groups they were counted in) and moments are
merged batch by batch, in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .sides import BinarySides, keeps_by_label

__all__ = ["NARROW_DTYPES", "GlobalMetricsState", "TaskStoreState", "join_rows", "narrow_join"]

# Dtypes kept class targets are narrowed to, smallest first (see `narrow_join`).
NARROW_DTYPES = (torch.int8, torch.int16, torch.int32)

_STORE_KEYS = frozenset({"counts", "moments", "inputs", "targets", "last_input", "last_target"})
_OPTIONAL_KEYS = frozenset({"bins", "bins_invalid", "last_counts"})
_ROW_KEYS = frozenset({"inputs", "targets", "last_input", "last_target"})  # data: any number of rows


class TaskStoreState:
    """`state_dict` / `load_state_dict` of the artifacts of one task; mixed into `_TaskStore`."""

    def state_dict(self) -> dict[str, Any]:
        counts = self.counts  # type: ignore[attr-defined]  # the queued batches are counted first
        data = self.local_data()  # type: ignore[attr-defined]
        last = self.latest()  # type: ignore[attr-defined]
        return {
            "counts": None if counts is None else counts.clone(),  # updated in place by later batches
            "moments": self.moments,  # type: ignore[attr-defined]
            "bins": None if self.bins is None else self.bins.clone(),  # type: ignore[attr-defined]
            "bins_invalid": None if self.bins_invalid is None else self.bins_invalid.clone(),  # type: ignore[attr-defined]
            "inputs": None if data is None else data[0],
            "targets": None if data is None else data[1],
            "last_input": None if last is None else _owned(last[0]),
            "last_target": None if last is None else _owned(last[1]),
            "last_counts": None if self.last_counts is None else self.last_counts.clone(),  # type: ignore[attr-defined]
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # "bins", "bins_invalid" and "last_counts" may be missing: states written before they existed had none.
        if not isinstance(state, Mapping) or set(state) - _OPTIONAL_KEYS != _STORE_KEYS:
            found = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"not the state of a GlobalMetrics task: expected keys {sorted(_STORE_KEYS)}, got {found}")
        for key, value in state.items():  # every entry is a tensor or absent; anything else fails here
            if value is not None and not isinstance(value, Tensor):
                kind = type(value).__name__
                raise ValueError(f"GlobalMetrics task state {key!r} must be a tensor or None, got {kind}")
        # Another task's counts or scores (other num_classes, ignore_index, bins...) would load
        # without complaint and be read as this task's: NaN or wrong values, silently.
        for key, expected in self.state_shapes().items():  # type: ignore[attr-defined]
            value = state.get(key)
            rows = key in _ROW_KEYS
            if value is not None and tuple(value.shape[1:] if rows else value.shape) != expected:
                found, wanted = tuple(value.shape), ("N", *expected) if rows else expected
                kind = self.task.kind  # type: ignore[attr-defined]
                raise ValueError(
                    f"GlobalMetrics task state {key!r} has shape {found}, but this container's {kind} task expects "
                    f"{wanted}: the state was written for another task (num_classes, num_labels, num_outputs, "
                    "ignore_index or bins)"
                )
        self.reset()  # type: ignore[attr-defined]
        self._counts, self.moments = state["counts"], state["moments"]
        self.bins = state.get("bins")  # type: ignore[attr-defined]
        self.bins_invalid = state.get("bins_invalid")  # type: ignore[attr-defined]
        inputs, targets = state["inputs"], state["targets"]
        if inputs is not None and self.order_free and keeps_by_label(inputs.device):  # type: ignore[attr-defined]
            self.sides = BinarySides(self.task.ignore_index)  # type: ignore[attr-defined]
            self.sides.add(inputs, targets.long())  # type: ignore[attr-defined]
            self.sides.last = None  # type: ignore[attr-defined]  # the state's own latest batch follows
        elif inputs is not None:
            self.inputs, self.targets = [inputs], [targets]
        if state["last_input"] is not None:
            self.last = (state["last_input"], state["last_target"])  # held on its own after a load
        self.last_counts = state.get("last_counts")  # type: ignore[attr-defined]


def _owned(tensor: Tensor) -> Tensor:
    # A view of the kept data (the latest batch is its tail) would save the whole storage.
    if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone()


class GlobalMetricsState:
    """`state_dict` / `load_state_dict` of a `GlobalMetrics`; mixed into it."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's stored artifacts and sample counts (tensors stay tensors; nothing is synchronised)."""
        stores = self._stores.values()  # type: ignore[attr-defined]
        return {
            "metrics": list(self.metrics),  # type: ignore[attr-defined]
            "count": self._count,  # type: ignore[attr-defined]
            "last_count": self._last_count,  # type: ignore[attr-defined]
            "tasks": {str(index): store.state_dict() for index, store in enumerate(stores)},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a `state_dict` of this rank, written by a `GlobalMetrics` of the same metrics.

        Raises:
            ValueError: `state` was written for other metrics or for tasks of another size
                (`num_classes`, `num_labels`, `num_outputs`, `ignore_index`, `bins`), or is not a
                `GlobalMetrics` state.
        """
        names = list(self.metrics)  # type: ignore[attr-defined]
        if not isinstance(state, Mapping) or "tasks" not in state:
            raise ValueError(f"not the state of a GlobalMetrics: {state!r}")
        stores = list(self._stores.values())  # type: ignore[attr-defined]
        if list(state.get("metrics") or ()) != names or len(state["tasks"]) != len(stores):
            raise ValueError(f"the state holds metrics {state.get('metrics')}, but this GlobalMetrics has {names}")
        for index, store in enumerate(stores):
            store.load_state_dict(state["tasks"][str(index)])
        self._cache.clear()  # type: ignore[attr-defined]
        self._count, self._last_count = int(state["count"]), int(state["last_count"])


def join_rows(tensors: list[Tensor]) -> Tensor:
    """Tensors concatenated along dim 0 (a single one returned as it is)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def narrow_join(targets: list[Tensor]) -> Tensor:
    """Class targets joined in the smallest integer dtype that holds them all (host int64 only).

    Reading the range costs nothing on the host; elsewhere it would wait for the device. Each
    batch is copied straight into the narrow result, never into an int64 one first.
    """
    if any(target.dtype is not torch.long or not target.is_cpu for target in targets):
        return join_rows(targets)
    low = high = 0
    for target in targets:
        if target.numel():
            least, most = torch.aminmax(target)
            low, high = min(low, int(least)), max(high, int(most))
    dtype = next((d for d in NARROW_DTYPES if torch.iinfo(d).min <= low and high <= torch.iinfo(d).max), None)
    if dtype is None:
        return join_rows(targets)
    joined = torch.empty((sum(t.shape[0] for t in targets), *targets[0].shape[1:]), dtype=dtype)
    row = 0
    for target in targets:
        joined[row : row + target.shape[0]] = target
        row += target.shape[0]
    return joined
