"""README's example subclasses `dl.Runner`: the same class runs on another backend by `stack` alone."""

import pytest
from torch import nn

import danling as dl
from tests.runners._torch_toy import make_data, make_model, tiny_config


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
