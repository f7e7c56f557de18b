"""Runner: stack dispatch through the runner registry."""

from __future__ import annotations

import pytest

from danling.runners import RUNNERS, BaseRunner, Runner, RunnerConfig, register_runner, resolve_runner
from tests.runners._toy import ToyRunner, toy_config


@pytest.fixture
def registry():
    """Register test backends and remove them (and their stack names) afterwards."""
    saved_runners, saved_stacks = dict(RUNNERS), RunnerConfig.STACKS
    yield
    RUNNERS.clear()
    RUNNERS.update(saved_runners)
    RunnerConfig.STACKS = saved_stacks


class OtherBackend(ToyRunner):
    lr = 0.5


def test_runner_returns_the_registered_backend(registry, tmp_path):
    register_runner("toy", ToyRunner)
    with Runner(toy_config(tmp_path, stack="toy")) as runner:
        assert type(runner) is ToyRunner
        runner.train()
        assert runner.train_state.epoch == 3


def test_subclass_is_combined_with_the_backend(registry, tmp_path):
    register_runner(("toy", "toy-fast"), ToyRunner)
    register_runner("other", OtherBackend)

    class MyRunner(Runner):
        def infer_step(self, data):
            return ["mine"]

    with MyRunner(toy_config(tmp_path, stack="TOY")) as runner:
        assert isinstance(runner, MyRunner) and isinstance(runner, ToyRunner)
        assert type(runner).__name__ == "MyRunner"
        assert runner.infer(steps=1) == ["mine"]  # the subclass hook wins over the backend
        assert runner.lr == ToyRunner.lr
        combined = type(runner)
    with MyRunner(toy_config(tmp_path, stack="other")) as runner:
        assert isinstance(runner, OtherBackend) and runner.lr == 0.5
    with MyRunner(toy_config(tmp_path, stack="toy-fast")) as again:
        assert type(again) is combined  # one combined class per (subclass, backend) pair


def test_unknown_stack_lists_registered_ones(registry, tmp_path):
    register_runner("toy", ToyRunner)
    with pytest.raises(ValueError, match=r"'nope'.*registered stacks: \[.*'toy'"):
        Runner(toy_config(tmp_path, stack="nope"))
    with pytest.raises(ValueError, match="registered stacks"):
        resolve_runner("jax")
    with pytest.raises(TypeError, match="mapping"):
        Runner(42)


def test_register_runner_as_decorator_extends_config_stacks(registry):
    @register_runner("decorated")
    class Decorated(BaseRunner):
        pass

    assert resolve_runner("Decorated") is Decorated
    assert "decorated" in RunnerConfig.STACKS
    with pytest.raises(TypeError, match="BaseRunner subclass"):
        register_runner("bad", object)
    with pytest.raises(ValueError, match="stack names"):
        register_runner([], Decorated)


def test_from_checkpoint_dispatches_on_the_saved_stack(registry, tmp_path):
    register_runner("toy", ToyRunner)
    with Runner(toy_config(tmp_path, stack="toy")) as runner:
        runner.train()
        path = runner.checkpoint_manager.latest
        weight = runner.model.weight
    with Runner.from_checkpoint(path) as restored:
        assert type(restored) is ToyRunner
        assert restored.model.weight == weight and restored.train_state.epoch == 3
