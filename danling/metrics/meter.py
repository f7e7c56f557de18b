"""Running averages: [`AverageMeter`][danling.metrics.AverageMeter] and a named collection of them.

Updates never leave the device: tensor values are accumulated as tensors and only turned into
Python numbers when read. Reading `bat` or `avg` in a multi-process run is a collective (one
shape exchange and one all-reduce for the whole collection) over the meter's `group` (every rank
by default), so all ranks of that group must read together.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from danling.utils import RoundDict

from .distributed import is_distributed, pack_group, unpack_group
from .meter_state import MetersState, MeterState, _joins, _joins_float64, _stacked
from .meter_sync import (
    SyncedValues,
    _accumulation_dtype,
    _nan_dtype,
    _restore_dtype,
    _shape,
    _to_python,
    format_number,
    sync_meters,
)

if TYPE_CHECKING:  # only for annotations: builds without distributed support lack the class
    from torch.distributed import ProcessGroup

try:  # Python 3.11+
    from typing import Self
except ImportError:  # pragma: no cover - Python 3.10
    from typing_extensions import Self

__all__ = ["AverageMeter", "AverageMeters", "MetersBase", "SyncedValues", "format_number", "sync_meters"]

Number = int | float
# 0-d tensor updates are summed in groups of this many (see AverageMeter): one stack and one
# reduction per group instead of an addition per update.
PENDING_VALUES = 64
_FLOAT32 = struct.Struct("f")


def check_weight(n: Any) -> None:
    """Refuse a weight `n` that is not a finite non-negative number (`bool` is no number here)."""
    # The per-step call passes a plain int, which skips the full type check.
    if type(n) is not int and (isinstance(n, bool) or not isinstance(n, (int, float))):
        raise TypeError(f"n must be a finite non-negative number, got {n!r}")
    if not 0 <= n < math.inf:  # NaN fails too: it would make `count` and `avg` NaN for good
        raise ValueError(f"n must be a finite non-negative number, got {n!r}")


class AverageMeter(MeterState):
    r"""Keep the latest value, the weighted sum, the count and the running average of a quantity.

    Python numbers stay Python numbers. Tensors stay on their device while updating (no host
    synchronisation); reading turns a 0-d result into a `float` and returns tensors with
    dimensions as tensors, so every update of one meter must use the same shape.

    0-d tensors (a loss per step) are batched: `update` records `val` and the count at once but
    only keeps the tensor; every 64 updates, and whenever the weight `n`, the dtype or the device
    changes, the kept values are added to the sum with one `torch.stack` and one float64 (MPS:
    float32) reduction. Reads include the kept values without adding them, so where the groups
    are cut depends only on the sequence of updates, not on when or how often values are read.
    The result differs from adding one value at a time only in the order of float64 roundings.
    Since a kept tensor is read later, do not change it in place after passing it.

    Attributes:
        val: Latest value on this rank.
        bat: Latest value combined over the ranks of `group` (weighted by each rank's `n`);
            equals `val` without a process group.
        avg: Weighted average of everything added so far, over the ranks of `group`.
        sum: Weighted sum of the values added on this rank.
        count: Total weight added on this rank.
        device: Device used for collectives; detected when a synchronisation happens if `None`.
        group: Process group whose ranks `bat` and `avg` combine; `None` means every rank.
            Assignable; a group of one rank makes reads local. Copies share it; pickles drop it.

    Args:
        device: Optional device for distributed reductions.
        group: Optional process group to reduce over (e.g. the data-parallel group of a
            [`Topology`][danling.distributed.Topology]); every rank by default.

    Examples:
        >>> meter = AverageMeter()
        >>> meter.update(0.7)
        >>> meter.val
        0.7
        >>> meter.bat  # Same as val in non-distributed mode
        0.7
        >>> meter.avg
        0.7
        >>> meter.update(0.9)
        >>> meter.val
        0.9
        >>> meter.avg
        0.8
        >>> meter.sum
        1.6
        >>> meter.count
        2
        >>> # Weighted update
        >>> meter.update(value=0.5, n=3)
        >>> meter.avg
        0.62
        >>> meter.reset()
        AverageMeter(val=nan, avg=nan)

        Tensor values keep their shape:

        >>> import torch
        >>> meter.update(torch.tensor([1.0, 2.0]), n=2)
        >>> meter.update(torch.tensor([4.0, 8.0]))
        >>> meter.avg
        tensor([2., 4.])
        >>> f"{meter:.1f}"
        '[4.0, 8.0] ([2.0, 4.0])'

    See Also:
        [`MetricMeter`][danling.metrics.MetricMeter]: applies a metric function to each batch.
    """

    device: torch.device | str | None = None
    group: ProcessGroup | None = None

    def __init__(self, *, device: torch.device | str | None = None, group: ProcessGroup | None = None) -> None:
        self.group = group
        self.reset(device=device)

    def reset(self, *, device: torch.device | str | None = None) -> Self:
        """Forget every value; optionally change the device used for collectives.

        Returns:
            The meter itself, so `meter.reset()` can be chained or displayed.
        """
        if device is not None:
            self.device = device
        self._val: Number | Tensor = math.nan
        self._n: Number = 0
        self._total: Number | Tensor = 0.0  # the weighted sum, without the values still pending
        self._pending: list[Tensor | float] = []  # 0-d values of weight `_pending_n`, not yet added
        self._pending_n: Number = 1
        self._count: Number = 0
        self._updated = False
        self._aside: Number | Tensor | None = None  # a non-finite running sum set apart (`isolate_nonfinite`)
        return self

    def update(self, value: float | int | Tensor, n: int = 1) -> None:
        """Add `value` with weight `n` (0-d tensors are added in groups: see the class docstring).

        A value of weight `n=0` (the NaN mean of an empty batch, say) becomes `val` as given but
        adds nothing to `sum`, `count` or `avg`.

        Args:
            value: A number or a tensor (detached; accumulated on its own device).
            n: Weight of the value, typically the number of samples it summarises.

        Raises:
            TypeError: If `value` is not a number or tensor, or `n` is not a number.
            ValueError: If `n` is negative, NaN or infinite, or the value's shape differs from
                earlier updates (a number counts as shape `()`): adding would broadcast one into
                the other.
        """
        pending = self._pending
        if pending and type(value) is Tensor and type(n) is int and n == self._pending_n and n > 0:
            # The per-step loss (or per-batch metric of a fixed batch size) joining the queue of
            # its kind: what the branches below do for it (`is_cpu` first: a device comparison
            # builds two device objects).
            first = pending[0]
            if type(first) is Tensor:
                same_kind = value.dtype is first.dtype and (
                    (value.is_cpu and first.is_cpu) or value.device == first.device
                )
            else:  # a float added by `update_float64`
                same_kind = value.dtype is torch.float64 and value.is_cpu
            if same_kind and not value.ndim and not value.requires_grad:
                pending.append(value)
                if len(pending) >= PENDING_VALUES:
                    self._commit()
                self._val, self._n = value, n
                self._count += n
                self._updated = True
                return
        check_weight(n)
        if self._updated and _shape(value) != _shape(self._val):
            self._refuse_shape(value)
        if isinstance(value, Tensor):
            if value.requires_grad:
                value = value.detach()
            if not n:  # weightless (an empty batch, whose mean is NaN): shown as `val`, never summed
                self._tensor_sum(value)
            elif value.ndim or (isinstance(self._total, Tensor) and self._total.ndim):
                self._add_tensor(value, n)
            else:  # the per-step loss: queue it, no tensor op now
                pending = self._pending
                self._queue(value, n, not pending or _joins(value, pending[0]))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if n:
                self._commit()
                self._total = self._total + value * n
        else:
            raise TypeError(f"AverageMeter values must be numbers or tensors, got {type(value).__name__}")
        self._val, self._n = value, n
        self._count += n
        self._updated = True

    def update_float64(self, value: float, n: int = 1) -> None:
        """`update(torch.tensor(value, dtype=torch.float64), n)`, without making the tensor.

        The float waits among the pending 0-d values as that tensor would and is summed with them
        by the same float64 reduction, so every reading is the same to the bit; `val` is the float.
        A metric counted on the host (accuracy of a CPU batch, say) is added this way.
        """
        pending = self._pending
        # Values wait only in a meter of 0-d values: with some pending, the shape needs no check.
        if type(n) is int and n > 0 and (pending or not self._shape_set()):
            self._queue(value, n, not pending or _joins_float64(pending[0]))
        else:  # a weightless value, an odd weight or a meter of shaped values: the general path decides
            self.update(torch.scalar_tensor(value, dtype=torch.float64), n)
            return
        self._val, self._n = value, n
        self._count += n
        self._updated = True

    def _queue(self, value: Tensor | float, n: Number, joins: bool) -> None:
        """Add a 0-d value of weight `n` to the pending group; the group is summed first unless `value` `joins` it."""
        pending = self._pending
        if pending and (n != self._pending_n or not joins):
            self._commit()
        if not pending:
            self._pending_n = n
        pending.append(value)
        if len(pending) >= PENDING_VALUES:
            self._commit()

    def _shape_set(self) -> bool:
        """Whether the meter holds values with dimensions (a 0-d value must then be refused)."""
        total = self._total
        return (self._updated and bool(_shape(self._val))) or (isinstance(total, Tensor) and bool(total.ndim))

    def _refuse_shape(self, value: Any) -> None:
        # Adding would broadcast one shape into the other and mix unrelated quantities.
        raise ValueError(
            f"AverageMeter got a value of shape {tuple(_shape(value))}, but earlier values had shape "
            f"{tuple(_shape(self._val))}; reset the meter to change shapes"
        )

    def _tensor_sum(self, like: Tensor) -> None:
        """Make the running sum a (float64) tensor shaped like `like`, as adding one would."""
        if not isinstance(self._total, Tensor):
            self._commit()
            zeros = torch.zeros(like.shape, dtype=_accumulation_dtype(like), device=like.device)
            self._total = zeros + self._total

    def _add_tensor(self, value: Tensor, n: Number) -> None:
        self._commit()
        total = self._total
        if isinstance(total, Tensor):
            if total.ndim and total.shape != value.shape:
                raise ValueError(
                    f"AverageMeter got a value of shape {tuple(value.shape)}, but earlier values had shape "
                    f"{tuple(total.shape)}; reset the meter to change shapes"
                )
            # One op, float64 accumulation by promotion; `alpha` only when needed (it costs per call).
            self._total = torch.add(total, value) if n == 1 else torch.add(total, value, alpha=n)
        else:
            self._total = total + value.to(_accumulation_dtype(value)) * n

    def _commit(self) -> None:
        """Add the pending values to the running sum (every `PENDING_VALUES` updates, and on changes)."""
        if self._pending:
            self._total = self._running_sum()
            self._pending.clear()

    @property
    def _sum(self) -> Number | Tensor:
        # The weighted sum of every update: the running sum and what `isolate_nonfinite` set apart.
        aside = self._aside
        return self._running_sum() if aside is None else self._running_sum() + aside

    def isolate_nonfinite(self) -> bool:
        """Set a NaN or infinite running sum apart, so that sums taken from now on are finite again.

        `sum` and `avg` still include it (they stay NaN or infinite); what changes is the running
        sum that differences of sums read, such as the runner's step logs over the steps since the
        previous log: once a NaN entered it, every later difference was NaN too. Reads the sum on
        the host (a synchronisation on a device): call it where values are read anyway.

        Returns:
            Whether a non-finite sum was set apart.
        """
        running = self._running_sum()
        if bool(torch.isfinite(running).all()) if isinstance(running, Tensor) else math.isfinite(running):
            return False  # nothing committed: reads never move where the pending groups are cut
        self._commit()
        total = self._total
        self._aside = total if self._aside is None else self._aside + total
        self._total = torch.zeros_like(total) if isinstance(total, Tensor) else 0.0
        return True

    def _running_sum(self) -> Number | Tensor:
        # The weighted sum of the updates since the last `isolate_nonfinite` that set a sum apart.
        # Reading it leaves the pending values pending, so where the groups are cut depends only on
        # the sequence of updates, never on when values are read.
        total, pending, n = self._total, self._pending, self._pending_n
        if not pending:
            return total
        values = pending[0] if len(pending) == 1 and type(pending[0]) is Tensor else _stacked(pending)
        dtype = _accumulation_dtype(values)  # float64, as one add per value would accumulate
        group = values.sum(dtype=dtype) if n == 1 else (values.to(dtype) * n).sum()
        return torch.add(total, group) if isinstance(total, Tensor) else total + group

    @_sum.setter
    def _sum(self, total: Number | Tensor) -> None:
        self._total, self._aside = total, None
        self._pending.clear()

    @property
    def val(self) -> Any:
        return _to_python(self._val)

    @property
    def bat(self) -> Any:
        if not is_distributed(self.group):
            return self.val
        return self.sync().bat

    @property
    def avg(self) -> Any:
        if not is_distributed(self.group):
            return self._local_avg()
        return self.sync().avg

    @property
    def sum(self) -> Any:
        return _to_python(self._sum)

    @property
    def count(self) -> Number:
        return self._count

    def sync(self) -> SyncedValues:
        """Current-step and running values combined over the ranks of `group` (a collective there)."""
        return sync_meters([self], group=self.group)[0]

    def _local_avg(self) -> Any:
        if not self._count:
            like = self._val  # nothing weighs yet: NaN, shaped like the values seen
            if isinstance(like, Tensor) and like.ndim:
                return torch.full_like(like, math.nan, dtype=_nan_dtype(like))
            return math.nan
        total = self._sum
        if isinstance(total, Tensor) and not total.ndim and total.dtype == torch.float64:
            # A 0-d sum is read as a number anyway: the same float64 division on the host costs
            # one transfer instead of a division, a cast and a transfer.
            mean = total.item() / self._count
            like = self._val
            if isinstance(like, Tensor) and like.is_floating_point() and like.dtype != torch.float64:
                if like.dtype == torch.float32:  # the rounding `_restore_dtype` applies, without two tensor ops
                    try:
                        return _FLOAT32.unpack(_FLOAT32.pack(mean))[0]
                    except OverflowError:  # Pythons that refuse to round out of range (torch gives inf)
                        pass
                return torch.tensor(mean, dtype=like.dtype).item()
            return mean
        return _to_python(_restore_dtype(total / self._count, self._val))

    def __format__(self, format_spec: str) -> str:
        synced = self.sync()
        return f"{format_number(synced.bat, format_spec)} ({format_number(synced.avg, format_spec)})"

    def __repr__(self) -> str:
        # Local values only: a repr must never block on a collective.
        return f"{type(self).__name__}(val={self.val}, avg={self._local_avg()})"

    def __getstate__(self) -> dict[str, Any]:
        return pack_group(self.__dict__.copy())

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(unpack_group(state))


class MetersBase(MetersState):
    """Named collection of meters with dictionary and attribute access.

    `val`, `sum` and `count` are local; `bat` and `avg` are synchronised for all meters at
    once when read in a multi-process run, over the ranks of `group` (every rank when `None`).
    Assigning the collection's `group` sets it on every meter it holds, and while it is set a
    meter added later takes it over, so that reading one meter reduces over the same ranks.
    """

    _group: ProcessGroup | None = None

    def __init__(self, *, device: torch.device | str | None = None, group: ProcessGroup | None = None) -> None:
        object.__setattr__(self, "_meters", {})
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "_group", group)

    def __getitem__(self, name: str) -> AverageMeter:
        return self._meters[name]

    def __setitem__(self, name: str, meter: AverageMeter) -> None:
        if not isinstance(meter, AverageMeter):
            raise TypeError(f"{type(self).__name__} holds AverageMeter instances, got {type(meter).__name__}")
        if self._group is not None:
            meter.group = self._group
        self._meters[name] = meter

    @property
    def group(self) -> ProcessGroup | None:
        """Process group the meters reduce over (`None`: every rank); assigning it updates every meter."""
        return self._group

    @group.setter
    def group(self, group: ProcessGroup | None) -> None:
        object.__setattr__(self, "_group", group)
        for meter in self._meters.values():
            meter.group = group

    def __delitem__(self, name: str) -> None:
        del self._meters[name]

    def __getattr__(self, name: str) -> AverageMeter:
        meters = self.__dict__.get("_meters", {})
        if name in meters:
            return meters[name]
        raise AttributeError(f"{type(self).__name__} has no attribute or meter {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, AverageMeter):
            self[name] = value
        else:
            object.__setattr__(self, name, value)

    def __contains__(self, name: object) -> bool:
        return name in self._meters

    def __iter__(self) -> Iterator[str]:
        return iter(self._meters)

    def __len__(self) -> int:
        return len(self._meters)

    def keys(self):
        return self._meters.keys()

    def values(self):
        return self._meters.values()

    def items(self):
        return self._meters.items()

    def reset(self) -> Self:
        """Reset every meter; returns the collection."""
        for meter in self._meters.values():
            meter.reset()
        return self

    @property
    def val(self) -> RoundDict:
        return RoundDict.from_flat({name: meter.val for name, meter in self._meters.items()})

    @property
    def bat(self) -> RoundDict:
        return self.read("bat")[0]

    @property
    def avg(self) -> RoundDict:
        return self.read("avg")[0]

    @property
    def sum(self) -> RoundDict:
        return RoundDict.from_flat({name: meter.sum for name, meter in self._meters.items()})

    @property
    def count(self) -> RoundDict:
        return RoundDict.from_flat({name: meter.count for name, meter in self._meters.items()})

    def read(self, kind: str) -> tuple[RoundDict, dict[str, Number]]:
        """Values of kind `"val"`, `"bat"` or `"avg"` with the weight behind each of them."""
        if kind == "val":
            return self.val, {name: meter._n for name, meter in self._meters.items()}
        if kind not in ("bat", "avg"):
            raise ValueError(f"kind must be 'val', 'bat' or 'avg', got {kind!r}")
        if kind == "avg" and not is_distributed(self._group):  # the per-split read: skip `bat`, which nobody asked for
            meters = self._meters
            values = {name: meter._local_avg() for name, meter in meters.items()}
            return RoundDict.from_flat(values), {name: meter._count for name, meter in meters.items()}
        synced = sync_meters(list(self._meters.values()), self.device, names=list(self._meters), group=self._group)
        values = RoundDict.from_flat({name: getattr(s, kind) for name, s in zip(self._meters, synced)})
        counts = {name: s.bat_count if kind == "bat" else s.count for name, s in zip(self._meters, synced)}
        return values, counts

    def __format__(self, format_spec: str) -> str:
        synced = sync_meters(list(self._meters.values()), self.device, names=list(self._meters), group=self._group)
        return "\t".join(
            f"{name}: {format_number(s.bat, format_spec)} ({format_number(s.avg, format_spec)})"
            for name, s in zip(self._meters, synced)
        )

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={meter!r}" for name, meter in self._meters.items())
        return f"{type(self).__name__}({inner})"

    def __getstate__(self) -> dict[str, Any]:
        return pack_group(self.__dict__.copy(), "_group")

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(unpack_group(state, "_group"))


class AverageMeters(MetersBase):
    r"""Several [`AverageMeter`][danling.metrics.AverageMeter]s addressed by name.

    Meters are created on first update, so a training loop can simply report whatever it
    measures.

    Examples:
        >>> meters = AverageMeters()
        >>> meters.update({"loss": 0.6, "auroc": 0.7, "r2": 0.8})
        >>> f"{meters:.4f}"
        'loss: 0.6000 (0.6000)\tauroc: 0.7000 (0.7000)\tr2: 0.8000 (0.8000)'
        >>> meters['loss'].update(value=0.9, n=1)
        >>> f"{meters:.4f}"
        'loss: 0.9000 (0.7500)\tauroc: 0.7000 (0.7000)\tr2: 0.8000 (0.8000)'
        >>> meters.sum.dict()
        {'loss': 1.5, 'auroc': 0.7, 'r2': 0.8}
        >>> meters.count.dict()
        {'loss': 2, 'auroc': 1, 'r2': 1}
        >>> meters.reset()
        AverageMeters(...)
        >>> f"{meters:.4f}"
        'loss: nan (nan)\tauroc: nan (nan)\tr2: nan (nan)'

    See Also:
        [`StreamMetrics`][danling.metrics.StreamMetrics]: the same for metric functions of
        `(input, target)`.
    """

    def update(self, *args: Mapping[str, int | float | Tensor], **values: int | float | Tensor) -> None:
        """Add one value to each named meter, creating meters that do not exist yet.

        Args:
            *args: Mappings from meter names to values.
            **values: Values given as keyword arguments.

        Raises:
            TypeError: A keyword `n`: every keyword names a meter, so `update(loss=x, n=32)` would
                track a meter named `n` rather than weigh `loss`. Weigh through the meter
                (`meters["loss"].update(x, n=32)`); a meter named `n` goes in a mapping.
        """
        if "n" in values:
            raise TypeError(
                f"AverageMeters.update got n={values['n']!r}: keywords name meters, so this would track a meter "
                "named 'n', not weigh the others; weigh one meter with meters[name].update(value, n=...), "
                "or pass {'n': value} to track a meter named n"
            )
        for mapping in args:
            if not isinstance(mapping, Mapping):
                raise TypeError(f"positional arguments to update() must be mappings, got {type(mapping).__name__}")
            values = {**mapping, **values}
        meters = self._meters
        for name, value in values.items():
            meter = meters.get(name)
            if meter is None:
                meter = meters[name] = AverageMeter(device=self.device, group=self._group)
            meter.update(value)
