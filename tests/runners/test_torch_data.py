"""Datasets to dataloaders: a training split that yields no batch is named."""

import pytest
import torch

from tests.runners._torch_toy import TinyRunner, tiny_config


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
