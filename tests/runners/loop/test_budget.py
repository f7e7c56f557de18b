"""The run budget: `epochs` / `steps` checks, and splits that yield no batch refused before the first step."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import TensorDataset

from tests.runners._torch_toy import TinyRunner, tiny_config
from tests.runners._toy import ToyRunner, toy_config


def test_zero_epochs_is_refused(tmp_path):
    with (
        ToyRunner(toy_config(tmp_path, epochs=0)) as runner,
        pytest.raises(ValueError, match=r"epochs=0 trains nothing"),
    ):
        runner.train()


def test_steps_with_epochs_is_logged(tmp_path, caplog):
    with caplog.at_level(logging.WARNING), ToyRunner(toy_config(tmp_path, epochs=1, steps=100)) as runner:
        runner.train()
    assert any("steps=100 and epochs=1" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("n_train", "overrides", "message"),
    [
        (0, {}, "its dataset is empty"),
        (
            3,
            {"dataloader.drop_last": True},
            r"its dataset has 3 samples and batch_size=4 with drop_last=True.*batch_size <= 3",
        ),
    ],
)
def test_training_data_that_yields_no_batch_is_refused_before_the_first_step(tmp_path, n_train, overrides, message):
    class Small(TinyRunner):
        pass

    Small.n_train = n_train
    with Small(tiny_config(tmp_path, **overrides)) as runner:
        with pytest.raises(ValueError, match=rf"training split 'train' yields no batch: {message}"):
            runner.train()
        assert runner.train_state.global_step == 0


def test_an_empty_evaluation_split_is_refused_instead_of_giving_nan_rows(tmp_path):
    class EmptyVal(TinyRunner):
        def __init__(self, config):
            super().__init__(config)
            self.datasets.val = TensorDataset(torch.zeros(0, 4), torch.zeros(0, 1))

    with EmptyVal(tiny_config(tmp_path, epochs=1)) as runner:
        with pytest.raises(ValueError, match=r"evaluation split 'val' yields no batch: its dataset is empty"):
            runner.train()
        assert not runner.results  # refused before the first step, not after a row of NaN
