"""Checkpointable running state of [`AverageMeter`][danling.metrics.AverageMeter] and its collections.

The state is this rank's own (nothing is synchronised) and keeps tensors as tensors, so a
checkpoint written in the middle of a pass can continue the pass: a meter that loads the state
reads the same `avg`, `sum` and `count`, bit for bit, as the meter that wrote it, and keeps doing
so as both receive the same further updates (the values still waiting to be summed are kept as
they were, so the summation groups are cut at the same updates).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["MeterState", "MetersState"]


def _stacked(pending: list[Tensor | float]) -> Tensor:
    """The pending values as one 1-d tensor; floats (from `update_float64`) stand for float64 CPU values."""
    if all(type(value) is Tensor for value in pending):
        return torch.stack(pending)  # type: ignore[arg-type]
    return torch.tensor([value if type(value) is float else value.item() for value in pending], dtype=torch.float64)


def _joins(value: Tensor, first: Tensor | float) -> bool:
    """Whether the 0-d tensor `value` may wait in one group with the pending value `first`."""
    if type(first) is not Tensor:
        return value.dtype is torch.float64 and value.device.type == "cpu"
    return value.dtype is first.dtype and value.device == first.device


def _joins_float64(first: Tensor | float) -> bool:
    """Whether a float (a float64 CPU value) may wait in one group with the pending value `first`."""
    return type(first) is not Tensor or (first.dtype is torch.float64 and first.is_cpu)


_METER_KEYS = frozenset({"val", "n", "total", "pending", "pending_n", "count", "updated"})


class MeterState:
    """`state_dict` / `load_state_dict` of one running meter; mixed into `AverageMeter`."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's running state: latest value, weighted sum (pending 0-d values stacked), count.

        Returns:
            A mapping of numbers and tensors; `load_state_dict` continues from it exactly.
        """
        pending = self._pending  # type: ignore[attr-defined]
        return {
            "val": self._val,  # type: ignore[attr-defined]
            "n": self._n,  # type: ignore[attr-defined]
            # The whole sum: a part that `isolate_nonfinite` set apart is folded back in.
            "total": self._total if self._aside is None else self._total + self._aside,  # type: ignore[attr-defined]
            "pending": _stacked(pending) if pending else None,
            "pending_n": self._pending_n,  # type: ignore[attr-defined]
            "count": self._count,  # type: ignore[attr-defined]
            "updated": self._updated,  # type: ignore[attr-defined]
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a `state_dict` (of this rank); `device` and `group` stay as they are.

        Raises:
            ValueError: `state` is not a meter state (its keys are named in the message).
        """
        if not isinstance(state, Mapping) or set(state) != _METER_KEYS:
            found = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"not the state of a meter: expected keys {sorted(_METER_KEYS)}, got {found}")
        pending = state["pending"]
        self._val, self._n = state["val"], state["n"]
        self._total, self._pending_n, self._aside = state["total"], state["pending_n"], None
        # One 0-d tensor per pending value, as the updates left them (restacking gives the same tensor).
        self._pending = [] if pending is None else list(pending.unbind(0))
        self._count, self._updated = state["count"], bool(state["updated"])


class MetersState:
    """`state_dict` / `load_state_dict` of a named collection of meters; mixed into `MetersBase`."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's state of every meter, by name (see `AverageMeter.state_dict`)."""
        return {name: meter.state_dict() for name, meter in self._meters.items()}  # type: ignore[attr-defined]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue every meter from `state`; meters the state does not name are reset.

        Raises:
            ValueError: `state` names a meter the collection cannot create (a `StreamMetrics`
                holds only the metrics it was built with), or a meter's state is malformed.
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"the state of {type(self).__name__} must be a mapping of meter states, got {state!r}")
        meters = self._meters  # type: ignore[attr-defined]
        unknown = [name for name in state if name not in meters and not self._creates_meters]
        if unknown:
            raise ValueError(
                f"{type(self).__name__} has no meters {unknown} named in the state; it holds {sorted(meters)}"
            )
        for name, meter in meters.items():
            if name not in state:
                meter.reset()
        for name, meter_state in state.items():
            if name not in meters:
                from .meter import AverageMeter  # here: meter.py imports this module

                self[name] = AverageMeter(device=self.device)  # type: ignore[index,attr-defined]  # takes the group
            meters[name].load_state_dict(meter_state)

    # Whether `load_state_dict` may create the meters a state names (as a first `update` would);
    # a `StreamMetrics` holds metric meters only, which a state cannot rebuild.
    _creates_meters = True
