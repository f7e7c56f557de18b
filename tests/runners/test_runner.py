"""Runner: stack dispatch through the runner registry."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import danling as dl
from danling.runners import RUNNERS, BaseRunner, Runner, RunnerConfig, register_runner, resolve_runner
from tests.runners._torch_toy import TinyRunner, make_data, make_model, tiny_config
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


def test_runner_reads_the_stack_as_the_config_validates_it(registry, tmp_path):
    # RunnerConfig accepts " Toy " (compared stripped and lower-cased), and so does ToyRunner itself
    register_runner("toy", ToyRunner)
    config = RunnerConfig(**toy_config(tmp_path, stack=" Toy "))
    with Runner(config) as runner:
        assert type(runner) is ToyRunner
    assert resolve_runner(" toy ") is ToyRunner


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


def test_stack_auto_is_resolved_to_ddp(tmp_path):
    from danling.runners import Runner, TorchRunner

    class TinyEntry(Runner):  # built through the stack registry: combined with TorchRunner
        def __init__(self, config):
            super().__init__(config)
            self.model = torch.nn.Linear(4, 1)

    with TinyRunner(tiny_config(tmp_path / "direct")) as runner:
        assert runner.config.stack == "ddp"
        # Recording the resolved backend leaves the experiment (and its run directory) as it was.
        assert runner.config.config_id == RunnerConfig(**tiny_config(tmp_path / "direct")).config_id
    config = RunnerConfig(**tiny_config(tmp_path / "entry"))
    assert config.stack == "auto"
    with TinyEntry(config) as runner:
        assert isinstance(runner, TorchRunner) and runner.config.stack == "ddp" and config.stack == "ddp"
    with TinyRunner(tiny_config(tmp_path / "named", stack="torch")) as runner:
        assert runner.config.stack == "torch"  # an explicit choice is kept
    # A run resumed with `stack: auto` again matches the checkpoint it wrote.
    with TinyRunner(tiny_config(tmp_path / "resume", epochs=1)) as first:
        first.train()
    with TinyRunner(tiny_config(tmp_path / "resume", epochs=1, auto_resume=True)) as again:
        assert again.train_state.epoch == 1


class ReadmeRunner(dl.Runner):
    def __init__(self, config):
        super().__init__(config)
        self.model = make_model()
        self.criterion = nn.MSELoss()
        self.datasets.train, self.datasets.val = make_data(16, seed=0), make_data(8, seed=1)


class PinnedRunner(dl.TorchRunner):
    def __init__(self, config):
        super().__init__(config)
        self.model = make_model()


@pytest.mark.parametrize(("stack", "backend"), [("torch", dl.TorchRunner), ("parallel", dl.ParallelRunner)])
def test_a_runner_subclass_switches_backend_by_configuration_alone(tmp_path, stack, backend):
    with ReadmeRunner(tiny_config(tmp_path, epochs=1, stack=stack)) as runner:
        assert isinstance(runner, backend) and isinstance(runner, ReadmeRunner)
        runner.train()
        assert 0 in runner.results


def test_a_runner_pinned_to_one_backend_names_the_class_that_switches(tmp_path):
    with pytest.raises(ValueError, match=r"implemented by ParallelRunner, not by PinnedRunner .*Runner\(config\)"):
        PinnedRunner(tiny_config(tmp_path, stack="parallel"))
