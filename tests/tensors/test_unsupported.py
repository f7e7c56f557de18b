"""Ops without a nested meaning raise TypeError naming the op and why, instead of computing on padding."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from danling.tensors import NestedTensor


def nested() -> NestedTensor:
    return NestedTensor(torch.randn(3, 4), torch.randn(2, 4))


UNDEFINED = [
    ("torch.Tensor.numpy", "rectangular", lambda x: x.numpy()),
    ("torch.Tensor.storage", "packed storage", lambda x: x.storage()),
    ("torch.msort", "batch dim", lambda x: torch.msort(x)),
    ("torch.Tensor.sum_to_size", "padded sizes", lambda x: x.sum_to_size(1, 3, 4)),
    ("torch.take", "flat indices", lambda x: torch.take(x, torch.tensor([0]))),
    ("torch.Tensor.as_strided", "packed", lambda x: x.as_strided((2,), (1,))),
    ("torch.Tensor.unfold", "padding", lambda x: x.unfold(1, 2, 1)),
]


@pytest.mark.parametrize("name,reason,call", UNDEFINED, ids=[name for name, _, _ in UNDEFINED])
def test_undefined_ops_name_themselves_and_why(name, reason, call):
    with pytest.raises(TypeError, match=f"NestedTensor does not support {re.escape(name)}: .*{reason}"):
        call(nested())


def test_unknown_op_names_itself():
    with pytest.raises(TypeError, match=r"NestedTensor does not support torch\.nn\.functional\.affine_grid"):
        F.affine_grid(nested(), (2, 1, 3, 4))


BATCH_DIM = [
    ("torch.stack", lambda x: torch.stack([x, x])),
    ("torch.sort", lambda x: torch.sort(x, dim=0)),
    ("torch.cumsum", lambda x: torch.cumsum(x, 0)),
    ("torch.gather", lambda x: torch.gather(x, 0, torch.zeros(1, 1, 1, dtype=torch.long))),
    ("torch.kthvalue", lambda x: torch.kthvalue(x, 1, dim=0)),
]


@pytest.mark.parametrize("name,call", BATCH_DIM, ids=[name for name, _ in BATCH_DIM])
def test_batch_dim_ops_say_why(name, call):
    with pytest.raises(ValueError, match=rf"{name.split('.')[-1]}.*batch"):
        call(nested())


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
    with pytest.raises(ValueError, match="different numbers of results"):
        torch.split(NestedTensor(torch.zeros(3), torch.zeros(1)), 2, dim=1)


def test_mismatched_ragged_operands_fail_like_the_elements():
    with pytest.raises(RuntimeError):
        nested() + NestedTensor(torch.randn(2, 4), torch.randn(3, 4))
