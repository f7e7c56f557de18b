"""Shape ops applied to every element.

Dims are NestedTensor dims (the batch dim counts; it can never be moved or merged), except for
``reshape``/``view`` whose target shape is the shape of each element (a full shape, batch size
first, is accepted where some element cannot take the target as its own shape). When an op leaves the
ragged dims alone it runs once on the packed values; otherwise it runs element by element.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from math import prod
from typing import Any

import torch
from torch import Tensor

from .. import layout
from ..nested_tensor import NestedTensor
from .common import is_simple, static_position
from .registry import register


def _dims_arg(dims: tuple) -> list[int]:
    if len(dims) == 1 and isinstance(dims[0], (list, tuple, torch.Size)):
        dims = tuple(dims[0])
    return [int(d) for d in dims]


def _edim(nt: NestedTensor, dim: int, op: str) -> int:
    element_dim = nt._element_dim(dim)
    if element_dim is None:
        raise ValueError(f"NestedTensor.{op} cannot act on the batch dim (dim={dim})")
    return element_dim


def _each(nt: NestedTensor, fn: Callable[[Tensor], Tensor]) -> NestedTensor:
    return nt._from_elements([fn(e) for e in nt._elements()])


def permute_elements(nt: NestedTensor, order: Sequence[int]) -> NestedTensor:
    """Permute element dims (``order[j]`` is the old dim that becomes dim ``j``)."""
    order = list(order)
    if order == list(range(len(order))):
        return nt
    shapes = tuple(torch.Size([s[d] for d in order]) for s in nt._shapes)
    permutation, ragged = layout.canonical(shapes)
    if [order[j] for j in permutation[:ragged]] == list(nt._permutation[: nt._ragged]):
        old_static = list(nt._permutation[nt._ragged :])
        positions = [1 + old_static.index(order[j]) for j in permutation[ragged:]]
        values = nt._values if positions == sorted(positions) else nt._values.permute(0, *positions)
        return nt._derive(values, shapes)
    return _each(nt, lambda e: e.permute(order))


def permute(input: NestedTensor, *dims: Any) -> NestedTensor:
    dims_list = [d % input.ndim for d in _dims_arg(dims)]
    if sorted(dims_list) != list(range(input.ndim)):
        raise ValueError(f"permute needs a permutation of {input.ndim} dims, got {dims_list}")
    batch = 0 if input._batch_first or input.ndim == 1 else 1
    if dims_list[batch] != batch:
        raise ValueError(f"NestedTensor.permute cannot move the batch dim (dims={dims_list})")
    return permute_elements(input, [input._element_dim(d) for j, d in enumerate(dims_list) if j != batch])


def transpose(input: NestedTensor, dim0: int, dim1: int) -> NestedTensor:
    ndim = input.ndim
    if ndim > 1 and {dim0 % ndim, dim1 % ndim} == {0, 1} and -ndim <= min(dim0, dim1) and max(dim0, dim1) < ndim:
        # Swapping the batch dim with its neighbour only changes which of the two comes first.
        return input._derive(input._values, input._shapes, batch_first=not input._batch_first)
    d0, d1 = _edim(input, dim0, "transpose"), _edim(input, dim1, "transpose")
    order = list(range(input.ndim - 1))
    order[d0], order[d1] = order[d1], order[d0]
    return permute_elements(input, order)


def movedim(input: NestedTensor, source: Any, destination: Any) -> NestedTensor:
    source = [source] if isinstance(source, int) else list(source)
    destination = [destination] if isinstance(destination, int) else list(destination)
    src = [_edim(input, d, "movedim") for d in source]
    dst = [_edim(input, d, "movedim") for d in destination]
    n = input.ndim - 1
    order = [-1] * n
    for s, d in zip(src, dst):
        order[d] = s
    rest = iter(i for i in range(n) if i not in src)
    order = [o if o >= 0 else next(rest) for o in order]
    return permute_elements(input, order)


def _target(shape: tuple) -> list[int]:
    return _dims_arg(shape)


def _fits(shape: torch.Size, target: list[int]) -> bool:
    """Whether an element of ``shape`` can be viewed as ``target`` (which may infer one size, -1)."""
    known = prod(size for size in target if size != -1)
    inferred = target.count(-1)
    if inferred == 0:
        return known == prod(shape)
    return inferred == 1 and known != 0 and prod(shape) % known == 0


def _element_target(input: NestedTensor, target: list[int]) -> list[int] | list[list[int]]:
    """Per-element target shapes when ``target`` is a full shape (batch first), else ``target`` itself.

    ``target`` is the shape of each element whenever every element fits it, also when its first
    size happens to equal the batch size. Only otherwise is a target that starts with the batch
    size read as a full shape, where a ragged dim may be given as its padded size (or -1) and
    then keeps each element's own size.
    """
    if not (input._batch_first and len(target) >= 2 and target[0] == len(input)):
        return target
    if all(_fits(shape, target) for shape in input._shapes):
        return target
    rest, padded = target[1:], input.shape[1:]
    ragged = set(input._permutation[: input._ragged]) if len({tuple(s) for s in input._shapes}) > 1 else set()
    if rest == list(padded):
        return [list(s) for s in input._shapes]
    out = []
    for shape in input._shapes:
        own = [j in ragged and j < len(padded) and size in (padded[j], -1) for j, size in enumerate(rest)]
        dims = [shape[j] if keep else size for j, (size, keep) in enumerate(zip(rest, own))]
        if dims.count(-1) > 1:
            raise ValueError(f"cannot infer more than one dim of {target} for an element of shape {tuple(shape)}")
        out.append(dims)
    return out


def _reshape(input: NestedTensor, shape: tuple, method: str) -> NestedTensor:
    if method == "view" and len(shape) == 1 and isinstance(shape[0], torch.dtype):
        return input._derive(input._values.view(shape[0]))
    target = _element_target(input, _target(shape))
    if target and isinstance(target[0], list):
        per = target
        return input._from_elements([getattr(e, method)(t) for e, t in zip(input._elements(), per)])
    if is_simple(input) and target and target[0] == -1 and -1 not in target[1:]:
        static = prod(input._values.shape[1:])
        rest = prod(target[1:])
        if rest and static % rest == 0:
            values = getattr(input._values, method)(-1, *target[1:])
            factor = static // rest
            shapes = tuple(torch.Size((s[0] * factor, *target[1:])) for s in input._shapes)
            return input._derive(values, shapes)
    return _each(input, lambda e: getattr(e, method)(target))


def reshape(input: NestedTensor, *shape: Any) -> NestedTensor:
    return _reshape(input, shape, "reshape")


def view(input: NestedTensor, *shape: Any) -> NestedTensor:
    return _reshape(input, shape, "view")


def flatten(input: NestedTensor, start_dim: int = 0, end_dim: int = -1) -> Tensor | NestedTensor:
    start = input._element_dim(start_dim)
    if start is None or (not input._batch_first and input.ndim > 1 and input._element_dim(end_dim) is None):
        return _flatten_batch(input, start_dim, end_dim)
    end = _edim(input, end_dim, "flatten")
    if end < start:
        raise ValueError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim}")
    if input.ndim == 1 or start == end:
        return input
    if is_simple(input):
        values = input._values.flatten(start, end)
        shapes = tuple(torch.Size((*s[:start], prod(s[start : end + 1]), *s[end + 1 :])) for s in input._shapes)
        return input._derive(values, shapes)
    return _each(input, lambda e: e.flatten(start, end))


def _flatten_batch(input: NestedTensor, start_dim: int, end_dim: int) -> Tensor:
    """Flatten a range of dims that includes the batch dim: the result has no batch, so it is dense.

    Like ``input.tensor.flatten(start_dim, end_dim)`` with the padding left out: elements are
    flattened over the covered element dims and concatenated (in batch order).
    """
    ndim = input.ndim
    start, end = start_dim % ndim, end_dim % ndim
    if end < start:
        raise ValueError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim}")
    if ndim == 1:
        return input._values
    if start != 0:
        raise ValueError(f"flatten({start_dim}, {end_dim}) would merge the batch dim with only some dims before it")
    last = end - 1  # last element dim merged into the batch
    parts = [e.flatten(0, last) if last >= 0 else e.unsqueeze(0) for e in input._elements()]
    if len({p.shape[1:] for p in parts}) > 1:
        raise ValueError(
            f"flatten({start_dim}, {end_dim}) leaves dims whose sizes differ between elements: the result is ragged"
        )
    if is_simple(input) and last >= 0:
        return input._values.flatten(0, last)
    return torch.cat(parts)


def unflatten(input: NestedTensor, dim: int, sizes: Sequence[int]) -> NestedTensor:
    element_dim = _edim(input, dim, "unflatten")
    position = static_position(input, element_dim)
    if position is not None and is_simple(input):
        values = input._values.unflatten(position, sizes)
        return input._derive(values, _shapes_from(input, values, element_dim, len(sizes)))
    return _each(input, lambda e: e.unflatten(element_dim, sizes))


def _shapes_from(input: NestedTensor, values: Tensor, element_dim: int, count: int) -> layout.Shapes:
    sizes = tuple(values.shape[element_dim : element_dim + count])
    return tuple(torch.Size((*s[:element_dim], *sizes, *s[element_dim + 1 :])) for s in input._shapes)


def squeeze(input: NestedTensor, dim: Any = None) -> NestedTensor:
    ndim = input.ndim - 1
    if dim is None:
        edims = [d for d in range(ndim) if all(s[d] == 1 for s in input._shapes)]
    else:
        dims = [dim] if isinstance(dim, int) else list(dim)
        edims = []
        for d in dims:
            element_dim = _edim(input, d, "squeeze")
            sizes = {s[element_dim] for s in input._shapes}
            if sizes == {1}:
                edims.append(element_dim)
            elif 1 in sizes:
                raise ValueError(f"squeeze(dim={d}) would drop a dim from only some elements (sizes {sorted(sizes)})")
    if not edims:
        return input
    keep = [d for d in range(ndim) if d not in edims]
    shapes = tuple(torch.Size([s[d] for d in keep]) for s in input._shapes)
    renumber = {d: i for i, d in enumerate(keep)}
    permutation, ragged = layout.canonical(shapes)
    if list(permutation[:ragged]) == [renumber.get(d) for d in input._permutation[: input._ragged]]:
        positions = tuple(static_position(input, d) for d in edims)
        return input._derive(input._values.squeeze(positions), shapes)  # type: ignore[arg-type]
    return _each(input, lambda e: e.squeeze(tuple(edims)))


def unsqueeze(input: NestedTensor, dim: int) -> NestedTensor:
    ndim = input.ndim
    if not -(ndim + 1) <= dim <= ndim:
        raise IndexError(f"unsqueeze: dim {dim} is out of range for a NestedTensor with {ndim} dims")
    dim %= ndim + 1
    batch = 0 if input._batch_first or ndim == 1 else 1
    if dim == batch and not (batch == 1 and dim == 0):
        raise ValueError(f"NestedTensor.unsqueeze cannot insert a dim at the batch position {dim}")
    element_dim = dim if dim < batch or (batch == 1 and dim == 0) else dim - 1
    shapes = tuple(torch.Size((*s[:element_dim], 1, *s[element_dim:])) for s in input._shapes)
    permutation, ragged = layout.canonical(shapes)
    shifted = [d + (d >= element_dim) for d in input._permutation[: input._ragged]]
    if list(permutation[:ragged]) == shifted:
        position = 1 + list(permutation[ragged:]).index(element_dim)
        return input._derive(input._values.unsqueeze(position), shapes)
    return _each(input, lambda e: e.unsqueeze(element_dim))


def flip(input: NestedTensor, *args: Any, dims: Any = None) -> NestedTensor:
    if dims is not None and args:
        raise TypeError("flip got dims both positionally and as a keyword")
    edims = [_edim(input, d, "flip") for d in _dims_arg(args if dims is None else (dims,))]
    positions = [static_position(input, d) for d in edims]
    if None not in positions:
        return input._derive(input._values.flip(positions))
    return _each(input, lambda e: e.flip(edims))


def roll(input: NestedTensor, shifts: Any, dims: Any = None) -> NestedTensor:
    if dims is None:
        return _each(input, lambda e: e.roll(shifts))
    dims = [dims] if isinstance(dims, int) else list(dims)
    edims = [_edim(input, d, "roll") for d in dims]
    positions = [static_position(input, d) for d in edims]
    if None not in positions:
        return input._derive(input._values.roll(shifts, positions))
    return _each(input, lambda e: e.roll(shifts, edims))


def rot90(input: NestedTensor, k: int = 1, dims: Sequence[int] | None = None) -> NestedTensor:
    if dims is None:
        edims = [0, 1]
    else:
        edims = [_edim(input, d, "rot90") for d in dims]
    positions = [static_position(input, d) for d in edims]
    if None not in positions:
        values = input._values.rot90(k, positions)
        shapes = input._shapes if k % 2 == 0 else tuple(_swap(s, *edims) for s in input._shapes)
        return input._derive(values, shapes)
    return _each(input, lambda e: e.rot90(k, edims))


def _split_batch(input: NestedTensor, sizes: list[int], op: str, batch_ok: tuple[int, ...]) -> list[int]:
    """The element part of a full-shape ``sizes`` (batch included); the batch entry must be one of ``batch_ok``."""
    if len(sizes) != input.ndim:
        raise ValueError(
            f"NestedTensor.{op} needs one size per dim ({input.ndim}, batch included), got {sizes}: "
            "new leading dims would come before the batch dim"
        )
    batch = 0 if input._batch_first or input.ndim == 1 else 1
    if sizes[batch] not in batch_ok:
        raise ValueError(
            f"NestedTensor.{op} cannot change the batch dim: its size must be one of {batch_ok}, got {sizes[batch]}"
        )
    return sizes[:batch] + sizes[batch + 1 :]


def expand(input: NestedTensor, *sizes: Any) -> NestedTensor:
    """Expand size-1 dims of every element; -1 (or a ragged dim's padded size) keeps each element's own size."""
    element = _split_batch(input, _dims_arg(sizes), "expand", (len(input), -1))
    padded = input.shape[1:] if input._batch_first else (input.shape[0], *input.shape[2:])

    ragged = {d for d in range(input.ndim - 1) if len({s[d] for s in input._shapes}) > 1}

    def target(shape: torch.Size) -> list[int]:
        keep = [size == -1 or (j in ragged and size == padded[j]) for j, size in enumerate(element)]
        return [own if k else size for size, own, k in zip(element, shape, keep)]

    return input._from_elements([e.expand(target(e.shape)) for e in input._elements()])


def expand_as(input: NestedTensor, other: Any) -> NestedTensor:
    if isinstance(other, NestedTensor):
        return input._from_elements([e.expand_as(o) for e, o in zip(input._elements(), other._elements())])
    return expand(input, *other.shape)


def repeat(input: NestedTensor, *sizes: Any) -> NestedTensor:
    """Repeat every element along its dims (sizes are NestedTensor dims; the batch entry must be 1)."""
    element = _split_batch(input, _dims_arg(sizes), "repeat", (1,))
    return _each(input, lambda e: e.repeat(element))


def tile(input: NestedTensor, *dims: Any) -> NestedTensor:
    sizes = _dims_arg(dims)
    return repeat(input, *([1] * (input.ndim - len(sizes)) + sizes))


def in_place(op: Callable, input: NestedTensor, *args: Any, **kwargs: Any) -> NestedTensor:
    """In-place shape ops (``transpose_``, ``squeeze_``...): ``input`` takes the result's storage and layout."""
    out = op(input, *args, **kwargs)
    input._set_storage(out._values, out._shapes, out._permutation, out._ragged)
    input._batch_first = out._batch_first
    return input


def _swap(shape: torch.Size, a: int, b: int) -> torch.Size:
    dims = list(shape)
    dims[a], dims[b] = dims[b], dims[a]
    return torch.Size(dims)


def _register() -> None:
    table: dict[str, Callable] = {
        "permute": permute,
        "transpose": transpose,
        "swapaxes": transpose,
        "swapdims": transpose,
        "movedim": movedim,
        "moveaxis": movedim,
        "reshape": reshape,
        "view": view,
        "flatten": flatten,
        "unflatten": unflatten,
        "squeeze": squeeze,
        "unsqueeze": unsqueeze,
        "flip": flip,
        "roll": roll,
        "rot90": rot90,
        "expand": expand,
        "expand_as": expand_as,
        "broadcast_to": expand,
        "repeat": repeat,
        "tile": tile,
    }
    for name, handler in table.items():
        register((getattr(torch, name, None), getattr(torch.Tensor, name, None)), handler)
    for name in ("transpose", "swapaxes", "swapdims", "squeeze", "unsqueeze"):
        register(getattr(torch.Tensor, name + "_"), partial(in_place, table[name]))
    register(torch.Tensor.t_, partial(in_place, lambda input: transpose(input, -2, -1)))


_register()
