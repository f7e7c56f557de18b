"""Exact comparison of metric values shared by the fast-path and deferred-update tests."""

from __future__ import annotations

import math

import torch


def same(a, b) -> bool:
    """Equal values, `nan` equal to `nan`, tensors compared exactly."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and torch.equal(a.nan_to_num(-7.0), b.nan_to_num(-7.0))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b
