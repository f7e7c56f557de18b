"""A run resumed from a checkpoint written in the middle of a training pass writes the uninterrupted run's rows."""

from __future__ import annotations

import copy
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


# ------------------------------------------------------------------ excluding the interrupted split's loader position


class Recording(MetricRunner):
    """Records the first feature of each training batch; `stop_at` asks for a graceful stop after that micro-step."""

    stop_at = 0

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.seen: list[list[float]] = []

    def train_step(self, data: Any) -> Any:
        self.seen.append(data[0][:, 0].tolist())
        result = super().train_step(data)
        if self.stop_at and self.train_state.micro_step == self.stop_at:
            self.supervisor.request_stop()
        return result


class StopsMidPass(Recording):
    stop_at = 3  # inside the second window of 2 micro-steps: that window closes at micro-step 4, then it stops


def _from_the_pass_start(config: dict[str, Any], payload: Any) -> Recording:
    """A runner restored from `payload` as if it had been written when its interrupted pass began.

    Its loaders start afresh (the config excludes their positions), so it trains what a fresh pass
    from the checkpoint's weights, optimizer, scheduler and counters trains: the reference for a
    restarted pass.
    """
    runner = Recording(config)
    payload = dict(runner.read_checkpoint(payload))
    payload["loop"] = dict(payload["loop"], split=None, batch=0, accumulator=None)
    payload["pass_meters"] = {"split": None}
    runner.load_checkpoint(payload)
    return runner


def _restart_notes(caplog: Any) -> list[str]:
    return [record.getMessage() for record in caplog.records if "restarts from its first batch" in record.getMessage()]


# accum_steps 2 over 5 micro-batches: windows of 2, 2 and 1 (3 updates a pass); a cosine schedule steps every update.
EPOCH_RESTART = {"accum_steps": 2, "deterministic": True, "scheduler.type": "cosine"}


@pytest.mark.parametrize("exclude", ["dataloaders", "dataloaders.train"])
def test_excluding_the_loader_position_restarts_the_interrupted_pass(tmp_path, caplog, exclude):
    config = tiny_config(tmp_path / "run", **EPOCH_RESTART)
    with pytest.raises(SystemExit), StopsMidPass(config) as stopped:
        stopped.train()
    assert (stopped.train_state.global_step, stopped.loop_state.batch) == (2, 4)  # shutdown saved after 2 windows
    checkpoint = str(stopped.checkpoint_manager.directory / "shutdown.pointer")
    excluded = {"checkpoint.exclude_from_loading": [exclude]}
    with caplog.at_level(logging.WARNING, logger="danling"):
        resumed = Recording({**config, **excluded, "resume": checkpoint})
    with resumed:
        assert (resumed.loop_state.split, resumed.loop_state.batch) == ("train", 0)
        assert resumed.checkpointing.restored_pass_meters is None
        # the global counters are the checkpoint's: the restarted pass's updates count on from them
        assert resumed.train_state.global_step == 2 and resumed.scheduler.last_epoch == 2
        resumed.train()
    notes = _restart_notes(caplog)
    assert len(notes) == 1 and "the 4 batch(es) it had trained are trained again" in notes[0], notes
    # The pass starts over from its first batch (the fresh loader's order is epoch 0's, as here), then epoch 1.
    assert resumed.seen[:4] == stopped.seen and len(resumed.seen) == 10
    assert resumed.train_state.epoch == 2 and list(resumed.results) == [0, 1]
    assert resumed.train_state.global_step == 2 + 3 + 3  # the restarted pass's 3 windows, then epoch 1's
    assert resumed.scheduler.last_epoch == 8
    with _from_the_pass_start(tiny_config(tmp_path / "fresh", **EPOCH_RESTART, **excluded), checkpoint) as fresh:
        fresh.train()
        assert fresh.seen == resumed.seen
        # Exactly a fresh pass's row: its loss and train metrics cover the 5 batches of the restarted pass only
        # (the interrupted part's 4 are not counted twice), and its windows lined up as a fresh pass's.
        assert resumed.results.dict() == fresh.results.dict()
        assert fresh.train_state.global_step == resumed.train_state.global_step
        weights = model_state(fresh)
        assert all(torch.equal(weights[key], value) for key, value in model_state(resumed).items())


# 20 samples in batches of 4 and a budget of 6 steps: the checkpoint of step 3 is mid-pass, and the
# budget runs out at the third batch of the restarted pass.
SHORT_STEP_MODE = {"epochs": None, "steps": 6, "evaluate_interval": 0, "checkpoint.interval": 3}


@pytest.mark.parametrize("resized", [False, True], ids=["same-size", "resized"])
@pytest.mark.parametrize("exclude", ["dataloaders", "dataloaders.train"])
def test_a_restarted_pass_in_step_mode_counts_its_own_batches(tmp_path, caplog, exclude, resized):
    with Recording(tiny_config(tmp_path / "whole", **SHORT_STEP_MODE)) as whole:
        whole.train()
        payload = dict(whole.read_checkpoint(whole.checkpoint_manager.directory / "step-000003"))
    if resized:  # as if written by two data-parallel ranks: a resize that also holds the global positions
        assert payload["loop"]["data"]["train"]["samples_consumed"] == 12
        payload["topology"] = dict(payload["topology"], data_size=2)
    excluded = {"checkpoint.exclude_from_loading": [exclude]}
    with Recording(tiny_config(tmp_path / "resumed", **SHORT_STEP_MODE, **excluded)) as resumed:
        with caplog.at_level(logging.WARNING, logger="danling"):
            resumed.load_checkpoint(copy.deepcopy(payload))  # a loaded optimizer state shares the payload's tensors
        assert (resumed.loop_state.split, resumed.loop_state.batch) == ("train", 0)
        resumed.train()
        assert len(_restart_notes(caplog)) == 1
        # Restarted from its first batch, not continued from the 12 samples consumed: the budget ends at the
        # third batch of the pass, so the round is not complete and no epoch is counted.
        assert resumed.seen == whole.seen[:3]
        assert resumed.train_state.global_step == 6 and resumed.train_state.epoch == 0
        assert (resumed.loop_state.split, resumed.loop_state.batch) == ("train", 3)
    with _from_the_pass_start(tiny_config(tmp_path / "fresh", **SHORT_STEP_MODE, **excluded), payload) as fresh:
        fresh.train()
        assert fresh.seen == resumed.seen
        assert resumed.results.dict() == fresh.results.dict()  # the row of step 6 covers the 3 restarted batches
