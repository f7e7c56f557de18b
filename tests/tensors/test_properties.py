"""Property tests: every supported op on a NestedTensor equals the op on each element, nested.

Values and gradients are compared over random ragged batches, for the common `(L_i, D)`
layout and for layouts with a ragged dim that is not first or with two ragged dims.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from danling.tensors import NestedTensor

from .strategies import SETTINGS, check_per_element, ragged

SEQ = ("L", 3)  # (L_i, 3): one ragged dim first, the packed layout is a plain concatenation
SEQ3 = ("L", 2, 3)
CHANNEL_FIRST = (2, "L")  # ragged dim second: the packed layout is permuted
GRID = ("L", "M", 2)  # two ragged dims

UNARY = {
    "exp": (torch.exp, torch.exp),
    "sin_method": (lambda x: x.sin(), torch.sin),
    "tanh": (torch.tanh, torch.tanh),
    "sigmoid": (torch.sigmoid, torch.sigmoid),
    "relu": (F.relu, F.relu),
    "gelu": (F.gelu, F.gelu),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), lambda x: F.gelu(x, approximate="tanh")),
    "silu": (F.silu, F.silu),
    "softplus": (F.softplus, F.softplus),
    "leaky_relu": (lambda x: F.leaky_relu(x, 0.2), lambda x: F.leaky_relu(x, 0.2)),
    "neg_operator": (lambda x: -x, lambda x: -x),
    "abs_builtin": (abs, abs),
    "pow_operator": (lambda x: x**2, lambda x: x**2),
    "affine_operators": (lambda x: 2 * x + 1 - x / 4, lambda x: 2 * x + 1 - x / 4),
    "rsub": (lambda x: 1 - x, lambda x: 1 - x),
    "clamp": (lambda x: x.clamp(-0.5, 0.5), lambda x: x.clamp(-0.5, 0.5)),
    "dropout_eval": (lambda x: F.dropout(x, 0.5, training=False), lambda x: x),
    "double": (lambda x: x.double(), lambda x: x.double()),
    "clone": (torch.clone, torch.clone),
}


@pytest.mark.parametrize("pattern", [SEQ, CHANNEL_FIRST, GRID], ids=["seq", "channel_first", "grid"])
@pytest.mark.parametrize("name", sorted(UNARY))
@SETTINGS
@given(data=st.data())
def test_unary(name, pattern, data):
    nested_fn, element_fn = UNARY[name]
    check_per_element(data.draw(ragged(pattern)), nested_fn, element_fn)


def _pair(elements):
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(e.shape, generator=generator, dtype=e.dtype) for e in elements]


BINARY = {
    "add": lambda x, y: x + y,
    "mul": lambda x, y: torch.mul(x, y),
    "sub_method": lambda x, y: x.sub(y),
    "div": lambda x, y: x / (y.exp() + 1),
    "maximum": torch.maximum,
    "atan2": torch.atan2,
    "where": lambda x, y: torch.where(x > y, x, y),
}


@pytest.mark.parametrize("pattern", [SEQ, GRID], ids=["seq", "grid"])
@pytest.mark.parametrize("name", sorted(BINARY))
@SETTINGS
@given(data=st.data())
def test_binary_nested(name, pattern, data):
    elements = data.draw(ragged(pattern))
    others = _pair(elements)
    other = NestedTensor(others)
    fn = BINARY[name]
    index = iter(range(len(elements)))
    check_per_element(elements, lambda nt: fn(nt, other), lambda e: fn(e, others[next(index)]))


@SETTINGS
@given(elements=ragged(SEQ))
def test_binary_trailing_broadcast(elements):
    bias = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    check_per_element(elements, lambda nt: nt * bias + bias, lambda e: e * bias + bias)


@SETTINGS
@given(elements=ragged(SEQ))
def test_binary_with_padded_dense(elements):
    nt = NestedTensor(elements)
    dense = torch.randn(nt.shape, dtype=torch.float64)
    index = iter(range(len(elements)))
    check_per_element(elements, lambda x: x + dense, lambda e: e + dense[next(index), : e.shape[0]])


SHAPE = {
    "transpose": (SEQ3, lambda x: x.transpose(1, 2), lambda e: e.transpose(0, 1)),
    "transpose_last": (SEQ3, lambda x: x.transpose(-1, -2), lambda e: e.transpose(-1, -2)),
    "permute": (SEQ3, lambda x: x.permute(0, 3, 1, 2), lambda e: e.permute(2, 0, 1)),
    "torch_permute": (SEQ3, lambda x: torch.permute(x, (0, 2, 3, 1)), lambda e: e.permute(1, 2, 0)),
    "movedim": (SEQ3, lambda x: x.movedim(1, 3), lambda e: e.movedim(0, 2)),
    "swapaxes": (SEQ3, lambda x: x.swapaxes(2, 3), lambda e: e.swapaxes(1, 2)),
    "mT": (SEQ3, lambda x: x.mT, lambda e: e.mT),
    "T": (SEQ3, lambda x: x.T, lambda e: e.permute(2, 1, 0)),
    "reshape_flat": (SEQ3, lambda x: x.reshape(-1), lambda e: e.reshape(-1)),
    "reshape_rows": (SEQ3, lambda x: x.reshape(-1, 6), lambda e: e.reshape(-1, 6)),
    "reshape_split": (SEQ, lambda x: x.reshape(-1, 3, 1), lambda e: e.reshape(-1, 3, 1)),
    "view": (SEQ3, lambda x: x.view(-1, 3), lambda e: e.view(-1, 3)),
    "flatten": (SEQ3, lambda x: x.flatten(2), lambda e: e.flatten(1)),
    "flatten_all": (SEQ3, lambda x: x.flatten(1), lambda e: e.flatten()),
    "unflatten": (SEQ3, lambda x: x.unflatten(-1, (3, 1)), lambda e: e.unflatten(-1, (3, 1))),
    "unsqueeze_first": (SEQ, lambda x: x.unsqueeze(1), lambda e: e.unsqueeze(0)),
    "unsqueeze_last": (SEQ, lambda x: x.unsqueeze(-1), lambda e: e.unsqueeze(-1)),
    "squeeze": (("L", 1, 3), lambda x: x.squeeze(2), lambda e: e.squeeze(1)),
    "flip_ragged": (SEQ, lambda x: x.flip(1), lambda e: e.flip(0)),
    "flip_static": (SEQ, lambda x: x.flip(-1), lambda e: e.flip(-1)),
    "roll_ragged": (SEQ, lambda x: x.roll(1, 1), lambda e: e.roll(1, 0)),
    "roll_static": (SEQ, lambda x: x.roll(1, 2), lambda e: e.roll(1, 1)),
    "rot90": (SEQ3, lambda x: x.rot90(1, (2, 3)), lambda e: e.rot90(1, (1, 2))),
    "rot90_ragged": (SEQ3, lambda x: x.rot90(1, (1, 2)), lambda e: e.rot90(1, (0, 1))),
    "channel_transpose": (CHANNEL_FIRST, lambda x: x.transpose(1, 2), lambda e: e.transpose(0, 1)),
    "grid_transpose": (GRID, lambda x: x.transpose(1, 3), lambda e: e.transpose(0, 2)),
    "grid_flatten": (GRID, lambda x: x.flatten(1, 2), lambda e: e.flatten(0, 1)),
    "index_static": (SEQ, lambda x: x[:, :, 1:], lambda e: e[:, 1:]),
    "index_ragged": (SEQ, lambda x: x[:, 1:], lambda e: e[1:]),
}


@pytest.mark.parametrize("name", sorted(SHAPE))
@SETTINGS
@given(data=st.data())
def test_shape(name, data):
    pattern, nested_fn, element_fn = SHAPE[name]
    check_per_element(data.draw(ragged(pattern, min_len=2)), nested_fn, element_fn)


REDUCE = {
    "sum_ragged": (SEQ, lambda x: x.sum(1), lambda e: e.sum(0)),
    "mean_ragged": (SEQ, lambda x: x.mean(dim=1), lambda e: e.mean(0)),
    "mean_ragged_keepdim": (SEQ, lambda x: x.mean(1, keepdim=True), lambda e: e.mean(0, keepdim=True)),
    "sum_two_dims": (SEQ3, lambda x: torch.sum(x, (1, 3)), lambda e: e.sum((0, 2))),
    "max_ragged": (SEQ, lambda x: x.max(1).values, lambda e: e.max(0).values),
    "min_ragged": (SEQ, lambda x: torch.min(x, dim=1)[0], lambda e: e.min(0)[0]),
    "amax_ragged": (SEQ, lambda x: x.amax(1), lambda e: e.amax(0)),
    "prod_ragged": (SEQ, lambda x: x.prod(1), lambda e: e.prod(0)),
    "logsumexp_ragged": (SEQ, lambda x: torch.logsumexp(x, 1), lambda e: torch.logsumexp(e, 0)),
    "var_ragged": (SEQ, lambda x: x.var(1), lambda e: e.var(0)),
    "sum_batch": (SEQ, lambda x: x.sum(0), lambda e: e.sum()),
    "mean_batch": (SEQ, lambda x: x.mean(0), lambda e: e.mean()),
    "channel_sum_ragged": (CHANNEL_FIRST, lambda x: x.sum(2), lambda e: e.sum(1)),
    "channel_max_ragged": (CHANNEL_FIRST, lambda x: x.amax(-1), lambda e: e.amax(-1)),
    "grid_mean": (GRID, lambda x: x.mean((1, 2)), lambda e: e.mean((0, 1))),
}

REDUCE_NESTED = {
    "sum_static": (SEQ, lambda x: x.sum(-1), lambda e: e.sum(-1)),
    "mean_static_keepdim": (SEQ, lambda x: x.mean(2, keepdim=True), lambda e: e.mean(1, keepdim=True)),
    "max_static": (SEQ, lambda x: x.max(dim=-1).values, lambda e: e.max(dim=-1).values),
    "grid_sum_one_ragged": (GRID, lambda x: x.sum(1), lambda e: e.sum(0)),
    "channel_sum_static": (CHANNEL_FIRST, lambda x: x.sum(1), lambda e: e.sum(0)),
}


@pytest.mark.parametrize("name", sorted(REDUCE))
@SETTINGS
@given(data=st.data())
def test_reduce_to_dense(name, data):
    pattern, nested_fn, element_fn = REDUCE[name]
    check_per_element(data.draw(ragged(pattern, min_len=2)), nested_fn, element_fn, reduction=True)


@pytest.mark.parametrize("name", sorted(REDUCE_NESTED))
@SETTINGS
@given(data=st.data())
def test_reduce_to_nested(name, data):
    pattern, nested_fn, element_fn = REDUCE_NESTED[name]
    check_per_element(data.draw(ragged(pattern, min_len=2)), nested_fn, element_fn, reduction=True)


@SETTINGS
@given(elements=ragged(SEQ))
def test_full_reductions_match_concatenation(elements):
    nt = NestedTensor(elements)
    flat = torch.cat([e.reshape(-1) for e in elements])
    for name in ("sum", "mean", "amax", "amin", "prod", "std"):
        torch.testing.assert_close(getattr(nt, name)(), getattr(flat, name)())
    torch.testing.assert_close(nt.mean(dim=(0, 1)), torch.cat(elements).mean(0))
    torch.testing.assert_close(nt.sum(dim=[0, 1], keepdim=True), torch.cat(elements).sum(0).view(1, 1, -1))


FUNCTIONAL = {
    "softmax_ragged": (SEQ, lambda x: x.softmax(1), lambda e: e.softmax(0)),
    "softmax_static": (SEQ, lambda x: F.softmax(x, dim=-1), lambda e: F.softmax(e, dim=-1)),
    "log_softmax_ragged": (SEQ, lambda x: F.log_softmax(x, 1), lambda e: F.log_softmax(e, 0)),
    "softmin_ragged": (SEQ, lambda x: F.softmin(x, 1), lambda e: F.softmin(e, 0)),
    "channel_softmax_ragged": (CHANNEL_FIRST, lambda x: x.softmax(-1), lambda e: e.softmax(-1)),
    "grid_softmax": (GRID, lambda x: x.softmax(2), lambda e: e.softmax(1)),
    "normalize": (SEQ, lambda x: F.normalize(x, dim=-1), lambda e: F.normalize(e, dim=-1)),
    "layer_norm": (SEQ, lambda x: F.layer_norm(x, (3,)), lambda e: F.layer_norm(e, (3,))),
    "matmul": (SEQ, lambda x: x @ torch.ones(3, 2, dtype=torch.float64), lambda e: e @ torch.ones(3, 2).double()),
    "matmul_vector": (
        SEQ,
        lambda x: torch.matmul(x, torch.arange(3.0).double()),
        lambda e: e @ torch.arange(3.0).double(),
    ),
    "channel_matmul": (
        CHANNEL_FIRST,
        lambda x: x.mT @ torch.ones(2, 4).double(),
        lambda e: e.mT @ torch.ones(2, 4).double(),
    ),
}


@pytest.mark.parametrize("name", sorted(FUNCTIONAL))
@SETTINGS
@given(data=st.data())
def test_functional(name, data):
    pattern, nested_fn, element_fn = FUNCTIONAL[name]
    check_per_element(data.draw(ragged(pattern)), nested_fn, element_fn)


@SETTINGS
@given(elements=ragged(SEQ))
def test_parameter_gradients_match(elements):
    torch.manual_seed(0)
    linear = torch.nn.Linear(3, 4).double()
    norm = torch.nn.LayerNorm(4).double()
    parameters = [*linear.parameters(), *norm.parameters()]
    norm(linear(NestedTensor(elements))).sum().backward()
    nested_grads = [p.grad.clone() for p in parameters]
    for p in parameters:
        p.grad = None
    sum(norm(linear(e)).sum() for e in elements).backward()
    for got, p in zip(nested_grads, parameters):
        torch.testing.assert_close(got, p.grad)


@SETTINGS
@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4))
def test_embedding_and_cross_entropy(lengths):
    torch.manual_seed(0)
    ids = [torch.randint(0, 7, (n,)) for n in lengths]
    embedding = torch.nn.Embedding(7, 5).double()
    head = torch.nn.Linear(5, 7).double()
    nested = NestedTensor(ids)
    logits = head(embedding(nested))
    assert isinstance(logits, NestedTensor) and logits.shape == (len(lengths), max(lengths), 7)
    loss = F.cross_entropy(logits, nested)
    expected = F.cross_entropy(torch.cat([head(embedding(i)) for i in ids]), torch.cat(ids))
    torch.testing.assert_close(loss, expected)
    loss.backward()
    nested_grad = embedding.weight.grad.clone()
    embedding.weight.grad = None
    expected.backward()
    torch.testing.assert_close(nested_grad, embedding.weight.grad)
    # a dense padded target works too, and padding positions are ignored
    padded_target = nested.tensor.masked_fill(~nested.mask, 3)
    torch.testing.assert_close(F.cross_entropy(logits, padded_target), loss)
    per_token = F.cross_entropy(logits, nested, reduction="none")
    assert isinstance(per_token, NestedTensor)
    for got, i in zip(per_token, ids):
        torch.testing.assert_close(got, F.cross_entropy(head(embedding(i)), i, reduction="none"))


@pytest.mark.parametrize("causal", [False, True])
@SETTINGS
@given(data=st.data())
def test_scaled_dot_product_attention(causal, data):
    elements = data.draw(ragged((2, "L", 4)))
    keys, values = _pair(elements), [e.flip(-1) for e in elements]
    index = iter(range(len(elements)))

    def nested_fn(q):
        return F.scaled_dot_product_attention(q, NestedTensor(keys), NestedTensor(values), is_causal=causal)

    def element_fn(q):
        i = next(index)
        return F.scaled_dot_product_attention(q, keys[i], values[i], is_causal=causal)

    check_per_element(elements, nested_fn, element_fn)


@SETTINGS
@given(elements=ragged(SEQ))
def test_batch_second_layout(elements):
    check_per_element(elements, lambda x: x.softmax(0), lambda e: e.softmax(0), batch_first=False)
    check_per_element(elements, lambda x: x.sum(0), lambda e: e.sum(0), batch_first=False, reduction=True)
    check_per_element(elements, lambda x: x.transpose(0, 2), lambda e: e.transpose(0, 1), batch_first=False)
