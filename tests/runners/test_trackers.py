"""Trackers: results reach real TensorBoard event files and a real offline W&B run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from danling.runners.services.trackers import TensorBoardTracker, Tracker, Trackers, WandbTracker, flatten_result

RESULTS = [
    (1, {"train": {"loss": torch.tensor(0.75), "lr": 0.1}}),
    (2, {"train": {"loss": torch.tensor(0.5), "lr": 0.1}, "val": {"acc": np.float32(0.625)}}),
    (4, {"train": {"loss": 0.25, "lr": 0.05}, "val": {"acc": 0.875}, "epoch": 1}),
]


def expected_series() -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for step, result in RESULTS:
        for tag, value in flatten_result(result).items():
            series.setdefault(tag, []).append((step, value))
    return series


def assert_series(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for tag, points in expected.items():
        assert [step for step, _ in got[tag]] == [step for step, _ in points], tag
        assert [value for _, value in got[tag]] == pytest.approx([value for _, value in points]), tag


def test_flatten_result_keeps_only_real_scalars():
    result = {
        "train": {"loss": torch.tensor([0.5]), "hist": torch.arange(3), "ok": True},
        "val": {"acc": np.float64(0.25), "nested": {"f1": np.array(0.5)}, "name": "x", "none": None},
        3: 2,
    }
    assert flatten_result(result) == {
        "train/loss": 0.5,
        "train/ok": 1.0,
        "val/acc": 0.25,
        "val/nested/f1": 0.5,
        "3": 2.0,
    }
    with pytest.raises(TypeError, match="list"):
        flatten_result([1, 2])


def test_tensorboard_event_files_hold_every_result(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with TensorBoardTracker(tmp_path / "tb") as tracker:
        for step, result in RESULTS:
            tracker.log(result, step)
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    got = {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }
    assert_series(got, expected_series())


def read_wandb_records(path: Path) -> list[bytes]:
    """Split a W&B `.wandb` file (LevelDB log format, 32 KiB blocks) into protobuf records."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks, records = 7, 32768, [], []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunks.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            records.append(b"".join(chunks))
            chunks = []
    return records


def test_wandb_offline_run_records_every_result(tmp_path, monkeypatch):
    from wandb.proto import wandb_internal_pb2

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = WandbTracker(project="danling-test", name="offline", dir=tmp_path, config={"lr": 0.1})
    try:
        for step, result in RESULTS:
            tracker.log(result, step)
    finally:
        tracker.close()
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    history: dict[str, list[tuple[int, float]]] = {}
    config = {}
    for raw in read_wandb_records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for key, value in items.items():
                if not key.startswith("_"):
                    history.setdefault(key, []).append((items["_step"], value))
        elif record.WhichOneof("record_type") in ("run", "config"):
            updates = record.run.config.update if record.HasField("run") else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
    assert_series(history, expected_series())
    assert config["lr"] == 0.1


def test_fan_out_and_close_errors(tmp_path):
    class Recorder(Tracker):
        def __init__(self):
            self.seen, self.closed = [], False

        def log(self, result, step):
            self.seen.append((step, result))

        def close(self):
            self.closed = True

    class Broken(Tracker):
        def close(self):
            raise OSError("disk gone")

    first, second = Recorder(), Recorder()
    trackers = Trackers([first, Broken(), second])
    trackers.log({"val": {"acc": torch.tensor(0.5)}}, 7)
    assert first.seen == second.seen == [(7, {"val/acc": 0.5})]
    with pytest.raises(OSError, match="disk gone"):
        trackers.close()
    assert first.closed and second.closed
    with pytest.raises(TypeError, match="object"):
        Trackers([object()])
    Trackers().log({"a": 1}, 0)  # empty fan-out is a no-op


def test_missing_optional_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"danling\[wandb\]"):
        WandbTracker(mode="offline")
