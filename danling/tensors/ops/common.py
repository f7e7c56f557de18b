"""Shared machinery of the op families: aligning operands with packed storage, per-element fallback."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import layout
from ..nested_tensor import NestedTensor


class Misaligned(Exception):
    """An operand cannot be mapped onto the packed values; run the op element by element."""


def plain(tensor: Tensor) -> Tensor:
    """Strip Tensor subclasses (e.g. PNTensor) so results are plain tensors, keeping autograd."""
    return tensor if type(tensor) is Tensor else tensor.as_subclass(Tensor)


def first_nested(args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> NestedTensor:
    """The first NestedTensor among the arguments (also looks inside lists/tuples)."""
    for arg in [*args, *(kwargs or {}).values()]:
        if isinstance(arg, NestedTensor):
            return arg
        if isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, NestedTensor):
                    return item
    raise TypeError("no NestedTensor among the arguments")


def trailing_static(nt: NestedTensor) -> int:
    """How many trailing element dims are static (and therefore trail the packed values too)."""
    if nt._ragged == 0:
        return 0
    return nt.ndim - 2 - max(nt._permutation[: nt._ragged])


def same_structure(a: NestedTensor, b: NestedTensor) -> bool:
    """Whether two NestedTensors pack their rows identically (static sizes may still differ)."""
    if a._shapes == b._shapes:
        return True
    if len(a) != len(b) or (a._permutation, a._ragged) != (b._permutation, b._ragged):
        return False
    dims = a._permutation[: a._ragged]
    return all(sa[d] == sb[d] for sa, sb in zip(a._shapes, b._shapes) for d in dims)


def align(arg: Any, ref: NestedTensor) -> Any:
    """Express ``arg`` so that it lines up with ``ref._values`` under broadcasting."""
    if isinstance(arg, NestedTensor):
        if len(arg) != len(ref):
            raise ValueError(f"NestedTensor batch sizes differ: {len(ref)} and {len(arg)}")
        if same_structure(arg, ref):
            return arg._values
        raise Misaligned
    if isinstance(arg, Tensor):
        arg = plain(arg)
        if arg.dim() == 0 or arg.dim() <= trailing_static(ref):
            return arg
        if arg.dim() <= ref.ndim:  # read like ``ref.tensor``: broadcast against the padded shape, keep real positions
            try:
                dense = torch.broadcast_to(arg, ref.shape)
            except RuntimeError:
                raise Misaligned from None
            return ref.nested_like(dense)._values
        raise Misaligned
    return arg


def element_arg(arg: Any, index: int, ref: NestedTensor) -> Any:
    """The operand seen by element ``index`` when an op runs element by element."""
    if isinstance(arg, NestedTensor):
        return arg._elements()[index]
    if isinstance(arg, Tensor) and arg.dim() == ref.ndim and arg.dim() > 0:
        row = plain(arg).movedim(0 if ref._batch_first or arg.dim() == 1 else 1, 0)
        row = row[index] if row.shape[0] > 1 else row[0]
        return row[tuple(slice(0, s) for s in ref._shapes[index])]
    if isinstance(arg, Tensor):
        return plain(arg)
    if isinstance(arg, (list, tuple)) and any(isinstance(a, NestedTensor) for a in arg):
        return type(arg)(element_arg(a, index, ref) for a in arg)
    return arg


def nested_arg(arg: Any, index: int, ref: NestedTensor) -> Any:
    """Like `element_arg`, but dense tensors are shared by every element (weights, indices, tables)."""
    if isinstance(arg, NestedTensor):
        if len(arg) != len(ref):
            raise ValueError(f"NestedTensor batch sizes differ: {len(ref)} and {len(arg)}")
        return arg._elements()[index]
    if isinstance(arg, Tensor):
        return plain(arg)
    if isinstance(arg, (list, tuple)) and any(isinstance(a, NestedTensor) for a in arg):
        return type(arg)(nested_arg(a, index, ref) for a in arg)
    return arg


def per_element(
    func: Callable,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    ref: NestedTensor | None = None,
    split_dense: bool = True,
) -> Any:
    """Run ``func`` on every element and nest the results (the reference semantics of every op).

    With ``split_dense`` a dense tensor that has the NestedTensor's number of dims is read like
    ``ref.tensor`` (row ``i`` cropped to element ``i``); otherwise dense tensors go to every element whole.
    """
    ref = ref if ref is not None else first_nested(args, kwargs)
    pick = element_arg if split_dense else nested_arg
    results = []
    for i in range(len(ref)):
        results.append(func(*[pick(a, i, ref) for a in args], **{k: pick(v, i, ref) for k, v in kwargs.items()}))
    return nest_results(results, ref)


def rebuild(like: Any, items: Sequence[Any]) -> Any:
    """A container of the kind of ``like`` (tuple, list, named tuple, torch.return_types) holding ``items``."""
    if hasattr(like, "_fields"):
        return type(like)(*items)
    if isinstance(like, list):
        return list(items)
    if type(like).__module__ == "torch.return_types":
        return type(like)(items)
    return tuple(items)


def nest_results(results: list[Any], ref: NestedTensor) -> Any:
    """Nest per-element results (tuples of results become tuples of NestedTensors)."""
    if results and isinstance(results[0], (tuple, list)) and not isinstance(results[0], Tensor):
        if len({len(r) for r in results}) > 1:
            raise ValueError(
                f"the op gives elements different numbers of results ({sorted({len(r) for r in results})}), "
                "so they cannot be nested; apply it to the elements (.unbind()) instead"
            )
        columns = list(zip(*results))
        return rebuild(results[0], [nest_results(list(col), ref) for col in columns])
    if results and not isinstance(results[0], Tensor):
        if all(r is None for r in results):
            return None
        return results
    return ref._from_elements(results)


def stack_or_nest(results: list[Tensor], ref: NestedTensor, batch_dim: int = 0) -> Tensor | NestedTensor:
    """Stack per-element results into a dense tensor when they share a shape, else nest them."""
    if results and all(r.shape == results[0].shape for r in results):
        return torch.stack(results, dim=batch_dim if results[0].dim() >= batch_dim else 0)
    return ref._from_elements(results)


def static_position(nt: NestedTensor, element_dim: int) -> int | None:
    """Packed position of a static element dim, ``None`` if the dim is ragged."""
    if element_dim in nt._permutation[: nt._ragged]:
        return None
    return 1 + nt._permutation[nt._ragged :].index(element_dim)


def element_dims(nt: NestedTensor, dims: Any) -> list[int | None]:
    """Map NestedTensor dims (int or sequence) to element dims (``None`` = batch)."""
    if isinstance(dims, int):
        dims = [dims]
    return [nt._element_dim(int(d)) for d in dims]


def is_simple(nt: NestedTensor) -> bool:
    return layout.is_simple(nt._permutation, nt._ragged)


def segment_ids(nt: NestedTensor) -> Tensor:
    """Element index of every packed row (cached per device)."""
    key = f"segments:{nt._values.device}"
    if key not in nt._cache:
        rows = layout.counts(nt._shapes, nt._permutation, nt._ragged)
        lengths = torch.tensor(rows, dtype=torch.long).to(nt._values.device, non_blocking=True)
        nt._cache[key] = torch.repeat_interleave(torch.arange(len(rows), device=nt._values.device), lengths)
        nt._cache[f"lengths:{nt._values.device}"] = lengths
    return nt._cache[key]


def row_lengths(nt: NestedTensor) -> Tensor:
    """Packed row count of every element, on the values' device (cached)."""
    segment_ids(nt)
    return nt._cache[f"lengths:{nt._values.device}"]
