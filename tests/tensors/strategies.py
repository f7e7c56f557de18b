"""Hypothesis strategies and the per-element reference check shared by the NestedTensor tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from hypothesis import settings
from hypothesis import strategies as st

from danling.tensors import NestedTensor

SETTINGS = settings(max_examples=20, deadline=None, derandomize=True)


@st.composite
def ragged(draw, pattern: Sequence[int | str] = ("L", 3), max_batch: int = 4, max_len: int = 5, min_len: int = 1):
    """Element tensors (float64) whose ``"L"``/``"M"`` dims vary per element and int dims are fixed."""
    batch = draw(st.integers(1, max_batch))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    elements = []
    for _ in range(batch):
        sizes = {name: draw(st.integers(min_len, max_len)) for name in ("L", "M")}
        shape = [sizes[p] if isinstance(p, str) else p for p in pattern]
        elements.append(torch.randn(*shape, generator=generator, dtype=torch.float64))
    return elements


def _assert_same(actual, expected) -> None:
    if isinstance(expected, (tuple, list)) and not isinstance(actual, torch.Tensor):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            _assert_same(a, e)
        return
    if isinstance(actual, NestedTensor):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            torch.testing.assert_close(a, e)
        return
    torch.testing.assert_close(actual, expected)


def _weighted_sum(output, weights: list[torch.Tensor]) -> torch.Tensor:
    parts = output if isinstance(output, (list, tuple, NestedTensor)) else list(output.unbind(0))
    return sum((p * w).sum() for p, w in zip(parts, weights))


def check_per_element(
    elements: list[torch.Tensor],
    nested_fn: Callable,
    element_fn: Callable,
    *,
    grad: bool = True,
    reduction: bool = False,
    **nested_kwargs,
) -> None:
    """``nested_fn(NestedTensor(elements))`` must equal ``element_fn`` applied element by element.

    Values are compared element by element (or against a stack of the per-element results when
    ``reduction`` and the per-element results share a shape: reductions return a dense tensor
    exactly then); gradients of a randomly weighted sum must match too.
    """
    nested_leaves = [e.clone().requires_grad_(grad) for e in elements]
    element_leaves = [e.clone().requires_grad_(grad) for e in elements]
    output = nested_fn(NestedTensor(nested_leaves, **nested_kwargs))
    expected = [element_fn(e) for e in element_leaves]
    if reduction and all(e.shape == expected[0].shape for e in expected):
        assert not isinstance(output, NestedTensor), f"expected a dense tensor, got {type(output).__name__}"
        _assert_same(output, torch.stack(expected))
    else:
        assert isinstance(output, NestedTensor), f"expected a NestedTensor, got {type(output).__name__}"
        _assert_same(output, expected)
    if not grad or not any(e.requires_grad for e in expected):
        return
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(e.shape, generator=generator, dtype=e.dtype) for e in expected]
    _weighted_sum(output, weights).backward()
    _weighted_sum(expected, weights).backward()
    for nested_leaf, element_leaf in zip(nested_leaves, element_leaves):
        torch.testing.assert_close(nested_leaf.grad, element_leaf.grad)
