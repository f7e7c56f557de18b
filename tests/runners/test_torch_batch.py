"""The default batch contract: a loss that is not one number and labels out of range are named in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from tests.runners._torch_toy import TinyRunner, tiny_config


def test_labels_out_of_range_name_the_range_and_split(tmp_path):
    class Classifier(TinyRunner):
        def __init__(self, config):
            super().__init__(config)
            self.model = nn.Linear(4, 3)
            self.criterion = nn.CrossEntropyLoss()
            self.datasets.train = TensorDataset(torch.randn(8, 4), torch.tensor([0, 1, 2, 3, 0, 1, 2, 0]))
            self.datasets.val = TensorDataset(torch.randn(4, 4), torch.tensor([0, 1, 2, 0]))

    pattern = r"labels out of range on split 'train'.*\[0, 2\].*3 classes.*0 to 3"
    with Classifier(tiny_config(tmp_path)) as runner, pytest.raises(ValueError, match=pattern):
        runner.train()


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
