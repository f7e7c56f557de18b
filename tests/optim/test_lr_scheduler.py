import io
import math
import pickle
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from danling.optim import LR_METHODS, LRScheduler


def make_optimizer(lr=1.0, groups=1, cls=torch.optim.SGD, **kwargs):
    params = [{"params": [torch.nn.Parameter(torch.ones(2))], "lr": lr * (i + 1)} for i in range(groups)]
    return cls(params, lr=lr, **kwargs)


def run_lrs(scheduler, optimizer, steps):
    """Learning rates the optimizer actually uses for `steps` updates."""
    lrs = []
    for _ in range(steps):
        lrs.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return lrs


def spec_sequence(**kwargs):
    optimizer = torch.optim.SGD([{"params": torch.tensor([0])}], lr=1, momentum=0.9)
    scheduler = LRScheduler(optimizer, total_steps=5, final_lr_ratio=1e-5, **kwargs)
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference sequence steps without optimizer.step()
        for _ in range(5):
            lrs.append(scheduler.get_lr()[0])
            scheduler.step()
    return lrs


def test_reference_sequences():
    assert [round(lr, 10) for lr in spec_sequence(method="linear")] == [0.1, 0.01, 0.001, 0.0001, 1e-09]
    assert [round(lr, 10) for lr in spec_sequence(method="cosine")] == [
        0.3330753446,
        0.0187302031,
        0.000533897,
        3.00232e-05,
        1e-09,
    ]
    numerical = spec_sequence(method="linear", scaling="numerical")
    assert [round(lr, 2) for lr in numerical] == [0.8, 0.6, 0.4, 0.2, 0.0]


def test_optimizer_uses_scheduled_lr():
    optimizer = make_optimizer()
    scheduler = LRScheduler(optimizer, total_steps=5, final_lr_ratio=1e-5, method="linear")
    used = [lrs[0] for lrs in run_lrs(scheduler, optimizer, 5)]
    assert [round(lr, 10) for lr in used] == [0.1, 0.01, 0.001, 0.0001, 1e-09]
    assert scheduler.get_last_lr() == [optimizer.param_groups[0]["lr"]]


