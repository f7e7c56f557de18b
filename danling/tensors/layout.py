"""Packed storage for ragged batches.

A batch of ``B`` tensors that share a number of dimensions is stored as one *packed* tensor.
Dimensions whose size differs between elements are *ragged*; the others are *static*. Every
element is permuted so that its ragged dimensions come first (in their original order), the
ragged dimensions are flattened into one, and the results are concatenated: the packed tensor
has shape ``(N, *static)`` where ``N`` sums the ragged extents of all elements. When no
dimension is ragged, dimension 0 plays that role, so the common ``(L_i, D)`` sequence batch is
packed as ``(sum L_i, D)`` with no permutation at all.

Everything here is a pure function of ``(values, shapes, permutation, ragged)`` and never reads
tensor data on the host: shapes are Python ints.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

import torch
from torch import Tensor

Shapes = tuple[torch.Size, ...]


def canonical(shapes: Sequence[torch.Size]) -> tuple[tuple[int, ...], int]:
    """Return ``(permutation, ragged)`` for element shapes: ragged dims first, then static dims."""
    if not shapes:
        return (), 0
    ndim = len(shapes[0])
    if ndim == 0:
        return (), 0
    first = shapes[0]
    ragged = [d for d in range(ndim) if any(s[d] != first[d] for s in shapes)]
    if not ragged:
        ragged = [0]
    static = [d for d in range(ndim) if d not in ragged]
    return tuple(ragged + static), len(ragged)


def check_shapes(tensors: Sequence[Tensor]) -> Shapes:
    """Element shapes, verifying that every element has the same number of dimensions."""
    shapes = tuple(t.shape for t in tensors)
    if shapes and any(len(s) != len(shapes[0]) for s in shapes):
        dims = sorted({len(s) for s in shapes})
        raise ValueError(f"all elements of a NestedTensor must have the same number of dimensions, got {dims}")
    return shapes


def counts(shapes: Shapes, permutation: tuple[int, ...], ragged: int) -> list[int]:
    """Number of packed rows each element occupies."""
    return [prod(s[d] for d in permutation[:ragged]) for s in shapes]


def static_shape(shapes: Shapes, permutation: tuple[int, ...], ragged: int) -> tuple[int, ...]:
    """Trailing shape of the packed tensor (sizes of the static dims, in packed order)."""
    if not shapes:
        return ()
    return tuple(shapes[0][d] for d in permutation[ragged:])


def is_simple(permutation: tuple[int, ...], ragged: int) -> bool:
    """Whether the packed layout is the plain ``(sum L_i, *rest)`` concatenation along dim 0."""
    return ragged == 1 and permutation == tuple(range(len(permutation)))


def pack(tensors: Sequence[Tensor]) -> tuple[Tensor, Shapes, tuple[int, ...], int]:
    """Pack element tensors; returns ``(values, shapes, permutation, ragged)``."""
    shapes = check_shapes(tensors)
    permutation, ragged = canonical(shapes)
    if not tensors:
        return torch.empty(0), shapes, permutation, ragged
    if ragged == 0:
        return torch.stack(list(tensors)), shapes, permutation, ragged
    identity = permutation == tuple(range(len(permutation)))
    parts = []
    for t in tensors:
        if not identity:
            t = t.permute(permutation)
        parts.append(t.reshape(-1, *t.shape[ragged:]) if ragged > 1 else t)
    return torch.cat(parts), shapes, permutation, ragged


def unpack(values: Tensor, shapes: Shapes, permutation: tuple[int, ...], ragged: int) -> tuple[Tensor, ...]:
    """Split packed values back into element tensors (views where possible)."""
    if ragged == 0:
        return tuple(values.unbind(0))
    parts = values.split(counts(shapes, permutation, ragged))
    if is_simple(permutation, ragged):
        return tuple(parts)
    inverse = inverse_permutation(permutation)
    out = []
    for part, shape in zip(parts, shapes):
        permuted = [shape[d] for d in permutation]
        out.append(part.reshape(permuted).permute(inverse))
    return tuple(out)


def inverse_permutation(permutation: Sequence[int]) -> tuple[int, ...]:
    """Inverse of a permutation."""
    inverse = [0] * len(permutation)
    for i, p in enumerate(permutation):
        inverse[p] = i
    return tuple(inverse)


def max_shape(shapes: Shapes) -> tuple[int, ...]:
    """Per-dimension maximum over element shapes."""
    return tuple(map(max, zip(*shapes))) if shapes else ()


def ragged_mask(shapes: Shapes, permutation: tuple[int, ...], ragged: int, device: torch.device) -> Tensor:
    """Boolean ``(B, *max ragged extents)`` mask of valid packed positions, ragged dims in packed order."""
    dims = permutation[:ragged]
    extents = torch.tensor([[s[d] for d in dims] for s in shapes], dtype=torch.long).reshape(len(shapes), ragged)
    extents = extents.to(device, non_blocking=True)
    sizes = [max((s[d] for s in shapes), default=0) for d in dims]
    mask = torch.ones((len(shapes), *sizes), dtype=torch.bool, device=device)
    for j, size in enumerate(sizes):
        positions = torch.arange(size, device=device).view([1] * (1 + j) + [size] + [1] * (ragged - j - 1))
        mask = mask & (positions < extents[:, j].view([len(shapes)] + [1] * ragged))
    return mask


def to_padded(
    values: Tensor, shapes: Shapes, permutation: tuple[int, ...], ragged: int, fill: float | bool, rmask: Tensor
) -> Tensor:
    """Scatter packed values into a batch-first padded tensor filled with ``fill``."""
    if ragged == 0:
        return values
    sizes = [max((s[d] for s in shapes), default=0) for d in permutation[:ragged]]
    buffer = values.new_full((len(shapes), *sizes, *values.shape[1:]), fill)
    # In-place on a fresh buffer is autograd-safe: the buffer itself never requires grad.
    buffer.index_put_((rmask,), values)
    if permutation == tuple(range(len(permutation))):
        return buffer
    inverse = inverse_permutation(permutation)
    return buffer.permute(0, *[1 + i for i in inverse])


def from_padded(padded: Tensor, shapes: Shapes, permutation: tuple[int, ...], ragged: int, rmask: Tensor) -> Tensor:
    """Gather the valid positions of a batch-first padded tensor into packed values."""
    if ragged == 0:
        return padded
    target = max_shape(shapes)
    if tuple(padded.shape[1:]) != target:
        padded = padded[(slice(None), *[slice(0, m) for m in target])]
    if permutation != tuple(range(len(permutation))):
        padded = padded.permute(0, *[1 + p for p in permutation])
    return padded[rmask]


def full_mask(shapes: Shapes, permutation: tuple[int, ...], ragged: int, device: torch.device) -> Tensor:
    """Boolean validity mask over element dims ``0..last ragged dim`` (trailing static dims dropped)."""
    if ragged == 0:
        return torch.ones(len(shapes), dtype=torch.bool, device=device)
    last = max(permutation[:ragged])
    sizes = list(max_shape(shapes)[: last + 1])
    mask = torch.ones((len(shapes), *sizes), dtype=torch.bool, device=device)
    ragged_dims = set(permutation[:ragged])
    for d in range(last + 1):
        if d not in ragged_dims:
            continue
        extent = torch.tensor([s[d] for s in shapes], dtype=torch.long).to(device, non_blocking=True)
        positions = torch.arange(sizes[d], device=device)
        valid = positions.view(1, -1) < extent.view(-1, 1)
        mask = mask & valid.view([len(shapes)] + [sizes[d] if i == d else 1 for i in range(last + 1)])
    return mask
