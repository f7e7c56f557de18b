"""Exact comparison of metric values and a count of dispatched ops, shared by the fast-path tests."""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def same(a, b) -> bool:
    """Equal values, `nan` equal to `nan`, tensors compared exactly."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and torch.equal(a.nan_to_num(-7.0), b.nan_to_num(-7.0))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


class CountOps(TorchDispatchMode):
    """Record every aten op dispatched inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))
