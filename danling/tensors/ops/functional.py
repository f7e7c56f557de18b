"""``torch.nn.functional`` ops used by sequence models, plus ``matmul`` and ``cat``.

Layers that act on trailing feature dims (linear, embedding, layer_norm) run once on the packed
values; softmax over the ragged dim uses segment reductions; losses see only real positions;
attention pads once and masks the padded keys.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import layout
from ..nested_tensor import NestedTensor
from .common import first_nested, is_simple, per_element, plain, segment_ids, static_position, trailing_static
from .registry import register


def linear(input: Any, weight: Tensor, bias: Tensor | None = None) -> Any:
    dense_weight = not isinstance(weight, NestedTensor) and not isinstance(bias, NestedTensor)
    if isinstance(input, NestedTensor) and dense_weight:
        bias = None if bias is None else plain(bias)
        if trailing_static(input) >= 1:
            return input._derive(F.linear(input._values, plain(weight), bias))
        if input.ndim == 2 and len({s[0] for s in input._shapes}) == 1:  # 1-D elements of one size: one matmul
            out = F.linear(input._values.view(len(input), -1), plain(weight), bias)
            return input._derive(out.reshape(-1), tuple(torch.Size(out.shape[1:]) for _ in input._shapes))
    return per_element(F.linear, (input, weight, bias), {}, split_dense=False)


def embedding(input: NestedTensor, weight: Tensor, *args: Any, **kwargs: Any) -> NestedTensor:
    if not isinstance(input, NestedTensor) or isinstance(weight, NestedTensor):
        raise TypeError("F.embedding supports NestedTensor indices with a dense weight only")
    out = F.embedding(input._values, plain(weight), *args, **kwargs)
    return input._derive(out, tuple(torch.Size((*s, out.shape[-1])) for s in input._shapes))


def one_hot(input: NestedTensor, num_classes: int = -1) -> NestedTensor:
    out = F.one_hot(input._values, num_classes)
    return input._derive(out, tuple(torch.Size((*s, out.shape[-1])) for s in input._shapes))


def _segment_softmax(values: Tensor, nt: NestedTensor, log: bool) -> Tensor:
    segments = segment_ids(nt)
    index = segments.view(-1, *[1] * (values.dim() - 1)).expand_as(values)
    peak = values.new_full((len(nt), *values.shape[1:]), float("-inf"))
    peak = peak.scatter_reduce(0, index, values.detach(), "amax", include_self=True)
    shifted = values - peak.index_select(0, segments)
    exp = shifted.exp()
    total = exp.new_zeros(peak.shape).index_add_(0, segments, exp)
    if log:
        return shifted - total.log().index_select(0, segments)
    return exp / total.index_select(0, segments)


def _softmax(kind: str, input: NestedTensor, dim: int | None = None, *args: Any, **kwargs: Any) -> NestedTensor:
    dtype = kwargs.pop("dtype", None)
    if dim is None:
        raise TypeError(f"{kind} on a NestedTensor needs an explicit dim")
    element_dim = input._element_dim(dim)
    if element_dim is None:
        raise ValueError(f"{kind} over the batch dim of a NestedTensor is not defined")
    values = input._values if dtype is None else input._values.to(dtype)
    if kind == "softmin":
        values = -values
    position = static_position(input, element_dim)
    if position is not None:
        func = F.log_softmax if kind == "log_softmax" else F.softmax
        return input._derive(func(values, position))
    if is_simple(input):
        return input._derive(_segment_softmax(values, input, kind == "log_softmax"))
    func = {"softmax": torch.softmax, "log_softmax": torch.log_softmax, "softmin": F.softmin}[kind]
    return input._from_elements([func(e if dtype is None else e.to(dtype), element_dim) for e in input._elements()])


def _trailing(func: Any, input: NestedTensor, normalized_shape: Any, *args: Any, **kwargs: Any) -> NestedTensor:
    count = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    if isinstance(input, NestedTensor) and trailing_static(input) >= count:
        args = tuple(plain(a) if isinstance(a, Tensor) else a for a in args)
        kwargs = {k: plain(v) if isinstance(v, Tensor) else v for k, v in kwargs.items()}
        return input._derive(func(input._values, normalized_shape, *args, **kwargs))
    return per_element(func, (input, normalized_shape, *args), kwargs)


def normalize(input: NestedTensor, p: float = 2.0, dim: int = 1, eps: float = 1e-12, out: None = None) -> NestedTensor:
    if out is not None:
        raise TypeError("F.normalize(out=...) is not supported for NestedTensor")
    element_dim = input._element_dim(dim)
    if element_dim is None:
        raise ValueError("F.normalize over the batch dim of a NestedTensor is not defined")
    position = static_position(input, element_dim)
    if position is not None:
        return input._derive(F.normalize(input._values, p, position, eps))
    return input._from_elements([F.normalize(e, p, element_dim, eps) for e in input._elements()])


def _attention_operand(x: Any, query: NestedTensor) -> tuple[Tensor, Tensor | None]:
    """A batch-first padded key/value and its per-element key lengths (``None``: every key is real).

    A dense operand with the query's number of dims carries the batch dim where the query has it;
    one with fewer dims is shared by every element.
    """
    if isinstance(x, NestedTensor):
        padded = layout.to_padded(x._values, x._shapes, x._permutation, x._ragged, 0, x._rmask())
        lengths = torch.tensor([s[-2] for s in x._shapes], dtype=torch.long)
        return padded, lengths.to(padded.device, non_blocking=True)
    x = plain(x)
    if x.dim() == query.ndim:
        return (x if query._batch_first else x.movedim(1, 0)), None
    return x.unsqueeze(0).expand(len(query), *x.shape), None


def scaled_dot_product_attention(
    query: NestedTensor,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    **kwargs: Any,
) -> NestedTensor:
    """Attention per element: pad once, hide padded keys, keep only real query rows."""
    if not isinstance(query, NestedTensor):
        raise TypeError("scaled_dot_product_attention on NestedTensors needs the query to be a NestedTensor")
    q = layout.to_padded(query._values, query._shapes, query._permutation, query._ragged, 0, query._rmask())
    (k, lengths), (v, _) = _attention_operand(key, query), _attention_operand(value, query)
    mask = None
    if lengths is not None:
        valid = torch.arange(k.shape[-2], device=k.device).view(1, -1) < lengths.view(-1, 1)
        mask = valid.view(len(query), *[1] * (q.dim() - 3), 1, k.shape[-2])
    if is_causal:
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        mask = causal if mask is None else mask & causal
    if attn_mask is not None:
        attn_mask = attn_mask.tensor if isinstance(attn_mask, NestedTensor) else plain(attn_mask)
        if mask is None:
            mask = attn_mask
        elif attn_mask.dtype == torch.bool:
            mask = mask & attn_mask
        else:
            mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill(~mask, float("-inf")) + attn_mask
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, **kwargs)
    shapes = tuple(torch.Size((*s[:-1], out.shape[-1])) for s in query._shapes)
    permutation, ragged = layout.canonical(shapes)
    same = (permutation, ragged) == (query._permutation, query._ragged)
    rmask = query._rmask() if same else layout.ragged_mask(shapes, permutation, ragged, out.device)
    return query._derive(layout.from_padded(out, shapes, permutation, ragged, rmask), shapes)


def matmul(input: Any, other: Any) -> Any:
    dense = isinstance(other, Tensor) and not isinstance(other, NestedTensor)
    if isinstance(input, NestedTensor) and dense and other.dim() in (1, 2) and trailing_static(input) >= 1:
        out = torch.matmul(input._values, plain(other))
        if other.dim() == 2:
            return input._derive(out)
        return input._derive(out, tuple(torch.Size(s[:-1]) for s in input._shapes))
    return per_element(torch.matmul, (input, other), {}, split_dense=_batched_dense(input, other))


def _batched_dense(*operands: Any) -> bool:
    """Whether a dense matmul operand carries the batch dim (3+ dims, as many as the NestedTensor)."""
    ref = first_nested(operands)
    return any(not isinstance(o, NestedTensor) and isinstance(o, Tensor) and o.dim() == ref.ndim > 2 for o in operands)


def rmatmul(self: NestedTensor, other: Any) -> Any:
    return per_element(torch.matmul, (other, self), {}, self, split_dense=_batched_dense(other, self))


def cat(tensors: Any, dim: int = 0) -> NestedTensor:
    ref = first_nested(list(tensors))
    tensors = [t if isinstance(t, NestedTensor) else _as_nested(t, ref) for t in tensors]
    element_dim = ref._element_dim(dim)
    if element_dim is None:
        shapes = tuple(s for t in tensors for s in t._shapes)
        canonical = layout.canonical(shapes)
        if all((t._permutation, t._ragged) == canonical for t in tensors):
            return ref._derive(torch.cat([t._values for t in tensors]), shapes)
        return ref._from_elements([e for t in tensors for e in t._elements()])
    return per_element(lambda *parts: torch.cat(parts, element_dim), tensors, {}, ref)


def _as_nested(tensor: Any, ref: NestedTensor) -> NestedTensor:
    """A dense ``torch.cat`` operand as a NestedTensor: its rows along ``ref``'s batch dim are whole elements."""
    tensor = plain(torch.as_tensor(tensor))
    if tensor.dim() != ref.ndim:
        raise ValueError(
            f"torch.cat: a dense operand needs {ref.ndim} dims like the NestedTensor, got shape {tuple(tensor.shape)}"
        )
    rows = tensor.movedim(1, 0) if not ref._batch_first and tensor.dim() > 1 else tensor
    return ref._from_elements(list(rows.unbind(0)))


def _register() -> None:
    register((F.linear,), linear)
    register((F.embedding,), embedding)
    register((F.one_hot,), one_hot)
    for kind in ("softmax", "log_softmax", "softmin"):
        funcs = (getattr(F, kind), getattr(torch, kind, None), getattr(torch.Tensor, kind, None))
        funcs += (getattr(torch.special, kind, None),)
        register(funcs, partial(_softmax, kind))
    register((F.layer_norm,), partial(_trailing, F.layer_norm))
    if hasattr(F, "rms_norm"):
        register((F.rms_norm,), partial(_trailing, F.rms_norm))
    register((F.normalize,), normalize)
    register((F.scaled_dot_product_attention,), scaled_dot_product_attention)
    register((torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__), matmul)
    register((torch.Tensor.__rmatmul__,), rmatmul)
    register((torch.cat, torch.concat, torch.concatenate), cat)


_register()
