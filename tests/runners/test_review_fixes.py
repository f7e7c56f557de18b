"""Regression tests for review findings: exact graceful stops, the `best` alias, resume checks, EMA, W&B, close."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from danling.checkpoint import FileCheckpointManager, read_checkpoint
from danling.checkpoint.manifest import HashingWriter
from danling.data import DataResumeError
from tests.runners._torch_toy import TinyRunner, make_data, model_state, tiny_config
from tests.runners.test_trackers import read_wandb_records


def _reference(root: Path, **overrides) -> tuple[int, dict[str, torch.Tensor], dict]:
    """Global step, weights and result rows of an uninterrupted run."""
    with TinyRunner(tiny_config(root, deterministic=True, **overrides)) as runner:
        runner.train()
        return runner.train_state.global_step, model_state(runner), runner.results.dict()


def _assert_same_weights(expected: dict[str, torch.Tensor], runner: TinyRunner) -> None:
    got = model_state(runner)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(value, got[key]), f"{key} differs from the uninterrupted run"


def _shutdown_payload(runner: TinyRunner) -> dict:
    return read_checkpoint(runner.checkpoint_manager.directory / "shutdown.pointer")


# ---------------------------------------------------------------------- graceful stops are exact
def test_stop_during_evaluation_resumes_with_evaluation_not_training(tmp_path):
    ref_step, ref_weights, ref_results = _reference(tmp_path / "clean")

    class StopInEval(TinyRunner):
        def evaluate_step(self, data):
            if self.train_state.epoch == 0:
                self.supervisor.request_stop()
            return super().evaluate_step(data)

    config = tiny_config(tmp_path / "run", deterministic=True)
    with pytest.raises(SystemExit) as stop, StopInEval(config) as runner:
        runner.train()
    assert stop.value.code == 0
    loop = _shutdown_payload(runner)["loop"]
    assert loop["split"] is None and loop["trained"] is True  # epoch 0 was evaluating
    assert loop["round"]["train"]["loss"] == pytest.approx(ref_results[0]["train"]["loss"])

    with TinyRunner({**config, "auto_resume": True}) as resumed:
        assert resumed.train_state.global_step == 5
        resumed.train()
        assert resumed.train_state.global_step == ref_step  # epoch 0 was not trained again
        _assert_same_weights(ref_weights, resumed)
        assert resumed.results.dict() == ref_results  # the row of epoch 0 is complete


def test_graceful_stop_inside_accumulation_window_finishes_the_window(tmp_path):
    ref_step, ref_weights, _ = _reference(tmp_path / "clean", accum_steps=2)

    class StopAtMicroStep3(TinyRunner):
        def train_step(self, data):
            out = super().train_step(data)
            if self.train_state.micro_step == 3 and not self.config.auto_resume:
                self.supervisor.request_stop()  # inside the second window of 2 micro-steps
            return out

    config = tiny_config(tmp_path / "run", deterministic=True, accum_steps=2)
    with pytest.raises(SystemExit), StopAtMicroStep3(config) as runner:
        runner.train()
    payload = _shutdown_payload(runner)
    # micro-step 4 closed the window and stepped; no partial window was applied
    assert payload["state"]["train"] == {"epoch": 0, "global_step": 2, "micro_step": 4}
    assert payload["loop"]["split"] == "train"

    with StopAtMicroStep3({**config, "auto_resume": True}) as resumed:
        resumed.train()
        assert resumed.train_state.global_step == ref_step
        assert resumed.train_state.micro_step == 10
        _assert_same_weights(ref_weights, resumed)


# ---------------------------------------------------------------------- best alias
def test_best_alias_never_points_at_an_unevaluated_mid_epoch_checkpoint(tmp_path):
    class MidEpochSave(TinyRunner):
        def optimizer_step(self):
            applied = super().optimizer_step()
            if applied and self.train_state.global_step == 7:  # inside epoch 1 (5 updates per epoch)
                self.save_checkpoint(force=True)
            return applied

        def evaluate_epoch(self, split="val"):
            result = super().evaluate_epoch(split)
            if self.train_state.epoch == 1:
                result["loss"] = 1e9  # epoch 1 is worse than epoch 0
            return result

    with MidEpochSave(tiny_config(tmp_path)) as runner:
        runner.train()
        manager = runner.checkpoint_manager
        assert runner.best_index == 0
        assert manager.best.name == "epoch-000000"
        assert sorted(path.name for path in manager.checkpoints()) == ["epoch-000000", "epoch-000001", "step-000007"]


# ---------------------------------------------------------------------- resume checks
class PlainLoaderRunner(TinyRunner):
    """Trains on a user-bound plain `DataLoader`, which cannot save its position."""

    def __init__(self, config):
        super().__init__(config)
        self.dataloaders.train = DataLoader(make_data(20), batch_size=4, shuffle=False)


def _crash_after_update(runner_cls: type, config: dict, step: int) -> None:
    class Crashing(runner_cls):
        def optimizer_step(self):
            applied = super().optimizer_step()
            if applied and self.train_state.global_step == step:
                self.save_checkpoint(force=True)
                raise KeyboardInterrupt("simulated crash")
            return applied

    with pytest.raises(KeyboardInterrupt), Crashing(config) as runner:
        runner.train()


def test_mid_pass_resume_of_a_plain_dataloader_fails_loudly(tmp_path):
    config = tiny_config(tmp_path, epochs=1)
    _crash_after_update(PlainLoaderRunner, config, step=2)
    with pytest.raises(DataResumeError, match=r"split 'train' mid-pass.*StatefulDataLoader"):
        PlainLoaderRunner({**config, "auto_resume": True})
    # Excluding the loader state restarts the pass knowingly; an epoch-boundary checkpoint needs no position.
    with PlainLoaderRunner({**config, "auto_resume": True, "checkpoint.exclude_from_loading": ["dataloaders"]}) as r:
        assert r.train_state.global_step == 2


def test_plain_dataloader_resumes_from_an_epoch_boundary(tmp_path):
    config = tiny_config(tmp_path, epochs=2)

    class CrashInEpoch1(PlainLoaderRunner):
        def optimizer_step(self):
            applied = super().optimizer_step()
            if self.train_state.global_step == 6:  # epoch 0 was checkpointed at its end, nothing since
                raise KeyboardInterrupt("simulated crash")
            return applied

    with pytest.raises(KeyboardInterrupt), CrashInEpoch1(config) as runner:
        runner.train()
    with PlainLoaderRunner({**config, "auto_resume": True}) as resumed:  # no position needed: no error
        assert (resumed.train_state.epoch, resumed.train_state.global_step) == (1, 5)
        resumed.train()
        assert resumed.train_state.global_step == 10


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.data = make_data(n)

    def __iter__(self):
        return iter(self.data)


class StreamRunner(TinyRunner):
    def __init__(self, config):
        super().__init__(config)
        self.datasets.train = Stream(20)


def test_mid_pass_resume_of_an_iterable_dataset_warns_that_it_cannot_verify(tmp_path, caplog):
    config = tiny_config(tmp_path, epochs=None, steps=4, **{"dataloader.train.shuffle": False})
    _crash_after_update(StreamRunner, config, step=3)
    with caplog.at_level(logging.WARNING, logger="danling"), StreamRunner({**config, "auto_resume": True}) as runner:
        assert runner.train_state.global_step == 3
        warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
        assert any("'train' mid-pass without verifying" in message for message in warnings), warnings
        runner.train()
        assert runner.train_state.global_step == 4


# ---------------------------------------------------------------------- EMA, W&B, close
def test_infer_uses_the_ema_weights(tmp_path):
    config = tiny_config(tmp_path, epochs=1, **{"ema.enabled": True, "ema.decay": 0.5})
    with TinyRunner(config) as runner:
        runner.train()
        x = torch.stack([sample[0] for sample in runner.datasets.val])
        with torch.no_grad():
            from_ema = runner.ema.module(x).squeeze(-1)
            from_model = runner.model(x).squeeze(-1)
        assert not torch.allclose(from_ema, from_model)  # the two really differ after training
        assert runner.infer("val") == pytest.approx(from_ema.tolist())


def _wandb_run(tmp_path: Path, monkeypatch, **overrides) -> tuple[dict, str, dict[str, dict[int, float]], str]:
    """Train a TinyRunner with an offline W&B run; return its results, id, recorded history and run name."""
    from wandb.proto import wandb_internal_pb2

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb = {"wandb.enabled": True, "wandb.mode": "offline", "wandb.dir": str(tmp_path), "wandb.project": "dl-test"}
    with TinyRunner(tiny_config(tmp_path / "run", log_interval=2, **wandb, **overrides)) as runner:
        runner.train()
        results, run_id = runner.results.dict(), runner.id
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    history: dict[str, dict[int, float]] = {}
    run_name = ""
    for raw in read_wandb_records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for key, value in items.items():
                if not key.startswith("_"):
                    history.setdefault(key, {})[items["_step"]] = value
        elif record.WhichOneof("record_type") == "run":
            run_name = record.run.display_name
    return results, run_id, history, run_name


def test_wandb_offline_run_through_the_runner_records_results(tmp_path, monkeypatch):
    results, run_id, history, run_name = _wandb_run(tmp_path, monkeypatch, epochs=None, steps=6, evaluate_interval=0)
    (row,) = results.values()
    assert run_name == run_id
    # step logs every 2 batches and at the end of the 5-batch pass, at the global step
    assert sorted(history["train_step/loss"]) == [2, 4, 5]
    assert history["train/loss"] == {6: pytest.approx(row["train"]["loss"])}
    assert history["val/loss"] == {6: pytest.approx(row["val"]["loss"])}


def test_wandb_offline_run_records_epoch_rows(tmp_path, monkeypatch):
    results, _, history, _ = _wandb_run(tmp_path, monkeypatch, epochs=2)
    assert history["train_step/loss"]  # the step logs arrive
    recorded = sorted(history.get("val/loss", {}).values())
    assert recorded == pytest.approx(sorted(row["val"]["loss"] for row in results.values()))


def test_close_with_timeout_reports_a_stalled_save_which_still_completes(tmp_path):
    release = threading.Event()

    class StalledWriter(HashingWriter):
        def write(self, data):
            release.wait()
            return super().write(data)

    class StalledManager(FileCheckpointManager):
        def _payload_stream(self, raw):
            return StalledWriter(raw)

    with TinyRunner(tiny_config(tmp_path / "run")) as runner:
        manager = StalledManager(tmp_path / "checkpoints", async_save=True)
        runner.set_checkpoint_manager(manager)
        expected = model_state(runner)
        runner.save_checkpoint(force=True)
        try:
            with pytest.warns(RuntimeWarning, match="still running"):
                assert runner.close(timeout=0) is False  # the write is stuck: not drained
        finally:
            release.set()
    assert manager.wait()  # the abandoned write finished in the background
    payload = FileCheckpointManager(tmp_path / "checkpoints").load("latest")
    assert payload["model"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(payload["model"][key], value)


# ---------------------------------------------------------------------- evaluation runs in one inference context
class _ModeRecordingData(torch.utils.data.Dataset):
    """Records whether inference mode was on each time the loader fetched an item."""

    def __init__(self, data: torch.utils.data.Dataset) -> None:
        self.data, self.modes = data, []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        self.modes.append(torch.is_inference_mode_enabled())
        return self.data[index]


def test_evaluation_pass_runs_in_inference_mode_and_stops_outside_it(tmp_path):
    class StopInEval(TinyRunner):
        def __init__(self, config):
            super().__init__(config)
            self.datasets.val = _ModeRecordingData(self.datasets.val)

        def evaluate_step(self, data):
            if self.train_state.epoch == 1:
                self.supervisor.request_stop()
            return super().evaluate_step(data)

        def prepare_for_shutdown_checkpoint(self):
            self.stop_in_inference_mode = torch.is_inference_mode_enabled()
            super().prepare_for_shutdown_checkpoint()

    with pytest.raises(SystemExit), StopInEval(tiny_config(tmp_path)) as runner:
        runner.train()
    # the whole pass, loading included, ran under inference mode
    assert runner.datasets.val.modes and all(runner.datasets.val.modes)
    assert runner.stop_in_inference_mode is False  # the shutdown checkpoint was taken after leaving it
    assert _shutdown_payload(runner)["state"]["train"]["epoch"] == 1


def test_an_overridden_stop_check_is_asked_after_every_batch(tmp_path):
    class StopAfterThreeBatches(TinyRunner):
        asked = 0

        def _stop_requested(self):
            self.asked += 1
            return self.asked >= 4  # the first call is the loop's check before any batch

    with pytest.raises(SystemExit), StopAfterThreeBatches(tiny_config(tmp_path)) as runner:
        runner.train()
    assert runner.train_state.micro_step == 3 and runner.asked == 4
