"""True curves: step logs are window means, carry lr / grad norm / throughput / memory, and resumed runs
continue the same curves in TensorBoard, metrics.csv and an offline W&B run (all read back from disk)."""

from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from danling.runners.services.csv_tracker import read_metrics_csv
from tests.runners._torch_toy import TinyRunner, tiny_config
from tests.runners.services.test_trackers import read_wandb_records


class RecordingRunner(TinyRunner):
    """Records every step's loss by global step, counts 3 tokens a step, and can stop itself."""

    stop_at: int | None = None

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.step_losses: dict[int, float] = {}

    def train_step(self, data: Any) -> tuple[Any, Any]:
        pred, loss = super().train_step(data)
        self.step_losses[self.train_state.global_step] = loss.item()  # the test may synchronise
        self.throughput.count_tokens(torch.tensor(3))
        if self.stop_at is not None and self.train_state.global_step == self.stop_at:
            self.supervisor.request_stop()
        return pred, loss


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def config_texts(log_dir: Path) -> int:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    texts = accumulator.Tensors("config/text_summary")
    assert all(b"optim" in text.tensor_proto.string_val[0] for text in texts)
    return len(texts)


def csv_steps(path: Path) -> list[int]:
    with open(path, newline="") as file:
        return [int(float(row[0])) for row in list(csv.reader(file))[1:]]


def assert_forward(series: dict[str, list[tuple[int, float]]]) -> None:
    for tag, points in series.items():
        steps = [step for step, _ in points]
        assert steps == sorted(set(steps)), f"{tag} goes back or repeats a step: {steps}"


def test_step_log_is_the_mean_since_the_previous_log(tmp_path, caplog):
    config = tiny_config(tmp_path, log_interval=2, tensorboard=True, max_grad_norm=100.0)
    runner = RecordingRunner(config)
    with caplog.at_level(logging.INFO, logger="danling"):
        runner.train()
    runner.close()
    losses = runner.step_losses
    # 5 batches an epoch, logged after batches 2, 4 and 5; a window never spans two passes
    windows = {2: (1, 2), 4: (3, 4), 5: (5,), 7: (6, 7), 9: (8, 9), 10: (10,)}
    expected = [(step, sum(losses[s] for s in window) / len(window)) for step, window in windows.items()]
    series = read_metrics_csv(runner.workspace.path / "metrics.csv")
    board = scalars(runner.workspace.path / "tensorboard")
    for got in (series["train_step/loss"], board["train_step/loss"]):
        assert [step for step, _ in got] == [step for step, _ in expected]
        assert [value for _, value in got] == pytest.approx([value for _, value in expected], rel=1e-5)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("train [")]
    assert [float(line.rsplit("loss: ", 1)[1]) for line in lines] == pytest.approx(
        [value for _, value in expected], abs=1e-4
    )  # the terminal shows what the trackers get
    assert [step for step, _ in series["grad_norm"]] == list(windows) and all(v > 0 for _, v in series["grad_norm"])
    assert [step for step, _ in series["lr"]] == list(windows)
    assert all(value > 0 for _, value in series["memory/peak_rss_mib"])
    steps_per_second = dict(series["throughput/steps_per_second"])
    for step, tokens in series["throughput/tokens_per_second"]:
        assert tokens == pytest.approx(3 * steps_per_second[step], rel=1e-3)


def test_a_skipped_nan_step_makes_its_own_window_nan_and_no_later_one(tmp_path):
    # The window is a difference of running sums: once a NaN loss entered the sum, every later
    # step log of the pass read nan, though the NaN step was skipped and training went on.
    class NanOnThirdStep(RecordingRunner):
        def train_step(self, data: Any) -> tuple[Any, Any]:
            pred, loss = super().train_step(data)
            return pred, loss * float("nan") if self.train_state.global_step == 3 else loss

    runner = NanOnThirdStep(tiny_config(tmp_path, log_interval=1, skip_nonfinite_grad=True))
    runner.train()
    runner.close()
    series = dict(read_metrics_csv(runner.workspace.path / "metrics.csv")["train_step/loss"])
    assert math.isnan(series[3])
    later = [step for step in series if step > 3]
    assert later and all(series[step] == pytest.approx(runner.step_losses[step], rel=1e-5) for step in later)
    assert math.isnan(runner.results[0]["train"]["loss"])  # the pass's mean still holds the NaN


def test_learning_rate_of_each_group_is_logged(tmp_path):
    class Groups(RecordingRunner):
        def __post_init__(self) -> None:
            super().__post_init__()
            model = self.unwrap(self.model)
            weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
            biases = [p for n, p in model.named_parameters() if not n.endswith("weight")]
            self.optimizer.param_groups.clear()
            self.optimizer.add_param_group({"params": weights, "lr": 0.01})
            self.optimizer.add_param_group({"params": biases, "lr": 0.02, "name": "bias"})

    runner = Groups(tiny_config(tmp_path, log_interval=5, epochs=1))
    runner.train()
    runner.close()
    series = read_metrics_csv(runner.workspace.path / "metrics.csv")
    assert series["lr/group0"] == [(5, 0.01)] and series["lr/bias"] == [(5, 0.02)]


