"""update/accumulation.py: accumulation windows, gradient sync and resuming mid-pass."""

import contextlib

import pytest
import torch
from torch import nn

from danling.runners.update import GradientAccumulator


def _plan(accumulator, steps):
    return [(accumulator.window_size, accumulator.advance()) for _ in range(steps)]


class _FakeDDP(nn.Module):
    def __init__(self):
        super().__init__()
        self.skipped = 0

    @contextlib.contextmanager
    def no_sync(self):
        self.skipped += 1
        yield


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


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_accumulator_rejects_bad_steps(bad):
    with pytest.raises(ValueError, match="accum_steps must be a positive integer"):
        GradientAccumulator(bad)
