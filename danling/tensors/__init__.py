"""Ragged batches: `NestedTensor` (packed storage, padded views) and `PNTensor` dataset items."""

from .nested_tensor import NestedTensor
from .ops import conv, coverage, elementwise, extra, functional, reduction, sequence, shape  # noqa: F401
from .pn_tensor import PNTensor, tensor

__all__ = ["NestedTensor", "PNTensor", "tensor"]
