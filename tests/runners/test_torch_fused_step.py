"""The fused default training pass: taken exactly when nothing but the default step runs, and the same to the bit."""

from __future__ import annotations

import weakref

import pytest
import torch

from danling.metrics import regression_metrics
from danling.runners import Events
from danling.runners.torch_fused_step import general_step_reason
from tests.runners._torch_toy import TinyRunner, model_state, tiny_config


class MeasuredRunner(TinyRunner):
    """A stream container for training, a global one for evaluation."""

    n_train = 28  # 7 batches of 4: step logs, budgets and stops land inside passes

    def __init__(self, config):
        super().__init__(config)
        self.train_metrics = regression_metrics(metrics=["mae", "mse"], mode="stream")
        self.evaluate_metrics = regression_metrics(metrics=["mse", "r2"])


class HookedRunner(MeasuredRunner):
    """Overrides `step` with itself: every training pass goes through the hooks."""

    def step(self):
        super().step()


def wrapping_criterion(cls, wrap):
    """`cls` whose criterion is `wrap(runner, criterion)`; `runner.calls` starts at 0 for it to count."""

    class Wrapped(cls):
        def __init__(self, config):
            super().__init__(config)
            self.calls = 0
            self.criterion = wrap(self, self.criterion)

    return Wrapped


def _run(cls, root, overrides):
    with cls(tiny_config(root, **{"deterministic": True, "epochs": 3, **overrides})) as runner:
        runner.train()
        return runner.loop.fused_step, {
            "weights": model_state(runner),
            "optimizer": runner.optimizer.state_dict(),
            "lr": [group["lr"] for group in runner.optimizer.param_groups],
            "state": runner.train_state.state_dict(),
            "loop": runner.loop_state.state_dict(),
            "accumulator": runner.update.accumulator.state_dict(),
            "results": runner.results.dict(),
            "meter": (runner.meters["loss"].sum, runner.meters["loss"].count),  # a Python float: its repr is exact
            "metrics": runner.train_metrics.state_dict(),
        }


def _assert_identical(fused, hooked):
    for key, value in fused["weights"].items():
        torch.testing.assert_close(value, hooked["weights"][key], rtol=0, atol=0)
    moments, reference = fused["optimizer"]["state"], hooked["optimizer"]["state"]
    assert moments.keys() == reference.keys()
    for index, values in moments.items():
        for name, value in values.items():
            torch.testing.assert_close(value, reference[index][name], rtol=0, atol=0)
    for key in ("lr", "state", "loop", "accumulator"):
        assert fused[key] == hooked[key], key
    assert repr(fused["results"]) == repr(hooked["results"])  # repr: every float to the bit
    assert repr(fused["meter"]) == repr(hooked["meter"]) and repr(fused["metrics"]) == repr(hooked["metrics"])


@pytest.mark.parametrize(
    "overrides",
    [
        {"log_interval": 0},  # nothing reads the loss meter before the end of a pass
        {"log_interval": 2},  # step logs read the loss meter inside the pass
        {"sched.type": "cosine"},  # a step-interval scheduler
        {"epochs": None, "steps": 11, "checkpoint.interval": 3},  # a budget: mid-pass checkpoints and the end
    ],
    ids=["plain", "step-logs", "scheduler", "budget"],
)
def test_the_fused_pass_gives_exactly_what_the_hooks_give(tmp_path, overrides):
    fused_taken, fused = _run(MeasuredRunner, tmp_path / "fused", overrides)
    hooks_taken, hooked = _run(HookedRunner, tmp_path / "hooks", overrides)
    assert fused_taken and not hooks_taken
    assert fused["state"]["global_step"] > 0
    _assert_identical(fused, hooked)


def test_a_stop_requested_in_a_fused_pass_stops_where_the_hooks_stop(tmp_path):
    """A stop asked for during batch 3 of epoch 1 (here by the criterion) ends the pass after that batch."""

    def watched(runner, criterion):
        def criterion_asking_a_stop(pred, target):
            runner.calls += runner.model.training  # training batches only
            if runner.calls == 10 and runner.model.training:
                runner.supervisor.request_stop()
            return criterion(pred, target)

        return criterion_asking_a_stop

    seen = {}
    for name, cls in (("fused", MeasuredRunner), ("hooks", HookedRunner)):
        config = tiny_config(tmp_path / name, deterministic=True, log_interval=0)  # the stop flag alone is read
        with pytest.raises(SystemExit), wrapping_criterion(cls, watched)(config) as runner:
            runner.train()
        seen[name] = (runner.loop.fused_step, runner.train_state.state_dict(), runner.loop_state.state_dict())
        seen[name] += (repr(runner.meters["loss"]._sum), model_state(runner))
    assert seen["fused"][0] and not seen["hooks"][0]
    assert seen["fused"][1] == seen["hooks"][1] == {"epoch": 1, "global_step": 10, "micro_step": 10}
    assert seen["fused"][2] == seen["hooks"][2] and seen["fused"][2]["batch"] == 3
    assert seen["fused"][3] == seen["hooks"][3]
    for key, value in seen["fused"][4].items():
        assert torch.equal(value, seen["hooks"][4][key])


class BackwardRunner(TinyRunner):
    def backward(self, loss, weight=None):
        super().backward(loss, weight)


