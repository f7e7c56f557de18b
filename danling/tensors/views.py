"""Dense views, conversions and constructors of NestedTensor (mixed into the class)."""

from __future__ import annotations

import warnings
from math import prod
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from . import layout

if TYPE_CHECKING:
    from .nested_tensor import NestedTensor


class NestedTensorViews:
    """Padded / packed views and conversions of [`NestedTensor`][danling.tensors.NestedTensor]."""

    @property
    def batch_first(self: NestedTensor) -> bool:  # type: ignore[misc]
        """Whether the batch dim comes first (`(B, N, *)`) or second (`(N, B, *)`)."""
        return self._batch_first

    @batch_first.setter
    def batch_first(self: NestedTensor, value: bool) -> None:
        _check(batch_first=value)
        self._batch_first = value

    @property
    def padding_value(self: NestedTensor) -> float:  # type: ignore[misc]
        """The value written into holes by `.tensor`."""
        return self._padding_value

    @padding_value.setter
    def padding_value(self: NestedTensor, value: float) -> None:
        _check(padding_value=value)
        self._padding_value = value

    @property
    def mask_value(self: NestedTensor) -> bool:  # type: ignore[misc]
        """The boolean `.mask` uses for padding positions."""
        return self._mask_value

    @mask_value.setter
    def mask_value(self: NestedTensor, value: bool) -> None:
        _check(mask_value=value)
        self._mask_value = value

    @property
    def _offsets(self: NestedTensor) -> Tensor:  # type: ignore[misc]
        """Cumulative packed row counts, shape `(B + 1,)`, on the CPU."""
        rows = layout.counts(self._shapes, self._permutation, self._ragged) if self._ragged else [1] * len(self)
        return torch.tensor([0, *rows], dtype=torch.long).cumsum(0)

    @property
    def _physical_shape(self: NestedTensor) -> Tensor:  # type: ignore[misc]
        """Element shapes as a `(B, ndim)` integer tensor on the CPU."""
        shapes = torch.tensor([list(s) for s in self._shapes], dtype=torch.long)
        return shapes.reshape(len(self), self.ndim - 1)

    @property
    def tensor(self: NestedTensor) -> Tensor:  # type: ignore[misc]
        """The elements padded to a common shape with `padding_value`.

        Examples:
            >>> nested_tensor = NestedTensor([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
            >>> nested_tensor.tensor
            tensor([[1, 2, 3],
                    [4, 5, 0]])
        """
        padded = layout.to_padded(
            self._values, self._shapes, self._permutation, self._ragged, self._padding_value, self._rmask()
        )
        if not self._batch_first and padded.dim() > 1:
            padded = padded.movedim(0, 1)
        return padded

    @property
    def mask(self: NestedTensor) -> Tensor:  # type: ignore[misc]
        """Booleans marking real positions; padding holds `mask_value` (`False` by default).

        The mask covers the batch dim and element dims up to the last ragged one; trailing
        dims that every element shares are left out, so `(B, L, D)` data has a `(B, L)` mask.

        Examples:
            >>> nested_tensor = NestedTensor([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
            >>> nested_tensor.mask
            tensor([[ True,  True,  True],
                    [ True,  True, False]])
        """
        key = f"mask:{self._values.device}"
        if key not in self._cache:
            self._cache[key] = layout.full_mask(self._shapes, self._permutation, self._ragged, self._values.device)
        mask = self._cache[key]
        if self._mask_value:
            mask = ~mask
        if not self._batch_first and mask.dim() > 1:
            mask = mask.movedim(0, 1)
        return mask

    @property
    def tensor_mask(self: NestedTensor) -> tuple[Tensor, Tensor]:  # type: ignore[misc]
        """`(self.tensor, self.mask)` in one call.

        Examples:
            >>> nested_tensor = NestedTensor([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
            >>> nested_tensor.tensor_mask
            (tensor([[1, 2, 3],
                    [4, 5, 0]]), tensor([[ True,  True,  True],
                    [ True,  True, False]]))
        """
        return self.tensor, self.mask

    @property
    def concat(self: NestedTensor) -> Tensor:  # type: ignore[misc]
        """All real elements joined along the ragged dim, with no padding (the packed storage).

        Dims whose size differs between elements are flattened into the first dim; shared
        dims are kept. Feed this to losses or `Linear` layers to skip work on padding.

        Examples:
            >>> nested_tensor = NestedTensor([torch.randn(9, 8), torch.randn(11, 8)])
            >>> nested_tensor.concat.shape
            torch.Size([20, 8])
            >>> nested_tensor = NestedTensor([torch.randn(9, 9, 8), torch.randn(11, 11, 8)])
            >>> nested_tensor.concat.shape
            torch.Size([202, 8])
            >>> nested_tensor = NestedTensor([torch.randn(9, 9, 8, 6), torch.randn(11, 11, 8, 6)])
            >>> nested_tensor.concat.shape
            torch.Size([202, 8, 6])
            >>> nested_tensor = NestedTensor([torch.randn(9, 9, 8, 7), torch.randn(11, 11, 8, 6)])
            >>> nested_tensor.concat.shape
            torch.Size([1293, 8])
            >>> nested_tensor = NestedTensor([torch.randn(1, 9, 9, 5), torch.randn(1, 11, 11, 5)])
            >>> nested_tensor.concat.shape
            torch.Size([202, 1, 5])
        """
        return self._values

    @property
    def occupancy(self: NestedTensor) -> float:  # type: ignore[misc]
        """Fraction of the padded tensor that holds real data.

        Examples:
            >>> nested_tensor = NestedTensor([torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6])])
            >>> nested_tensor.occupancy
            0.75
        """
        total = prod(self.shape)
        return self._values.numel() / total if total else 0.0

    @property
    def T(self: NestedTensor) -> NestedTensor:  # type: ignore[misc]
        """Every element with its dims reversed."""
        dims = [self._logical_dim(d) for d in reversed(range(self.ndim - 1))]
        batch = 0 if self._batch_first or self.ndim == 1 else 1
        dims.insert(batch, batch)
        return self.permute(*dims)

    @property
    def mT(self: NestedTensor) -> NestedTensor:  # type: ignore[misc]
        """Every element with its last two dims swapped."""
        return self.transpose(-2, -1)

    def concatenate(self: NestedTensor) -> tuple[Tensor, tuple[torch.Size, ...]]:  # type: ignore[misc]
        """Return `(self.concat, element shapes)`, enough to rebuild with `from_concatenated`.

        Examples:
            >>> nested_tensor = NestedTensor([torch.randn(9, 8), torch.randn(11, 8)])
            >>> concat_tensor, shapes = nested_tensor.concatenate()
            >>> concat_tensor.shape
            torch.Size([20, 8])
            >>> shapes
            (torch.Size([9, 8]), torch.Size([11, 8]))
            >>> reconstructed = NestedTensor.from_concatenated(concat_tensor, shapes)
            >>> torch.equal(nested_tensor.tensor, reconstructed.tensor)
            True
        """
        return self._values, self._shapes

    @classmethod
    def from_concatenated(cls, concat_tensor: Tensor, shapes: tuple[torch.Size, ...], **kwargs: Any) -> NestedTensor:
        """Rebuild a NestedTensor from the output of `concatenate()`.

        Args:
            concat_tensor: Packed values, as returned by `concatenate()` / `.concat`.
            shapes: The element shapes returned alongside it.
            **kwargs: `batch_first`, `padding_value`, `mask_value`.

        Examples:
            >>> nested_tensor = NestedTensor([torch.randn(9, 9, 8), torch.randn(11, 11, 8)])
            >>> concat_tensor, shapes = nested_tensor.concatenate()
            >>> reconstructed = NestedTensor.from_concatenated(concat_tensor, shapes)
            >>> concat_tensor.shape
            torch.Size([202, 8])
            >>> reconstructed.shape
            torch.Size([2, 11, 11, 8])
            >>> torch.equal(nested_tensor.tensor, reconstructed.tensor)
            True
        """
        flags, to = _options(kwargs)
        concat_tensor = concat_tensor.to(**to) if to else concat_tensor
        shapes = tuple(torch.Size(s) for s in shapes)
        if len({len(s) for s in shapes}) > 1:
            raise ValueError(f"all shapes must have the same number of dims, got {[tuple(s) for s in shapes]}")
        permutation, ragged = layout.canonical(shapes)
        rows = sum(layout.counts(shapes, permutation, ragged)) if ragged else len(shapes)
        expected = (rows, *layout.static_shape(shapes, permutation, ragged))
        if tuple(concat_tensor.shape) != expected:
            raise ValueError(
                f"concat_tensor of shape {tuple(concat_tensor.shape)} does not hold elements of shapes "
                f"{[tuple(s) for s in shapes]}; expected shape {expected}"
            )
        return cls._make(concat_tensor, shapes, permutation, ragged, **flags)  # type: ignore[attr-defined]

    @classmethod
    def from_tensor_mask(cls, tensor: Tensor, mask: Tensor, *, batched: bool = False, **kwargs: Any) -> NestedTensor:
        """Build a NestedTensor from a padded tensor and its mask.

        Args:
            tensor: The padded tensor, batch dim first (second if `batch_first=False` is passed).
            mask: Validity mask over the leading dims of `tensor`; padding positions hold
                `mask_value` (default `False`) and real positions hold its negation.
            batched: With a 1-D mask, pick whole rows of `tensor` (one element per valid row)
                instead of treating `tensor` as a single sequence.
            **kwargs: `batch_first`, `padding_value`, `mask_value`.

        Examples:
            >>> padded_tensor = torch.tensor([[1, 2, 3, 0, 0],
            ...                                [4, 5, 0, 0, 0],
            ...                                [6, 7, 8, 9, 0]])
            >>> mask_tensor = torch.tensor([[1, 1, 1, 0, 0],
            ...                             [1, 1, 0, 0, 0],
            ...                             [1, 1, 1, 1, 0]])
            >>> nested_tensor = NestedTensor.from_tensor_mask(padded_tensor, mask_tensor)
            >>> nested_tensor
            NestedTensor([
                [1, 2, 3],
                [4, 5],
                [6, 7, 8, 9]
            ])
        """
        flags, to = _options(kwargs)
        tensor = tensor.to(**to) if to else tensor
        valid = mask.to(tensor.device).bool() != flags.get("mask_value", False)
        if not flags.get("batch_first", True) and valid.dim() > 1:
            tensor, valid = tensor.movedim(1, 0), valid.movedim(1, 0)
        if valid.shape != tensor.shape[: valid.dim()]:
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not match tensor of shape {tuple(tensor.shape)}")
        if valid.dim() == 1:
            if batched:
                return cls(list(tensor[valid]), **flags)  # type: ignore[call-arg]
            _check_prefix(valid.unsqueeze(0), mask)
            return cls([tensor[valid]], **flags)  # type: ignore[call-arg]
        extents = _check_prefix(valid, mask)
        if valid.dim() == 2:
            shapes = tuple(torch.Size((int(n), *tensor.shape[2:])) for n in extents[:, 0].tolist())
            return cls._make(tensor[valid], shapes, **flags)  # type: ignore[attr-defined]
        elements = [row[tuple(slice(0, e) for e in sizes)] for row, sizes in zip(tensor, extents.tolist())]
        return cls(elements, **flags)  # type: ignore[call-arg]

    def nested_like(self: NestedTensor, tensor: Tensor, strict: bool = True) -> NestedTensor:  # type: ignore[misc]
        """Cut a padded tensor into a NestedTensor with this one's element shapes.

        Args:
            tensor: A tensor laid out like `self.tensor` (or a NestedTensor, returned as is).
            strict: Require `tensor` to have exactly `self.shape`; otherwise only the batch size
                must match and every element is cropped to what `tensor` holds.

        Examples:
            >>> nested_tensor = NestedTensor([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
            >>> (nested_tensor == nested_tensor.nested_like(nested_tensor)).all()
            tensor(True)
            >>> tensor = nested_tensor.tensor
            >>> (nested_tensor == nested_tensor.nested_like(tensor)).all()
            tensor(True)
            >>> f = nested_tensor.nested_like(torch.randn(2, 2))
            Traceback (most recent call last):
            ...
            ValueError: The shape of NestedTensor and input tensor does not match, ...
            >>> p = nested_tensor.nested_like(torch.randn(2, 2), False)
            >>> p = nested_tensor.nested_like(torch.randn(3, 3), False)
            Traceback (most recent call last):
            ...
            ValueError: The batch size of NestedTensor and input tensor does not match, 2 != 3
        """
        from .nested_tensor import NestedTensor

        if isinstance(tensor, NestedTensor):
            if len(tensor) != len(self):
                raise ValueError(
                    f"The batch size of NestedTensor and input tensor does not match, {len(self)} != {len(tensor)}"
                )
            if strict and tensor._shapes != self._shapes:
                raise ValueError("The shape of NestedTensor and input NestedTensor does not match")
            return tensor
        batch = 0 if self._batch_first or tensor.dim() < 2 else 1
        if tensor.dim() == 0 or tensor.shape[batch] != len(self):
            size = tensor.shape[batch] if tensor.dim() else "a scalar"
            raise ValueError(f"The batch size of NestedTensor and input tensor does not match, {len(self)} != {size}")
        if strict:
            if tensor.shape != self.shape:
                raise ValueError(
                    "The shape of NestedTensor and input tensor does not match, "
                    f"{tuple(self.shape)} != {tuple(tensor.shape)}"
                )
            if batch:
                tensor = tensor.movedim(1, 0)
            values = layout.from_padded(tensor, self._shapes, self._permutation, self._ragged, self._rmask())
            return self._derive(values, self._shapes)
        if batch:
            tensor = tensor.movedim(1, 0)
        elements = [row[tuple(slice(0, s) for s in shape[: row.dim()])] for row, shape in zip(tensor, self._shapes)]
        return self._from_elements(elements)

    def to_torch_nested(self: NestedTensor) -> Tensor:  # type: ignore[misc]
        """Convert to a `torch.nested` tensor with the jagged layout.

        Examples:
            >>> nested_tensor = NestedTensor([[2, 3, 5], [7, 8]])
            >>> nt = nested_tensor.to_torch_nested()
            >>> nt.layout == torch.jagged
            True
            >>> nt.values()
            tensor([2, 3, 5, 7, 8])
        """
        if self.ndim == 1 and len(self):  # jagged layouts need a ragged dim: scalars get the strided layout
            with warnings.catch_warnings():  # torch flags the strided layout as a prototype
                warnings.simplefilter("ignore", UserWarning)
                return torch.nested.nested_tensor(list(self._elements()), layout=torch.strided)
        if layout.is_simple(self._permutation, self._ragged):
            offsets = self._offsets.to(self._values.device, non_blocking=True)
            return torch.nested.nested_tensor_from_jagged(self._values, offsets)
        return torch.nested.as_nested_tensor(list(self._elements()), layout=torch.jagged)

    def unbind(self: NestedTensor, dim: int = 0) -> tuple[Tensor, ...]:  # type: ignore[misc]
        """Split into the element tensors (only along the batch dim)."""
        if self._element_dim(dim) is not None:
            raise ValueError(f"NestedTensor can only be unbound along its batch dim, got dim={dim}")
        return self._elements()

    def tolist(self: NestedTensor) -> list:  # type: ignore[misc]
        """The elements as nested Python lists.

        Examples:
            >>> nested_tensor = NestedTensor([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
            >>> nested_tensor.tolist()
            [[1, 2, 3], [4, 5]]
        """
        return [element.tolist() for element in self._elements()]

    def size(self: NestedTensor, dim: int | None = None) -> torch.Size | int:  # type: ignore[misc]
        """The padded shape, or its size along `dim`.

        Examples:
            >>> nested_tensor = NestedTensor([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
            >>> nested_tensor.size()
            torch.Size([2, 3])
            >>> nested_tensor.size(0)
            2
            >>> nested_tensor[1] = torch.tensor([4, 5, 6, 7])
            >>> nested_tensor.shape
            torch.Size([2, 4])
            >>> nested_tensor.size(1)
            4
        """
        shape = self.shape
        return shape if dim is None else shape[dim]

    def dim(self: NestedTensor) -> int:  # type: ignore[misc]
        """Number of dims, batch included.

        Examples:
            >>> nested_tensor = NestedTensor([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
            >>> nested_tensor.dim()
            2
        """
        return self.ndim

    def numel(self: NestedTensor) -> int:  # type: ignore[misc]
        """Number of real (non-padding) values.

        Examples:
            >>> nested_tensor = NestedTensor([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
            >>> nested_tensor.numel()
            5
        """
        return self._values.numel()

    def to(self: NestedTensor, *args: Any, **kwargs: Any) -> NestedTensor:  # type: ignore[misc]
        """Convert dtype and/or device like `Tensor.to`; returns `self` when nothing changes."""
        from .nested_tensor import NestedTensor

        args = tuple(a._values if isinstance(a, NestedTensor) else a for a in args)
        values = self._values.to(*args, **kwargs)
        return self if values is self._values else self._derive(values, self._shapes)

    def pin_memory(self: NestedTensor, device: Any = None) -> NestedTensor:  # type: ignore[misc]
        """Copy the packed storage into page-locked memory for faster host-to-device copies."""
        values = self._values.pin_memory() if device is None else self._values.pin_memory(device)
        return self._derive(values, self._shapes)

    def requires_grad_(self: NestedTensor, requires_grad: bool = True) -> NestedTensor:  # type: ignore[misc]
        """Switch gradient recording of the packed values in place; returns `self`."""
        self._values.requires_grad_(requires_grad)
        return self


