"""Reductions: over all real values, over element dims (padding ignored) or per element.

Dims are given in NestedTensor coordinates. Reducing

- no dim: reduces every real value (the concatenation of all elements);
- only the batch dim: reduces each element completely, giving one value per element;
- the batch dim together with every ragged dim: reduces the concatenation along those dims;
- element dims only: reduces each element, stacking the results when their shapes agree.

Sums and means over the ragged dim use segment sums on the packed values; max/min-like ops
pad with the identity of the reduction, so padding can never win.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor

from .. import layout
from ..nested_tensor import NestedTensor
from .common import element_dims, is_simple, row_lengths, segment_ids, stack_or_nest, static_position
from .elementwise import elementwise
from .registry import register, torch_variants, unsupported

MULTI_DIM = {"sum", "mean", "nansum", "amax", "amin", "all", "any", "logsumexp", "var", "std", "nanmean"}
SEGMENT = {"sum", "mean"}
PADDED = {"prod", "max", "min", "amax", "amin", "all", "any", "logsumexp", "nansum"}
NEEDS_DIM = {"argmax", "argmin", "logsumexp"}
NAMES = ["sum", "mean", "nansum", "nanmean", "prod", "max", "min", "amax", "amin", "all", "any", "logsumexp"]
NAMES += ["var", "std", "argmax", "argmin", "median"]


def _identity(name: str, dtype: torch.dtype) -> float | bool | int:
    if name in {"prod"}:
        return 1
    if name in {"all"}:
        return True
    if name in {"any", "nansum"}:
        return False if dtype == torch.bool else 0
    low = name in {"max", "amax", "logsumexp"}
    if dtype == torch.bool:
        return not low
    if dtype.is_floating_point:
        return float("-inf") if low else float("inf")
    info = torch.iinfo(dtype)
    return info.min if low else info.max


def _call(name: str, tensor: Tensor, dims: list[int], keepdim: bool, kwargs: dict[str, Any]) -> Any:
    func = getattr(torch, name)
    if name in MULTI_DIM:
        return func(tensor, dim=tuple(dims), keepdim=keepdim, **kwargs)
    if len(dims) != 1:
        raise ValueError(f"torch.{name} reduces a single dim at a time, got dims {dims}")
    return func(tensor, dims[0], keepdim=keepdim, **kwargs)


def _parse(args: tuple, kwargs: dict[str, Any]) -> tuple[Any, bool, dict[str, Any]]:
    args = list(args)
    dim = kwargs.pop("dim", args.pop(0) if args else None)
    keepdim = kwargs.pop("keepdim", args.pop(0) if args and isinstance(args[0], bool) else False)
    if args:
        raise TypeError(f"unexpected positional arguments {args} for a NestedTensor reduction")
    return dim, bool(keepdim), kwargs


def reduce(name: str, input: Any, *args: Any, **kwargs: Any) -> Any:
    """Reduce a NestedTensor with ``torch.<name>``; see the module docstring for dim semantics."""
    if not isinstance(input, NestedTensor):
        raise unsupported(getattr(torch, name), "only the first argument may be a NestedTensor")
    if name in {"max", "min"} and args and isinstance(args[0], Tensor):
        return elementwise(torch.maximum if name == "max" else torch.minimum, input, args[0])
    dim, keepdim, kwargs = _parse(args, kwargs)
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return _reduce_all(name, input, keepdim, kwargs)
    edims = element_dims(input, dim)
    if None in edims:
        return _reduce_with_batch(name, input, sorted({d for d in edims if d is not None}), keepdim, kwargs)
    edims = sorted(set(edims))  # type: ignore[arg-type]
    positions = [static_position(input, d) for d in edims]
    if None not in positions:
        out = _call(name, input._values, positions, keepdim, kwargs)  # type: ignore[arg-type]
        return _rewrap(out, input, edims, keepdim)
    if is_simple(input) and edims[0] == 0:
        if name in SEGMENT:
            return _place_batch(_segment(name, input, edims, keepdim, kwargs), input, edims, keepdim)
        if name in PADDED:
            fill = _identity(name, input.dtype)
            padded = layout.to_padded(input._values, input._shapes, input._permutation, 1, fill, input._rmask())
            out = _call(name, padded, [d + 1 for d in edims], keepdim, kwargs)
            return _place_batch(out, input, edims, keepdim)
    results = [_call(name, e, edims, keepdim, kwargs) for e in input._elements()]
    if isinstance(results[0], tuple):
        columns = [[r[i] for r in results] for i in range(len(results[0]))]
        return type(results[0])([_stack(col, input, edims, keepdim) for col in columns])
    return _stack(results, input, edims, keepdim)


def _reduce_all(name: str, nt: NestedTensor, keepdim: bool, kwargs: dict[str, Any]) -> Tensor:
    """Reduce every real value; ``keepdim`` keeps all of the NestedTensor's dims with size 1."""
    if name in {"argmax", "argmin"}:
        # An index into the flattened padded tensor (as torch would give for ``nt.tensor``), padding never wins.
        fill = _identity("max" if name == "argmax" else "min", nt.dtype)
        padded = layout.to_padded(nt._values, nt._shapes, nt._permutation, nt._ragged, fill, nt._rmask())
        if not nt._batch_first and padded.dim() > 1:
            padded = padded.movedim(0, 1)
        out = getattr(torch, name)(padded)
    elif name == "logsumexp":
        out = torch.logsumexp(nt._values.reshape(-1), 0)
    else:
        out = getattr(torch, name)(nt._values, **kwargs)
    return out.reshape([1] * nt.ndim) if keepdim else out


