"""update/precision.py: precision names, autocast and the fp16 gradient scaler."""

import warnings

import pytest
import torch
from torch import nn

from danling.runners.update import Precision


@pytest.mark.parametrize(
    ("name", "canonical", "dtype"),
    [
        (None, "fp32", None),
        ("FP32", "fp32", None),
        ("bfloat16", "bf16", torch.bfloat16),
        ("half", "fp16", torch.float16),
    ],
)
def test_precision_names(name, canonical, dtype):
    policy = Precision(name, "cpu")
    assert (policy.name, policy.dtype, policy.scaler) == (canonical, dtype, None)


@pytest.mark.parametrize(
    ("name", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)]
)
def test_autocast_on_cpu(name, dtype):
    layer = nn.Linear(4, 4)
    with Precision(name, "cpu").autocast():
        out = layer(torch.randn(2, 4))
    assert out.dtype == dtype
    assert layer.weight.dtype == torch.float32  # parameters stay in full precision


def test_scaler_only_for_fp16_on_cuda():
    assert Precision("bf16", "cuda").scaler is None
    with warnings.catch_warnings():  # CPU-only builds warn that the CUDA scaler is disabled
        warnings.simplefilter("ignore")
        assert isinstance(Precision("fp16", "cuda:0").scaler, torch.amp.GradScaler)
    with pytest.raises(ValueError, match="unknown precision 'int8'; accepted: None, .*'bf16'"):
        Precision("int8")
    policy = Precision("fp16", "cpu")
    loss = torch.tensor(2.0)
    assert policy.scale(loss) is loss and policy.state_dict() == {}


def test_fp32_context_is_reusable():
    policy = Precision("fp32")
    context = policy.autocast()
    with context, context:  # one shared no-op context serves every step, nested or not
        assert not torch.is_autocast_enabled("cpu")
    assert policy.autocast() is context
