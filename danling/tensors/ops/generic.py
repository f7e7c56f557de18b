"""Generic handlers that many torch ops share, so each op is one table entry instead of one function.

- `dim_op`: ops with a ``dim`` argument (sort, cumsum, gather, split...). The dim is a NestedTensor
  dim; on a static dim the op runs once on the packed values, otherwise on every element.
- `trailing_op`: ops on the last ``k`` dims (linear algebra). When those dims are static the packed
  values are already a batch of them, so the op runs once.
- `each` / `batched`: run on every element as is, or with a batch dim of one added for ops that
  only accept batched input (``F.interpolate``, ``F.group_norm``...).

Every path computes exactly what applying the op to each element and nesting the results gives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..nested_tensor import NestedTensor
from .common import first_nested, per_element, plain, rebuild, static_position, trailing_static
from .registry import func_name

BATCH_SPLITS = {"split", "chunk", "tensor_split", "split_with_sizes"}


def _dim(args: tuple, kwargs: dict[str, Any], position: int, default: Any) -> Any:
    if "dim" in kwargs:
        return kwargs["dim"]
    return args[position] if len(args) > position else default


def _with_dim(args: tuple, kwargs: dict[str, Any], position: int, dim: Any) -> tuple[tuple, dict[str, Any]]:
    if "dim" in kwargs or len(args) <= position:
        return args, {**kwargs, "dim": dim}
    return (*args[:position], dim, *args[position + 1 :]), kwargs


def _wrap_packed(out: Any, ref: NestedTensor) -> Any:
    """Wrap results computed on the packed values; ``None`` if a result does not keep the packed rows."""
    if isinstance(out, Tensor):
        fits = out.dim() == ref._values.dim() and out.shape[0] == ref._values.shape[0]
        return ref._derive(plain(out)) if fits else None
    if isinstance(out, (tuple, list)):
        wrapped = [_wrap_packed(o, ref) for o in out]
        return None if any(w is None for w in wrapped) else rebuild(out, wrapped)
    return None


def _packed_operands(args: tuple, kwargs: dict[str, Any], ref: NestedTensor) -> tuple[tuple, dict] | None:
    """Operands with NestedTensors replaced by packed values, if all of them share ``ref``'s layout."""

    def swap(arg: Any) -> Any:
        if isinstance(arg, NestedTensor):
            if arg._shapes != ref._shapes:
                raise LookupError
            return arg._values
        if isinstance(arg, Tensor) and arg.dim() > 0:
            raise LookupError  # a dense index or source would not line up with the packed rows
        return arg

    try:
        return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}
    except LookupError:
        return None


def dim_op(func: Callable, position: int, default: Any, *args: Any, **kwargs: Any) -> Any:
    """An op whose ``dim`` (argument ``position``, or keyword) is a NestedTensor dim."""
    ref = first_nested(args, kwargs)
    dim = _dim(args, kwargs, position, default)
    if not isinstance(args[0], NestedTensor) or dim is None:
        return per_element(func, args, kwargs, ref, split_dense=False)
    element_dim = ref._element_dim(int(dim))
    if element_dim is None:
        return _batch_dim_op(func, ref, args, kwargs, position)
    where = static_position(ref, element_dim)
    if where is not None:
        packed = _packed_operands(*_with_dim(args, kwargs, position, where), ref)
        if packed is not None:
            out = _wrap_packed(func(*packed[0], **packed[1]), ref)
            if out is not None:
                return out
    new_args, new_kwargs = _with_dim(args, kwargs, position, element_dim)
    return per_element(func, new_args, new_kwargs, ref, split_dense=False)


def _batch_dim_op(func: Callable, nt: NestedTensor, args: tuple, kwargs: dict[str, Any], position: int) -> Any:
    """Ops along the batch dim: only those that select or split whole elements are defined."""
    name = getattr(func, "__name__", "")
    rest = [a for i, a in enumerate(args) if i not in (0, position)] + [v for k, v in kwargs.items() if k != "dim"]
    if name in BATCH_SPLITS:
        sizes = rest[0]
        batch = torch.arange(len(nt))
        pieces = getattr(torch, name)(batch, sizes.tolist() if isinstance(sizes, Tensor) else sizes)
        return tuple(nt[p.tolist()] for p in pieces)
    if name == "index_select":
        return nt[rest[0].tolist()]
    if name == "select":
        return nt[int(rest[0])]
    if name == "narrow":
        start, length = int(rest[0]), int(rest[1])
        return nt[start : start + length]
    raise ValueError(
        f"{func_name(func)} along the batch dim of a NestedTensor is not defined: it would mix elements of "
        "different sizes; use an element dim, or .tensor for the padded batch"
    )


