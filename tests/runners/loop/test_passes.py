"""One pass over a split: step-log pacing."""

from __future__ import annotations

import logging

import pytest

from danling.runners import RunnerConfig
from tests.runners._toy import ToyRunner, toy_config


def test_log_interval_zero_turns_step_logs_off(tmp_path, caplog):
    RunnerConfig(log_interval=0).boot()  # accepted
    with pytest.raises(ValueError, match="log_interval"):
        RunnerConfig(log_interval=-1).boot()
    with ToyRunner(toy_config(tmp_path, log_interval=0, epochs=1)) as runner:
        assert runner.log_interval == 0
        with caplog.at_level(logging.INFO, logger=runner.logger.name):
            runner.train()
    step_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("train [", "val ["))]
    assert step_lines == []
    assert runner.results[0]["train"]["loss"] >= 0  # rounds still run and are recorded
