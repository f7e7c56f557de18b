"""A save that fails on a full disk raises one clear error, and the previous checkpoint survives."""

from __future__ import annotations

import errno
import threading

import pytest
import torch

from danling.checkpoint import FileCheckpointManager
from danling.checkpoint.failures import CheckpointSaveError
from danling.checkpoint.manifest import HashingWriter


class _FullDisk:
    """A raw file whose writes fail with ENOSPC once `limit` bytes went through (a patched write call)."""

    def __init__(self, raw, limit: int) -> None:
        self.raw, self.limit, self.written = raw, limit, 0

    def __getattr__(self, name):
        return getattr(self.raw, name)

    def write(self, data) -> int:
        if self.written + len(memoryview(data).cast("B")) > self.limit:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.written += self.raw.write(data)
        return len(memoryview(data).cast("B"))


def _fill_disk_after(monkeypatch, limit: int) -> None:
    def stream(self, raw):
        return HashingWriter(_FullDisk(raw, limit))

    monkeypatch.setattr(FileCheckpointManager, "_payload_stream", stream)


def _state(value: float) -> dict:
    return {"weight": torch.full((4096,), value), "step": int(value)}


@pytest.mark.parametrize("async_save", [False, True])
def test_full_disk_names_path_bytes_and_keeps_previous_checkpoint(tmp_path, monkeypatch, async_save):
    manager = FileCheckpointManager(tmp_path, async_save=async_save)
    manager.save(_state(1.0), "step-000001")
    manager.wait()
    _fill_disk_after(monkeypatch, limit=1024)
    with pytest.raises(CheckpointSaveError) as info:
        manager.save(_state(2.0), "step-000002")
        manager.maybe_wait_for_staging() if not async_save else manager.wait()  # async: raised by the next call
    error = info.value
    message = str(error)
    assert "step-000002" in message and str(tmp_path) in message
    assert "No space left on device" in message and "free" in message and "needs about 16.0 KiB" in message
    assert "step-000001 is untouched" in message and "unexpected pos" not in message
    assert error.errno == errno.ENOSPC and isinstance(error, OSError)
    assert error.needed >= 4096 * 4 and error.free is not None
    manager.close()
    monkeypatch.undo()
    reader = FileCheckpointManager(tmp_path)
    assert reader.latest.name == "step-000001" and reader.load("latest")["step"] == 1
    assert not [entry for entry in tmp_path.iterdir() if entry.name.startswith(".tmp-")]  # no staging left


def test_async_failure_surfaces_before_the_next_optimizer_step(tmp_path, monkeypatch):
    manager = FileCheckpointManager(tmp_path, async_save=True)
    _fill_disk_after(monkeypatch, limit=1024)
    manager.save(_state(2.0), "step-000002")
    manager._pending.exception()  # let the background write finish (and fail) first
    with pytest.raises(CheckpointSaveError, match="step-000002"):
        manager.maybe_wait_for_staging()  # what a runner calls before every optimizer step
    manager.maybe_wait_for_staging()  # raised once
    manager.close()


def test_other_save_errors_propagate_unchanged(tmp_path):
    manager = FileCheckpointManager(tmp_path)
    with pytest.raises(Exception) as info:
        manager.save({"fn": lambda: 1}, "step-000001")  # cannot be pickled: not a disk problem
    assert not isinstance(info.value, CheckpointSaveError)


def _local_function():
    return lambda: 1


@pytest.mark.parametrize(
    ("value", "async_save"),
    [(_local_function(), False), (_local_function(), True), (threading.Lock(), False)],
    ids=["local function", "local function, async", "lock"],
)
def test_an_entry_that_cannot_be_pickled_is_named(tmp_path, value, async_save):
    # pickle's own message names no entry, and from Python 3.13 a local function's does not say
    # "pickle" either ("Can't get local object ...")
    manager = FileCheckpointManager(tmp_path, async_save=async_save)
    expected = r"checkpoint step-000001 failed: its entry 'extra' cannot be pickled \((TypeError|AttributeError): "
    with pytest.raises(TypeError, match=expected):
        manager.save({"weight": torch.ones(4), "extra": {"hook": value}}, "step-000001")
        manager.wait()
    assert manager.checkpoints() == [] and not list(tmp_path.iterdir())
    manager.save(_state(1.0), "step-000002")  # the manager saves again once the state is fixed
    manager.close()
    assert [checkpoint.name for checkpoint in manager.checkpoints()] == ["step-000002"]