def reducing_dim_op(func: Callable, position: int, default: Any, *args: Any, **kwargs: Any) -> Any:
    """A dim op that removes its dim (kthvalue, mode, nanmedian): results stack when they share a shape."""
    nt = args[0]
    dim = _dim(args, kwargs, position, default)
    element_dim = nt._element_dim(int(dim)) if isinstance(nt, NestedTensor) and dim is not None else None
    if element_dim is None:
        raise ValueError(
            f"{func_name(func)} on a NestedTensor needs an element dim, got dim={dim}: along the batch dim it "
            "would mix elements of different sizes"
        )
    from .reduction import _stack  # the reductions' rule for where the batch dim of a dense result goes

    new_args, new_kwargs = _with_dim(args, kwargs, position, element_dim)
    keepdim = bool(kwargs.get("keepdim", False))
    results = [func(e, *new_args[1:], **new_kwargs) for e in nt._elements()]
    if isinstance(results[0], tuple):
        columns = [[r[i] for r in results] for i in range(len(results[0]))]
        return rebuild(results[0], [_stack(c, nt, [element_dim], keepdim) for c in columns])
    return _stack(results, nt, [element_dim], keepdim)


def trailing_op(func: Callable, k: int, reduces: bool, *args: Any, **kwargs: Any) -> Any:
    """An op on the last ``k`` dims of each element (linear algebra, distances).

    When those dims are static the packed values are already a batch of them and the op runs once.
    Ops that reduce the ``k`` dims away come back dense when every element's result has one shape.
    """
    nt = first_nested(args, kwargs)
    packed = _packed_operands(args, kwargs, nt) if trailing_static(nt) >= k else None
    if packed is not None:
        out = func(*packed[0], **packed[1])
        keep = nt._values.dim() - k  # packed dims ahead of the op's dims
        results = _trailing_wrap(out, nt, k, keep)
    else:
        results = per_element(func, args, kwargs, nt, split_dense=False)
    if reduces:
        return _densify(results)
    return results


def _trailing_wrap(out: Any, nt: NestedTensor, k: int, keep: int) -> Any:
    if isinstance(out, (tuple, list)):
        return rebuild(out, [_trailing_wrap(o, nt, k, keep) for o in out])
    tail = tuple(out.shape[keep:])
    shapes = tuple(torch.Size((*s[: len(s) - k], *tail)) for s in nt._shapes)
    return nt._derive(plain(out), shapes)


def _densify(result: Any) -> Any:
    """Results whose elements all share a shape become a dense tensor (the reduction convention)."""
    if isinstance(result, NestedTensor):
        shapes = set(result._shapes)
        if len(shapes) == 1:
            return torch.stack(list(result._elements())) if result._batch_first else result.tensor
        return result
    if isinstance(result, (tuple, list)):
        return rebuild(result, [_densify(r) for r in result])
    return result


def each(func: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run ``func`` on every element (dense operands are shared by all of them) and nest the results."""
    return per_element(func, args, kwargs, split_dense=False)


def batched(func: Callable, *args: Any, **kwargs: Any) -> Any:
    """Like `each`, for ops that need a batch dim: every element runs as a batch of one."""

    def call(element: Tensor, *rest: Any, **options: Any) -> Any:
        out = func(element.unsqueeze(0), *rest, **options)
        return tuple(o.squeeze(0) for o in out) if isinstance(out, tuple) else out.squeeze(0)

    if not isinstance(args[0], NestedTensor):
        raise TypeError(f"{func_name(func)} supports a NestedTensor as its first argument only")
    return per_element(call, args, kwargs, split_dense=False)


def in_place(handler: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    """The in-place form of an op: compute it, then write the result into ``self``'s packed values."""
    if not isinstance(self, NestedTensor):
        raise TypeError("an in-place op with a NestedTensor operand needs the NestedTensor to be the one modified")
    out = handler(self, *args, **kwargs)
    if out._shapes != self._shapes:
        raise RuntimeError("the in-place op would change element shapes; use its out-of-place form")
    self._values.copy_(out._values)
    return self
