"""The fused default steps: chosen exactly when no hook they stand for is overridden, and doing what the hooks do."""

from __future__ import annotations

import pytest
import torch

from danling.metrics import regression_metrics
from danling.runners.loop.loops import RunnerMode
from danling.runners.torch_steps import _EVALUATE_HOOKS, _TRAIN_HOOKS, TorchStepMixin
from tests.runners._torch_toy import TinyRunner, model_state, tiny_config


class MeasuredRunner(TinyRunner):
    """Training and evaluation metrics, and a loss that turns NaN in the 7th training step (a skipped update)."""

    def __init__(self, config):
        super().__init__(config)
        self.metrics = regression_metrics(metrics=["mse", "r2"])
        self.train_metrics = regression_metrics(metrics=["mae"], mode="stream")
        criterion, self.calls = self.criterion, 0

        def flaky(pred, target):
            loss = criterion(pred, target)
            if not self.model.training:
                return loss
            self.calls += 1
            return loss * float("nan") if self.calls == 7 else loss

        self.criterion = flaky


class HookedRunner(MeasuredRunner):
    """Overrides one hook of each fused step with itself, so that every pass calls the hooks."""

    def step(self):
        super().step()

    def forward_context(self):
        return super().forward_context()


def _run(cls, root, overrides):
    with cls(tiny_config(root, deterministic=True, **overrides)) as runner:
        assert (runner._batch_step(RunnerMode.train).__func__ is TorchStepMixin._fused_train_step) == (
            cls is MeasuredRunner
        )
        runner.train()
        evaluated = runner.evaluate()
        ema = None if runner.ema is None else {k: v.clone() for k, v in runner.ema.state_dict().items()}
        return {
            "weights": model_state(runner),
            "ema": ema,
            "optimizer": runner.optimizer.state_dict(),
            "lr": [group["lr"] for group in runner.optimizer.param_groups],
            "state": runner.train_state.state_dict(),
            "skipped": runner.optimizer_container.skipped_steps,
            "results": runner.results.dict(),
            "evaluated": evaluated.dict(),
        }


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"skip_nonfinite_grad": True, "max_grad_norm": 0.05},
        {"skip_nonfinite_grad": True, "max_grad_value": 0.01, "sched.type": "cosine"},
        {"skip_nonfinite_grad": True, "ema.enabled": True, "ema.decay": 0.5},
    ],
    ids=["plain", "clip-norm", "clip-value-scheduler", "ema"],
)
def test_fused_steps_give_exactly_what_the_hooks_give(tmp_path, overrides):
    fused = _run(MeasuredRunner, tmp_path / "fused", overrides)
    hooked = _run(HookedRunner, tmp_path / "hooks", overrides)
    if overrides.get("skip_nonfinite_grad"):
        assert fused["skipped"] == 1 and fused["state"]["global_step"] == fused["state"]["micro_step"] - 1
    else:  # the NaN reached the weights both ways
        assert not all(torch.isfinite(w).all() for w in fused["weights"].values())
    for key in fused["weights"]:
        torch.testing.assert_close(fused["weights"][key], hooked["weights"][key], rtol=0, atol=0, equal_nan=True)
    if fused["ema"] is not None:
        for key, value in fused["ema"].items():
            assert torch.equal(value, hooked["ema"][key])
    for key in ("lr", "state", "skipped"):
        assert fused[key] == hooked[key], key
    moments, reference = fused["optimizer"]["state"], hooked["optimizer"]["state"]
    assert moments.keys() == reference.keys()
    for index, values in moments.items():
        for name, value in values.items():
            torch.testing.assert_close(value, reference[index][name], rtol=0, atol=0, equal_nan=True)
    # repr: exact floats, and the NaN training loss of epoch 1 equals itself
    assert repr(fused["results"]) == repr(hooked["results"]) and repr(fused["evaluated"]) == repr(hooked["evaluated"])
    assert set(fused["results"][1]["train"]) == {"loss", "mae"}
    assert set(fused["results"][1]["val"]) == {"loss", "mse", "r2"}


@pytest.mark.parametrize("hook", _TRAIN_HOOKS)
def test_overriding_any_train_hook_turns_the_fused_train_step_off(tmp_path, hook):
    original = getattr(TorchStepMixin, hook)
    passthrough = {hook: lambda self, *args, **kwargs: original(self, *args, **kwargs)}
    with type("Overridden", (TinyRunner,), passthrough)(tiny_config(tmp_path)) as runner:
        assert runner._batch_step(RunnerMode.train) == runner.train_step
        if hook not in _EVALUATE_HOOKS:
            assert runner._batch_step(RunnerMode.evaluate).__func__ is TorchStepMixin._fused_evaluate_step


@pytest.mark.parametrize("hook", _EVALUATE_HOOKS)
def test_overriding_any_evaluate_hook_turns_the_fused_evaluate_step_off(tmp_path, hook):
    with TinyRunner(tiny_config(tmp_path)) as runner:
        assert runner._batch_step(RunnerMode.evaluate).__func__ is TorchStepMixin._fused_evaluate_step
        setattr(runner, hook, getattr(runner, hook))  # an instance attribute counts as an override
        assert runner._batch_step(RunnerMode.evaluate) == runner.evaluate_step


@pytest.mark.parametrize(
    ("overrides", "train_fused", "evaluate_fused"),
    [
        ({}, True, True),
        ({"accum_steps": 2}, False, True),
        ({"precision": "bf16"}, False, False),
        ({"optim.type": None}, False, True),
    ],
    ids=["fp32", "accumulation", "autocast", "no-optimizer"],
)
def test_fused_steps_only_where_they_apply(tmp_path, overrides, train_fused, evaluate_fused):
    with TinyRunner(tiny_config(tmp_path, **overrides)) as runner:
        train, evaluate = runner._batch_step(RunnerMode.train), runner._batch_step(RunnerMode.evaluate)
        assert (getattr(train, "__func__", None) is TorchStepMixin._fused_train_step) == train_fused
        assert (getattr(evaluate, "__func__", None) is TorchStepMixin._fused_evaluate_step) == evaluate_fused
        assert runner._batch_step(RunnerMode.infer) == runner.evaluate_step