def _fail_saves(monkeypatch, failing: set[int]) -> None:
    """The disk is full during the payload writes numbered in `failing` (0-based), fine otherwise."""
    count = iter(range(1000))

    def stream(self, raw):
        return HashingWriter(_FullDisk(raw, 0 if next(count) in failing else 1 << 40))

    monkeypatch.setattr(FileCheckpointManager, "_payload_stream", stream)


def test_runner_stops_at_a_failed_save_by_default(tmp_path, monkeypatch):
    from tests.runners._toy import ToyRunner, toy_config

    _fail_saves(monkeypatch, {1})
    runner = ToyRunner(toy_config(tmp_path, epochs=3))
    with pytest.raises(CheckpointSaveError, match=r"epoch-000001.*epoch-000000 is untouched"):
        runner.train()
    runner.close()
    assert runner.train_state.epoch == 2  # stopped right after the epoch whose save failed
    assert FileCheckpointManager(runner.checkpoint_manager.directory).load("latest")["state"]["train"]["epoch"] == 1


def test_runner_continues_and_retries_when_configured(tmp_path, monkeypatch, caplog):
    from tests.runners._toy import ToyRunner, toy_config

    _fail_saves(monkeypatch, {1})
    with ToyRunner(toy_config(tmp_path, epochs=3, **{"checkpoint.continue_on_save_error": True})) as runner:
        runner.train()
        names = [path.name for path in runner.checkpoint_manager.checkpoints()]
    assert runner.train_state.epoch == 3
    assert names == ["epoch-000002", "epoch-000000"]  # the failed one is missing, the next save worked
    assert any("epoch-000001" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)


def test_runner_with_async_saves_stops_on_the_failed_save(tmp_path, monkeypatch):
    from tests.runners._toy import ToyRunner, toy_config

    _fail_saves(monkeypatch, {1})
    runner = ToyRunner(toy_config(tmp_path, epochs=4, **{"checkpoint.async_enabled": True}))
    with pytest.raises(CheckpointSaveError, match=r"epoch-000001.*epoch-000000 is untouched"):
        runner.train()  # raised before the next optimizer step, or at the next save, whichever comes first
    runner.close()  # raised once: closing afterwards is clean
    assert runner.train_state.epoch <= 3
    assert FileCheckpointManager(runner.checkpoint_manager.directory).load("latest")["state"]["train"]["epoch"] == 1


def _status(runner) -> dict:
    import json

    return json.loads((runner.workspace.path / "status.json").read_text())


@pytest.mark.parametrize("async_save", [False, True])
def test_a_run_whose_last_save_failed_fails_even_when_continuing(tmp_path, monkeypatch, caplog, async_save):
    from tests.runners._toy import ToyRunner, toy_config

    _fail_saves(monkeypatch, {1, 2})  # epoch-000000 lands; the two saves after it find the disk full
    config = toy_config(tmp_path, epochs=3, **{"checkpoint.continue_on_save_error": True})
    config["checkpoint.async_enabled"] = async_save
    runner = ToyRunner(config)
    with pytest.raises(CheckpointSaveError, match=r"ended without its last checkpoint.*epoch-000002"):
        runner.train()
    runner.close()
    assert runner.train_state.epoch == 3
    status = _status(runner)
    assert status["status"] == "failed" and "epoch-000002" in status["error"]
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("epoch-000001" in message for message in errors)  # the skipped save is an ERROR line
    assert FileCheckpointManager(runner.checkpoint_manager.directory).latest.name == "epoch-000000"


def test_a_background_failure_found_by_the_next_save_does_not_skip_it(tmp_path, monkeypatch, caplog):
    from tests.runners._toy import ToyRunner, toy_config

    _fail_saves(monkeypatch, {0})
    config = toy_config(tmp_path, **{"checkpoint.continue_on_save_error": True, "checkpoint.async_enabled": True})
    with ToyRunner(config) as runner:
        runner.save_checkpoint(force=True)  # fails in the background
        runner.save_checkpoint(name="second", force=True)  # finds that failure first, then still saves
        runner.checkpoint_manager.wait()
        assert runner.checkpoint_manager.alias("second") is not None
    failures = [r for r in caplog.records if r.getMessage().startswith("saving checkpoint step-000000")]
    assert [r.levelname for r in failures] == ["ERROR"]
