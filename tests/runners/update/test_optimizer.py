"""update/optimizer.py: clipping, non-finite checks and one optimizer update."""

import pytest
import torch
from torch import nn

from danling.runners.update import (
    OptimizerContainer,
    Precision,
    clip_gradients,
    has_nonfinite_gradients,
    scale_gradients,
)


def _param(*grad):
    param = nn.Parameter(torch.zeros(len(grad)))
    param.grad = torch.tensor(grad)
    return param


def _setup(**options):
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return model, optimizer, scheduler, OptimizerContainer(optimizer, scheduler, **options)


def test_clip_value_then_norm():
    a, b = _param(3.0, -10.0), _param(4.0)
    norm = clip_gradients([a, b, nn.Parameter(torch.zeros(1))], max_grad_norm=1.0, max_grad_value=4.0)
    torch.testing.assert_close(norm, torch.tensor(41.0).sqrt())  # measured after value clipping: 3² + 4² + 4²
    total = torch.cat([a.grad, b.grad]).norm()
    torch.testing.assert_close(total, torch.tensor(1.0))
    assert clip_gradients([a]) is None
    with pytest.raises(ValueError, match="max_grad_norm must be positive"):
        clip_gradients([a], max_grad_norm=0)
    with pytest.raises(ValueError, match="max_grad_value must be positive"):
        clip_gradients([a], max_grad_value=-1)


def test_nonfinite_detection_does_not_overflow():
    assert has_nonfinite_gradients([_param(1e30, 3e38)]) is False  # the 2-norm of these overflows
    assert has_nonfinite_gradients([_param(1.0), _param(float("inf"))]) is True
    assert has_nonfinite_gradients([_param(float("nan"))]) is True
    assert has_nonfinite_gradients([nn.Parameter(torch.zeros(1))]) is False  # no gradients at all


def test_scale_gradients():
    a = _param(1.0, 2.0)
    scale_gradients([a, nn.Parameter(torch.zeros(1))], 0.5)
    assert a.grad.tolist() == [0.5, 1.0]


def test_applied_update_steps_scheduler_and_zeroes_grads():
    model, optimizer, scheduler, container = _setup(max_grad_norm=0.5)
    before = model.weight.detach().clone()
    model(torch.ones(3, 2)).sum().backward()
    assert container.step() is True
    assert model.weight.grad is None and not torch.equal(before, model.weight)
    assert scheduler.last_epoch == 1 and optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    torch.testing.assert_close(container.last_grad_norm, torch.tensor(27.0).sqrt())


def test_nonfinite_update_is_skipped_and_counted():
    model, optimizer, scheduler, container = _setup(skip_nonfinite_grad=True)
    before = [p.detach().clone() for p in model.parameters()]
    (model(torch.ones(1, 2)).sum() * float("inf")).backward()
    assert container.step() is False
    assert container.skipped_steps == 1 and scheduler.last_epoch == 0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    restored = _setup()[3]
    restored.load_state_dict(container.state_dict())
    assert restored.skipped_steps == 1


def test_nonfinite_limit_message_suggests_only_what_is_not_set():
    from danling.runners.update.optimizer import TrainingDivergedError

    model, _, _, container = _setup(skip_nonfinite_grad=True, max_nonfinite_updates=1)
    (model(torch.ones(1, 2)).sum() * float("nan")).backward()
    with pytest.raises(TrainingDivergedError) as error:
        container.step()
    # skipping is already on: the only way on is a higher limit
    assert "skip_nonfinite_grad=True" not in str(error.value)
    assert "raise nonfinite.max_consecutive" in str(error.value)
    model, _, _, container = _setup(check_nonfinite=True)
    (model(torch.ones(1, 2)).sum() * float("nan")).backward()
    with pytest.raises(TrainingDivergedError, match="set skip_nonfinite_grad=True"):
        container.step()


def test_without_skip_nonfinite_updates_go_through():
    model, _, _, container = _setup()
    (model(torch.ones(1, 2)).sum() * float("nan")).backward()
    assert container.step() is True and torch.isnan(model.weight).all()


def test_epoch_interval_leaves_the_scheduler_alone_and_multiplier_rescales():
    model, _, scheduler, container = _setup(scheduler_interval="epoch")
    model.weight.data.zero_()
    model.bias.data.zero_()
    model(torch.ones(1, 2)).sum().backward()  # d/dw = 1 for each weight
    container.step(grad_multiplier=3.0)
    assert scheduler.last_epoch == 0
    torch.testing.assert_close(model.weight.detach(), torch.full((1, 2), -0.3))


def test_grad_scaler_path_skips_overflow_and_backs_off():
    model, optimizer, _, _ = _setup()
    precision = Precision("fp16", "cpu")
    precision.scaler = torch.amp.GradScaler("cpu", init_scale=8.0)  # exercise the scaler path on CPU
    container = OptimizerContainer(optimizer, precision=precision)
    precision.scale(model(torch.ones(1, 2)).sum() * float("inf")).backward()
    assert container.step() is False and precision.scaler.get_scale() == 4.0
    precision.scale(model(torch.ones(1, 2)).sum()).backward()
    weight = model.weight.detach().clone()
    assert container.step() is True
    torch.testing.assert_close(model.weight.detach(), weight - 0.1)  # gradients were unscaled before the step
    state = container.state_dict()
    other = Precision("fp16", "cpu")
    other.scaler = torch.amp.GradScaler("cpu")
    OptimizerContainer(optimizer, precision=other).load_state_dict(state)
    assert other.scaler.get_scale() == precision.scaler.get_scale()


def test_container_rejects_bad_thresholds():
    with pytest.raises(ValueError, match="max_grad_value must be positive or None, got 0"):
        _setup(max_grad_value=0)
