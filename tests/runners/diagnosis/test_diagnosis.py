"""The diagnosis plug-ins in one process: the straggler rule, checksums, verdicts and bad settings."""

from __future__ import annotations

import pytest
import torch

from danling.runners import RunnerConfig
from danling.runners.diagnosis import name_straggler, replica_tensors, tensor_checksum
from danling.runners.diagnosis.consistency import ConsistencySentinel, _odd_ranks
from danling.runners.diagnosis.stragglers import TRAINING_PHASES, PhaseClock, StragglerMonitor
from danling.runners.loop import Events
from tests.runners._torch_toy import TinyRunner, tiny_config


def test_the_slow_rank_is_named_not_the_ranks_waiting_for_it():
    # Rank 2 loads slowly; ranks 0 and 1 wait for it inside backward (the all-reduce).
    times = [[0.001, 0.01, 0.105, 0.002], [0.002, 0.01, 0.104, 0.002], [0.101, 0.01, 0.005, 0.002]]
    straggler = name_straggler(times, TRAINING_PHASES, ["backward"])
    assert (straggler.rank, straggler.phase) == (2, "data loading")
    assert straggler.lag_ms == pytest.approx(99.5) and straggler.waiting_ms == pytest.approx(99.5)
    assert straggler.slowdown == pytest.approx(0.118 / 0.0185)
    # Without the rule (backward counted as work) every rank's step takes as long: nobody stands out.
    assert name_straggler(times, TRAINING_PHASES, []).slowdown == pytest.approx(1.0, abs=0.01)
    assert name_straggler(times[:1], TRAINING_PHASES, ["backward"]) is None


def test_phase_clock_times_the_phases_and_passes_marks_on():
    marks = []

    class Inner:
        phase, step = "idle", 7

        def enter(self, phase, step):
            marks.append((phase, step))

    clock = PhaseClock(Inner())
    clock.enter("forward", 7)
    clock.enter("backward", 7)
    clock.enter("forward", 8)
    assert marks == [("forward", 7), ("backward", 7), ("forward", 8)] and clock.step == 8
    assert set(clock.totals) == {"idle", "forward", "backward"} and all(t >= 0 for t in clock.totals.values())


def test_checksums_see_one_flipped_bit_in_every_dtype():
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64):
        tensor = torch.arange(1, 9, dtype=dtype)
        flipped = tensor.clone()
        bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}[flipped.element_size()]
        flipped.view(bits)[3] ^= 1
        assert tensor_checksum(tensor) != tensor_checksum(flipped), dtype
        assert tensor_checksum(tensor) == tensor_checksum(tensor.clone())


def test_replica_tensors_name_parameters_then_optimizer_state():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    names = [name for name, _ in replica_tensors(model, optimizer)]
    assert names[:2] == ["model.weight", "model.bias"]
    assert names[2:] == [f"optimizer.{p}.{k}" for p in ("weight", "bias") for k in ("exp_avg", "exp_avg_sq", "step")]
    assert [name for name, _ in replica_tensors(model)] == names[:2]


def test_the_odd_ranks_are_the_minority_of_their_replica_group():
    # Two replica groups (first ranks 0 and 1); rank 4 differs in the first, none in the second.
    rows = [[5, 0], [9, 1], [5, 0], [9, 1], [6, 0], [9, 1]]
    assert _odd_ranks(rows) == [4]
    assert _odd_ranks([[5, 0], [6, 0]]) == [1]  # a tie: those differing from the group's first rank
    assert _odd_ranks([[5, 0], [5, 0]]) == []


def test_off_by_default_and_one_process_subscribes_nothing(tmp_path):
    with TinyRunner(tiny_config(tmp_path / "off")) as runner:
        assert runner.diagnosis.stragglers is None and runner.diagnosis.consistency is None
    config = tiny_config(tmp_path / "on", **{"stragglers.enabled": True, "consistency.interval": 1})
    with TinyRunner(config) as runner:
        assert not runner.events.has_subscribers(Events.STEP_LOG)
        assert not runner.events.has_subscribers(Events.STEP_END)
        assert not runner.diagnosis.consistency.active
        runner.train()
        assert runner.diagnosis.consistency.checks == 0


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("stragglers.factor", 1.0, "stragglers.factor must be a number above 1, got 1.0"),
        ("stragglers.window", 0, "stragglers.window must be an integer >= 1, got 0"),
        ("stragglers.collective_phases", ["wait"], "stragglers.collective_phases names unknown phases ['wait']"),
        ("consistency.interval", 0, "consistency.interval must be an integer >= 1 (or None: off), got 0"),
        ("consistency.policy", "panic", "consistency.policy must be one of warn, stop, rollback, got 'panic'"),
        ("consistency.max_rollbacks", -1, "consistency.max_rollbacks must be an integer >= 0, got -1"),
    ],
)
def test_bad_settings_are_refused_by_name(key, value, message):
    pattern = message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    section, name = key.split(".")
    switch = {"stragglers.enabled": True} if section == "stragglers" else {"consistency.interval": 1}
    with pytest.raises(ValueError, match=pattern):
        RunnerConfig(**{**switch, key: value})  # as the config is validated: before any model or data
    config = RunnerConfig(**switch)
    setattr(config[section], name, value)  # changed after validation: the part checks again when built
    with pytest.raises(ValueError, match=pattern):
        if section == "stragglers":
            StragglerMonitor(config.stragglers, world_size=2)
        else:
            ConsistencySentinel(config.consistency, list, replicas=[0, 1], rank=0, world_size=2)