@pytest.mark.parametrize(
    "overrides",
    [
        {"accum_steps": 2},
        {"max_grad_norm": 1.0},
        {"max_grad_value": 1.0},
        {"precision": "bf16"},
        {"ema.enabled": True},
        {"skip_nonfinite_grad": True},
        {"nonfinite.check": "update"},
        {"spikes.policy": "skip"},
    ],
    ids=lambda overrides: next(iter(overrides)),
)
def test_anything_but_the_plain_update_keeps_the_hooks(tmp_path, overrides):
    with TinyRunner(tiny_config(tmp_path, **overrides)) as runner:
        assert general_step_reason(runner) is not None
        runner.train()
        assert not runner.loop.fused_step and runner.train_state.global_step > 0


def test_an_overridden_hook_or_a_step_subscriber_keeps_the_hooks(tmp_path):
    with TinyRunner(tiny_config(tmp_path / "plain")) as runner:
        assert general_step_reason(runner) is None
        runner.train()
        assert runner.loop.fused_step

    with BackwardRunner(tiny_config(tmp_path / "class")) as runner:
        assert general_step_reason(runner) == "backward is overridden"
        runner.train()
        assert not runner.loop.fused_step

    with TinyRunner(tiny_config(tmp_path / "instance")) as runner:
        calls = []
        default = runner.to_device
        runner.to_device = lambda data: calls.append(runner.model.training) or default(data)
        runner.train()
        assert not runner.loop.fused_step and sum(calls) == runner.train_state.micro_step

    with TinyRunner(tiny_config(tmp_path / "subscriber")) as runner:
        ends = []
        runner.events.subscribe(Events.STEP_END, lambda context: ends.append(context.runner.model.training))
        runner.train()
        assert not runner.loop.fused_step and sum(ends) == runner.train_state.micro_step


def test_a_loss_the_meter_refuses_fails_at_its_own_batch(tmp_path):
    """A (1,)-shaped loss after ()-shaped ones is refused by the loss meter at that batch on both paths."""

    def reshaping(runner, criterion):
        def criterion_reshaping_its_third_loss(pred, target):
            runner.calls += 1
            loss = criterion(pred, target)
            return loss.reshape(1) if runner.calls == 3 else loss

        return criterion_reshaping_its_third_loss

    seen = {}
    for name, cls in (("fused", MeasuredRunner), ("hooks", HookedRunner)):
        config = tiny_config(tmp_path / name, log_interval=0)  # no step logs: nothing reads the meter sooner
        with pytest.raises(ValueError, match="shape"), wrapping_criterion(cls, reshaping)(config) as runner:
            runner.train()
        seen[name] = (runner.loop.fused_step, runner.train_state.state_dict())
    assert seen["fused"][0] and not seen["hooks"][0]
    assert seen["fused"][1] == seen["hooks"][1] == {"epoch": 0, "global_step": 3, "micro_step": 3}


def test_the_fused_pass_lets_the_output_go_before_the_backward_pass(tmp_path):
    # A criterion that saves only its own result (log_softmax in cross-entropy) leaves the model output
    # referenced by the loop alone; holding it through backward kept one more logits-sized tensor alive
    # at the memory peak (measured on a GPU: see docs/gpu.md).

    def watch(runner, criterion):
        def loss(pred, target):
            runner.calls += 1
            output = weakref.ref(pred)
            value = torch.log_softmax(pred, -1).sum(-1).mean() + 0 * criterion(pred.detach(), target)
            if value.requires_grad:  # a training batch (evaluation builds no graph)
                value.register_hook(lambda grad: runner.alive.append(output() is not None))
            return value

        return loss

    cls = wrapping_criterion(TinyRunner, watch)
    with cls(tiny_config(tmp_path, epochs=1)) as runner:
        runner.alive = []
        runner.train()
        assert runner.loop.fused_step
        assert runner.alive == [False] * 5  # 5 training batches, none holding its output during backward


class WatchedOutputRunner(TinyRunner):
    """Counts, at the start of each training backward pass, whether the model output is still referenced."""

    def __init__(self, config):
        super().__init__(config)
        self.alive, plain = [], self.criterion

        def loss(pred, target):
            output = weakref.ref(pred)
            value = torch.log_softmax(pred, -1).sum(-1).mean() + 0 * plain(pred.detach(), target)
            if value.requires_grad:  # a training batch (evaluation builds no graph)
                value.register_hook(lambda grad: self.alive.append(output() is not None))
            return value

        self.criterion = loss


class OutputReadingRunner(WatchedOutputRunner):
    def train_step(self, data):
        pred, loss = super().train_step(data)
        self.outputs.append(pred is not None)
        return pred, loss


def test_the_hooked_default_step_lets_the_output_go_unless_something_reads_it(tmp_path):
    # bf16 autocast keeps the hooked path; its default step held the logits through backward (+12% peak
    # memory for GPT-2 small on an H200, docs/gpu.md) although the loop discards them.
    with WatchedOutputRunner(tiny_config(tmp_path / "a", epochs=1, precision="bf16")) as runner:
        runner.train()
        assert not runner.loop.fused_step and runner.alive == [False] * 5
        assert runner.train_step(next(iter(runner.dataloaders["train"])))[0] is not None  # called directly: kept
    with OutputReadingRunner(tiny_config(tmp_path / "b", epochs=1, precision="bf16")) as runner:
        runner.outputs = []
        runner.train()  # an override that calls super() gets the output
        assert runner.outputs == [True] * 5 and runner.alive == [True] * 5
    with WatchedOutputRunner(tiny_config(tmp_path / "c", epochs=1, precision="bf16")) as runner:
        seen = []
        runner.events.subscribe(Events.STEP_END, lambda context: seen.append(context))
        runner.train()  # a step subscriber may read the output: kept
        assert runner.alive == [True] * 5 and seen
