"""Reduction and shape methods of NestedTensor (mixed into the class).

Each method forwards to the handler that ``torch.<name>(nested_tensor, ...)`` reaches, so the
method and function spellings always agree. Dims are NestedTensor dims: the batch dim counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, SupportsFloat

import torch
from torch import Tensor

from .ops.registry import HANDLERS

if TYPE_CHECKING:
    from .nested_tensor import NestedTensor


def _run(func: Any, *args: Any, **kwargs: Any) -> Any:
    return HANDLERS[func](*args, **kwargs)


class NestedTensorMethods:
    """Reductions and shape ops of [`NestedTensor`][danling.tensors.NestedTensor]."""

    def all(self, dim: int | None = None, keepdim: bool = False) -> Any:
        """Whether every real value is true, overall or along `dim`.

        Reducing the batch dim alone gives one answer per element; reducing an element dim
        ignores padding.

        Examples:
            >>> nested_tensor = NestedTensor([torch.ones(2, 4, dtype=torch.bool), torch.ones(3, 5, dtype=torch.bool)])
            >>> nested_tensor.all()
            tensor(True)
            >>> nested_tensor.all(dim=0)
            tensor([True, True])
            >>> nested_tensor.all(dim=0, keepdim=True)
            tensor([[True, True]])
            >>> nested_tensor.all(dim=1)
            NestedTensor([
                [True, True, True, True],
                [True, True, True, True, True]
            ])
            >>> nested_tensor.all(dim=1, keepdim=True)
            NestedTensor([
                [[True, True, True, True]],
                [[True, True, True, True, True]]
            ])
            >>> nested_tensor.batch_first = False
            >>> nested_tensor.all(dim=1)
            tensor([True, True])
            >>> nested_tensor.all(dim=0)
            NestedTensor([
                [True, True, True, True],
                [True, True, True, True, True]
            ])
            >>> nested_tensor.all(dim=-2)
            tensor([True, True])
        """
        return _run(torch.all, self, dim, keepdim)

    def any(self, dim: int | None = None, keepdim: bool = False) -> Any:
        """Whether any real value is true, overall or along `dim`.

        Examples:
            >>> nested_tensor = NestedTensor([torch.zeros(2, dtype=torch.bool), torch.ones(3, dtype=torch.bool)])
            >>> nested_tensor.any()
            tensor(True)
            >>> nested_tensor.any(dim=0)
            tensor([False,  True])
        """
        return _run(torch.any, self, dim, keepdim)

    def max(self, dim: Any = None, keepdim: bool = False) -> Any:
        """Largest real value, or `(values, indices)` along `dim` (a tensor `dim` means `maximum`).

        Examples:
            >>> NestedTensor([[1, 5, 2], [7, 3]]).max(dim=1).values
            tensor([5, 7])
        """
        return _run(torch.max, self, dim, keepdim)

    def min(self, dim: Any = None, keepdim: bool = False) -> Any:
        """Smallest real value, or `(values, indices)` along `dim` (a tensor `dim` means `minimum`).

        Examples:
            >>> NestedTensor([[1, 5, 2], [7, 3]]).min(dim=1).indices
            tensor([0, 1])
        """
        return _run(torch.min, self, dim, keepdim)

    def mean(self, dim: Any = None, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> Any:
        """Mean of the real values, overall or along `dim`; padding is never counted.

        Examples:
            >>> NestedTensor([[1.0, 2.0, 3.0], [4.0, 5.0]]).mean(dim=1)
            tensor([2.0000, 4.5000])
        """
        return _run(torch.mean, self, dim, keepdim, dtype=dtype)

    def prod(self, dim: int | None = None, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> Any:
        """Product of the real values, overall or along `dim`.

        Examples:
            >>> NestedTensor([[1, 2, 3], [4, 5]]).prod(dim=1)
            tensor([ 6, 20])
        """
        return _run(torch.prod, self, dim, keepdim, dtype=dtype)

    def sum(
        self, dim: int | Sequence[int] | None = None, keepdim: bool = False, *, dtype: torch.dtype | None = None
    ) -> Any:
        """Sum of the real values over `dim` (an int, several ints, or `None` for everything).

        Args:
            dim: Dims to reduce. The batch dim alone sums each element; the batch dim with
                every ragged dim sums across elements; element dims sum inside each element.
            keepdim: Keep reduced dims with size 1.
            dtype: Accumulate and return in this dtype.

        Returns:
            A tensor when the results share a shape, otherwise a NestedTensor.

        Examples:
            >>> nested_tensor = NestedTensor([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
            >>> nested_tensor.sum()
            tensor(15)
            >>> nested_tensor.sum(dim=0)  # when dim=0, sum across batch dimension
            tensor([6, 9])
            >>> nested_tensor.sum(dim=1)
            tensor([6, 9])
            >>> nested_tensor.sum(dim=[0, 1])
            tensor(15)
            >>> nested_tensor.sum(dim=0, keepdim=True)
            tensor([[6, 9]])
            >>> nested_tensor.sum(dtype=torch.float32)
            tensor(15.)
        """
        return _run(torch.sum, self, dim, keepdim, dtype=dtype)

    def permute(self, *dims: Any) -> NestedTensor:
        """Reorder dims; the batch dim must stay where it is.

        Examples:
            >>> nested_tensor = NestedTensor([torch.randn(3, 4, 5), torch.randn(2, 4, 5)])
            >>> permuted = nested_tensor.permute(0, 3, 1, 2)
            >>> permuted.shape
            torch.Size([2, 5, 3, 4])
        """
        return _run(torch.permute, self, *dims)

    def transpose(self, dim0: int, dim1: int) -> NestedTensor:
        """Swap two (non-batch) dims of every element.

        Examples:
            >>> nested_tensor = NestedTensor([torch.randn(3, 4), torch.randn(2, 4)])
            >>> # NestedTensor shape is [2, 3, 4], underlying tensors are [3, 4] and [2, 4]
            >>> transposed = nested_tensor.transpose(1, 2)  # transpose dims 1 and 2
            >>> transposed.shape  # batch dimension is still first
            torch.Size([2, 4, 3])
        """
        return _run(torch.transpose, self, dim0, dim1)

    def swapaxes(self, axis0: int, axis1: int) -> NestedTensor:
        """Same as `transpose`."""
        return _run(torch.transpose, self, axis0, axis1)

    def swapdims(self, dim0: int, dim1: int) -> NestedTensor:
        """Same as `transpose`."""
        return _run(torch.transpose, self, dim0, dim1)

    def moveaxis(self, source: Any, destination: Any) -> NestedTensor:
        """Move (non-batch) dims to new positions, keeping the others in order."""
        return _run(torch.movedim, self, source, destination)

    def movedim(self, source: Any, destination: Any) -> NestedTensor:
        """Same as `moveaxis`."""
        return _run(torch.movedim, self, source, destination)

    def reshape(self, *shape: Any) -> NestedTensor:
        """Reshape every element to `shape` (an element shape; the batch dim is not part of it).

        `shape` is read as each element's shape whenever every element can take it, also when
        its first size equals the batch size. Otherwise a shape that starts with the batch size
        is read as the full shape (`nt.reshape(nt.shape)`), a ragged dim given as its padded
        size or -1 keeping each element's own size.

        Examples:
            >>> nested_tensor = NestedTensor([torch.tensor([[1, 2], [3, 4]]), torch.tensor([[5, 6], [7, 8]])])
            >>> reshaped = nested_tensor.reshape(4)
            >>> reshaped.shape
            torch.Size([2, 4])
            >>> NestedTensor([torch.arange(4), torch.arange(4)]).reshape(2, 2).shape  # (2, 2) per element
            torch.Size([2, 2, 2])
        """
        return _run(torch.reshape, self, *shape)

    def view(self, *shape: Any) -> NestedTensor:
        """Like `reshape` (the same reading of `shape`), but only as a view of the existing storage (or a dtype view).

        Examples:
            >>> nested_tensor = NestedTensor([torch.tensor([[1, 2], [3, 4]]), torch.tensor([[5, 6], [7, 8]])])
            >>> viewed = nested_tensor.view(4)  # View each 2x2 tensor as 4
            >>> viewed.shape
            torch.Size([2, 4])
            >>> type(viewed).__name__
            'NestedTensor'
        """
        return _run(torch.Tensor.view, self, *shape)

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> Tensor | NestedTensor:
        """Flatten dims `start_dim..end_dim`, as torch does on `.tensor` but without the padding.

        Element dims only: every element is flattened, the result is a NestedTensor. A range that
        starts at the batch dim removes it, so the result is dense: the real values, flattened
        over the covered element dims and concatenated in batch order.

        Examples:
            >>> nested_tensor = NestedTensor([torch.zeros(2, 3), torch.zeros(1, 3)])
            >>> nested_tensor.flatten(1).shape
            torch.Size([2, 6])
            >>> nested_tensor.flatten().shape  # the 9 real values
            torch.Size([9])
            >>> nested_tensor.flatten(0, 1).shape  # the 3 real rows
            torch.Size([3, 3])
        """
        return _run(torch.flatten, self, start_dim, end_dim)

    def unflatten(self, dim: int, sizes: Sequence[int]) -> NestedTensor:
        """Split one (non-batch) dim of every element into `sizes`."""
        return _run(torch.unflatten, self, dim, sizes)

    def squeeze(self, dim: int | Sequence[int] | None = None) -> NestedTensor:
        """Drop size-1 dims; with `dim=None`, only dims of size 1 in every element."""
        return _run(torch.squeeze, self, dim)

    def unsqueeze(self, dim: int) -> NestedTensor:
        """Insert a size-1 dim at `dim` (counted in the result's dims, batch included).

        Examples:
            >>> nested_tensor = NestedTensor([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
            >>> # Original shape: [2, 3] (batch_size=2, max_seq_len=3)
            >>> unsqueezed = nested_tensor.unsqueeze(1)
            >>> unsqueezed.shape
            torch.Size([2, 1, 3])
            >>> nested_tensor_2d = NestedTensor([torch.randn(3, 4), torch.randn(2, 4)])
            >>> # Original shape: [2, 3, 4] (batch_size=2, max_len1=3, max_len2=4)
            >>> unsqueezed_2d = nested_tensor_2d.unsqueeze(2)
            >>> unsqueezed_2d.shape
            torch.Size([2, 3, 1, 4])
        """
        return _run(torch.unsqueeze, self, dim)

    def flip(self, *args: Any, dims: Any = None) -> NestedTensor:
        """Reverse every element along `dims`; reversing a ragged dim reverses only real values.

        Examples:
            >>> NestedTensor([[1, 2, 3], [4, 5]]).flip(1)
            NestedTensor([
                [3, 2, 1],
                [5, 4]
            ])
        """
        return _run(torch.flip, self, *args, dims=dims)

    def roll(self, shifts: Any, dims: Any = None) -> NestedTensor:
        """Roll every element along `dims` (all of its values when `dims` is `None`)."""
        return _run(torch.roll, self, shifts, dims)

    def rot90(self, k: int = 1, dims: Sequence[int] | None = None) -> NestedTensor:
        """Rotate every element by `k` quarter turns in the plane `dims` (default: its first two dims)."""
        return _run(torch.rot90, self, k, dims)

    def where(self, condition: Tensor | NestedTensor, other: Tensor | NestedTensor | SupportsFloat) -> NestedTensor:
        """Keep values where `condition` holds and take `other` elsewhere.

        A dense `condition` or `other` with the batch dim is read like `.tensor`; a scalar or
        a tensor matching trailing element dims is broadcast.

        Examples:
            >>> nested_tensor = NestedTensor([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
            >>> nested_tensor.where(nested_tensor > 2, torch.tensor([[6, 5, 4], [3, 2, 1]]))
            NestedTensor([
                [6, 5, 3],
                [4, 5]
            ])
            >>> nested_tensor.where(nested_tensor > 2, NestedTensor([[6, 5, 4], [3, 2]]))
            NestedTensor([
                [6, 5, 3],
                [4, 5]
            ])
            >>> nested_tensor.where(torch.tensor(True), NestedTensor([[6, 5, 4], [3, 2]]))
            NestedTensor([
                [1, 2, 3],
                [4, 5]
            ])
        """
        return _run(torch.where, condition, self, other)
