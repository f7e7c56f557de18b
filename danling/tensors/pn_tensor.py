"""PNTensor: a dataset item that the default DataLoader collate turns into a NestedTensor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils.data._utils.collate import default_collate_fn_map

from .nested_tensor import NestedTensor


class PNTensor(Tensor):
    r"""A tensor that asks to be nested when batched ("potential NestedTensor").

    Return PNTensors from a dataset's `__getitem__` and the stock
    `torch.utils.data.default_collate` (used by `DataLoader` when no `collate_fn` is given)
    builds a [`NestedTensor`][danling.tensors.NestedTensor] instead of trying to stack
    tensors of different lengths. Anywhere else a PNTensor behaves as a regular tensor; it
    also offers `.tensor`, `.mask` and `.concat` so code written for NestedTensor accepts a
    single item.

    Examples:
        >>> from torch.utils.data import Dataset, DataLoader
        >>> from danling.tensors import PNTensor
        >>> class VariableLengthDataset(Dataset):
        ...     def __init__(self, data):
        ...         self.data = data
        ...     def __len__(self):
        ...         return len(self.data)
        ...     def __getitem__(self, idx):
        ...         return PNTensor(self.data[idx])
        >>> # Create a dataset with variable-length sequences
        >>> dataset = VariableLengthDataset([[1, 2, 3], [4, 5], [6, 7, 8, 9]])
        >>> dataloader = DataLoader(dataset, batch_size=3)
        >>> # The DataLoader produces NestedTensor batches by default for PNTensor
        >>> batch = next(iter(dataloader))
        >>> batch
        NestedTensor([
            [1., 2., 3.],
            [4., 5.],
            [6., 7., 8., 9.]
        ])
        >>> tensor = PNTensor([1, 2, 3])
        >>> tensor
        PNTensor([1., 2., 3.])
        >>> tensor.tensor
        PNTensor([1., 2., 3.])
        >>> tensor.mask
        PNTensor([True, True, True])
    """

    @property
    def tensor(self) -> Tensor:
        """The item itself: it has no padding.

        Examples:
            >>> tensor = torch.tensor([1, 2, 3])
            >>> pn_tensor = PNTensor([1, 2, 3])
            >>> bool((tensor == pn_tensor).all())
            True
            >>> bool((tensor == pn_tensor.tensor).all())
            True
        """
        return self

    @property
    def mask(self) -> Tensor:
        """An all-`True` mask shaped like the item, expanded from one value (no allocation).

        Examples:
            >>> tensor = torch.tensor([1, 2, 3])
            >>> pn_tensor = PNTensor([1, 2, 3])
            >>> bool((pn_tensor.mask == torch.ones_like(pn_tensor)).all().item())
            True
        """
        return self.new_ones((), dtype=torch.bool).expand(self.shape)

    @property
    def concat(self) -> Tensor:
        """The item itself: concatenating one element changes nothing.

        Examples:
            >>> pn_tensor = PNTensor([1, 2, 3])
            >>> bool((pn_tensor == pn_tensor.concat).all())
            True
        """
        return self

    def new_empty(self, *args: Any, **kwargs: Any) -> PNTensor:
        """An uninitialised tensor like `Tensor.new_empty`, kept a PNTensor."""
        out = super().new_empty(*args, **kwargs)
        return out if isinstance(out, PNTensor) else out.as_subclass(PNTensor)


def tensor(
    data: Any,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    requires_grad: bool = False,
    pin_memory: bool = False,
) -> PNTensor:
    """Build a [`PNTensor`][danling.tensors.PNTensor] with the arguments of `torch.tensor`.

    Use it in a dataset instead of `torch.tensor` to get NestedTensor batches from the
    default collate.

    Args:
        data: Anything `torch.tensor` accepts: lists, tuples, NumPy arrays, scalars.
        dtype: Element type; inferred from `data` when `None`.
        device: Where to allocate the tensor.
        requires_grad: Record autograd operations on the result.
        pin_memory: Allocate in page-locked memory (CPU tensors only).

    Returns:
        PNTensor: The new tensor.

    Examples:
        >>> from danling.tensors import tensor
        >>> t = tensor([1, 2, 3])
        >>> t
        PNTensor([1, 2, 3])
    """
    if isinstance(data, Tensor):  # copy like torch.tensor does, without its copy-construct warning
        data = data.detach().to(device=device, dtype=dtype, copy=True)
        data = (data.pin_memory() if pin_memory else data).as_subclass(PNTensor)
    else:
        data = torch.tensor(data, dtype=dtype, device=device, pin_memory=pin_memory).as_subclass(PNTensor)
    # Set requires_grad after as_subclass so the result stays an autograd leaf.
    return data.requires_grad_(requires_grad) if requires_grad else data


def collate_pn_tensor_fn(batch: Any, *, collate_fn_map: dict[type, Callable] | None = None) -> NestedTensor:
    """Collate function for a batch of PNTensors: nest them instead of stacking."""
    return NestedTensor(*batch)


# torch's default collate looks the element type up in this map before anything else.
default_collate_fn_map[PNTensor] = collate_pn_tensor_fn
