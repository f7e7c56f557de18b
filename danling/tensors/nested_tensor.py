"""NestedTensor: a batch of variable-shaped tensors stored packed, viewed padded on demand."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from numbers import Number
from typing import Any

import torch
from torch import Tensor

from . import layout, methods, views
from .dynamo import opaque_to_dynamo
from .ops import registry


class NestedTensor(methods.NestedTensorMethods, views.NestedTensorViews, Tensor):
    r"""A batch of tensors whose sizes differ, stored without padding.

    Elements are packed into one tensor (see [`layout`][danling.tensors.layout]); padding only
    exists in the views you ask for. Three views cover most needs:

    - `.tensor`: a padded dense tensor, holes filled with `padding_value`;
    - `.mask`: booleans telling real positions from holes (see `mask_value`);
    - `.concat`: every real element concatenated along the ragged dimension, no padding.

    Indexing with an `int` returns that element unpadded, a slice or a list returns a
    NestedTensor holding the chosen elements, and a tuple indexes the batch first and then
    every element with the rest of the tuple.

    Torch functions, `Tensor` methods and the `torch.nn.functional` ops that sequence models
    use work on a NestedTensor directly and act on each element; ops that have no nested
    meaning raise `TypeError` naming the op.

    Attributes:
        _values: Packed element data, shape `(N, *static)`.
        _shapes: Shape of every element.
        _permutation: Element dims in packed order (ragged dims first).
        _ragged: How many leading dims of `_permutation` are flattened into the packed dim 0.

    Args:
        *tensors: The elements: tensors, nested Python lists, or a single list of either.
        batch_first: Put the batch dimension first (`(B, N, *)`); otherwise second (`(N, B, *)`).
        padding_value: Fill value of `.tensor`.
        mask_value: The boolean that marks padding in `.mask` (valid positions get its negation).
        dtype: Optionally convert the elements to this dtype.
        device: Optionally move the elements to this device.
        requires_grad: Optionally make the packed values a leaf that requires grad.

    Raises:
        ValueError: If a lone positional argument is neither a tensor nor an iterable, or if
            elements differ in their number of dimensions.

    Examples:
        >>> nested_tensor = NestedTensor(torch.tensor([1, 2, 3]), torch.tensor([4, 5]))
        >>> nested_tensor.shape
        torch.Size([2, 3])
        >>> nested_tensor.tensor  # Padded representation
        tensor([[1, 2, 3],
                [4, 5, 0]])
        >>> nested_tensor.mask  # Mask showing real vs padding values
        tensor([[ True,  True,  True],
                [ True,  True, False]])
        >>> nested_tensor.concat  # Concatenated version (no padding)
        tensor([1, 2, 3, 4, 5])
        >>> nested_tensor[0]  # First tensor (no padding)
        tensor([1, 2, 3])
        >>> nested_tensor[:2]  # Returns a NestedTensor slice
        NestedTensor([
            [1, 2, 3],
            [4, 5]
        ])
        >>> nested_tensor[:, 1:]  # Slice operations return a new NestedTensor
        NestedTensor([
            [2, 3],
            [5]
        ])
        >>> nested_tensor.to(torch.float).tensor
        tensor([[1., 2., 3.],
                [4., 5., 0.]])
        >>> nested_tensor.half().tensor
        tensor([[1., 2., 3.],
                [4., 5., 0.]], dtype=torch.float16)
        >>> nested_tensor.tolist()
        [[1, 2, 3], [4, 5]]
        >>> NestedTensor(*[[1, 2, 3], [4, 5]])
        NestedTensor([
            [1, 2, 3],
            [4, 5]
        ])
    """

    _values: Tensor
    _shapes: layout.Shapes
    _permutation: tuple[int, ...]
    _ragged: int
    _batch_first: bool
    _padding_value: float
    _mask_value: bool
    _cache: dict[str, Any]

    @staticmethod
    def __new__(
        cls,
        *tensors: Any,
        batch_first: bool = True,
        padding_value: float = 0.0,
        mask_value: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        requires_grad: bool | None = None,
    ):
        check_flags(batch_first=batch_first, padding_value=padding_value, mask_value=mask_value)
        elements = _coerce_elements(tensors, dtype, device)
        values, shapes, permutation, ragged = layout.pack(elements)
        if not elements and (dtype is not None or device is not None):  # nothing was converted: honour them
            values = values.to(device=device, dtype=dtype)
        if requires_grad is not None:
            values = values.detach().requires_grad_(requires_grad)
        return cls._make(values, shapes, permutation, ragged, batch_first, padding_value, mask_value)

    def __init__(
        self,
        *tensors: Any,
        batch_first: bool = True,
        padding_value: float = 0.0,
        mask_value: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        requires_grad: bool | None = None,
    ) -> None:
        # All state is set in __new__; Tensor.__init__ must not see the element arguments.
        super().__init__()

    @classmethod
    def _make(
        cls,
        values: Tensor,
        shapes: layout.Shapes,
        permutation: tuple[int, ...] | None = None,
        ragged: int | None = None,
        batch_first: bool = True,
        padding_value: float = 0.0,
        mask_value: bool = False,
    ) -> NestedTensor:
        if permutation is None or ragged is None:
            permutation, ragged = layout.canonical(shapes)
        if type(values) is not Tensor:
            values = values.as_subclass(Tensor)
        maxes = layout.max_shape(shapes)
        size = _logical_size(len(shapes), maxes, batch_first)
        obj = Tensor._make_wrapper_subclass(cls, size, dtype=values.dtype, device=values.device)
        obj._set_storage(values, shapes, permutation, ragged, maxes)
        obj._batch_first, obj._padding_value, obj._mask_value = bool(batch_first), padding_value, bool(mask_value)
        return obj

    def _set_storage(
        self,
        values: Tensor,
        shapes: layout.Shapes,
        permutation: tuple[int, ...],
        ragged: int,
        maxes: tuple[int, ...] | None = None,
    ) -> None:
        self._values, self._shapes, self._permutation, self._ragged = values, tuple(shapes), permutation, ragged
        self._maxes = layout.max_shape(self._shapes) if maxes is None else maxes
        self._cache = {}

    def _derive(self, values: Tensor, shapes: layout.Shapes | None = None, **overrides: Any) -> NestedTensor:
        """A new NestedTensor with this one's flags; ``shapes=None`` keeps the ragged structure."""
        same_ragged = shapes is None or shapes is self._shapes
        if shapes is None:
            shapes = self._shapes_for_static(tuple(values.shape[1:]))
            permutation, ragged = self._permutation, self._ragged
        else:
            permutation, ragged = layout.canonical(shapes)
        flags = {"batch_first": self._batch_first, "padding_value": self._padding_value}
        flags["mask_value"] = self._mask_value
        flags.update(overrides)
        out = type(self)._make(values, shapes, permutation, ragged, **flags)
        if same_ragged:  # masks and segment ids depend only on the ragged structure: share them
            out._cache.update({k: v for k, v in self._cache.items() if not k.startswith("mask:")})
            if shapes is self._shapes:
                out._cache.update(self._cache)
        return out

    def _shapes_for_static(self, static: tuple[int, ...]) -> layout.Shapes:
        """Element shapes after the static dims (in packed order) change to ``static``."""
        if static == layout.static_shape(self._shapes, self._permutation, self._ragged):
            return self._shapes
        out = []
        for shape in self._shapes:
            dims = list(shape)
            for d, size in zip(self._permutation[self._ragged :], static):
                dims[d] = size
            out.append(torch.Size(dims))
        return tuple(out)

    def _from_elements(self, elements: Sequence[Tensor], **overrides: Any) -> NestedTensor:
        values, shapes, permutation, ragged = layout.pack(elements)
        if not elements:
            values = self._values.new_empty(0)
        flags = {"batch_first": self._batch_first, "padding_value": self._padding_value}
        flags["mask_value"] = self._mask_value
        flags.update(overrides)
        return type(self)._make(values, shapes, permutation, ragged, **flags)

    def _rmask(self) -> Tensor:
        """Cached packed-order validity mask used to scatter into / gather from padded tensors."""
        key = f"rmask:{self._values.device}"
        if key not in self._cache:
            self._cache[key] = layout.ragged_mask(self._shapes, self._permutation, self._ragged, self._values.device)
        return self._cache[key]

    def _element_dim(self, dim: int) -> int | None:
        """Map a dim of the NestedTensor to an element dim; ``None`` means the batch dim."""
        ndim = self.ndim
        if not -ndim <= dim < ndim:
            raise IndexError(
                f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {dim})"
            )
        dim %= ndim
        batch = 0 if self._batch_first or ndim == 1 else 1
        if dim == batch:
            return None
        return dim if dim < batch else dim - 1

    def _logical_dim(self, element_dim: int, ndim: int | None = None) -> int:
        """Inverse of `_element_dim` for a NestedTensor whose elements have ``ndim`` dims."""
        batch = 0 if self._batch_first or (ndim if ndim is not None else self.ndim - 1) == 0 else 1
        return element_dim + 1 if element_dim >= batch else element_dim

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return registry.dispatch(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Reached only if something bypassed __torch_function__; the wrapper holds no data.
        raise registry.unsupported(func, "it reached the dispatcher below __torch_function__")

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        if not self._shapes:
            return "NestedTensor([])"
        body = ",\n".join("    " + _format_element(e) for e in self._elements())
        return f"NestedTensor([\n{body}\n])"

    def __format__(self, spec: str) -> str:
        if spec and self.numel() == 1:
            return format(self._values.reshape(()).item(), spec)
        return repr(self)

    def __reduce_ex__(self, protocol: Any) -> tuple:
        flags = (self._batch_first, self._padding_value, self._mask_value)
        return _rebuild, (self._values, self._shapes, flags)

    def __hash__(self) -> int:
        return id(self)

    def __len__(self) -> int:
        """Return the number of tensors in the batch."""
        return len(self._shapes)

    def __bool__(self) -> bool:
        """Truthiness as for a tensor: defined only when exactly one element value exists."""
        if self._values.numel() != 1:
            raise RuntimeError(
                f"Boolean value of a NestedTensor with {self._values.numel()} values is ambiguous; use .any() or .all()"
            )
        return bool(self._values)

    def __iter__(self) -> Iterator[Tensor]:
        """Iterate over the tensors in the batch."""
        return iter(self._elements())

    def __eq__(self, other: Any) -> NestedTensor:  # type: ignore[override]
        """Element-wise equality; returns a boolean NestedTensor (Python's identity rule for non-numbers)."""
        if not isinstance(other, (Tensor, Number)):
            return NotImplemented
        return registry.dispatch(torch.eq, (self, other), None)

    def __ne__(self, other: Any) -> NestedTensor:  # type: ignore[override]
        """Element-wise inequality; returns a boolean NestedTensor (`True` against a non-number, as torch)."""
        if not isinstance(other, (Tensor, Number)):
            return NotImplemented
        return registry.dispatch(torch.ne, (self, other), None)

    def __copy__(self) -> NestedTensor:
        """Shallow copy: a new NestedTensor over the same packed storage."""
        return self._derive(self._values, self._shapes)

    def __deepcopy__(self, memo: dict) -> NestedTensor:
        """Deep copy: the packed storage is copied too."""
        return self._derive(copy.deepcopy(self._values, memo), self._shapes)

    def __getitem__(self, index: Any) -> Tensor | NestedTensor:
        """Index the batch (`int`, slice, list, tensor), then elements (rest of a tuple)."""
        from .indexing import getitem

        return getitem(self, index)

    def __setitem__(self, index: Any, value: Any) -> None:
        """Replace elements or parts of elements; element shapes may change.

        Examples:
            >>> nested_tensor = NestedTensor([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
            >>> nested_tensor[0] = torch.tensor([6, 7, 8])
            >>> nested_tensor[0]
            tensor([6, 7, 8])
            >>> nested_tensor[1] = torch.tensor([9, 10, 11, 12])
            >>> nested_tensor.shape
            torch.Size([2, 4])
        """
        from .indexing import setitem

        setitem(self, index, value)

    def _elements(self) -> tuple[Tensor, ...]:
        return layout.unpack(self._values, self._shapes, self._permutation, self._ragged)

    # ------------------------------------------------------------------ metadata

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        """Padded shape: the batch size plus the largest size of every element dim."""
        return torch.Size(_logical_size(len(self._shapes), self._maxes, self._batch_first))

    @property
    def ndim(self) -> int:  # type: ignore[override]
        """Number of dims, batch included (same as `dim()`)."""
        return len(self._shapes[0]) + 1 if self._shapes else 1

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        """Data type of the elements; assigning converts them."""
        return self._values.dtype

    @dtype.setter
    def dtype(self, dtype: torch.dtype) -> None:
        self._set_storage(self._values.to(dtype), self._shapes, self._permutation, self._ragged)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        """Device of the elements; assigning moves them."""
        return self._values.device

    @device.setter
    def device(self, device: torch.device | str) -> None:
        self._set_storage(self._values.to(device), self._shapes, self._permutation, self._ragged)

    @property
    def requires_grad(self) -> bool:  # type: ignore[override]
        """Whether autograd records operations on the elements; assignable."""
        return self._values.requires_grad

    @requires_grad.setter
    def requires_grad(self, requires_grad: bool) -> None:
        self._values.requires_grad_(requires_grad)

    @property
    def grad(self) -> NestedTensor | None:  # type: ignore[override]
        """Gradient of the packed values, as a NestedTensor of the same structure (or `None`)."""
        grad = self._values.grad
        return None if grad is None else self._derive(grad, self._shapes)


# The mixin modules cannot import this one (it imports them): hand them the class, which also puts
# it in the globals their doctests run with.
methods.NestedTensor = views.NestedTensor = NestedTensor  # type: ignore[attr-defined]


def check_flags(**flags: Any) -> None:
    """Reject flag values of the wrong type: `batch_first`/`mask_value` are bools, `padding_value` a number."""
    for name, value in flags.items():
        if name == "padding_value":
            ok = isinstance(value, Number) and not isinstance(value, complex)
            accepted = "a real number"
        else:
            ok, accepted = isinstance(value, bool), "a bool"
        if not ok:
            raise TypeError(f"NestedTensor {name} must be {accepted}, got {value!r} ({type(value).__name__})")


def _logical_size(batch: int, maxes: tuple[int, ...], batch_first: bool) -> tuple[int, ...]:
    if not batch:
        return (0,)
    if batch_first or not maxes:
        return (batch, *maxes)
    return (maxes[0], batch, *maxes[1:])


def _coerce_elements(tensors: tuple, dtype: torch.dtype | None, device: Any) -> list[Tensor]:
    if len(tensors) == 1 and not isinstance(tensors[0], Tensor):
        if not isinstance(tensors[0], Iterable) or isinstance(tensors[0], (str, bytes)):
            raise ValueError(f"NestedTensor expects tensors or an iterable of them, got {type(tensors[0]).__name__}")
        tensors = tuple(tensors[0])
    elements = []
    for item in tensors:
        if isinstance(item, NestedTensor):
            raise TypeError("a NestedTensor cannot be an element of another NestedTensor")
        if isinstance(item, Tensor):
            element = item if type(item) is Tensor else item.as_subclass(Tensor)
        else:
            element = torch.tensor(item)
        if dtype is not None or device is not None:
            element = element.to(device=device, dtype=dtype)
        elements.append(element)
    return elements


def _format_element(element: Tensor) -> str:
    from torch._tensor_str import _tensor_str

    try:
        return _tensor_str(element.detach(), 4)
    except Exception:  # private printer API; fall back to the plain list form
        return str(element.tolist())


def _rebuild(values: Tensor, shapes: layout.Shapes, flags: tuple) -> NestedTensor:
    batch_first, padding_value, mask_value = flags
    return NestedTensor._make(values, shapes, None, None, batch_first, padding_value, mask_value)


opaque_to_dynamo(NestedTensor, methods.NestedTensorMethods, views.NestedTensorViews)
