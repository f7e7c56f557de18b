"""Op coverage: each op on a NestedTensor equals the op on every element, nested (values and gradients).

Dims are NestedTensor dims (batch first), so dim ``d`` of the NestedTensor is dim ``d - 1`` of an element.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from danling.tensors import NestedTensor

from .strategies import check_per_element


def batch(*shapes: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator, dtype=torch.float64) for shape in shapes]


SEQ = batch((3, 4), (1, 4), (5, 4))  # (L_i, D): ragged dim first
CHANNELS = batch((2, 7), (2, 4), (2, 9))  # (C, L_i): ragged dim last
SQUARE = batch((3, 3, 3), (1, 3, 3), (2, 3, 3))  # (L_i, n, n): matrices on static dims
IMAGES = batch((2, 6, 5), (2, 4, 8))  # (C, H_i, W_i)
VOLUMES = batch((1, 4, 5, 6), (1, 6, 4, 4))
INDEX = torch.tensor([2, 0])
W1, W2, W3, PROJECT = batch((3, 2, 3), (3, 2, 3, 3), (2, 1, 2, 2, 2), (4, 2), seed=1)

# id: (elements, nested call, element call, grad, result may be dense)
CASES = {
    "sort": (SEQ, lambda x: torch.sort(x, dim=1), lambda e: torch.sort(e, dim=0), False, False),
    "sort_static": (
        SEQ,
        lambda x: x.sort(dim=-1, descending=True),
        lambda e: e.sort(dim=-1, descending=True),
        False,
        False,
    ),
    "argsort": (CHANNELS, lambda x: x.argsort(dim=2), lambda e: e.argsort(dim=1), False, False),
    "topk_ragged": (CHANNELS, lambda x: torch.topk(x, 2, dim=-1), lambda e: torch.topk(e, 2, dim=-1), False, False),
    "topk_static": (SEQ, lambda x: x.topk(2), lambda e: e.topk(2), False, False),
    "topk_values_grad": (SEQ, lambda x: x.topk(1, dim=1).values, lambda e: e.topk(1, dim=0).values, True, False),
    "cumsum": (SEQ, lambda x: torch.cumsum(x, 1), lambda e: torch.cumsum(e, 0), True, False),
    "cumsum_static": (SEQ, lambda x: x.cumsum(dim=2), lambda e: e.cumsum(dim=1), True, False),
    "cumprod": (CHANNELS, lambda x: torch.cumprod(x, -1), lambda e: torch.cumprod(e, -1), True, False),
    "cummax": (SEQ, lambda x: torch.cummax(x, 1), lambda e: torch.cummax(e, 0), False, False),
    "logcumsumexp": (SEQ, lambda x: torch.logcumsumexp(x, 1), lambda e: torch.logcumsumexp(e, 0), True, False),
    "diff": (CHANNELS, lambda x: torch.diff(x), lambda e: torch.diff(e), True, False),
    "split_static": (SEQ, lambda x: torch.split(x, 2, dim=2), lambda e: torch.split(e, 2, dim=1), False, False),
    "chunk_static": (SEQ, lambda x: x.chunk(2, dim=-1), lambda e: e.chunk(2, dim=-1), False, False),
    "split_ragged": (batch((4, 2), (5, 2)), lambda x: x.split(3, 1), lambda e: e.split(3, 0), False, False),
    "gather": (
        SEQ,
        lambda x: torch.gather(x, 2, NestedTensor([torch.zeros(n, 2, dtype=torch.long) for n in (3, 1, 5)])),
        lambda e: torch.gather(e, 1, torch.zeros(e.shape[0], 2, dtype=torch.long)),
        True,
        False,
    ),
    "index_select": (SEQ, lambda x: x.index_select(2, INDEX), lambda e: e.index_select(1, INDEX), True, False),
    "index_select_ragged": (SEQ, lambda x: torch.index_select(x, 1, torch.tensor([0])), lambda e: e[[0]], True, False),
    "scatter_add": (
        SEQ,
        lambda x: x.scatter_add(2, NestedTensor([torch.ones(n, 4, dtype=torch.long) for n in (3, 1, 5)]), x),
        lambda e: e.scatter_add(1, torch.ones(e.shape, dtype=torch.long), e),
        True,
        False,
    ),
    "narrow": (CHANNELS, lambda x: x.narrow(2, 1, 2), lambda e: e.narrow(1, 1, 2), True, False),
    "select": (SEQ, lambda x: x.select(2, 1), lambda e: e.select(1, 1), True, False),
    "repeat_interleave": (
        SEQ,
        lambda x: x.repeat_interleave(2, dim=1),
        lambda e: e.repeat_interleave(2, 0),
        True,
        False,
    ),
    "stack": (SEQ, lambda x: torch.stack([x, x * 2], dim=1), lambda e: torch.stack([e, e * 2]), True, False),
    "stack_last": (SEQ, lambda x: torch.stack([x, x], dim=-1), lambda e: torch.stack([e, e], dim=-1), True, False),
    "where": (SEQ, lambda x: torch.where(x > 0, x, -x), lambda e: torch.where(e > 0, e, -e), True, False),
    "clamp_tensor": (SEQ, lambda x: x.clamp(min=torch.zeros(4)), lambda e: e.clamp(min=torch.zeros(4)), True, False),
    "clamp_nested": (SEQ, lambda x: torch.clamp(x, max=x * 0.5), lambda e: torch.clamp(e, max=e * 0.5), True, False),
    "einsum_bilinear": (SEQ, lambda x: torch.einsum("bld,de->ble", x, PROJECT), lambda e: e @ PROJECT, True, False),
    "einsum_pool": (SEQ, lambda x: torch.einsum("bld->bd", x), lambda e: e.sum(0), True, True),
    "einsum_gram": (SEQ, lambda x: torch.einsum("bld,bmd->blm", x, x), lambda e: e @ e.T, True, False),
    "vector_norm": (
        SEQ,
        lambda x: torch.linalg.vector_norm(x, dim=2),
        lambda e: torch.linalg.vector_norm(e, dim=1),
        True,
        False,
    ),
    "norm_ragged": (SEQ, lambda x: x.norm(dim=1), lambda e: e.norm(dim=0), True, True),
    "norm_batch": (SEQ, lambda x: torch.norm(x, dim=0), lambda e: torch.linalg.vector_norm(e), True, True),
    "matrix_norm": (SQUARE, lambda x: torch.linalg.matrix_norm(x), lambda e: torch.linalg.matrix_norm(e), True, False),
    "det": (SQUARE, torch.linalg.det, torch.linalg.det, True, False),
    "inv": (
        SQUARE,
        lambda x: torch.inverse(x + 3 * torch.eye(3)),
        lambda e: torch.inverse(e + 3 * torch.eye(3)),
        True,
        False,
    ),
    "eigh_values": (
        SQUARE,
        lambda x: torch.linalg.eigvalsh(x @ x.mT),
        lambda e: torch.linalg.eigvalsh(e @ e.mT),
        False,
        False,
    ),
    "kthvalue": (SEQ, lambda x: x.kthvalue(1, dim=1).values, lambda e: e.kthvalue(1, dim=0).values, True, True),
    "conv1d": (CHANNELS, lambda x: F.conv1d(x, W1, padding=1), lambda e: F.conv1d(e, W1, padding=1), True, False),
    "conv2d": (IMAGES, lambda x: F.conv2d(x, W2, stride=2), lambda e: F.conv2d(e, W2, stride=2), True, False),
    "conv3d": (VOLUMES, lambda x: F.conv3d(x, W3), lambda e: F.conv3d(e, W3), True, False),
    "conv_transpose1d": (
        CHANNELS,
        lambda x: F.conv_transpose1d(x, W1.transpose(0, 1)),
        lambda e: F.conv_transpose1d(e, W1.transpose(0, 1)),
        True,
        False,
    ),
    "max_pool1d": (CHANNELS, lambda x: F.max_pool1d(x, 2), lambda e: F.max_pool1d(e, 2), True, False),
    "avg_pool2d": (IMAGES, lambda x: F.avg_pool2d(x, 2), lambda e: F.avg_pool2d(e, 2), True, False),
    "adaptive_avg_pool1d": (
        CHANNELS,
        lambda x: F.adaptive_avg_pool1d(x, 3),
        lambda e: F.adaptive_avg_pool1d(e, 3),
        True,
        False,
    ),
    "adaptive_max_pool2d": (
        IMAGES,
        lambda x: F.adaptive_max_pool2d(x, 2),
        lambda e: F.adaptive_max_pool2d(e, 2),
        True,
        False,
    ),
    "interpolate": (
        CHANNELS,
        lambda x: F.interpolate(x, scale_factor=2.0, mode="linear"),
        lambda e: F.interpolate(e[None], scale_factor=2.0, mode="linear")[0],
        True,
        False,
    ),
    "pad": (SEQ, lambda x: F.pad(x, (1, 2)), lambda e: F.pad(e, (1, 2)), True, False),
    "pad_reflect": (
        CHANNELS,
        lambda x: F.pad(x, (2, 1), mode="reflect"),
        lambda e: F.pad(e, (2, 1), mode="reflect"),
        True,
        False,
    ),
    "group_norm": (CHANNELS, lambda x: F.group_norm(x, 1), lambda e: F.group_norm(e[None], 1)[0], True, False),
    "instance_norm": (CHANNELS, F.instance_norm, lambda e: F.instance_norm(e[None])[0], True, False),
    "glu": (SEQ, lambda x: F.glu(x), lambda e: F.glu(e), True, False),
    "cosine_similarity": (
        SEQ,
        lambda x: F.cosine_similarity(x, x.flip(2), dim=2),
        lambda e: F.cosine_similarity(e, e.flip(1), dim=1),
        True,
        False,
    ),
    "pairwise_distance": (
        SEQ,
        lambda x: F.pairwise_distance(x, x * 2),
        lambda e: F.pairwise_distance(e, e * 2),
        True,
        False,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_elements(name):
    _check(*CASES[name])


def _check(elements, nested_fn, element_fn, grad, dense):
    expected = [element_fn(e) for e in elements]
    if isinstance(expected[0], tuple):  # several results: each is a NestedTensor of the per-element results
        output = nested_fn(NestedTensor(elements))
        assert isinstance(output, tuple) and len(output) == len(expected[0])
        for i, column in enumerate(output):
            assert isinstance(column, NestedTensor)
            for actual, reference in zip(column, expected):
                torch.testing.assert_close(actual, reference[i])
        return
    check_per_element(elements, nested_fn, element_fn, grad=grad, reduction=dense)


def test_in_place_dim_op():
    elements = batch((3, 2), (1, 2))
    nt = NestedTensor([e.clone() for e in elements])
    assert nt.cumsum_(1) is nt
    for actual, e in zip(nt, elements):
        torch.testing.assert_close(actual, e.cumsum(0))


def test_split_along_batch_splits_elements():
    nt = NestedTensor(SEQ)
    first, second = torch.split(nt, [2, 1])
    assert len(first) == 2 and len(second) == 1
    torch.testing.assert_close(second[0], SEQ[2])
    assert len(nt.chunk(3, dim=0)) == 3
    torch.testing.assert_close(nt.index_select(0, torch.tensor([2]))[0], SEQ[2])


def test_isin_bucketize_searchsorted():
    nt = NestedTensor([torch.tensor([1, 5, 3]), torch.tensor([2])])
    assert torch.isin(nt, torch.tensor([1, 2])).tolist() == [[True, False, False], [True]]
    assert torch.isin(nt, NestedTensor([torch.tensor([3]), torch.tensor([2])])).tolist() == [
        [False, False, True],
        [True],
    ]
    boundaries = torch.tensor([2, 4])
    assert torch.bucketize(nt, boundaries).tolist() == [[0, 2, 1], [0]]
    assert torch.searchsorted(boundaries, nt).tolist() == [[0, 2, 1], [0]]


def test_values_ops_see_only_real_values():
    nt = NestedTensor([torch.tensor([1, 0, 3]), torch.tensor([3])], padding_value=7)
    assert torch.unique(nt).tolist() == [0, 1, 3]
    values, inverse = torch.unique(nt, return_inverse=True)
    assert isinstance(inverse, NestedTensor) and inverse.tolist() == [[1, 0, 2], [2]]
    assert torch.bincount(nt).tolist() == [1, 1, 0, 2]
    assert torch.nonzero(nt).tolist() == nt.tensor.mul(nt.mask).nonzero().tolist()
    assert [t.tolist() for t in torch.where(nt)] == [[0, 0, 1], [0, 2, 0]]
    assert torch.histc(nt.float(), bins=4, min=0, max=4).tolist() == [1, 1, 0, 2]


def test_norm_without_dim_covers_real_values():
    nt = NestedTensor(SEQ, padding_value=100.0)
    torch.testing.assert_close(torch.linalg.vector_norm(nt), torch.linalg.vector_norm(torch.cat(SEQ)))
    torch.testing.assert_close(nt.norm(), torch.cat(SEQ).norm())
    torch.testing.assert_close(torch.linalg.norm(nt, keepdim=True).flatten(), torch.cat(SEQ).norm().flatten())


def test_losses_average_over_real_positions():
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(n, 4, generator=generator) for n in (3, 1)]
    targets = [torch.randn(n, 4, generator=generator) for n in (3, 1)]
    flat_in, flat_t = torch.cat(inputs), torch.cat(targets)
    nt_in, nt_t = NestedTensor(inputs), NestedTensor(targets)
    torch.testing.assert_close(F.poisson_nll_loss(nt_in, nt_t), F.poisson_nll_loss(flat_in, flat_t))
    var = NestedTensor([torch.ones(n, 4) for n in (3, 1)])
    torch.testing.assert_close(
        F.gaussian_nll_loss(nt_in, nt_t, var), F.gaussian_nll_loss(flat_in, flat_t, torch.ones(4, 4))
    )
    labels = NestedTensor([torch.tensor([1.0, -1.0, 1.0]), torch.tensor([-1.0])])
    torch.testing.assert_close(
        F.cosine_embedding_loss(nt_in, nt_t, labels), F.cosine_embedding_loss(flat_in, flat_t, labels.concat)
    )
    torch.testing.assert_close(
        F.triplet_margin_loss(nt_in, nt_t, -nt_t), F.triplet_margin_loss(flat_in, flat_t, -flat_t)
    )
    per_row = F.cosine_embedding_loss(nt_in, nt_t, labels, reduction="none")
    assert isinstance(per_row, NestedTensor) and [tuple(e.shape) for e in per_row] == [(3,), (1,)]


def test_a_loss_takes_a_nested_tensor_of_weights_beside_its_operands():
    # Per-position weights of a binary cross-entropy, ragged like the scores: they failed with
    # "no NestedTensor among the arguments" (they reached the loss unpacked, beside packed operands).
    generator = torch.Generator().manual_seed(0)
    scores = [torch.rand(n, 2, generator=generator) for n in (3, 1)]
    labels = [torch.randint(0, 2, (n, 2), generator=generator).float() for n in (3, 1)]
    weights = [torch.rand(n, 2, generator=generator) for n in (3, 1)]
    flat = [torch.cat(tensors) for tensors in (scores, labels, weights)]
    nested = [NestedTensor(tensors) for tensors in (scores, labels, weights)]
    for loss in (F.binary_cross_entropy, F.binary_cross_entropy_with_logits):
        torch.testing.assert_close(loss(*nested[:2], weight=nested[2]), loss(*flat[:2], weight=flat[2]))
        torch.testing.assert_close(loss(*nested[:2], nested[2]), loss(*flat[:2], flat[2]))
        per_position = loss(*nested[:2], weight=nested[2], reduction="none")
        assert isinstance(per_position, NestedTensor)
        torch.testing.assert_close(per_position.concat, loss(*flat[:2], weight=flat[2], reduction="none"))


def test_ctc_loss_takes_lengths_from_elements():
    generator = torch.Generator().manual_seed(0)
    log_probs = [torch.randn(n, 5, generator=generator).log_softmax(-1) for n in (6, 4)]
    targets = [torch.tensor([1, 2]), torch.tensor([3])]
    out = F.ctc_loss(NestedTensor(log_probs), NestedTensor(targets), None, None, reduction="sum")
    expected = sum(
        F.ctc_loss(lp, t, torch.tensor([len(lp)]), torch.tensor([len(t)]), reduction="sum")
        for lp, t in zip(log_probs, targets)
    )
    torch.testing.assert_close(out, expected)


def test_batch_norm_uses_every_real_position():
    nt = NestedTensor(CHANNELS)
    running_mean, running_var = torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    out = F.batch_norm(nt, running_mean, running_var, training=True)
    flat = torch.cat(CHANNELS, dim=1)  # (C, sum L_i)
    expected = (flat - flat.mean(1, keepdim=True)) / (flat.var(1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    torch.testing.assert_close(torch.cat(list(out), dim=1), expected)
    torch.testing.assert_close(running_mean, 0.1 * flat.mean(1))


def test_embedding_bag_one_bag_per_element():
    weight = torch.randn(10, 3)
    ids = [torch.tensor([1, 2, 3]), torch.tensor([4])]
    out = F.embedding_bag(NestedTensor(ids), weight, mode="mean")
    torch.testing.assert_close(out, torch.stack([weight[i].mean(0) for i in ids]))


@pytest.mark.parametrize("cell", [torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_rnn_modules_run_each_sequence(cell, bidirectional):
    torch.manual_seed(0)
    rnn = cell(4, 3, num_layers=2, batch_first=True, bidirectional=bidirectional)
    sequences = [torch.randn(n, 4) for n in (5, 2, 3)]
    leaves = [s.clone().requires_grad_() for s in sequences]
    output, state = rnn(NestedTensor(leaves))
    output.sum().backward()
    for leaf, sequence in zip(leaves, sequences):
        alone = sequence.clone().requires_grad_()
        rnn(alone[None])[0].sum().backward()
        torch.testing.assert_close(leaf.grad, alone.grad, atol=1e-6, rtol=1e-5)
    states = state if isinstance(state, tuple) else (state,)
    for i, sequence in enumerate(sequences):
        expected, expected_state = rnn(sequence[None])
        expected_states = expected_state if isinstance(expected_state, tuple) else (expected_state,)
        torch.testing.assert_close(output[i], expected[0], atol=1e-6, rtol=1e-5)
        for s, e in zip(states, expected_states):
            torch.testing.assert_close(s[:, i], e[:, 0], atol=1e-6, rtol=1e-5)


def test_rnn_batch_first_mismatch_is_explained():
    rnn = torch.nn.GRU(4, 3)  # batch_first=False, the NestedTensor is batch first
    with pytest.raises(ValueError, match="batch_first"):
        rnn(NestedTensor([torch.randn(5, 4), torch.randn(2, 4)]))


def test_multihead_attention_module_per_element():
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    sequences = [torch.randn(n, 8) for n in (4, 2)]
    nt = NestedTensor(sequences)
    output, weights = attention(nt, nt, nt)
    assert isinstance(output, NestedTensor) and output.batch_first
    for i, sequence in enumerate(sequences):
        expected, expected_weights = attention(sequence[None], sequence[None], sequence[None])
        torch.testing.assert_close(output[i], expected[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(weights[i], expected_weights[0], atol=1e-6, rtol=1e-5)


def test_dims_follow_batch_second_layout():
    nt = NestedTensor(SEQ, batch_first=False)  # (L, B, D): the sequence is dim 0
    for actual, e in zip(nt.sort(dim=0).values, SEQ):
        torch.testing.assert_close(actual, e.sort(dim=0).values)
    for actual, e in zip(torch.cumsum(nt, 2), SEQ):
        torch.testing.assert_close(actual, e.cumsum(1))
    first, second = torch.split(nt, [2, 1], dim=1)  # dim 1 is the batch here
    assert len(first) == 2 and len(second) == 1
    rnn = torch.nn.GRU(4, 3, dtype=torch.float64)  # batch_first=False matches the NestedTensor
    output, state = rnn(nt)
    for i, e in enumerate(SEQ):
        expected, expected_state = rnn(e[:, None])
        torch.testing.assert_close(output[i], expected[:, 0])
        torch.testing.assert_close(state[:, i], expected_state[:, 0])
