"""Ragged batches: `NestedTensor` (packed storage, padded views) and `PNTensor` dataset items."""

from .nested_tensor import NestedTensor
from .ops import elementwise, functional, reduction, shape  # noqa: F401  (registers the op families)
from .pn_tensor import PNTensor, tensor

__all__ = ["NestedTensor", "PNTensor", "tensor"]
