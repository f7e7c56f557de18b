"""update/ema.py: the exponential moving average of the weights, and where runners use it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from danling.runners.update import EMA
from tests.runners._torch_toy import TinyRunner, tiny_config


def test_infer_uses_the_ema_weights(tmp_path):
    config = tiny_config(tmp_path, epochs=1, **{"ema.enabled": True, "ema.decay": 0.5})
    with TinyRunner(config) as runner:
        runner.train()
        x = torch.stack([sample[0] for sample in runner.datasets.val])
        with torch.no_grad():
            from_ema = runner.ema.module(x).squeeze(-1)
            from_model = runner.model(x).squeeze(-1)
        assert not torch.allclose(from_ema, from_model)  # the two really differ after training
        assert runner.infer("val") == pytest.approx(from_ema.tolist())


def test_ema_tracks_average_and_copies_buffers():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    ema = EMA(nn.DataParallel(model), decay=0.75)
    start = model[0].weight.detach().clone()
    assert not any(p.requires_grad for p in ema.parameters())
    for _ in range(2):
        with torch.no_grad():
            model[0].weight.add_(1.0)
        model.train()
        model(torch.randn(4, 2))  # moves the batch-norm statistics
        ema.update(model)
    # ema = 0.75^2 * w0 + 0.25 * 0.75 * (w0 + 1) + 0.25 * (w0 + 2)
    torch.testing.assert_close(ema.module[0].weight, start + 0.25 * 0.75 + 0.5)
    torch.testing.assert_close(ema.module[1].running_mean, model[1].running_mean)
    assert ema.module[1].num_batches_tracked.item() == 2
    assert set(ema.module.state_dict()) == set(model.state_dict())
    ema.eval()
    model.eval()
    x = torch.randn(3, 2)
    with ema.swap(model):
        torch.testing.assert_close(model(x), ema(x))
    torch.testing.assert_close(model[0].weight, start + 2)


def test_ema_decay_is_validated():
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\], got 1.5"):
        EMA(nn.Linear(1, 1), decay=1.5)


def test_weights_only_ema_averages_like_the_runnable_copy_and_swaps_into_the_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 2))
    model[2].weight = model[0].weight  # tied weights stay one tensor in the copy
    runnable, weights = EMA(model, decay=0.75), EMA(model, decay=0.75, runnable=False)
    copied = dict(weights.module.named_children())
    assert not weights.runnable and copied["2"].weight is copied["0"].weight
    assert list(weights.module.state_dict()) == list(model.state_dict())
    for _ in range(3):
        with torch.no_grad():
            model[0].weight.add_(1.0)
        model.train()
        model(torch.randn(4, 2))
        runnable.update(model)
        weights.update(model)
    for key, value in runnable.module.state_dict().items():
        assert torch.equal(weights.module.state_dict()[key], value), key
    with pytest.raises(RuntimeError, match=r"holds only the \(sharded\) weights .* `ema.swap\(model\)`"):
        weights(torch.randn(1, 2))
    live = {key: value.clone() for key, value in model.state_dict().items()}
    model.eval()
    x = torch.randn(3, 2)
    with weights.swap(model):
        torch.testing.assert_close(model(x), runnable.eval()(x))
    for key, value in model.state_dict().items():
        assert torch.equal(value, live[key]), key
    with pytest.raises(ValueError, match="the EMA holds 8 tensors but the Linear has 2"), weights.swap(nn.Linear(2, 2)):
        pass
