import inspect
import warnings

import chanfig
import pytest
import torch
from torch import nn

from danling import Registry
from danling.optim import (
    LR_METHODS,
    OPTIMIZERS,
    SCHEDULERS,
    LRScheduler,
    build_optimizer,
    build_scheduler,
    is_metric_scheduler,
)


def test_every_torch_optimizer_is_registered():
    for name, obj in inspect.getmembers(torch.optim, inspect.isclass):
        if issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer:
            assert OPTIMIZERS.get(name.lower()) is obj
    optimizer = OPTIMIZERS.build(nn.Linear(2, 2).parameters(), type="adamw", lr=1e-3)
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["lr"] == 1e-3


def test_schedulers_registered():
    for name in ("steplr", "OneCycleLR", "reduce_lr_on_plateau", "cosineannealinglr", "lrscheduler", "phases"):
        assert name in SCHEDULERS
    for method in LR_METHODS:
        assert method in SCHEDULERS.names()
    assert SCHEDULERS.get("ReduceLROnPlateau") is torch.optim.lr_scheduler.ReduceLROnPlateau


def test_unknown_names_list_registered():
    with pytest.raises(ValueError, match=r"unknown optimizer 'adamx'; registered: .*adamw.*sgd"):
        build_optimizer(nn.Linear(2, 2), {"type": "adamx"})
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"unknown scheduler 'cosin'; registered: .*cosine.*reducelronplateau"):
        build_scheduler(optimizer, {"type": "cosin"}, total_steps=10)
    with pytest.raises(ValueError, match="needs a 'type'; registered: .*adamw"):
        build_optimizer(nn.Linear(2, 2), {"lr": 0.1})


def test_build_optimizer_errors():
    with pytest.raises(ValueError, match="lr must be non-negative, got -0.1"):
        build_optimizer(nn.Linear(2, 2), {"type": "sgd", "lr": -0.1})
    with pytest.raises(ValueError, match=r"cannot build optimizer 'sgd'.*'momentom'.*accepts: params, lr"):
        build_optimizer(nn.Linear(2, 2), {"type": "sgd", "lr": 0.1, "momentom": 0.9})


def test_build_optimizer_inputs():
    model = nn.Linear(2, 2)
    optimizer = build_optimizer(model.named_parameters(), chanfig.Config(type="SGD", lr=0.1), momentum=0.9)
    assert optimizer.defaults["momentum"] == 0.9
    groups = [{"params": [model.weight]}, {"params": [model.bias], "lr": 0.5}]
    optimizer = build_optimizer(groups, {"type": "sgd", "lr": 0.1})
    assert [group["lr"] for group in optimizer.param_groups] == [0.1, 0.5]
    optimizer = build_optimizer(model, {"type": "adam", "betas": [0.8, 0.9]})
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.9)


def test_build_scheduler_methods_and_total_steps():
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
    scheduler = build_scheduler(optimizer, {"type": "polynomial", "power": 3, "warmup_steps": 0}, total_steps=50)
    assert isinstance(scheduler, LRScheduler) and scheduler.method == "polynomial" and scheduler.total_steps == 50
    scheduler = build_scheduler(
        optimizer, {"type": "lrscheduler", "method": "linear", "total_steps": 7}, total_steps=50
    )
    assert scheduler.total_steps == 7  # the section wins over the runner's value
    scheduler = build_scheduler(optimizer, {"type": "CosineAnnealingLR"}, total_steps=30)
    assert scheduler.T_max == 30
    scheduler = build_scheduler(optimizer, {"type": "polynomiallr"}, total_steps=30)
    assert scheduler.total_iters == 30
    scheduler = build_scheduler(optimizer, {"type": "onecyclelr", "max_lr": 1.0}, total_steps=30)
    assert scheduler.total_steps == 30
    scheduler = build_scheduler(optimizer, chanfig.Config(type="steplr", step_size=3, interval="epoch"))
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    assert build_scheduler(optimizer, None) is None
    assert build_scheduler(optimizer, chanfig.Config(interval="step", monitor="val.loss")) is None
    with pytest.raises(ValueError, match="cannot build scheduler 'cosine'.*total_steps"):
        build_scheduler(optimizer, {"type": "cosine"})
    with pytest.raises(ValueError, match="total_steps must be a positive integer, got 0"):
        build_scheduler(optimizer, {"type": "cosine"}, total_steps=0)