def _check(**flags: Any) -> None:
    from .nested_tensor import check_flags

    check_flags(**flags)


def _options(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split constructor kwargs into NestedTensor flags (type-checked) and `Tensor.to` arguments."""
    flags = {k: v for k, v in kwargs.items() if k not in ("dtype", "device")}
    unknown = set(flags) - {"batch_first", "padding_value", "mask_value"}
    if unknown:
        raise TypeError(f"unexpected NestedTensor options {sorted(unknown)}")
    _check(**flags)
    return flags, {k: v for k, v in kwargs.items() if k in ("dtype", "device")}


def _check_prefix(valid: Tensor, mask: Tensor) -> Tensor:
    """Per-row extents of a `(B, *dims)` validity mask; every row must be a box at the origin."""
    batch, dims = valid.shape[0], valid.dim() - 1
    rows = [valid.movedim(d + 1, 1).reshape(batch, valid.shape[d + 1], -1).any(2).sum(1) for d in range(dims)]
    extents = torch.stack(rows, dim=1).reshape(batch, dims)
    box = torch.ones_like(valid)
    for d in range(dims):
        positions = torch.arange(valid.shape[d + 1], device=valid.device)
        inside = positions.view(1, -1) < extents[:, d].view(-1, 1)
        box = box & inside.view([batch] + [valid.shape[d + 1] if i == d else 1 for i in range(dims)])
    if not torch.equal(box, valid):
        raise ValueError(
            "from_tensor_mask needs every element's valid positions to form a prefix (a box starting at 0); "
            f"mask {mask.tolist() if mask.numel() <= 64 else tuple(mask.shape)} does not"
        )
    return extents