def test_no_warnings_in_normal_loop():
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduler = LRScheduler(optimizer, total_steps=20)
        for _ in range(25):  # a few steps past the end too
            model(torch.randn(4, 3)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            scheduler.get_last_lr()
            scheduler.get_lr()
        scheduler.load_state_dict(scheduler.state_dict())
    assert scheduler.get_last_lr()[0] == pytest.approx(1e-9)


FORMULAS = {
    "linear": ({}, lambda p: p),
    "cosine": ({}, lambda p: (1 - math.cos(math.pi * p)) / 2),
    "constant": ({}, lambda p: 0.0),
    "exponential": ({"rate": 3.0}, lambda p: (1 - math.exp(-3 * p)) / (1 - math.exp(-3))),
    "polynomial": ({"power": 3.0}, lambda p: 1 - (1 - p) ** 3),
}


@pytest.mark.parametrize("method", sorted(FORMULAS))
def test_method_formulas(method):
    options, ratio = FORMULAS[method]
    base, final = 2.0, 0.02
    for scaling in ("numerical", "percentile"):
        optimizer = make_optimizer(lr=base)
        scheduler = LRScheduler(
            optimizer,
            total_steps=10,
            final_lr_ratio=final / base,
            min_lr=0.0,
            method=method,
            warmup_steps=0,
            cooldown_steps=0,
            scaling=scaling,
            **options,
        )
        for step in (1, 3, 5, 8, 10):
            r = ratio(step / 10)
            expected = final + (base - final) * (1 - r) if scaling == "numerical" else base * (final / base) ** r
            assert scheduler.lr_at(base, step) == pytest.approx(expected, rel=1e-12), (scaling, step)


def test_method_ratio_endpoints():
    for name in LR_METHODS:
        fn = LR_METHODS.get(name)
        assert fn(0.0) == pytest.approx(0.0)
        assert fn(1.0) == pytest.approx(0.0 if name == "constant" else 1.0)
    assert LR_METHODS.get("exponential")(0.3, rate=0) == 0.3


def test_warmup_and_cooldown_defaults():
    optimizer = make_optimizer(lr=1.0)
    scheduler = LRScheduler(optimizer, total_steps=100, method="constant", min_lr=0.0)
    assert (scheduler.warmup_steps, scheduler.cooldown_steps) == (5, 20)
    lrs = [lrs[0] for lrs in run_lrs(scheduler, optimizer, 100)]
    assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert lrs[5:80] == pytest.approx([1.0] * 75)
    assert lrs[80:] == pytest.approx([1 - i / 20 for i in range(1, 21)])


def test_zero_disables_warmup_and_cooldown():
    optimizer = make_optimizer(lr=1.0)
    scheduler = LRScheduler(optimizer, total_steps=10, method="constant", warmup_steps=0, cooldown_steps=0)
    assert [lrs[0] for lrs in run_lrs(scheduler, optimizer, 10)] == [1.0] * 10


def test_final_lr_and_min_lr():
    optimizer = make_optimizer(lr=1.0, groups=2)
    scheduler = LRScheduler(optimizer, total_steps=4, final_lr=0.5, method="linear", warmup_steps=0, cooldown_steps=0)
    assert scheduler.scaling == "numerical"
    lrs = run_lrs(scheduler, optimizer, 4)
    assert lrs[-1] == pytest.approx([0.5, 0.5])  # final_lr is shared by every group
    assert lrs[1] == pytest.approx([1 - 0.5 * 0.5, 2 - 1.5 * 0.5])
    optimizer = make_optimizer(lr=1.0)
    scheduler = LRScheduler(
        optimizer, total_steps=4, final_lr_ratio=0.0, min_lr=0.1, method="linear", scaling="numerical"
    )
    assert min(lrs[0] for lrs in run_lrs(scheduler, optimizer, 6)) == pytest.approx(0.1)


def test_zero_lr_group_stays_zero():
    optimizer = make_optimizer(lr=0.0)
    scheduler = LRScheduler(optimizer, total_steps=10)
    assert {lrs[0] for lrs in run_lrs(scheduler, optimizer, 10)} == {0.0}


def checkpoint_bytes(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("optimizer_first", [True, False])
def test_resume_matches_uninterrupted(optimizer_first):
    kwargs = {"total_steps": 40, "method": "cosine", "warmup_steps": 4, "cooldown_steps": 8}
    optimizer = make_optimizer(groups=2, cls=torch.optim.Adam)
    reference = run_lrs(LRScheduler(optimizer, **kwargs), optimizer, 40)

    optimizer = make_optimizer(groups=2, cls=torch.optim.Adam)
    scheduler = LRScheduler(optimizer, **kwargs)
    first = run_lrs(scheduler, optimizer, 17)
    state = torch.load(
        checkpoint_bytes({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}), weights_only=True
    )

    optimizer = make_optimizer(groups=2, cls=torch.optim.Adam)
    if optimizer_first:
        optimizer.load_state_dict(state["optimizer"])
        scheduler = LRScheduler(optimizer, **kwargs)
    else:
        scheduler = LRScheduler(optimizer, **kwargs)
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    assert first + run_lrs(scheduler, optimizer, 23) == reference


@settings(max_examples=30, deadline=None)
@given(
    total=st.integers(1, 60),
    data=st.data(),
    method=st.sampled_from(sorted(FORMULAS)),
    scaling=st.sampled_from(["percentile", "numerical"]),
)
def test_resume_property(total, data, method, scaling):
    warmup = data.draw(st.integers(0, total))
    cooldown = data.draw(st.integers(0, total - warmup))
    split = data.draw(st.integers(0, total))
    kwargs = dict(total_steps=total, method=method, warmup_steps=warmup, cooldown_steps=cooldown, scaling=scaling)
    optimizer = make_optimizer()
    reference = run_lrs(LRScheduler(optimizer, **kwargs), optimizer, total)
    optimizer = make_optimizer()
    scheduler = LRScheduler(optimizer, **kwargs)
    first = run_lrs(scheduler, optimizer, split)
    state = pickle.loads(pickle.dumps(scheduler.state_dict()))
    optimizer = make_optimizer()
    scheduler = LRScheduler(optimizer, **kwargs)
    scheduler.load_state_dict(state)
    assert first + run_lrs(scheduler, optimizer, total - split) == reference
    assert all(lr[0] >= 1e-9 for lr in reference)


def test_tensor_lr():
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.Adam([param], lr=torch.tensor(0.1))
    scheduler = LRScheduler(optimizer, total_steps=10, method="linear", scaling="numerical", final_lr_ratio=0.0)
    run_lrs(scheduler, optimizer, 3)
    assert isinstance(optimizer.param_groups[0]["lr"], torch.Tensor)
    assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(scheduler.lr_at(0.1, 4))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"total_steps": 0}, "total_steps must be a positive integer, got 0"),
        ({"total_steps": -3}, "got -3"),
        ({"total_steps": 10, "warmup_steps": 6, "cooldown_steps": 5}, "got 6 \\+ 5 > 10"),
        ({"total_steps": 10, "warmup_steps": -1}, "warmup_steps must be a non-negative integer, got -1"),
        ({"total_steps": 10, "final_lr": 0.1, "final_lr_ratio": 0.1}, "not both"),
        ({"total_steps": 10, "final_lr_ratio": -0.1}, "final_lr_ratio must be non-negative, got -0.1"),
        ({"total_steps": 10, "method": "sawtooth"}, "unknown lr method 'sawtooth'; registered: constant, cosine"),
        ({"total_steps": 10, "scaling": "log"}, "scaling must be one of percentile, numerical, got 'log'"),
        ({"total_steps": 10, "method": "polynomial", "power": 0}, "power must be positive, got 0"),
        ({"total_steps": 10, "method": "linear", "power": 2}, "lr method 'linear'.*power"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LRScheduler(make_optimizer(), **kwargs)


def test_negative_lr_rejected():
    optimizer = make_optimizer()
    optimizer.param_groups[0]["lr"] = -0.5
    with pytest.raises(ValueError, match=r"lr=-0.5 in param_groups\[0\]"):
        LRScheduler(optimizer, total_steps=10)


def test_repr_and_state_dict_is_plain():
    scheduler = LRScheduler(make_optimizer(), total_steps=10, method="polynomial", power=3)
    assert "method='polynomial'" in repr(scheduler)
    state = scheduler.state_dict()
    assert state["method"] == "polynomial" and state["method_options"] == {"power": 3}
    assert not any(callable(value) for value in state.values())


def test_a_longer_budget_keeps_the_new_shape_and_continues_from_the_saved_step(caplog):
    optimizer = make_optimizer()
    scheduler = LRScheduler(optimizer, total_steps=10, method="linear", warmup_steps=0, cooldown_steps=0)
    run_lrs(scheduler, optimizer, 4)
    state = pickle.loads(pickle.dumps(scheduler.state_dict()))
    optimizer = make_optimizer()
    extended = LRScheduler(optimizer, total_steps=20, method="linear", warmup_steps=2, cooldown_steps=4)
    with caplog.at_level("WARNING", logger="danling"):
        extended.load_state_dict(state)
    assert (extended.total_steps, extended.warmup_steps, extended.cooldown_steps) == (20, 2, 4)
    assert extended.last_epoch == 4
    reference = LRScheduler(make_optimizer(), total_steps=20, method="linear", warmup_steps=2, cooldown_steps=4)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(reference.lr_at(1.0, 5))
    message = caplog.records[-1].getMessage()
    assert "rebuilt for total_steps=20 (the saved run had 10)" in message and "at step 4" in message
    assert run_lrs(extended, optimizer, 16)[-1][0] == pytest.approx(reference.lr_at(1.0, 20))


def test_the_same_budget_resumes_without_a_warning(caplog):
    optimizer = make_optimizer()
    scheduler = LRScheduler(optimizer, total_steps=10)
    run_lrs(scheduler, optimizer, 4)
    state = scheduler.state_dict()
    with caplog.at_level("WARNING"):
        LRScheduler(make_optimizer(), total_steps=10).load_state_dict(state)
    assert not caplog.records


def test_a_misspelt_scheduler_option_names_the_schedulers_arguments_not_only_the_methods():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"takes no option 'warmup_step'; did you mean warmup_steps\? it accepts: .*"):
        LRScheduler(optimizer, total_steps=10, method="cosine", warmup_step=5)