def _batch(nt: NestedTensor) -> int:
    return 0 if nt._batch_first or nt.ndim == 1 else 1


def _stack_dim(nt: NestedTensor, edims: list[int], keepdim: bool) -> int:
    """Where the batch dim lands after reducing element dims ``edims``."""
    if nt._batch_first or nt.ndim == 1:
        return 0
    return 1 if (0 not in edims or keepdim) else 0


def _stack(results: list[Tensor], nt: NestedTensor, edims: list[int], keepdim: bool) -> Tensor | NestedTensor:
    stacked = stack_or_nest(results, nt)
    if isinstance(stacked, NestedTensor):
        return stacked
    return stacked.movedim(0, 1) if _stack_dim(nt, edims, keepdim) == 1 and stacked.dim() > 1 else stacked


def _place_batch(out: Any, nt: NestedTensor, edims: list[int], keepdim: bool) -> Any:
    """Move the batch dim of a batch-first dense result to its logical position."""
    if isinstance(out, tuple):
        return type(out)([_place_batch(o, nt, edims, keepdim) for o in out])
    return out.movedim(0, 1) if _stack_dim(nt, edims, keepdim) == 1 and out.dim() > 1 else out


def _rewrap(out: Any, nt: NestedTensor, edims: list[int], keepdim: bool) -> Any:
    """Wrap packed values reduced along static dims back into a NestedTensor."""
    if isinstance(out, tuple):
        return type(out)([_rewrap(o, nt, edims, keepdim) for o in out])
    shapes = []
    for shape in nt._shapes:
        dims = [1 if d in edims else s for d, s in enumerate(shape)] if keepdim else []
        if not keepdim:
            dims = [s for d, s in enumerate(shape) if d not in edims]
        shapes.append(torch.Size(dims))
    nested = nt._derive(out, tuple(shapes))
    # Same rule as the per-element path: results that share a shape come back dense.
    return nested.tensor if all(s == shapes[0] for s in shapes) else nested


def _segment(name: str, nt: NestedTensor, edims: list[int], keepdim: bool, kwargs: dict[str, Any]) -> Tensor:
    values = nt._values
    if kwargs.get("dtype") is not None:
        values = values.to(kwargs["dtype"])
    if name == "mean" and not (values.is_floating_point() or values.is_complex()):
        raise RuntimeError(
            f"mean(): could not infer output dtype. Input dtype must be floating point, got {values.dtype}"
        )
    others = [d for d in edims if d != 0]
    if others:
        values = values.sum(dim=others, keepdim=keepdim) if name == "sum" else values.mean(dim=others, keepdim=keepdim)
    out = values.new_zeros((len(nt), *values.shape[1:])).index_add_(0, segment_ids(nt), values)
    if name == "mean":
        out = out / row_lengths(nt).to(out.dtype).view(-1, *[1] * (out.dim() - 1))
    return out.unsqueeze(1) if keepdim else out


def _reduce_with_batch(name: str, nt: NestedTensor, edims: list[int], keepdim: bool, kwargs: dict[str, Any]) -> Any:
    if not edims:
        results = []
        for element in nt._elements():
            flat = element.reshape(-1)
            results.append(
                _call(name, flat, [0], False, kwargs) if name not in MULTI_DIM else _full(name, flat, kwargs)
            )
        if isinstance(results[0], tuple):
            out = type(results[0])([torch.stack([r[i] for r in results]) for i in range(len(results[0]))])
            return type(out)([o.unsqueeze(0) for o in out]) if keepdim else out
        out = torch.stack(results)
        return out.unsqueeze(0) if keepdim else out
    ragged = set(nt._permutation[: nt._ragged])
    if not ragged <= set(edims):
        raise ValueError(
            f"reducing the batch dim together with element dims {edims} leaves ragged dims "
            f"{sorted(ragged - set(edims))}; include every ragged dim or none"
        )
    if name in NEEDS_DIM or name in {"max", "min", "median"}:
        raise ValueError(f"NestedTensor.{name} over the batch dim and other dims has no meaningful indices")
    positions = [0] + [static_position(nt, d) for d in edims if d not in ragged]
    out = _call(name, nt._values, positions, False, kwargs)  # type: ignore[arg-type]
    if keepdim:
        batch = _batch(nt)
        for logical in sorted([batch] + [nt._logical_dim(d) for d in edims]):
            out = out.unsqueeze(logical)
    return out


def _full(name: str, tensor: Tensor, kwargs: dict[str, Any]) -> Tensor:
    return getattr(torch, name)(tensor, **kwargs)


def _count_nonzero(input: NestedTensor, dim: Any = None) -> Any:
    """``count_nonzero``: over all real values, or along ``dim`` with the reduction rules above."""
    if dim is None:
        return torch.count_nonzero(input._values)
    return reduce("sum", input != 0, dim)


def _register() -> None:
    for name in NAMES:
        register(torch_variants(name), partial(reduce, name))
    register((torch.count_nonzero, torch.Tensor.count_nonzero), _count_nonzero)


_register()
