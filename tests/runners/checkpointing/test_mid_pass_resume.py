"""A run resumed from a checkpoint written in the middle of a training pass writes the uninterrupted run's rows."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from danling.metrics import regression_metrics
from danling.runners.checkpointing import TorchCheckpointing
from tests.runners._torch_toy import TinyRunner, model_state, tiny_config

# 20 samples in batches of 4: a pass is 5 updates, so the checkpoint of step 3 is written mid-pass.
STEP_MODE = {"epochs": None, "steps": 10, "evaluate_interval": 5, "checkpoint.interval": 3}


class MetricRunner(TinyRunner):
    """The toy with train metrics of the container type `mode` ("stream" or "global")."""

    mode = "global"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        # spearman keeps the predictions themselves; mae and r2 keep merged moments
        metrics = ["mae", "r2", "spearman"] if self.mode == "global" else ["mae", "mse"]
        self.train_metrics = regression_metrics(metrics=metrics, mode=self.mode)


class StreamRunner(MetricRunner):
    mode = "stream"


class UnevenRunner(MetricRunner):
    """18 samples, kept whole: a pass of 5 updates whose last batch holds 2 samples (its loss weighs 2)."""

    n_train = 18

    def __init__(self, config: Any) -> None:
        super().__init__(dict(config, **{"dataloader.train.drop_last": False}))


class PlainRunner(TinyRunner):
    """Train metrics of a container that cannot be checkpointed."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.train_metrics = _Unsaved()


class _Unsaved:
    """A minimal metric container: the sum of the targets, with `update`/`reset`/`avg` only."""

    group = None

    def __init__(self) -> None:
        self.total = 0.0

    def reset(self) -> None:
        self.total = 0.0

    def update(self, pred: Any, target: Any) -> None:
        self.total += float(target.sum())

    @property
    def avg(self) -> dict[str, float]:
        return {"total": self.total}


def _rows(runner: TinyRunner) -> dict[int, Any]:
    return {index: row.dict() for index, row in runner.results.items()}


def _uninterrupted_and_resumed(tmp_path, runner_type: type[TinyRunner], **overrides: Any):
    config = tiny_config(tmp_path / "whole", **STEP_MODE, **overrides)
    with runner_type(config) as whole:
        whole.train()
        rows, weights = _rows(whole), model_state(whole)
        checkpoint = whole.checkpoint_manager.directory / "step-000003"
    resumed_config = tiny_config(tmp_path / "resumed", **STEP_MODE, **overrides, resume=str(checkpoint))
    with runner_type(resumed_config) as resumed:
        assert resumed.loop_state.split == "train" and resumed.loop_state.batch == 3  # written mid-pass
        resumed.train()
        assert all(torch.equal(weights[key], value) for key, value in model_state(resumed).items())
        return rows, _rows(resumed)


@pytest.mark.parametrize(
    "runner_type", [StreamRunner, MetricRunner, UnevenRunner], ids=["stream", "global", "uneven-batches"]
)
def test_rows_after_a_mid_pass_resume_equal_the_uninterrupted_rows(tmp_path, runner_type):
    rows, resumed = _uninterrupted_and_resumed(tmp_path, runner_type)
    assert list(rows) == [5, 10] and set(rows[5]["train"]) > {"loss"}
    assert resumed == rows  # exact: loss and every train metric of the interrupted pass


def test_rows_after_a_mid_pass_resume_of_the_dcp_backend(tmp_path):
    rows, resumed = _uninterrupted_and_resumed(tmp_path, MetricRunner, **{"checkpoint.backend": "dcp"})
    assert resumed == rows


class OldPayload(TorchCheckpointing):
    """Writes checkpoints as before `pass_meters` existed."""

    def runner_payload(self, cls: type = dict) -> Any:
        payload = super().runner_payload(cls)
        del payload["pass_meters"]
        return payload


class OldWriter(MetricRunner):
    checkpointing_class = OldPayload


def test_an_old_dcp_checkpoint_without_the_meters_loads_as_before(tmp_path):
    config = tiny_config(tmp_path, **STEP_MODE, **{"checkpoint.backend": "dcp"})
    with OldWriter(config) as old:
        old.train()
        checkpoint = old.checkpoint_manager.directory / "step-000003"
    with MetricRunner(dict(config, resume=str(checkpoint))) as resumed:
        assert resumed.checkpointing.restored_pass_meters is None and resumed.loop_state.batch == 3
        resumed.train()
        assert resumed.train_state.global_step == 10


def test_a_metric_container_without_state_restarts_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        rows, resumed = _uninterrupted_and_resumed(tmp_path, PlainRunner)
    assert "restart at the resume" in caplog.text
    assert resumed[5]["train"]["loss"] == rows[5]["train"]["loss"]  # the loss meters still continue
    assert resumed[5]["train"]["total"] != rows[5]["train"]["total"]  # the metric covers batches 4 and 5 only
    assert resumed[10] == rows[10]


def test_only_a_mid_pass_checkpoint_of_the_same_layout_restores_the_meters(tmp_path, caplog):
    config = tiny_config(tmp_path, **STEP_MODE)
    with MetricRunner(config) as runner:
        runner.train()
        directory = runner.checkpoint_manager.directory
        assert runner.read_checkpoint(directory / "step-000010")["pass_meters"] == {"split": None}  # after the pass
    with MetricRunner(dict(config, resume=str(directory / "step-000003"))) as resumed:
        state = resumed.checkpointing.restored_pass_meters
        assert state is not None and state["split"] == "train" and state["batch"] == 3
        assert state["meters"]["loss"]["count"] == 12 and state["metrics"]["count"] == 12  # 3 batches of 4 samples
    with MetricRunner(tiny_config(tmp_path / "old", **STEP_MODE)) as old:
        payload = dict(old.read_checkpoint(directory / "step-000003"))
        del payload["pass_meters"]  # as written before the key existed
        old.load_checkpoint(payload)
        assert old.checkpointing.restored_pass_meters is None and old.loop_state.batch == 3
    with MetricRunner(tiny_config(tmp_path / "elastic", **STEP_MODE)) as elastic, caplog.at_level(logging.INFO):
        payload = dict(elastic.read_checkpoint(directory / "step-000003"))
        payload["topology"] = dict(payload["topology"], data_size=2)  # as if written by two data-parallel ranks
        elastic.load_checkpoint(payload)
        assert elastic.checkpointing.restored_pass_meters is None
    notes = [record.getMessage() for record in caplog.records if "restarts its loss meters" in record.getMessage()]
    assert len(notes) == 1 and "cover the batches after the resume" in notes[0], notes
