"""Trackers: results reach real TensorBoard event files and a real offline W&B run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from danling.runners.services.csv_tracker import CSVTracker, read_metrics_csv
from danling.runners.services.mlflow_tracker import MLflowTracker
from danling.runners.services.trackers import TensorBoardTracker, Tracker, Trackers, WandbTracker, flatten_result
from tests.runners._torch_toy import TinyRunner, tiny_config

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


def test_tensorboard_config_text_is_strict_json(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = {"max_grad_norm": float("inf"), "optim": {"lr": 0.1, "eps": float("nan")}}
    with TensorBoardTracker(tmp_path / "tb", config=config) as tracker:
        tracker.log({"train": {"loss": 0.5}}, step=1)
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    (event,) = accumulator.Tensors("config/text_summary")
    text = event.tensor_proto.string_val[0].decode()

    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    shown = json.loads(text, parse_constant=refuse)  # the code block's indent is JSON whitespace
    assert shown == {"max_grad_norm": None, "optim": {"eps": None, "lr": 0.1}}


def test_tensorboard_is_imported_at_the_first_write_not_when_the_tracker_is_built(tmp_path):
    code = (
        "import sys; from danling.runners.services.trackers import TensorBoardTracker\n"
        f"tracker = TensorBoardTracker({str(tmp_path / 'tb')!r}, config={{'lr': 0.1}})\n"
        "print('tensorboard' in sys.modules, 'torch.utils.tensorboard' in sys.modules)\n"
        "tracker.log({'train': {'loss': 0.5}}, step=1); tracker.close()\n"
        "print('torch.utils.tensorboard' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "True"]
    assert any("tfevents" in name for name in os.listdir(tmp_path / "tb"))


def test_a_tensorboard_tracker_without_tensorboard_names_the_extra_when_built(tmp_path, monkeypatch):
    from danling.runners.services import trackers

    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(
        trackers.importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a)
    )
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # and importing it fails, as it would
    with pytest.raises(ImportError, match=r"pip install danling\[tensorboard\]"):
        TensorBoardTracker(tmp_path / "tb")


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


# ------------------------------------------------------------------------------------ CSV


def test_csv_file_holds_every_result_and_grows_its_header(tmp_path):
    path = tmp_path / "run" / "metrics.csv"
    with CSVTracker(path) as tracker:
        for step, result in RESULTS:
            tracker.log(result, step)
    lines = path.read_text().splitlines()
    # `val/acc` first appears at step 2: the rows written before it were rewritten under the wider header
    assert lines[0] == "step,train/loss,train/lr,val/acc,epoch"
    assert lines[1] == "1,0.75,0.1,,"
    assert_series(read_metrics_csv(path), expected_series())


def test_csv_merges_a_step_and_continues_an_existing_file(tmp_path):
    path = tmp_path / "metrics.csv"
    tracker = CSVTracker(path, flush_seconds=0)
    tracker.log({"train_step": {"loss": 1.0}}, 5)
    tracker.log({"train": {"loss": 0.9}, "val": {"loss": 1.5}}, 5)  # the epoch row at the same step
    tracker.log({"train_step": {"loss": 0.8}}, 6)
    assert path.read_text().splitlines() == ["step,train_step/loss,train/loss,val/loss", "5,1,0.9,1.5"]
    tracker.close()
    resumed = CSVTracker(path)  # a resumed run appends under the same columns
    resumed.log({"val": {"loss": 1.25}, "lr": 0.5}, 6)
    resumed.close()
    assert read_metrics_csv(path) == {
        "train_step/loss": [(5, 1.0), (6, 0.8)],
        "train/loss": [(5, 0.9)],
        "val/loss": [(5, 1.5), (6, 1.25)],
        "lr": [(6, 0.5)],
    }
    with pytest.raises(ValueError, match="flush_seconds"):
        CSVTracker(path, flush_seconds=-1)


def val_loss(runner, epoch: int):
    return pytest.approx(runner.results[epoch]["val"]["loss"])


def test_csv_keeps_the_last_row_when_nobody_closes_the_tracker(tmp_path):
    # Scripts often end without runner.close(): the pending row is written when Python exits.
    path = tmp_path / "metrics.csv"
    code = (
        "import sys; from danling.runners.services.csv_tracker import CSVTracker; "
        "tracker = CSVTracker(sys.argv[1]); tracker.log({'loss': 1.0}, 1); tracker.log({'loss': 0.5}, 2)"
    )
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, env=env, timeout=120)
    assert read_metrics_csv(path) == {"loss": [(1, 1.0), (2, 0.5)]}


def test_a_run_writes_metrics_csv_with_learning_rate_and_throughput(tmp_path):
    runner = TinyRunner(tiny_config(tmp_path, log_interval=2))
    runner.train()
    runner.close()
    series = read_metrics_csv(runner.workspace.path / "metrics.csv")
    # step logs every 2 batches plus the last of each 5-batch epoch, and the epoch rows at steps 5 and 10
    assert [step for step, _ in series["train_step/loss"]] == [2, 4, 5, 7, 9, 10]
    assert series["lr"] == [(step, 0.01) for step in (2, 4, 5, 7, 9, 10)]
    rates = dict(series["throughput/steps_per_second"])
    samples = dict(series["throughput/samples_per_second"])
    assert set(rates) == {2, 4, 5, 7, 9, 10} and all(rate > 0 for rate in rates.values())
    assert all(samples[step] == pytest.approx(4 * rates[step]) for step in rates)  # batch size 4
    assert series["val/loss"] == [(5, val_loss(runner, 0)), (10, val_loss(runner, 1))]
    assert series["epoch"] == [(5, 0.0), (10, 1.0)]
    status = json.loads((runner.workspace.path / "status.json").read_text())
    assert status["status"] == "finished" and status["global_step"] == 10
    off = TinyRunner(tiny_config(tmp_path / "off", **{"csv.enabled": False}))
    assert not any(isinstance(tracker, CSVTracker) for tracker in off.trackers)
    off.close()


# ------------------------------------------------------------------------------------ MLflow


def read_mlflow(uri: str, run_id: str) -> tuple[dict, dict, str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    history = {
        key: [(metric.step, metric.value) for metric in client.get_metric_history(run_id, key)]
        for key in run.data.metrics
    }
    return history, run.data.params, run.info.status


def test_mlflow_local_store_records_every_result(tmp_path):
    tracker = MLflowTracker(tmp_path, experiment="danling-test", run_name="r", params={"optim": {"lr": 0.1}})
    with tracker:
        for step, result in RESULTS:
            tracker.log(result, step)
    history, params, status = read_mlflow(tracker.tracking_uri, tracker.run_id)
    assert tracker.tracking_uri == (tmp_path / "mlruns").resolve().as_uri()
    assert_series(history, expected_series())
    assert params == {"optim.lr": "0.1"} and status == "FINISHED"
    with pytest.raises(ValueError, match="tracking_uri"):
        MLflowTracker()


def test_a_run_with_mlflow_enabled_records_config_and_results(tmp_path):
    runner = TinyRunner(tiny_config(tmp_path, **{"mlflow.enabled": True}))
    runner.train()
    runner.close()
    (tracker,) = [tracker for tracker in runner.trackers if isinstance(tracker, MLflowTracker)]
    history, params, _ = read_mlflow(tracker.tracking_uri, tracker.run_id)
    assert tracker.tracking_uri.endswith(f"{runner.id}/mlruns")
    assert params["optim.lr"] == "0.01" and params["epochs"] == "2"
    assert history["val/loss"] == [(5, val_loss(runner, 0)), (10, val_loss(runner, 1))]
    assert [step for step, _ in history["train_step/loss"]] == list(range(1, 11))


def test_missing_mlflow_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    with pytest.raises(ImportError, match=r"danling\[mlflow\]"):
        MLflowTracker(tmp_path)


# ------------------------------------------------------------------------------------ registry


class Recording(Tracker):
    def __init__(self, run_dir):
        self.run_dir, self.logged, self.closed = run_dir, [], False

    def log(self, result, step):
        self.logged.append((step, dict(result)))

    def close(self):
        self.closed = True


def test_a_registered_tracker_is_built_by_name_and_a_runner_takes_appended_ones(tmp_path):
    from danling.runners.services import TRACKERS, register_tracker

    assert list(TRACKERS)[:4] == ["tensorboard", "wandb", "csv", "mlflow"]  # the order a runner builds them
    with pytest.raises(TypeError, match="register_tracker"):
        register_tracker("broken", None)
    register_tracker(
        "recording", lambda setup: Recording(setup.workspace.dir), enabled=lambda c: c.experiment == "registry"
    )
    try:
        runner = TinyRunner(tiny_config(tmp_path, experiment="registry", epochs=1))
        other = TinyRunner(tiny_config(tmp_path / "other", epochs=1))
    finally:
        del TRACKERS["recording"]
    built = [tracker for tracker in runner.trackers if isinstance(tracker, Recording)]
    assert len(built) == 1 and built[0].run_dir == runner.workspace.dir
    assert not any(isinstance(tracker, Recording) for tracker in other.trackers)
    appended = Recording(None)
    runner.trackers.append(appended)
    runner.train()
    runner.close()
    other.close()
    for tracker in (built[0], appended):
        assert tracker.closed and any("val/loss" in values for _, values in tracker.logged)


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


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def test_the_guide_s_json_lines_tracker_writes_non_finite_values_as_null(tmp_path):
    import re

    from danling.runners.services.tracking import TRACKERS

    guide = (Path(__file__).resolve().parents[3] / "docs" / "cli.md").read_text()
    (snippet,) = [block for block in re.findall(r"```python\n(.*?)```", guide, flags=re.DOTALL) if "JSONLines" in block]
    namespace: dict = {}
    try:
        exec(compile(snippet, "cli.md[JSONLinesTracker]", "exec"), namespace)
    finally:
        TRACKERS.pop("jsonl", None)  # the snippet registers it for every runner built afterwards
    tracker = namespace["JSONLinesTracker"](tmp_path / "metrics.jsonl")
    tracker.log({"val/loss": float("nan"), "val/ratio": float("inf"), "val/acc": 0.5}, 3)
    tracker.log({"train/loss": float("-inf")}, 4)
    tracker.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=_refuse_constant) for line in lines]  # NaN would raise
    assert records == [
        {"step": 3, "val/loss": None, "val/ratio": None, "val/acc": 0.5},
        {"step": 4, "train/loss": None},
    ]
