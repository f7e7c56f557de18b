"""Property tests of the generic op handlers: every dim of every layout, against the elements.

Each op runs along each element dim of random ragged batches in three layouts (ragged dim first,
ragged dim last, two ragged dims), so both the packed-values path (static dims) and the
per-element path (ragged dims) are exercised, values and gradients.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from .strategies import SETTINGS, check_per_element, ragged

LAYOUTS = {"seq": ("L", 3), "channel_first": (2, "L"), "grid": ("L", "M", 2)}
DIM_OPS = {
    "sort_values": (lambda x, d: x.sort(dim=d).values, lambda e, d: e.sort(dim=d).values),
    "cumsum": (lambda x, d: torch.cumsum(x, d), lambda e, d: torch.cumsum(e, d)),
    "cumprod": (lambda x, d: x.cumprod(d), lambda e, d: e.cumprod(d)),
    "logcumsumexp": (lambda x, d: torch.logcumsumexp(x, d), lambda e, d: torch.logcumsumexp(e, d)),
    "topk_values": (lambda x, d: x.topk(1, dim=d).values, lambda e, d: e.topk(1, dim=d).values),
    "flip": (lambda x, d: x.flip(dims=(d,)), lambda e, d: e.flip(d)),
    "diff": (lambda x, d: torch.diff(x, dim=d), lambda e, d: torch.diff(e, dim=d)),
    "narrow": (lambda x, d: x.narrow(d, 0, 1), lambda e, d: e.narrow(d, 0, 1)),
    "stack": (lambda x, d: torch.stack([x, x.exp()], dim=d), lambda e, d: torch.stack([e, e.exp()], dim=d - 1)),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(DIM_OPS))
@SETTINGS
@given(data=st.data())
def test_dim_ops_on_every_dim(name, layout, data):
    pattern = LAYOUTS[layout]
    nested_fn, element_fn = DIM_OPS[name]
    elements = data.draw(ragged(pattern, min_len=2))
    dim = data.draw(st.integers(1, len(pattern)))  # a NestedTensor dim (0 is the batch)
    if name == "stack":
        dim = data.draw(st.integers(1, len(pattern) + 1))
        check_per_element(elements, lambda x: nested_fn(x, dim), lambda e: element_fn(e, dim))
        return
    check_per_element(elements, lambda x: nested_fn(x, dim), lambda e: element_fn(e, dim - 1))
