import io
import pickle
import random

import numpy as np
import pytest
import torch

from danling.runners.state import RunnerElasticState, RunnerRNGState, RunnerState, RunnerTrainState


def draw() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_defaults_and_shortcuts():
    state = RunnerState()
    assert (state.epoch, state.global_step, state.micro_step) == (0, 0, 0)
    assert state.elastic.restart_count == 0
    assert state.rng.python is None and state.rng.cuda is None
    state.epoch = 2
    state.global_step += 5
    state.micro_step = 20
    assert state.train == RunnerTrainState(epoch=2, global_step=5, micro_step=20)


@pytest.mark.parametrize("value", [-1, 1.5, "3", True, None])
def test_counters_reject_bad_values(value):
    with pytest.raises(ValueError, match="must be a non-negative integer"):
        RunnerTrainState(global_step=value)
    state = RunnerState()
    with pytest.raises(ValueError, match="RunnerTrainState.epoch must be a non-negative integer"):
        state.epoch = value
    with pytest.raises(ValueError, match="restart_count"):
        RunnerElasticState(restart_count=value)


def test_numpy_integers_are_accepted_as_plain_ints():
    state = RunnerTrainState(global_step=np.int64(7))
    assert state.global_step == 7 and type(state.global_step) is int


def test_state_dict_round_trip_restores_counters_and_rng():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    state = RunnerState()
    state.train.epoch, state.train.global_step, state.train.micro_step = 3, 40, 160
    state.elastic.restart_count = 2
    state.rng.capture()
    expected = draw()
    payload = state.state_dict()
    assert set(payload) == {"train", "elastic", "rng"}
    assert payload["train"] == {"epoch": 3, "global_step": 40, "micro_step": 160}

    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    restored = RunnerState()
    restored.load_state_dict(payload)
    assert restored.train == state.train and restored.elastic.restart_count == 2
    assert draw() != expected  # loading does not reseed by itself
    restored.rng.restore()
    assert draw() == expected


def test_state_dict_is_weights_only_loadable_and_picklable():
    state = RunnerState()
    state.global_step = 9
    state.rng.capture()
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded["rng"]["torch"].dtype == torch.uint8
    assert not any(isinstance(v, np.ndarray) for v in loaded["rng"]["numpy"].values())
    restored = RunnerState()
    restored.load_state_dict(pickle.loads(pickle.dumps(loaded)))
    assert restored.global_step == 9
    assert torch.equal(restored.rng.torch, state.rng.torch)
    assert restored.rng.numpy == state.rng.numpy and restored.rng.python == state.rng.python


def test_capture_does_not_initialise_cuda():
    state = RunnerRNGState().capture()
    if not torch.cuda.is_initialized():
        assert state.cuda is None


def test_restore_of_an_empty_snapshot_changes_nothing():
    random.seed(5)
    expected = random.random()
    random.seed(5)
    RunnerRNGState().restore()
    assert random.random() == expected


def test_missing_parts_keep_current_values():
    state = RunnerState()
    state.elastic.restart_count = 4
    state.load_state_dict({"train": {"global_step": 2}})
    assert state.global_step == 2 and state.epoch == 0 and state.elastic.restart_count == 4


@pytest.mark.parametrize(
    ("payload", "error", "match"),
    [
        ([1, 2], TypeError, "RunnerState state must be a mapping, got list"),
        ({"train": "x"}, TypeError, "RunnerTrainState state must be a mapping"),
        ({"train": {"epoch": -3}}, ValueError, "epoch must be a non-negative integer, got -3"),
        ({"rng": {"python": "seed"}}, ValueError, r"rng.python must be \[version"),
        ({"rng": {"numpy": [1, 2]}}, ValueError, "rng.numpy must be a mapping with a 'key' entry"),
        ({"rng": {"torch": [1, 2]}}, ValueError, "rng.torch must be a ByteTensor, got list"),
        ({"rng": {"cuda": [1]}}, ValueError, "rng.cuda must be a list of ByteTensors"),
    ],
)
def test_malformed_payloads_raise_clear_errors(payload, error, match):
    with pytest.raises(error, match=match):
        RunnerState().load_state_dict(payload)


def test_config_is_carried_but_not_serialised():
    state = RunnerState(config={"epochs": 1})
    assert state.config == {"epochs": 1}
    assert "config" not in state.state_dict()
