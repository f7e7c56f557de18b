"""One step path: the default hooks and hooks overridden by passthroughs give exactly the same run."""

from __future__ import annotations

import pytest
import torch

from danling.metrics import regression_metrics
from danling.runners import TorchRunner
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
        {"nonfinite.check": "off"},  # unchecked updates: the NaN reaches the weights, the same both ways
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


_HOOKS = ("train_step", "evaluate_step", "to_device", "train_context", "forward_context", "backward", "step")


@pytest.mark.parametrize("hook", [*_HOOKS, "optimizer_step"])
def test_every_overridden_hook_is_called(tmp_path, hook):
    """No pass bypasses a hook: an override (on the class or the instance) sees every call it stands for."""
    calls = []
    original = getattr(TorchRunner, hook)

    def counted(self, *args, **kwargs):
        calls.append(hook)
        return original(self, *args, **kwargs)

    with type("Overridden", (TinyRunner,), {hook: counted})(tiny_config(tmp_path)) as runner:
        runner.train()
        assert calls, hook
        assert runner.train_state.global_step > 0


def test_an_instance_attribute_overrides_the_evaluate_step(tmp_path):
    with TinyRunner(tiny_config(tmp_path)) as runner:
        seen = []
        default = runner.evaluate_step
        runner.evaluate_step = lambda data: seen.append(1) or default(data)
        runner.evaluate()
        assert seen
