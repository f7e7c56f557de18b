"""Best selection never on `test` unless named, early stopping in both modes, and `evaluate_splits: []`."""

from __future__ import annotations

import logging
import os

import pytest

from danling.runners import RunnerConfig
from tests.runners._torch_toy import TinyRunner, make_data, tiny_config
from tests.runners._toy import ToyRunner, toy_config


class NoValRunner(TinyRunner):
    """A train and a test split, no validation split."""

    def __init__(self, config):
        super().__init__(config)
        del self.datasets["val"]
        self.datasets.test = make_data(8, seed=2)


def _no_best_warnings(caplog):
    return [r for r in caplog.records if "NO BEST CHECKPOINT" in r.getMessage() and r.levelno == logging.WARNING]


def test_without_a_validation_split_nothing_is_selected_on_test_and_the_run_says_so_once(tmp_path, caplog):
    with caplog.at_level(logging.INFO), NoValRunner(tiny_config(tmp_path, epochs=3)) as runner:
        runner.train()
        assert "test" in runner.results[2] and runner.score_split is None
        assert runner.best_result is None and not runner.is_best
        runner.bookkeeping.flush()
        assert not os.path.exists(os.path.join(runner.workspace.path, "best.json"))
    assert len(_no_best_warnings(caplog)) == 1


def test_a_test_split_named_as_the_score_split_is_selected_on(tmp_path, caplog):
    with caplog.at_level(logging.INFO), NoValRunner(tiny_config(tmp_path, epochs=2, score_split="test")) as runner:
        runner.train()
        assert runner.score_split == "test" and runner.best_result is not None
    assert not _no_best_warnings(caplog)


def test_a_validation_split_is_still_chosen_by_itself(tmp_path):
    with TinyRunner(tiny_config(tmp_path, epochs=2)) as runner:
        runner.train()
        assert runner.score_split == "val" and runner.best_result is not None


# ------------------------------------------------------------------ early stopping


def test_a_tie_is_no_improvement_so_a_flat_score_runs_out_of_patience(tmp_path):
    # lr 0: the weights never change, every evaluation scores the same
    with TinyRunner(tiny_config(tmp_path, epochs=10, patience=1, **{"optim.lr": 0.0})) as runner:
        runner.train()
        assert list(runner.results) == [0, 1, 2]  # the first scores, two ties: more than 1 without improvement


def test_patience_works_in_step_mode_counted_in_evaluations(tmp_path):
    config = tiny_config(tmp_path, epochs=None, steps=40, evaluate_interval=5, patience=2, **{"optim.lr": 0.0})
    with TinyRunner(config) as runner:
        runner.train()
        assert list(runner.results) == [5, 10, 15, 20] and runner.train_state.global_step == 20


def test_min_delta_sets_what_counts_as_an_improvement(tmp_path):
    overrides = {"optim.lr": 0.01, "score.min_delta": 1e9}
    with TinyRunner(tiny_config(tmp_path, epochs=10, patience=1, **overrides)) as runner:
        runner.train()
        assert list(runner.results) == [0, 1, 2]
    with TinyRunner(tiny_config(tmp_path / "b", epochs=4, patience=1, **{"optim.lr": 0.01})) as runner:
        runner.train()  # the loss goes down every epoch: patience never runs out
        assert list(runner.results) == [0, 1, 2, 3]


def test_patience_that_cannot_act_is_an_error(tmp_path):
    config = tiny_config(tmp_path, epochs=None, steps=10, evaluate_interval=0, patience=2)
    with TinyRunner(config) as runner, pytest.raises(ValueError, match=r"patience=2 .*evaluate_interval=0"):
        runner.train()
    with (
        NoValRunner(tiny_config(tmp_path / "b", epochs=2, patience=2)) as runner,
        pytest.raises(ValueError, match=r"config\.patience=2 counts evaluations of a validation split"),
    ):
        runner.train()
    with pytest.raises(ValueError, match=r"config\.score\.min_delta must be a number >= 0"):
        RunnerConfig(**{"score.min_delta": -1})


# ------------------------------------------------------------------ evaluate_splits: [] and none


def test_an_empty_evaluate_splits_evaluates_nothing(tmp_path):
    with TinyRunner(tiny_config(tmp_path, epochs=2, evaluate_splits=[])) as runner:
        assert runner.evaluate_splits == []
        runner.train()
        assert set(runner.results[1]) == {"train"}


def test_none_and_null_unset_a_list_key_on_the_command_line(tmp_path):
    assert RunnerConfig().parse(["--evaluate_splits", "none"]).evaluate_splits is None
    assert RunnerConfig().parse(["--evaluate_splits", "null", "--train_splits", "NULL"]).train_splits is None
    assert RunnerConfig().parse(["--evaluate_splits"]).evaluate_splits == []  # no value: the empty list
    path = tmp_path / "exp.yaml"
    path.write_text("evaluate_splits: []\n")
    assert RunnerConfig().parse(["--config", str(path)]).evaluate_splits == []


def test_missing_score_split_fails_at_first_evaluation_listing_splits(tmp_path):
    with ToyRunner(toy_config(tmp_path, score_split="validation")) as runner:
        with pytest.raises(ValueError, match=r"score_split 'validation'.*available splits: \['train', 'val'\]"):
            runner.train()
        assert runner.train_state.epoch == 0  # refused at the first row, not after the whole run


def test_missing_score_name_fails_when_set_and_warns_by_default(tmp_path, caplog):
    pattern = r"score_name 'acc'.*split 'val'.*available metrics: \['loss'\]"
    with ToyRunner(toy_config(tmp_path / "a", score_name="acc")) as runner, pytest.raises(ValueError, match=pattern):
        runner.train()

    class NoLoss(ToyRunner):
        def evaluate_step(self, data):
            return self.model.weight, None  # no loss: the row has no 'loss' metric

    with caplog.at_level(logging.WARNING), NoLoss(toy_config(tmp_path / "b", epochs=1)) as runner:
        runner.evaluate_epoch = lambda split="val": {"acc": 0.5}
        runner.train()
    assert any("score_name 'loss'" in r.getMessage() and "['acc']" in r.getMessage() for r in caplog.records)