def test_metric_scheduler():
    model = nn.Linear(2, 1)
    optimizer = build_optimizer(model, {"type": "sgd", "lr": 1.0})
    scheduler = build_scheduler(
        optimizer, {"type": "ReduceLROnPlateau", "patience": 0, "factor": 0.5, "monitor": "val.loss"}, total_steps=10
    )
    assert is_metric_scheduler(scheduler) and is_metric_scheduler("reducelronplateau")
    assert not is_metric_scheduler(LRScheduler) and not is_metric_scheduler("steplr")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for loss in (1.0, 1.0, 1.0):
            optimizer.step()
            scheduler.step(loss)
    assert optimizer.param_groups[0]["lr"] == 0.25


def test_registry_basics():
    registry = Registry("widget")
    registry.register(dict, "Mapping_Type")
    assert registry.get("mapping-type") is dict and "MAPPINGTYPE" in registry and len(registry) == 1
    assert registry.names() == ["mapping_type"] and list(registry) == ["mapping_type"]
    with pytest.raises(ValueError, match="already registered"):
        registry.register(list, "mapping_type")
    registry.register(list, "mapping_type", override=True)
    assert registry.get("mapping_type") is list
    with pytest.raises(ValueError, match="needs type=<name>"):
        registry.build()
    with pytest.raises(TypeError, match="must be a string, got 3"):
        registry.get(3)
    assert 3 not in registry and "widget" in repr(registry)


def test_new_lr_method_is_one_function():
    @LR_METHODS.register("test_step_half")
    def step_half(progress: float) -> float:
        return 0.0 if progress < 0.5 else 1.0

    try:
        optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
        kwargs = {"type": "test_step_half", "warmup_steps": 0, "cooldown_steps": 0, "final_lr_ratio": 0.1}
        scheduler = build_scheduler(optimizer, kwargs, total_steps=4)
        assert [scheduler.lr_at(1.0, step) for step in (1, 2, 3)] == pytest.approx([1.0, 0.1, 0.1])
    finally:
        LR_METHODS._entries.pop("teststephalf")
        LR_METHODS._names.pop("teststephalf")


def test_none_values_are_unset():
    optimizer = build_optimizer(nn.Linear(2, 2), {"type": "sgd", "lr": 0.1, "param_groups": None, "momentum": None})
    assert len(optimizer.param_groups) == 1 and optimizer.defaults["momentum"] == 0
    config = {"type": "cosine", "total_steps": None, "interval": None, "monitor": None}
    assert build_scheduler(optimizer, config, total_steps=12).total_steps == 12
    assert build_scheduler(optimizer, {"type": None, "interval": None}) is None


def test_phases_given_as_fractions_and_phases_longer_than_a_short_run_are_fitted():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    scheduler = build_scheduler(
        optimizer, {"type": "cosine", "warmup_steps": 0.1, "cooldown_steps": 0.25}, total_steps=40
    )
    assert (scheduler.warmup_steps, scheduler.cooldown_steps) == (4, 10)
    # a config written for a long run still builds for a 10-step smoke test, and says so
    with pytest.warns(UserWarning, match=r"warmup_steps=500 \+ cooldown_steps=100 exceed the run's 10 optimizer steps"):
        scheduler = build_scheduler(
            optimizer, {"type": "cosine", "warmup_steps": 500, "cooldown_steps": 100}, total_steps=10
        )
    assert (scheduler.warmup_steps, scheduler.cooldown_steps) == (8, 1)
    # the defaults fit any run of at least one step
    scheduler = build_scheduler(optimizer, {"type": "cosine"}, total_steps=1)
    assert (scheduler.warmup_steps, scheduler.cooldown_steps) == (0, 0)
    # the class itself still refuses inconsistent phases given directly
    with pytest.raises(ValueError, match=r"got 6 \+ 5 > 10"):
        LRScheduler(optimizer, total_steps=10, warmup_steps=6, cooldown_steps=5)
