"""Ops with a NestedTensor meaning of their own: stack, einsum, norms, set and search ops, batch_norm.

Each follows the per-element rule; where an op reduces over all values (``norm`` without ``dim``,
``unique``, ``histc``) "all values" means the real values of every element, never padding.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..indexing import _valid
from ..nested_tensor import NestedTensor
from . import reduction
from .common import element_dims, first_nested, per_element, plain, static_position
from .functional import _as_nested
from .registry import register


def stack(tensors: Any, dim: int = 0) -> NestedTensor:
    """Stack elements pairwise: element ``i`` of the result stacks element ``i`` of every operand."""
    ref = first_nested(list(tensors))
    operands = [t if isinstance(t, NestedTensor) else _as_nested(t, ref) for t in tensors]
    ndim = ref.ndim + 1
    if not -ndim <= dim < ndim:
        raise IndexError(f"torch.stack: dim {dim} is out of range for a result with {ndim} dims")
    dim %= ndim
    batch = 0 if ref._batch_first or ref.ndim == 1 else 1
    if dim == batch:
        raise ValueError(
            "torch.stack of NestedTensors along the batch dim is not defined: the new dim would come before "
            "the batch; stack along an element dim, or use torch.cat to join batches"
        )
    element_dim = dim - 1 if dim > batch else dim
    return per_element(lambda *parts: torch.stack(parts, element_dim), operands, {}, ref, split_dense=False)


def einsum(equation: str, *operands: Any) -> Tensor | NestedTensor:
    """``einsum`` whose subscripts name the NestedTensor dims, batch included.

    The batch subscript (at the batch position of every NestedTensor operand) must be the same
    letter; dense operands that use it carry the batch dim there too, others are shared. The
    equation runs per element without the batch letter. Results that keep no ragged dim come
    back dense when they share a shape (like reductions), otherwise as a NestedTensor.
    """
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    ref = first_nested(operands)
    inputs, arrow, output = equation.replace(" ", "").partition("->")
    if not arrow or "..." in equation:
        raise ValueError("einsum on NestedTensors needs an explicit output (->) and no ellipsis")
    subscripts = inputs.split(",")
    batch_position = 0 if ref._batch_first or ref.ndim == 1 else 1
    letters = {s[batch_position] for s, o in zip(subscripts, operands) if isinstance(o, NestedTensor)}
    if len(letters) != 1:
        raise ValueError(f"einsum: NestedTensor operands must share one batch subscript, got {sorted(letters)}")
    (batch,) = letters
    if output.count(batch) != 1:
        raise ValueError(f"einsum: the output must keep the batch subscript {batch!r} once (got {output!r})")
    ragged = {
        s[ref._logical_dim(d)]
        for s, o in zip(subscripts, operands)
        if isinstance(o, NestedTensor)
        for d in o._permutation[: o._ragged]
        if len(o) and len({sh[d] for sh in o._shapes}) > 1
    }
    element_equation = ",".join(s.replace(batch, "") for s in subscripts) + "->" + output.replace(batch, "")
    results = []
    for i in range(len(ref)):
        parts = [_einsum_operand(o, s, batch, i) for o, s in zip(operands, subscripts)]
        results.append(torch.einsum(element_equation, *parts))
    if not (ragged & set(output)) and all(r.shape == results[0].shape for r in results):
        return torch.stack(results, dim=output.index(batch))
    return ref._from_elements(results)


def _einsum_operand(operand: Any, subscript: str, batch: str, index: int) -> Tensor:
    if isinstance(operand, NestedTensor):
        return operand._elements()[index]
    operand = plain(operand)
    return operand.select(subscript.index(batch), index) if batch in subscript else operand


def isin(elements: Any, test_elements: Any, **kwargs: Any) -> Any:
    """Membership per value; a NestedTensor of test elements tests each element against its own set."""
    if isinstance(elements, NestedTensor) and isinstance(test_elements, NestedTensor):
        return per_element(lambda e, t: torch.isin(e, t, **kwargs), (elements, test_elements), {}, elements)
    if isinstance(elements, NestedTensor):
        return elements._derive(torch.isin(elements._values, test_elements, **kwargs))
    return torch.isin(elements, test_elements._values, **kwargs)


def bucketize(input: Any, boundaries: Tensor, **kwargs: Any) -> Any:
    if not isinstance(input, NestedTensor) or isinstance(boundaries, NestedTensor):
        return per_element(partial(torch.bucketize, **kwargs), (input, boundaries), {}, split_dense=False)
    return input._derive(torch.bucketize(input._values, plain(boundaries), **kwargs))


def searchsorted(sorted_sequence: Any, input: Any, **kwargs: Any) -> Any:
    if isinstance(input, NestedTensor) and not isinstance(sorted_sequence, NestedTensor) and sorted_sequence.dim() == 1:
        return input._derive(torch.searchsorted(plain(sorted_sequence), input._values, **kwargs))
    return per_element(partial(torch.searchsorted, **kwargs), (sorted_sequence, input), {}, split_dense=False)


def nonzero(input: NestedTensor, *, as_tuple: bool = False) -> Any:
    """Coordinates of non-zero real values in ``input.tensor`` (padding never counts)."""
    hits = (input.tensor != 0) & _valid(input)
    return torch.nonzero(hits, as_tuple=as_tuple)


def argwhere(input: NestedTensor) -> Tensor:
    return nonzero(input)


def unique(input: NestedTensor, *args: Any, dim: int | None = None, **kwargs: Any) -> Any:
    """Unique real values (``dim=None``); an inverse comes back shaped like ``input``."""
    if dim is not None:
        element_dim = input._element_dim(dim)
        if element_dim is None:
            raise ValueError("torch.unique along the batch dim of a NestedTensor is not defined: elements differ")
        return per_element(lambda e: torch.unique(e, *args, dim=element_dim, **kwargs), (input,), {}, input)
    out = torch.unique(input._values, *args, **kwargs)
    if isinstance(out, tuple) and (kwargs.get("return_inverse") or (len(args) > 1 and args[1])):
        return (out[0], input._derive(out[1]), *out[2:])
    return out


def values_only(func: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
    """An op over all real values (``histc``, ``bincount``): it runs on the packed values."""
    args = tuple(a._values if isinstance(a, NestedTensor) else a for a in args)
    kwargs = {k: v._values if isinstance(v, NestedTensor) else v for k, v in kwargs.items()}
    return func(input._values.reshape(-1) if func is torch.bincount else input._values, *args, **kwargs)


def norm(func: Any, kind: str, input: NestedTensor, *args: Any, **kwargs: Any) -> Any:
    """Norms: over all real values without ``dim``, otherwise per element with the reduction rules."""
    names = ("ord", "dim", "keepdim")
    options = dict(zip(names, args))
    for alias, name in (("p", "ord"), ("ord", "ord"), ("dim", "dim"), ("keepdim", "keepdim")):
        if alias in kwargs:
            options[name] = kwargs.pop(alias)
    ord_, dim, keepdim = options.get("ord"), options.get("dim"), bool(options.get("keepdim", False))
    if dim is None and kind == "matrix":
        dim = (-2, -1)
    if dim is None:
        if ord_ not in (None, "fro") and kind != "vector":
            raise ValueError(f"{kind} norm of order {ord_!r} on a NestedTensor needs dim")
        out = torch.linalg.vector_norm(input._values, 2 if ord_ in (None, "fro") else ord_, **kwargs)
        return out.reshape([1] * input.ndim) if keepdim else out
    edims = element_dims(input, dim)
    defaults = {"matrix": "fro", "torch": "fro", "linalg": None, "vector": 2}
    positional = [ord_ if ord_ is not None else defaults[kind]]
    if None in edims:
        if len(edims) > 1:
            raise ValueError(f"a norm over the batch dim together with dims {dim} is not defined for a NestedTensor")
        order = 2 if positional[0] in ("fro", None) else positional[0]
        results = [torch.linalg.vector_norm(e, order, **kwargs) for e in input._elements()]
        out = torch.stack(results)
        return out.unsqueeze(0) if keepdim else out
    edims = sorted(edims)  # type: ignore[type-var]
    positions = [static_position(input, d) for d in edims]
    if None not in positions and kind != "matrix":
        out = func(input._values, *positional, positions if len(positions) > 1 else positions[0], keepdim, **kwargs)
        return reduction._rewrap(out, input, edims, keepdim)
    single = edims if len(edims) > 1 else edims[0]
    results = [func(e, *positional, single, keepdim, **kwargs) for e in input._elements()]
    return reduction._stack(results, input, edims, keepdim)


def unbind(input: NestedTensor, dim: int = 0) -> tuple[Tensor, ...]:
    return input.unbind(dim)


def masked_select(input: NestedTensor, mask: Any) -> Tensor:
    """The real values where ``mask`` holds, in the order ``input.tensor.masked_select`` gives them."""
    if not isinstance(mask, NestedTensor) and mask.shape != input.shape:
        mask = torch.broadcast_to(plain(mask), input.shape)
    out = input[mask]
    return out if isinstance(out, NestedTensor) else out.reshape(-1)


def aminmax(input: NestedTensor, *, dim: int | None = None, keepdim: bool = False) -> Any:
    low, high = reduction.reduce("amin", input, dim, keepdim), reduction.reduce("amax", input, dim, keepdim)
    return torch.return_types.aminmax((low, high))


def std_var_mean(name: str, input: NestedTensor, dim: Any = None, *args: Any, **kwargs: Any) -> tuple:
    keepdim = kwargs.pop("keepdim", False)
    spread = reduction.reduce(name, input, dim, keepdim, *args, **kwargs)
    return spread, reduction.reduce("mean", input, dim, keepdim)


def quantile(
    func: Any, input: NestedTensor, q: Any, dim: int | None = None, keepdim: bool = False, **kwargs: Any
) -> Any:
    """Quantiles of all real values (``dim=None``) or of each element along ``dim``."""
    if dim is None:
        out = func(input._values.reshape(-1), q, **kwargs)
        return out.reshape(*out.shape, *[1] * input.ndim) if keepdim else out
    from .generic import reducing_dim_op

    return reducing_dim_op(lambda e, q_, dim: func(e, q_, dim, keepdim, **kwargs), 2, None, input, q, dim)


def dist(input: Any, other: Any, p: float = 2) -> Tensor:
    """The p-norm of ``input - other`` over all real values."""
    from .elementwise import elementwise

    return torch.linalg.vector_norm(elementwise(torch.sub, input, other)._values, p)


def reshape_as(method: str, input: NestedTensor, other: Any) -> NestedTensor:
    """Reshape every element like the matching element of ``other`` (a NestedTensor), or to ``other.shape``."""
    if not isinstance(other, NestedTensor):
        return getattr(input, method)(other.shape)
    if len(other) != len(input):
        raise ValueError(f"NestedTensor batch sizes differ: {len(input)} and {len(other)}")
    return input._from_elements([getattr(e, method)(s) for e, s in zip(input._elements(), other._shapes)])


def bilinear(input1: Any, input2: Any, weight: Tensor, bias: Tensor | None = None) -> Any:
    """``F.bilinear`` on the last dim: once on the packed values when both inputs share their layout."""
    if isinstance(input1, NestedTensor) and isinstance(input2, NestedTensor) and input1._shapes == input2._shapes:
        out = F.bilinear(input1._values, input2._values, plain(weight), None if bias is None else plain(bias))
        shapes = tuple(torch.Size((*s[:-1], out.shape[-1])) for s in input1._shapes)
        if out.shape[0] == input1._values.shape[0] and input1._values.dim() == out.dim():
            return input1._derive(out, shapes)
    return per_element(F.bilinear, (input1, input2, weight, bias), {}, split_dense=False)


def diagonal(input: NestedTensor, offset: int = 0, dim1: int = 0, dim2: int = 1) -> NestedTensor:
    """Diagonals of every element over two element dims (NestedTensor dims; the batch dim cannot be one)."""
    first, second = input._element_dim(dim1), input._element_dim(dim2)
    if first is None or second is None:
        raise ValueError(f"diagonal over the batch dim of a NestedTensor is not defined (dims {dim1}, {dim2})")
    return per_element(lambda e: torch.diagonal(e, offset, first, second), (input,), {}, input)


def index_put(inplace: bool, input: NestedTensor, indices: Any, values: Any, accumulate: bool = False) -> NestedTensor:
    """``index_put``: assignment at ``indices`` as ``input[indices] = values`` would do it."""
    if accumulate:
        raise TypeError("NestedTensor.index_put with accumulate=True is not supported: use the elements")
    target = input if inplace else input.clone()
    target[tuple(indices)] = values
    return target


def tensor_type(input: NestedTensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
    """``Tensor.type``: the type string without an argument, otherwise a converted NestedTensor."""
    if dtype is None:
        return input._values.type()
    return input._derive(input._values.type(dtype, non_blocking, **kwargs))


def register_hook(input: NestedTensor, hook: Any) -> Any:
    """A gradient hook that sees (and may replace) the gradient as a NestedTensor of ``input``'s structure."""

    def on_values(grad: Tensor) -> Tensor | None:
        out = hook(input._derive(grad, input._shapes))
        return out._values if isinstance(out, NestedTensor) else out

    return input._values.register_hook(on_values)


