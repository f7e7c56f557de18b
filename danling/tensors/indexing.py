"""``__getitem__`` / ``__setitem__`` of NestedTensor.

The first index always addresses the batch (elements); the remaining entries of a tuple index
every selected element, exactly as if each element were indexed on its own.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from . import layout

if TYPE_CHECKING:
    from .nested_tensor import NestedTensor


def _as_int(index: Any) -> int | None:
    if isinstance(index, bool):
        return None
    if isinstance(index, Tensor):
        if index.dim() == 0 and not index.dtype.is_floating_point and index.dtype != torch.bool:
            return int(index)
        return None
    try:
        return operator.index(index)
    except TypeError:
        return None


def _positions(nt: NestedTensor, index: Any) -> list[int]:
    """Batch positions selected by an int, slice, list or 1-D integer/boolean tensor."""
    batch = len(nt)
    position = _as_int(index)
    if position is not None:
        if not -batch <= position < batch:
            raise IndexError(f"index {position} is out of range for a NestedTensor of {batch} elements")
        return [position % batch]
    if isinstance(index, slice):
        return list(range(*index.indices(batch)))
    if isinstance(index, list) and index and all(isinstance(i, bool) for i in index):
        index = torch.tensor(index)  # a boolean mask, as `nt.tensor[[True, False]]` reads it
    if isinstance(index, Tensor):
        if index.dtype == torch.bool:
            if index.shape != (batch,):
                raise IndexError(f"a boolean batch selector must have shape ({batch},), got {tuple(index.shape)}")
            index = index.nonzero().flatten()
        index = index.tolist()
    if isinstance(index, (list, range)):
        return [_positions(nt, i)[0] for i in index]
    raise TypeError(f"NestedTensor batch index must be an int, slice, list or tensor, got {type(index).__name__}")


def _select(nt: NestedTensor, index: Any) -> NestedTensor:
    """A NestedTensor holding the selected elements, sharing storage for contiguous slices."""
    if isinstance(index, slice):
        start, stop, step = index.indices(len(nt))
        shapes = nt._shapes[start:stop] if step == 1 else None
        if shapes and layout.canonical(shapes) == (nt._permutation, nt._ragged):
            rows = layout.counts(nt._shapes, nt._permutation, nt._ragged) if nt._ragged else [1] * len(nt)
            begin = sum(rows[:start])
            end = begin + sum(rows[start:stop])
            return nt._derive(nt._values[begin:end], shapes)
    elements = nt._elements()
    return nt._from_elements([elements[i] for i in _positions(nt, index)])


def _split_tuple(nt: NestedTensor, index: tuple) -> tuple[Any, tuple]:
    """Separate a tuple index into its batch part and its per-element part."""
    if index and index[0] is Ellipsis:
        return slice(None), index
    if not nt._batch_first and nt.ndim > 1 and len(index) >= 2:
        return index[1], (index[0], *index[2:])
    return index[0], tuple(index[1:])


def _packed_mask(nt: NestedTensor, index: Tensor) -> Tensor:
    """A boolean index over the packed values from a boolean NestedTensor or padded tensor."""
    from .nested_tensor import NestedTensor

    if not isinstance(index, NestedTensor):
        index = nt.nested_like(index.expand(nt.shape) if index.shape != nt.shape else index)
    if index._shapes != nt._shapes:
        raise IndexError("a boolean NestedTensor index must have the same element shapes as the indexed one")
    return index._values


def _is_value_mask(nt: NestedTensor, index: Any) -> bool:
    from .nested_tensor import NestedTensor

    return isinstance(index, NestedTensor)


def _is_padded_index(nt: NestedTensor, index: Any) -> bool:
    """Whether ``index`` is read as an index of ``nt.tensor`` (tensor indices beyond a batch selection)."""
    if isinstance(index, tuple):
        batch_index = _split_tuple(nt, index)[0] if index else None
        return isinstance(batch_index, Tensor) and batch_index.dim() > 0
    if not isinstance(index, Tensor) or index.dim() == 0:
        return False
    batch_selector = index.dim() == 1 and (nt._batch_first or nt.ndim == 1)
    return not batch_selector or (index.dtype == torch.bool and nt.ndim == 1)


def _valid(nt: NestedTensor) -> Tensor:
    """Boolean tensor of ``nt.shape``: True at real positions of ``nt.tensor``."""
    mask = layout.full_mask(nt._shapes, nt._permutation, nt._ragged, nt._values.device)
    batch_first_shape = (len(nt), *layout.max_shape(nt._shapes))
    mask = mask.view(*mask.shape, *[1] * (len(batch_first_shape) - mask.dim())).expand(batch_first_shape)
    return mask.movedim(0, 1) if not nt._batch_first and mask.dim() > 1 else mask


def _getitem_padded(nt: NestedTensor, index: Any) -> Tensor | NestedTensor:
    """``nt.tensor[index]``; a result that holds padding in a ragged pattern comes back as a NestedTensor."""
    out, keep = nt.tensor[index], _valid(nt)[index]
    if out.dim() < 2 or bool(keep.all()):
        return out
    kept_batch = out.dim() == nt.ndim and out.shape[0 if nt._batch_first else 1] == len(nt)
    batch_first = nt._batch_first if kept_batch else True
    try:
        return type(nt).from_tensor_mask(
            out, keep, batch_first=batch_first, padding_value=nt._padding_value, mask_value=nt._mask_value
        )
    except ValueError:  # padding scattered through the result: return it as torch would
        return out


def getitem(nt: NestedTensor, index: Any) -> Tensor | NestedTensor:
    """Implement ``nt[index]``."""
    if _is_value_mask(nt, index):
        return nt._values[_packed_mask(nt, index)]
    if _is_padded_index(nt, index):
        return _getitem_padded(nt, index)
    if index is Ellipsis:
        return nt
    if not isinstance(index, tuple):
        position = _as_int(index)
        if position is not None:
            return nt._elements()[_positions(nt, position)[0]]
        return _select(nt, index)
    batch_index, rest = _split_tuple(nt, index)
    if not rest:
        return getitem(nt, batch_index)
    position = _as_int(batch_index)
    if position is not None:
        return nt._elements()[_positions(nt, position)[0]][rest]
    selected = nt if batch_index == slice(None) else _select(nt, batch_index)
    simple = layout.is_simple(selected._permutation, selected._ragged)
    if simple and rest[0] == slice(None) and all(isinstance(r, (int, slice)) for r in rest[1:]):
        values = selected._values[(slice(None), *rest[1:])]
        shapes = tuple(torch.Size((s[0], *values.shape[1:])) for s in selected._shapes)
        return selected._derive(values, shapes)
    return selected._from_elements([element[rest] for element in selected._elements()])


def _element_values(value: Any, count: int) -> list[Any]:
    from .nested_tensor import NestedTensor

    if isinstance(value, NestedTensor):
        if len(value) != count:
            raise ValueError(f"cannot assign a NestedTensor of {len(value)} elements to {count} positions")
        return list(value._elements())
    if count > 1 and isinstance(value, (list, tuple)) and len(value) == count:
        return list(value)
    return [value] * count


def setitem(nt: NestedTensor, index: Any, value: Any) -> None:
    """Implement ``nt[index] = value``: in place, or on new storage when element shapes change."""
    from .nested_tensor import NestedTensor

    if _is_value_mask(nt, index):
        nt._values[_packed_mask(nt, index)] = value._values if isinstance(value, NestedTensor) else value
        return
    if _is_padded_index(nt, index):  # as torch would on ``nt.tensor``; only real positions are kept
        padded = nt.tensor.clone()
        padded[index] = value.tensor if isinstance(value, NestedTensor) else value
        nt._values.copy_(nt.nested_like(padded)._values)
        return
    batch_index, rest = _split_tuple(nt, index) if isinstance(index, tuple) else (index, ())
    positions = _positions(nt, batch_index)
    single = _as_int(batch_index) is not None
    elements = list(nt._elements())
    like = nt._values
    for position, item in zip(positions, [value] if single else _element_values(value, len(positions))):
        if rest:
            element = elements[position].clone()
            element[rest] = item
        else:
            element = torch.as_tensor(item, dtype=like.dtype, device=like.device)
            if type(element) is not Tensor:
                element = element.as_subclass(Tensor)
            if element.dim() < elements[position].dim():
                # Fewer dims than the element (`nt[0] = 0`): broadcast into it, as torch assigns to
                # a tensor's row; as many dims replace the element, which may change its size.
                filled = elements[position].clone()
                filled[...] = element
                element = filled
        elements[position] = element
    values, shapes, permutation, ragged = layout.pack(elements)
    if shapes == nt._shapes:
        # Every element keeps its shape: write into the packed storage, as torch writes into a
        # tensor's, so that copies and views sharing it (`copy.copy`, contiguous slices) see it.
        nt._values.copy_(values)
    else:
        nt._set_storage(values, shapes, permutation, ragged)
