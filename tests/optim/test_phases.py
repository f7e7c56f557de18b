import math
import warnings

import pytest
import torch
import yaml

from danling.optim import PHASE_CURVES, Phase, PhaseScheduler, build_scheduler, is_metric_scheduler

YAML = """
sched:
  type: phases
  interval: step
  initial_multiplier: 0.0
  phases:
    - mode: steps
      steps: 4
      target_multiplier: 1.0
      curve: {type: linear}
    - steps: 2
      target_multiplier: 1.0
      curve: constant
    - mode: rest
      target_multiplier: 0.1
      curve: {type: cosine}
"""


def make_optimizer(lr=2.0):
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=lr)


def used_lrs(scheduler, optimizer, steps):
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_yaml_schedule():
    config = yaml.safe_load(YAML)
    optimizer = make_optimizer(lr=2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduler = build_scheduler(optimizer, config["sched"], total_steps=10)
        lrs = used_lrs(scheduler, optimizer, 12)
    assert isinstance(scheduler, PhaseScheduler) and not is_metric_scheduler(scheduler)
    cosine = [0.1 + 0.9 * (1 + math.cos(math.pi * i / 4)) / 2 for i in range(4)]
    expected = [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, *cosine, 0.1, 0.1]
    assert lrs == pytest.approx([2.0 * m for m in expected])


def test_curves():
    assert PHASE_CURVES.get("linear")(1.0, 3.0, 0.25) == 1.5
    assert PHASE_CURVES.get("cosine")(1.0, 0.0, 0.5) == pytest.approx(0.5)
    assert PHASE_CURVES.get("cosine")(1.0, 0.0, 0.0) == 1.0
    assert PHASE_CURVES.get("constant")(1.0, 0.3, 0.0) == 0.3
    assert PHASE_CURVES.get("exponential")(1.0, 0.01, 0.5) == pytest.approx(0.1)


def test_exponential_phase_and_fixed_only_phases():
    optimizer = make_optimizer(lr=1.0)
    phases = [Phase(steps=2, target_multiplier=0.01, curve="exponential"), {"steps": 1, "target_multiplier": 0.5}]
    scheduler = PhaseScheduler(optimizer, phases, initial_multiplier=1.0)
    assert used_lrs(scheduler, optimizer, 5) == pytest.approx([1.0, 0.1, 0.01, 0.5, 0.5])


def test_empty_rest_phase_ends_on_its_target():
    phases = [{"steps": 3, "target_multiplier": 1.0}, {"steps": "rest", "target_multiplier": 0.2}]
    scheduler = PhaseScheduler(make_optimizer(lr=1.0), phases, initial_multiplier=0.0, total_steps=3)
    assert scheduler.multiplier(2) == pytest.approx(2 / 3)
    assert scheduler.multiplier(3) == 0.2


def test_resume():
    config = yaml.safe_load(YAML)["sched"]
    optimizer = make_optimizer()
    reference = used_lrs(build_scheduler(optimizer, config, total_steps=10), optimizer, 10)
    optimizer = make_optimizer()
    scheduler = build_scheduler(optimizer, config, total_steps=10)
    first = used_lrs(scheduler, optimizer, 5)
    state = scheduler.state_dict()
    optimizer = make_optimizer()
    scheduler = build_scheduler(optimizer, config, total_steps=10)
    scheduler.load_state_dict(state)
    assert first + used_lrs(scheduler, optimizer, 5) == reference


@pytest.mark.parametrize(
    ("phases", "kwargs", "message"),
    [
        ([], {}, "non-empty list"),
        ([{"steps": 2}], {}, "needs target_multiplier"),
        ([{"steps": 0, "target_multiplier": 1}], {}, r"phases\[0\].steps must be a positive integer or 'rest', got 0"),
        ([{"steps": 2, "target_multiplier": 1, "shape": "x"}], {}, r"unknown keys \['shape'\]"),
        ([{"mode": "rest", "target_multiplier": 1}], {}, "needs total_steps"),
        ([{"mode": "rest", "target_multiplier": 1}] * 2, {"total_steps": 5}, "at most one phase"),
        ([{"steps": 6, "target_multiplier": 1}], {"total_steps": 5}, "6 fixed steps, more than total_steps=5"),
        ([{"steps": 2, "target_multiplier": 1, "curve": "zigzag"}], {}, "unknown phase curve 'zigzag'"),
        ([{"steps": 2, "target_multiplier": 1, "curve": "exponential"}], {"initial_multiplier": 0.0}, "phases\\[0\\]"),
        ([{"steps": 2, "target_multiplier": -1}], {}, "non-negative, got -1"),
        ([{"steps": 2, "mode": "linear", "target_multiplier": 1}], {}, "mode must be 'steps' or 'rest'"),
    ],
)
def test_bad_phases(phases, kwargs, message):
    with pytest.raises(ValueError, match=message):
        PhaseScheduler(make_optimizer(), phases, **kwargs)


def test_a_longer_budget_stretches_the_rest_phase_and_continues_from_the_saved_step(caplog):
    config = yaml.safe_load(YAML)["sched"]
    optimizer = make_optimizer()
    scheduler = build_scheduler(optimizer, config, total_steps=10)
    used_lrs(scheduler, optimizer, 8)
    state = scheduler.state_dict()
    optimizer = make_optimizer()
    extended = build_scheduler(optimizer, config, total_steps=20)
    with caplog.at_level("WARNING", logger="danling"):
        extended.load_state_dict(state)
    assert extended.total_steps == 20 and extended.last_epoch == 8
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2.0 * extended.multiplier(8))
    assert "rebuilt for total_steps=20 (the saved run had 10)" in caplog.records[-1].getMessage()
    assert used_lrs(extended, optimizer, 13)[-1] == pytest.approx(2.0 * extended.multiplier(20))
