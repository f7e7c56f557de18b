"""A launch that dies before its first checkpoint leaves no rows for the next launch to mix with."""

import json

import pytest

from danling.runners.services.run_dirs import has_checkpoints
from tests.runners._torch_toy import TinyRunner, tiny_config


class DiesAtThirdBatch(TinyRunner):
    def train_step(self, data):
        if self.train_state.micro_step == 3:
            raise RuntimeError("the node went away")
        return super().train_step(data)


def test_the_next_launch_starts_clean_and_the_failed_files_are_kept_aside(tmp_path):
    config = tiny_config(tmp_path, epochs=1, log=True, log_interval=1)
    with DiesAtThirdBatch(config) as runner, pytest.raises(RuntimeError, match="went away"):
        runner.train()
    run_dir = runner.workspace.path
    failed_rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert len(failed_rows) > 1 and not has_checkpoints(run_dir)
    with TinyRunner(config) as runner:
        assert runner.workspace.path == run_dir  # the same run directory, started afresh
        runner.train()
    steps = [line.split(",")[0] for line in (run_dir / "metrics.csv").read_text().splitlines()[1:]]
    assert len(steps) == len(set(steps))  # no step twice: the dead launch's rows are not there
    assert "went away" not in (run_dir / "run.log").read_text()
    assert len(json.loads((run_dir / "metadata.json").read_text())["launches"]) == 1
    (kept,) = (run_dir / "failed").iterdir()
    assert kept.name.startswith("launch-") and (kept / "metrics.csv").read_text().splitlines() == failed_rows
    assert json.loads((kept / "status.json").read_text())["status"] == "failed"
    assert "ended before its first checkpoint" in (run_dir / "run.log").read_text()