def _where(condition: Any, input: Any = None, other: Any = None) -> Any:
    if input is None and other is None:  # torch.where(condition) is nonzero(condition, as_tuple=True)
        return nonzero(condition, as_tuple=True)
    from .elementwise import elementwise

    return elementwise(torch.where, condition, input, other)


def _ravel(input: NestedTensor) -> Tensor:
    return input.flatten()


def _item(input: NestedTensor) -> Any:
    return input._values.item()


def _register() -> None:
    register((torch.stack,), stack)
    register((torch.einsum,), einsum)
    register((torch.isin,), isin)
    register((torch.bucketize,), bucketize)
    register((torch.searchsorted,), searchsorted)
    register((torch.nonzero, torch.Tensor.nonzero), nonzero)
    register((torch.argwhere, torch.Tensor.argwhere), argwhere)
    register((torch.unique, torch.Tensor.unique), unique)
    register((torch.where,), _where)
    register((torch.ravel, torch.Tensor.ravel), _ravel)
    register((torch.Tensor.item,), _item)
    register((F.bilinear,), bilinear)
    register((torch.Tensor.type,), tensor_type)
    register((torch.Tensor.register_hook,), register_hook)
    register((torch.diagonal, torch.Tensor.diagonal), diagonal)
    register((torch.index_put, torch.Tensor.index_put), partial(index_put, False))
    register((torch.Tensor.index_put_,), partial(index_put, True))
    for func in (torch.histc, torch.Tensor.histc, torch.bincount, torch.Tensor.bincount):
        register(func, partial(values_only, func))
    norms = {
        torch.norm: "torch",
        torch.Tensor.norm: "torch",
        torch.linalg.norm: "linalg",
        torch.linalg.vector_norm: "vector",
        torch.linalg.matrix_norm: "matrix",
        torch.nn.functional.normalize: None,
    }
    for func, kind in norms.items():
        if kind is not None:
            register(func, partial(norm, func, kind))


_register()
