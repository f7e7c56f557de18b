import contextlib
import warnings

import pytest
import torch
from torch import nn

from danling.runners.update import (
    EMA,
    GradientAccumulator,
    OptimizerContainer,
    Precision,
    clip_gradients,
    has_nonfinite_gradients,
    scale_gradients,
)

# Precision ----------------------------------------------------------------------------------


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


# GradientAccumulator ------------------------------------------------------------------------


def _plan(accumulator, steps):
    return [(accumulator.window_size, accumulator.advance()) for _ in range(steps)]


def test_windows_with_partial_final_window():
    accumulator = GradientAccumulator(3)
    accumulator.start(total=7)
    assert _plan(accumulator, 7) == [(3, False), (3, False), (3, True)] * 2 + [(1, True)]
    assert accumulator.finish() is None
    accumulator.start(total=2)  # a pass shorter than one window is one window
    assert _plan(accumulator, 2) == [(2, False), (2, True)]


def test_unknown_length_flushes_with_a_rescale_factor():
    accumulator = GradientAccumulator(4)
    accumulator.start(None)
    assert _plan(accumulator, 6) == [(4, False)] * 3 + [(4, True)] + [(4, False)] * 2
    assert accumulator.finish() == 2.0  # the open window had 2 of 4 micro-steps
    assert accumulator.finish() is None


def test_accumulated_gradient_is_the_window_mean():
    torch.manual_seed(0)
    x, y = torch.randn(5, 3), torch.randn(5, 1)
    model = nn.Linear(3, 1)
    accumulator = GradientAccumulator(3)
    accumulator.start(total=5)
    windows = []
    for i in range(5):
        accumulator.normalize(nn.functional.mse_loss(model(x[i : i + 1]), y[i : i + 1])).backward()
        if accumulator.advance():
            windows.append(model.weight.grad.clone())
            model.zero_grad()
    for rows, got in zip([slice(0, 3), slice(3, 5)], windows):
        model.zero_grad()
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        torch.testing.assert_close(got, model.weight.grad)


class _FakeDDP(nn.Module):
    def __init__(self):
        super().__init__()
        self.skipped = 0

    @contextlib.contextmanager
    def no_sync(self):
        self.skipped += 1
        yield


def test_no_sync_except_on_window_boundaries():
    model = _FakeDDP()
    accumulator = GradientAccumulator(2)
    accumulator.start(total=3)
    for _ in range(3):
        with accumulator.no_sync(model):
            pass
        accumulator.advance()
    assert model.skipped == 1  # micro-step 0 only; 1 closes a window, 2 is the partial window
    with accumulator.no_sync(nn.Linear(1, 1)):  # models without no_sync get a no-op
        pass


def test_accumulator_resumes_mid_pass():
    accumulator = GradientAccumulator(2)
    accumulator.start(total=6)
    _plan(accumulator, 4)
    state = accumulator.state_dict()
    assert state == {"accum_steps": 2, "total": 6, "position": 4}
    restored = GradientAccumulator(2)
    restored.load_state_dict(state)
    restored.start(total=6)  # continues the interrupted pass
    assert _plan(restored, 2) == [(2, False), (2, True)]
    restored.start(total=6)  # the next start opens a new pass
    assert restored.position == 0
    changed = GradientAccumulator(2)
    changed.load_state_dict(state)
    with pytest.raises(ValueError, match="restored pass had 6 micro-batches but the loader now has 8"):
        changed.start(total=8)
    finished = GradientAccumulator(2)
    finished.load_state_dict({"accum_steps": 2, "total": 6, "position": 6})
    finished.start(total=6)
    assert finished.position == 0


def test_single_step_windows_still_record_the_position():
    # accum_steps=1 takes a shortcut in advance(); the position a checkpoint records must not change.
    accumulator = GradientAccumulator(1)
    accumulator.start(total=3)
    assert _plan(accumulator, 2) == [(1, True), (1, True)]
    assert accumulator.state_dict() == {"accum_steps": 1, "total": 3, "position": 2}
    assert accumulator.finish() is None
    restored = GradientAccumulator(1)
    restored.load_state_dict(accumulator.state_dict())
    restored.start(total=3)
    assert _plan(restored, 1) == [(1, True)] and restored.position == 3


def test_fp32_context_is_reusable():
    policy = Precision("fp32")
    context = policy.autocast()
    with context, context:  # one shared no-op context serves every step, nested or not
        assert not torch.is_autocast_enabled("cpu")
    assert policy.autocast() is context


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_accumulator_rejects_bad_steps(bad):
    with pytest.raises(ValueError, match="accum_steps must be a positive integer"):
        GradientAccumulator(bad)


# clipping and non-finite checks -------------------------------------------------------------


def _param(*grad):
    param = nn.Parameter(torch.zeros(len(grad)))
    param.grad = torch.tensor(grad)
    return param


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


# OptimizerContainer -------------------------------------------------------------------------


def _setup(**options):
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return model, optimizer, scheduler, OptimizerContainer(optimizer, scheduler, **options)


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


# EMA ----------------------------------------------------------------------------------------


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
