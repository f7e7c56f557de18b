"""torch.compile runs code that uses NestedTensor ops, with no warning (so also under ``-W error``).

NestedTensor ops are opaque to Dynamo: it breaks the graph at each of them and compiles the dense
code around them; results must equal eager mode.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from danling.tensors import NestedTensor

WEIGHT = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))

OPS = {
    "arithmetic": lambda x: (x * 2 + 1).relu(),
    "reduction": lambda x: x.sum(dim=1) / x.mean(dim=1).abs().clamp_min(1),
    "softmax_ragged": lambda x: x.softmax(dim=1),
    "linear_layer_norm": lambda x: F.layer_norm(F.linear(x, WEIGHT), (5,)),
    "indexing_views": lambda x: x[:, 1:].tensor + x.mask.sum(),
    "sort_cumsum": lambda x: x.sort(dim=1).values.cumsum(1),
    "attention": lambda x: F.scaled_dot_product_attention(x, x, x),
    "construct": lambda x: NestedTensor(x[0] * 2, x[1]) + 1,
}


def batch() -> NestedTensor:
    generator = torch.Generator().manual_seed(1)
    return NestedTensor(torch.randn(3, 4, generator=generator), torch.randn(2, 4, generator=generator))


def assert_same(actual, expected) -> None:
    if isinstance(expected, NestedTensor):
        assert isinstance(actual, NestedTensor) and len(actual) == len(expected)
        for a, e in zip(actual, expected):
            torch.testing.assert_close(a, e)
    else:
        torch.testing.assert_close(actual, expected)


def _allow_interpreter_warning():
    # Under Python 3.13.0 exactly, Dynamo warns that its guards run slower than on 3.13.1+: a
    # property of the interpreter's patch release, not of the code compiled here.
    warnings.filterwarnings("ignore", message="Guards may run slower on Python 3.13.0", category=RuntimeWarning)


@pytest.mark.parametrize("name", sorted(OPS))
def test_compiled_ops_match_eager(name):
    fn = OPS[name]
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Dynamo's "does not know how to trace" warnings must not appear
        _allow_interpreter_warning()
        compiled = torch.compile(fn, backend="eager")
        assert_same(compiled(batch()), fn(batch()))


def test_aot_eager_with_gradients():
    def step(x: NestedTensor, weight: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(x @ weight.T)  # dense around the NestedTensor ops is compiled
        return hidden.mean(dim=1).pow(2).sum()

    torch._dynamo.reset()
    weights = [WEIGHT.clone().requires_grad_() for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _allow_interpreter_warning()
        loss = torch.compile(step, backend="aot_eager")(batch(), weights[0])
    loss.backward()
    expected = step(batch(), weights[1])
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(weights[0].grad, weights[1].grad)