def test_resumed_run_continues_the_same_tensorboard_and_csv_curves(tmp_path):
    config = tiny_config(tmp_path, log_interval=2, tensorboard=True)
    first = RecordingRunner(config)
    first.train()
    first.evaluate()  # at the step the last epoch row already used: no second point
    first.close()
    run_dir = first.workspace.path
    checkpoint = run_dir / "checkpoints" / "epoch-000000"  # step 5: steps 6-10 are trained again
    second = RecordingRunner({**config, "resume": str(checkpoint)})
    assert second.workspace.path == run_dir and second.train_state.global_step == 5
    second.train()
    second.close()
    board = scalars(run_dir / "tensorboard")
    assert_forward(board)
    assert config_texts(run_dir / "tensorboard") == 1  # written by the first run only
    assert [step for step, _ in board["train_step/loss"]] == [2, 4, 5, 7, 9, 10]
    assert [step for step, _ in board["val/loss"]] == [5, 10]
    resumed = dict(board["train_step/loss"])
    losses = second.step_losses
    assert resumed[7] == pytest.approx((losses[6] + losses[7]) / 2, rel=1e-5)  # the resumed run's steps
    steps = csv_steps(run_dir / "metrics.csv")
    assert steps == sorted(set(steps)) == [2, 4, 5, 7, 9, 10]
    series = read_metrics_csv(run_dir / "metrics.csv")
    assert [v for _, v in series["train_step/loss"]] == pytest.approx(
        [v for _, v in board["train_step/loss"]], rel=1e-6
    )


def test_a_pass_resumed_mid_way_logs_its_last_step_and_counts_its_batches_from_the_start(tmp_path, caplog):
    reference = RecordingRunner(tiny_config(tmp_path / "reference", log_interval=2))
    reference.train()
    reference.close()
    config = tiny_config(tmp_path / "resumed", log_interval=2, auto_resume=True)
    first = RecordingRunner(config)
    first.stop_at = 7  # batch 2 of the second pass (steps 6-10)
    with pytest.raises(SystemExit):
        first.train()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="danling"):
        second = RecordingRunner(config)
        second.train()
        second.close()
    expected = read_metrics_csv(reference.workspace.path / "metrics.csv")["train_step/loss"]
    got = read_metrics_csv(second.workspace.path / "metrics.csv")["train_step/loss"]
    assert [step for step, _ in got] == [step for step, _ in expected] == [2, 4, 5, 7, 9, 10]  # 10 was missing
    assert [value for _, value in got] == pytest.approx([value for _, value in expected], rel=1e-5)
    lines = [r.getMessage().split("\t")[0] for r in caplog.records if r.getMessage().startswith("train [")]
    assert lines == ["train [4/5]", "train [5/5]"]  # batches of the pass, not of the resumed part of it


def test_a_scoring_job_on_a_resumed_checkpoint_records_its_split_and_keeps_the_history(tmp_path):
    from tests.runners._torch_toy import make_data

    class WithTest(RecordingRunner):
        def __init__(self, config):
            super().__init__(config)
            self.datasets.test = make_data(8, seed=5)

    config = tiny_config(tmp_path, tensorboard=True, evaluate_splits=["val"])
    with WithTest(config) as first:
        first.train()
    run_dir = first.workspace.path
    history = read_metrics_csv(run_dir / "metrics.csv")
    for checkpoint, step in (("latest", 10), ("epoch-000000", 5)):  # the final weights, an earlier (best) one
        with WithTest({**config, "resume": str(run_dir / "checkpoints" / checkpoint)}) as evaluation:
            assert evaluation.train_state.global_step == step
            test_loss = evaluation.evaluate(["test"])["test"]["loss"]  # a scoring job
            evaluation.evaluate(["val"])  # logged by the training run at this step already: no second point
        series = read_metrics_csv(run_dir / "metrics.csv")
        assert (step, pytest.approx(test_loss)) in series.pop("test/loss")  # was left out of every tracker
        assert series == history  # the training history stays whole: nothing after `step` is dropped
        board = scalars(run_dir / "tensorboard")
        assert (step, pytest.approx(test_loss)) in board["test/loss"]
        assert [s for s, _ in board["val/loss"]] == [5, 10] and [s for s, _ in board["train_step/loss"]][-1] == 10


def test_evaluation_of_a_runner_built_from_another_runs_checkpoint_is_recorded(tmp_path):
    first = TinyRunner(tiny_config(tmp_path))
    first.train()
    first.close()
    source = first.workspace.path / "checkpoints" / "latest"
    runner = TinyRunner.from_checkpoint(source)  # a new version of the run directory, with no curves yet
    assert runner.workspace.path != first.workspace.path and runner.train_state.global_step == 10
    result = runner.evaluate(["val"])
    runner.close()
    # nothing of the source run is in this directory: its evaluation at the checkpoint's step is new
    series = read_metrics_csv(runner.workspace.path / "metrics.csv")
    assert series["val/loss"] == [(10, pytest.approx(result["val"]["loss"], rel=1e-6))]


