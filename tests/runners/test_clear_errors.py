"""Mistakes that used to surface as a library's internal error now say what is wrong in one line."""

import pytest
import torch
from torch import nn

from tests.runners._torch_toy import TinyRunner, tiny_config


class PerSampleLoss(TinyRunner):
    def __init__(self, config):
        super().__init__(config)
        self.criterion = nn.MSELoss(reduction="none")


class OwnStep(TinyRunner):
    def train_step(self, data):
        x, y = data
        loss = (self.model(x) - y) ** 2  # forgot .mean()
        self.backward(loss)
        self.step()
        return None, loss.detach().mean()


def test_a_per_sample_loss_names_the_criterion_its_shape_and_the_fix(tmp_path):
    expected = r"criterion MSELoss\(\) returned a loss of shape \(4, 1\).*reduction='mean'"
    with PerSampleLoss(tiny_config(tmp_path, epochs=1)) as runner, pytest.raises(ValueError, match=expected):
        runner.train()
    expected = r"backward\(\) got a loss of shape \(4, 1\), not one number"
    with OwnStep(tiny_config(tmp_path / "b", epochs=1)) as runner, pytest.raises(ValueError, match=expected):
        runner.train()


class TinySplit(TinyRunner):
    n_train = 3  # fewer samples than one batch of 4, and training drops the last partial batch


class NoTrainSplit(TinyRunner):
    def __init__(self, config):
        super().__init__(config)
        del self.datasets["train"]


def test_a_split_that_yields_no_batch_is_named_instead_of_a_missing_run_length(tmp_path):
    config = tiny_config(tmp_path, **{"scheduler.type": "cosine"})
    with pytest.raises(ValueError, match=r"training split 'train' yields no batch: 3 sample\(s\) .*batch_size 4"):
        TinySplit(config)
    with pytest.raises(ValueError, match=r"no training split among the datasets \['val'\]"):
        NoTrainSplit(tiny_config(tmp_path / "b", **{"scheduler.type": "cosine"}))
    with TinyRunner(tiny_config(tmp_path / "c", **{"scheduler.type": "cosine"})) as runner:
        assert runner.scheduler is not None and torch.is_tensor(next(runner.model.parameters()))
