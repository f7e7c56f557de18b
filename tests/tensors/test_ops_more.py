"""More op coverage: aliases, padded-batch fast paths, and less common ops, each against the elements."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from danling.tensors import NestedTensor

from .test_ops_coverage import CHANNELS, IMAGES, PROJECT, SEQ, SQUARE, W1, W2, _check, batch

ALIASES = {
    "interpolate_nearest_2d": (
        IMAGES,
        lambda x: F.interpolate(x, scale_factor=(1.5, 2.0)),
        lambda e: F.interpolate(e[None], scale_factor=(1.5, 2.0))[0],
        True,
        False,
    ),
    "interpolate_bilinear": (
        IMAGES,
        lambda x: F.interpolate(x, scale_factor=2.5, mode="bilinear"),
        lambda e: F.interpolate(e[None], scale_factor=2.5, mode="bilinear")[0],
        True,
        False,
    ),
    "interpolate_size": (
        CHANNELS,
        lambda x: F.interpolate(x, size=6, mode="linear", align_corners=True),
        lambda e: F.interpolate(e[None], size=6, mode="linear", align_corners=True)[0],
        True,
        False,
    ),
    "conv1d_strided": (
        CHANNELS,
        lambda x: F.conv1d(x, W1, stride=2, padding=2, dilation=2),
        lambda e: F.conv1d(e, W1, stride=2, padding=2, dilation=2),
        True,
        False,
    ),
    "conv1d_same": (
        CHANNELS,
        lambda x: F.conv1d(x, W1, padding="same"),
        lambda e: F.conv1d(e, W1, padding="same"),
        True,
        False,
    ),
    "conv_transpose2d": (
        IMAGES,
        lambda x: F.conv_transpose2d(x, W2.transpose(0, 1), stride=2, output_padding=1),
        lambda e: F.conv_transpose2d(e, W2.transpose(0, 1), stride=2, output_padding=1),
        True,
        False,
    ),
    "max_pool1d_ceil": (
        CHANNELS,
        lambda x: F.max_pool1d(x, 3, 2, padding=1, ceil_mode=True),
        lambda e: F.max_pool1d(e, 3, 2, padding=1, ceil_mode=True),
        True,
        False,
    ),
    "max_pool2d": (
        IMAGES,
        lambda x: F.max_pool2d(x, 2, ceil_mode=True),
        lambda e: F.max_pool2d(e, 2, ceil_mode=True),
        True,
        False,
    ),
    "max_pool2d_indices": (
        IMAGES,
        lambda x: F.max_pool2d(x, 2, return_indices=True),
        lambda e: F.max_pool2d(e, 2, return_indices=True),
        False,
        False,
    ),
    "nn_conv1d": (CHANNELS, torch.nn.Conv1d(2, 3, 3, padding=1, dtype=torch.float64), None, True, False),
    "logaddexp": (SEQ, lambda x: torch.logaddexp(x, x * 2), lambda e: torch.logaddexp(e, e * 2), True, False),
    "vstack": (SEQ, lambda x: torch.vstack([x, x])[3:], lambda e: e, True, False),
    "hstack": (SEQ, lambda x: torch.hstack([x, x]), lambda e: torch.cat([e, e]), True, False),
    "hsplit": (SEQ, lambda x: torch.hsplit(x, 2), lambda e: torch.tensor_split(e, 2, dim=0), False, False),
    "addmm": (
        SEQ,
        lambda x: torch.addmm(PROJECT[0], x, PROJECT),
        lambda e: torch.addmm(PROJECT[0], e, PROJECT),
        True,
        False,
    ),
    "diagonal_linalg": (SQUARE, torch.linalg.diagonal, torch.linalg.diagonal, True, False),
    "cdist": (SEQ, lambda x: torch.cdist(x, x), lambda e: torch.cdist(e, e), True, False),
    "reshape_as": (SEQ, lambda x: x.reshape_as(x.flatten(1)), lambda e: e.flatten(), True, False),
    "quantile_dim": (SEQ, lambda x: x.quantile(0.5, dim=1), lambda e: e.quantile(0.5, dim=0), True, True),
    "aminmax": (SEQ, lambda x: torch.aminmax(x, dim=1), lambda e: torch.aminmax(e, dim=0), False, True),
}


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_aliases_match_elements(name):
    elements, nested_fn, element_fn, grad, dense = ALIASES[name]
    element_fn = element_fn or nested_fn
    if name == "aminmax":
        low, high = nested_fn(NestedTensor(elements))
        torch.testing.assert_close(low, torch.stack([element_fn(e).min for e in elements]))
        torch.testing.assert_close(high, torch.stack([element_fn(e).max for e in elements]))
        return
    _check(elements, nested_fn, element_fn, grad, dense)


def test_values_reductions_and_selection():
    nt = NestedTensor(SEQ, padding_value=50.0)
    flat = torch.cat(SEQ)
    torch.testing.assert_close(torch.quantile(nt, 0.5), flat.flatten().quantile(0.5))
    torch.testing.assert_close(torch.dist(nt, nt * 0), flat.norm())
    longer = SEQ[:1] + SEQ[2:]  # std of a single row is undefined
    std, mean = torch.std_mean(NestedTensor(longer), dim=1)
    torch.testing.assert_close(mean, torch.stack([e.mean(0) for e in longer]))
    torch.testing.assert_close(std, torch.stack([e.std(0) for e in longer]))
    torch.testing.assert_close(torch.masked_select(nt, nt > 0), flat[flat > 0])
    assert [t.shape for t in torch.unbind(nt)] == [e.shape for e in SEQ]
    frac, exponent = torch.frexp(nt)
    torch.testing.assert_close(torch.cat(list(frac * 2.0**exponent)), flat)
    assert torch.numel(nt) == flat.numel() and torch.is_floating_point(nt)
    copied = NestedTensor([torch.zeros_like(e) for e in SEQ])
    copied.copy_(nt)
    torch.testing.assert_close(copied.concat, flat)


(BILINEAR,) = batch((2, 4, 4), seed=2)
MORE = {
    "prelu": (CHANNELS, lambda x: F.prelu(x, PROJECT[0]), lambda e: F.prelu(e[None], PROJECT[0])[0], True, False),
    "bilinear": (SEQ, lambda x: F.bilinear(x, x * 2, BILINEAR), lambda e: F.bilinear(e, e * 2, BILINEAR), True, False),
    "bilinear_ragged": (
        batch((2, 3), (4, 3)),
        lambda x: F.bilinear(x, x.flip(1), SQUARE[0]),
        lambda e: F.bilinear(e, e.flip(0), SQUARE[0]),
        True,
        False,
    ),
    "diagonal": (SQUARE, lambda x: x.diagonal(dim1=-2, dim2=-1), lambda e: e.diagonal(dim1=-2, dim2=-1), True, False),
    "tril": (SQUARE, torch.tril, torch.tril, True, False),
    "view_as_real": (
        SEQ,
        lambda x: torch.view_as_real(x.to(torch.complex128)),
        lambda e: torch.view_as_real(e.to(torch.complex128)),
        False,
        False,
    ),
    "linear_cross_entropy": (
        SEQ,
        lambda x: F.linear_cross_entropy(
            x, PROJECT.T, NestedTensor([torch.zeros(n, dtype=torch.long) for n in (3, 1, 5)])
        ),
        None,
        True,
        True,
    ),
}


@pytest.mark.parametrize("name", sorted(MORE))
def test_more_ops_match_elements(name):
    elements, nested_fn, element_fn, grad, dense = MORE[name]
    if element_fn is None:  # a loss: the mean over every real position of the batch
        flat = torch.cat(elements)
        expected = F.linear_cross_entropy(flat, PROJECT.T, torch.zeros(len(flat), dtype=torch.long))
        torch.testing.assert_close(nested_fn(NestedTensor(elements)), expected)
        return
    _check(elements, nested_fn, element_fn, grad, dense)


def test_in_place_tril_and_index_put():
    nt = NestedTensor([e.clone() for e in SQUARE])
    nt.tril_()
    for actual, e in zip(nt, SQUARE):
        torch.testing.assert_close(actual, e.tril())
    seq = NestedTensor([e.clone() for e in SEQ])
    mask = seq.mask
    seq.index_put_((mask,), torch.tensor(0.0, dtype=torch.float64))
    assert seq.concat.abs().sum() == 0


def test_expand_repeat_tile_take_full_shapes():
    elements = [torch.randn(n, 1, dtype=torch.float64) for n in (3, 1, 2)]
    nt = NestedTensor(elements)
    _check(elements, lambda x: x.expand(3, -1, 4), lambda e: e.expand(-1, 4), True, False)
    # the ragged dim given as its padded size keeps each element's own size
    _check(elements, lambda x: x.expand(-1, 3, 4), lambda e: e.expand(-1, 4), True, False)
    _check(elements, lambda x: x.repeat(1, 2, 3), lambda e: e.repeat(2, 3), True, False)
    _check(elements, lambda x: torch.tile(x, (2,)), lambda e: torch.tile(e, (1, 2)), True, False)
    _check(elements, lambda x: x.expand_as(x.repeat(1, 1, 5)), lambda e: e.expand(-1, 5), True, False)
    with pytest.raises(ValueError, match="batch dim"):
        nt.repeat(2, 1, 1)
    with pytest.raises(ValueError, match="batch dim"):
        nt.expand(2, 3, 4, 1)


def test_linalg_norm_over_two_dims_is_frobenius():
    elements = batch((2, 3, 4), (5, 3, 4))
    _check(
        elements, lambda x: torch.linalg.norm(x, dim=(2, 3)), lambda e: torch.linalg.norm(e, dim=(1, 2)), True, False
    )
    _check(elements, lambda x: torch.norm(x, dim=3), lambda e: torch.norm(e, dim=2), True, False)


def test_in_place_shape_ops_type_and_hooks():
    elements = batch((3, 1, 4), (2, 1, 4))
    nt = NestedTensor([e.clone() for e in elements])
    assert nt.squeeze_(2) is nt and [tuple(e.shape) for e in nt] == [(3, 4), (2, 4)]
    nt.transpose_(1, 2)
    for actual, e in zip(nt, elements):
        torch.testing.assert_close(actual, e.squeeze(1).T)
    nt.transpose_(0, 1)
    assert nt.batch_first is False
    assert nt.type() == "torch.DoubleTensor" and nt.type(torch.float32).dtype == torch.float32
    leaf = NestedTensor(elements, requires_grad=True)
    seen = []
    leaf.register_hook(lambda grad: seen.append(grad) or grad * 2)
    (leaf * 3).sum().backward()
    assert isinstance(seen[0], NestedTensor) and torch.equal(seen[0].concat, torch.full_like(leaf.concat, 3))
    torch.testing.assert_close(leaf.grad.concat, torch.full_like(leaf.concat, 6))


def test_transformer_layers_run_each_sequence():
    torch.manual_seed(0)
    encoder = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 2)
    decoder = torch.nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    sequences = [torch.randn(n, 8) for n in (4, 2, 3)]
    nt = NestedTensor(sequences)
    encoded, decoded = encoder(nt), decoder(nt, nt)
    assert isinstance(encoded, NestedTensor) and isinstance(decoded, NestedTensor)
    for i, s in enumerate(sequences):
        torch.testing.assert_close(encoded[i], encoder(s[None])[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(decoded[i], decoder(s[None], s[None])[0], atol=1e-5, rtol=1e-4)