def wandb_history(run_file: Path) -> tuple[str, list[dict[str, Any]]]:
    from wandb.proto import wandb_internal_pb2

    run_id, rows = "", []
    for raw in read_wandb_records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
        elif kind == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return run_id, rows


def test_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = tiny_config(tmp_path, log_interval=2, auto_resume=True, **{"wandb.enabled": True, "wandb.mode": "offline"})
    first = RecordingRunner(config)
    first.stop_at = 6  # stops after step 6 with a shutdown checkpoint there
    with pytest.raises(SystemExit):
        first.train()
    second = RecordingRunner(config)
    assert second.train_state.global_step == 6
    second.train()
    second.close()
    files = sorted((first.workspace.path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2
    (first_id, first_rows), (second_id, second_rows) = map(wandb_history, files)
    assert first_id == second_id == (first.workspace.path / "wandb-run-id").read_text().strip()
    steps = [row["_step"] for row in first_rows + second_rows]
    assert steps == sorted(set(steps)), steps
    logged = {row["_step"]: row["train_step/loss"] for row in second_rows if "train_step/loss" in row}
    losses = second.step_losses
    # the resumed pass counts its log interval from where it resumed (after step 6)
    assert logged[8] == pytest.approx((losses[7] + losses[8]) / 2, rel=1e-5)
    assert logged[10] == pytest.approx((losses[9] + losses[10]) / 2, rel=1e-5)


def test_fan_out_drops_repeated_and_pre_resume_points_and_csv_drops_later_rows(tmp_path):
    from danling.runners.services.csv_tracker import CSVTracker
    from danling.runners.services.trackers import Trackers

    path = tmp_path / "metrics.csv"
    with Trackers([CSVTracker(path)]) as trackers:
        for step in (1, 2, 3):
            trackers.log({"train": {"loss": float(step)}}, step)
        trackers.log({"train": {"loss": 9.0}, "val": {"loss": 0.5}}, 3)  # train/loss at 3 again: dropped
    assert read_metrics_csv(path) == {"train/loss": [(1, 1.0), (2, 2.0), (3, 3.0)], "val/loss": [(3, 0.5)]}
    with Trackers([CSVTracker(path)]) as trackers:
        trackers.resume_at(1)  # the checkpoint was taken at step 1
        trackers.log({"train": {"loss": 7.0}}, 1)  # already on disk: dropped
        trackers.log({"train": {"loss": 4.0}}, 2)
    assert csv_steps(path) == [1, 2]
    assert read_metrics_csv(path) == {"train/loss": [(1, 1.0), (2, 4.0)]}


def _window_worker(rank: int, world_size: int) -> list[float]:
    from danling.metrics import AverageMeters
    from danling.runners.services.step_window import StepWindow

    meters, window, reads = AverageMeters(), StepWindow(), []
    for step in range(1, 7):
        meters.update(loss=torch.tensor(float(step * (rank + 1))))  # rank 1 sees twice rank 0's values
        if step % 3 == 0:
            reads.append(window.read(meters)["loss"])
    return reads


@pytest.mark.distributed
def test_window_mean_is_combined_over_ranks():
    from tests.dist import run_distributed

    # steps 1-3 then 4-6, over both ranks: mean of (1+2+3)*(1+2)/6 = 3.0, then (4+5+6)*3/6 = 7.5
    assert run_distributed(_window_worker, world_size=2) == [[3.0, 7.5], [3.0, 7.5]]


def test_resumed_run_continues_the_same_mlflow_run(tmp_path):
    # Each resume used to open a new MLflow run: the curves of one training run came in pieces.
    from danling.runners.services.mlflow_tracker import MLflowTracker
    from tests.runners.services.test_trackers import read_mlflow

    config = tiny_config(tmp_path, log_interval=2, auto_resume=True, **{"mlflow.enabled": True})
    first = RecordingRunner(config)
    first.stop_at = 6
    with pytest.raises(SystemExit):
        first.train()
    second = RecordingRunner({**config, "epochs": 3})  # the same run directory: epochs stay out of its id
    assert second.train_state.global_step == 6
    second.train()
    second.close()
    trackers = [tracker for runner in (first, second) for tracker in runner.trackers]
    (run_id,) = {tracker.run_id for tracker in trackers if isinstance(tracker, MLflowTracker)}
    assert (first.workspace.path / "mlflow-run-id").read_text().strip() == run_id
    (tracker,) = [tracker for tracker in second.trackers if isinstance(tracker, MLflowTracker)]
    history, params, status = read_mlflow(tracker.tracking_uri, run_id)
    steps = [step for step, _ in history["train_step/loss"]]
    assert steps == sorted(set(steps)) and steps[0] == 2 and steps[-1] == 15  # both runs, one curve
    assert params["epochs"] == "2" and status == "FINISHED"  # a parameter keeps its first value
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(tracking_uri=tracker.tracking_uri).get_run(run_id).data.tags
    assert tags["danling.resumed.epochs"] == "3"
