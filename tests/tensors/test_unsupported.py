"""Ops without a nested meaning raise TypeError naming the op instead of computing on padding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from danling.tensors import NestedTensor


def nested() -> NestedTensor:
    return NestedTensor(torch.randn(3, 4), torch.randn(2, 4))


UNSUPPORTED = [
    ("torch.stack", lambda x: torch.stack([x, x])),
    ("torch.Tensor.numpy", lambda x: x.numpy()),
    ("torch.sort", lambda x: torch.sort(x, dim=1)),
    ("torch.cumsum", lambda x: torch.cumsum(x, 1)),
    ("torch.Tensor.index_select", lambda x: x.index_select(1, torch.tensor([0]))),
    ("torch.Tensor.expand", lambda x: x.expand(2, 3, 4)),
    ("torch.nn.functional.conv1d", lambda x: F.conv1d(x, torch.randn(2, 4, 1))),
    ("torch.einsum", lambda x: torch.einsum("bld->bd", x)),
    ("torch.Tensor.storage", lambda x: x.storage()),
    ("torch.where", lambda x: torch.where(x > 0)),
]


@pytest.mark.parametrize("name,call", UNSUPPORTED, ids=[name for name, _ in UNSUPPORTED])
def test_unsupported_ops_name_themselves(name, call):
    with pytest.raises(TypeError, match=name.split(".")[-1]):
        call(nested())


def test_message_names_full_op():
    with pytest.raises(TypeError, match=r"NestedTensor does not support torch\.stack"):
        torch.stack([nested(), nested()])


def test_layout_errors_are_value_errors():
    nt = nested()
    with pytest.raises(ValueError, match="batch dim"):
        nt.transpose(0, 2)
    with pytest.raises(ValueError, match="batch dim"):
        nt.permute(1, 0, 2)
    with pytest.raises(ValueError, match="batch sizes differ"):
        nt + NestedTensor([torch.randn(3, 4)])
    with pytest.raises(ValueError, match="only some elements"):
        NestedTensor(torch.zeros(1, 2), torch.zeros(3, 2)).squeeze(1)


def test_mismatched_ragged_operands_fail_like_the_elements():
    with pytest.raises(RuntimeError):
        nested() + NestedTensor(torch.randn(2, 4), torch.randn(3, 4))
