"""Reading meters across ranks: one shape exchange and one all-reduce for a whole collection.

`sync_meters` combines the current-step and running values of any number of
[`AverageMeter`][danling.metrics.AverageMeter]s; the helpers below turn the accumulated tensors
back into what a meter reports (numbers for 0-d values, tensors otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .distributed import collective_device, gather_shapes, is_distributed, sum_across_ranks

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from .meter import AverageMeter

__all__ = ["SyncedValues", "format_number", "sync_meters"]

Number = int | float


@dataclass
class SyncedValues:
    """Values of one meter after a read: the current step and the running average, with weights."""

    bat: Any
    bat_count: Number
    avg: Any
    count: Number


def sync_meters(
    meters: Sequence[AverageMeter],
    device: torch.device | str | None = None,
    *,
    names: Sequence[str] | None = None,
    group: ProcessGroup | None = None,
) -> list[SyncedValues]:
    """Combine the current-step and running values of several meters over the ranks of `group`.

    One shape exchange and one all-reduce serve all meters; `group=None` means every rank, and
    a group of one rank gives the local values. A rank that never updated a meter contributes
    nothing to it, so uneven data is fine.
    """
    if not is_distributed(group):
        return [SyncedValues(m.val, m._n, m._local_avg(), m._count) for m in meters]
    if not meters:
        return []
    device = device or next((m.device for m in meters if m.device is not None), None)
    if device is None:
        device = next((m._val.device for m in meters if isinstance(m._val, Tensor)), None)
    local_shapes = [_shape(m._val) if m._updated else None for m in meters]
    per_rank = gather_shapes(local_shapes, device, group)
    shapes = []
    names = names if names is not None else [str(i) for i in range(len(meters))]
    for index, meter_name in enumerate(names):
        seen = {s for rank_shapes in per_rank if (s := rank_shapes[index]) is not None}
        if len(seen) > 1:
            raise ValueError(f"meter {meter_name!r} has different shapes across ranks: {sorted(map(tuple, seen))}")
        shapes.append(seen.pop() if seen else torch.Size())
    pieces = []
    for meter, shape in zip(meters, shapes):
        numel = shape.numel()
        if meter._updated:
            # A weightless value (NaN of an empty batch, say) contributes nothing, not NaN * 0.
            zeros = torch.zeros(numel, dtype=torch.float64)
            weighted_val = _flat64(meter._val, numel) * meter._n if meter._n else zeros
            pieces += [weighted_val, _flat64(meter._n, 1), _flat64(meter._sum, numel), _flat64(meter._count, 1)]
        else:
            pieces.append(torch.zeros(2 * numel + 2, dtype=torch.float64))
    wire = collective_device(device, group)
    total = sum_across_ranks(torch.cat([p.to(wire) for p in pieces]), wire, group).cpu()
    results, offset = [], 0
    for meter, shape in zip(meters, shapes):
        numel = shape.numel()
        vn, n, s, c = torch.split(total[offset : offset + 2 * numel + 2], [numel, 1, numel, 1])
        offset += 2 * numel + 2
        n_total, c_total = _as_number(n.item()), _as_number(c.item())
        bat = _shape_like(vn / n if n_total else vn * math.nan, shape, meter)
        avg = _shape_like(s / c if c_total else s * math.nan, shape, meter)
        results.append(SyncedValues(bat, n_total, avg, c_total))
    return results


def format_number(value: Any, format_spec: str) -> str:
    """Format a number, or a tensor/list element by element, with `format_spec`."""
    if isinstance(value, Tensor):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_number(item, format_spec) for item in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {format_number(v, format_spec)}" for k, v in value.items()) + "}"
    return format(value, format_spec)


def _accumulation_dtype(value: Tensor) -> torch.dtype:
    # float64 keeps long runs of float32 updates exact enough; MPS has no float64.
    return torch.float32 if value.device.type == "mps" else torch.float64


def _restore_dtype(value: Any, like: Any) -> Any:
    if isinstance(value, Tensor) and isinstance(like, Tensor) and like.is_floating_point():
        return value.to(like.dtype)
    if isinstance(value, Tensor) and value.dtype == torch.float64 and value.ndim:
        return value.to(torch.get_default_dtype())
    return value


def _to_python(value: Any) -> Any:
    """0-d tensors become Python numbers when read; tensors with dimensions stay tensors."""
    if isinstance(value, Tensor) and value.ndim == 0:
        return value.item()
    return value


def _shape(value: Any) -> torch.Size:
    return value.shape if isinstance(value, Tensor) else torch.Size()


def _flat64(value: Any, numel: int) -> Tensor:
    if isinstance(value, Tensor):
        flat = value.detach().to(torch.float64).reshape(-1)
        return flat.expand(numel) if flat.numel() == 1 else flat
    return torch.full((numel,), float(value), dtype=torch.float64)


def _shape_like(flat: Tensor, shape: torch.Size, meter: AverageMeter) -> Any:
    if not shape:
        return flat.item()
    device = meter._val.device if isinstance(meter._val, Tensor) else torch.device("cpu")
    return _restore_dtype(flat.reshape(shape), meter._val).to(device)


def _as_number(value: float) -> Number:
    return int(value) if float(value).is_integer() else value


def _nan_dtype(like: Tensor) -> torch.dtype:
    return like.dtype if like.is_floating_point() else torch.get_default_dtype()
