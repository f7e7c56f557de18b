"""Step mode evaluates every `evaluate_interval` steps over whole splits, with one row per evaluation."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from danling.checkpoint import read_checkpoint
from tests.runners._torch_toy import TinyRunner, model_state, tiny_config
from tests.runners._toy import ToyRunner, toy_config

LONG_VAL = [float(value) for value in range(10)]  # a 10-batch validation split


class CountingRunner(ToyRunner):
    def __init__(self, config):
        super().__init__(config)
        self.dataloaders["val"] = list(LONG_VAL)
        self.evaluated: list[int] = []  # global step of every evaluation batch

    def evaluate_step(self, data):
        self.evaluated.append(self.train_state.global_step)
        return super().evaluate_step(data)


def test_default_interval_evaluates_whole_split_a_tenth_of_the_budget_apart(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="danling"):
        runner = CountingRunner(toy_config(tmp_path, epochs=None, steps=40))
        try:
            runner.train()
            runner.bookkeeping.flush()
            rows = json.loads((runner.workspace.path / "results.json").read_text())["results"]
        finally:
            runner.close()
    steps = list(range(4, 41, 4))
    assert list(runner.results) == steps and [int(index) for index in rows] == steps
    assert all(set(runner.results[step]) == {"train", "val"} for step in steps)
    # every evaluation reads all 10 validation batches (not steps // 20 = 2 of them)
    assert runner.evaluated == [step for step in steps for _ in LONG_VAL]
    assert any("every 4 steps (steps // 10)" in record.getMessage() for record in caplog.records)
    # the default checkpoint cadence matches, so `best` names an evaluated checkpoint
    assert runner.checkpoint_manager.best.name == f"step-{runner.best_index:06d}"


def test_configured_interval_and_batch_limit_with_a_final_evaluation(tmp_path):
    config = toy_config(tmp_path, epochs=None, steps=7, evaluate_interval=3, evaluate_batches=2)
    with CountingRunner(config) as runner:
        runner.train()
        assert list(runner.results) == [3, 6, 7]  # every 3 steps, plus the final one
        assert runner.evaluated == [3, 3, 6, 6, 7, 7]
        # each row's training values cover the batches since the previous row (losses are per batch)
        assert all(runner.results[step]["train"]["loss"] > 0 for step in (3, 6, 7))


def test_evaluating_inside_a_pass_leaves_training_unchanged(tmp_path):
    # The toy's updates draw from Python's global `random`: each run is seeded when it is built.
    with ToyRunner(toy_config(tmp_path / "a", epochs=None, steps=12, evaluate_interval=0)) as reference:
        reference.train()
    with ToyRunner(toy_config(tmp_path / "b", epochs=None, steps=12, evaluate_interval=1)) as evaluated:
        evaluated.train()
    assert list(reference.results) == [12] and list(evaluated.results) == list(range(1, 13))
    assert evaluated.model.weight == reference.model.weight
    assert evaluated.results[12]["val"] == reference.results[12]["val"]


class ModeCheckingRunner(TinyRunner):
    def train_step(self, data):
        assert self.model.training and torch.is_grad_enabled(), "training resumed in evaluation mode"
        return super().train_step(data)


def test_torch_runner_returns_to_training_mode_after_an_evaluation(tmp_path):
    # Dropout draws from the torch generator, and so does every evaluation loader's iterator: the
    # generators are put back after each evaluation, so the weights match a run without them.
    with TinyRunner(tiny_config(tmp_path / "a", epochs=None, steps=10, evaluate_interval=0)) as plain:
        plain.train()
        expected = model_state(plain)
    with ModeCheckingRunner(tiny_config(tmp_path / "b", epochs=None, steps=10, evaluate_interval=2)) as periodic:
        periodic.train()
        assert list(periodic.results) == [2, 4, 6, 8, 10]
        for name, value in model_state(periodic).items():
            torch.testing.assert_close(value, expected[name])


class StopAtStep6(TinyRunner):
    def train_step(self, data):
        out = super().train_step(data)
        if self.train_state.global_step == 6 and not self.config.auto_resume:
            self.supervisor.request_stop()
        return out


def test_a_run_stopped_between_evaluations_resumes_to_the_same_weights_and_rows(tmp_path):
    overrides = {"epochs": None, "steps": 12, "evaluate_interval": 4, "deterministic": True}
    with TinyRunner(tiny_config(tmp_path / "clean", **overrides)) as clean:
        clean.train()
        expected = model_state(clean)
    config = tiny_config(tmp_path / "run", **overrides)
    with pytest.raises(SystemExit), StopAtStep6(config) as stopped:
        stopped.train()
    assert list(stopped.results) == [4]
    with StopAtStep6({**config, "auto_resume": True}) as resumed:
        assert resumed.train_state.global_step == 6
        resumed.train()
        assert list(resumed.results) == [4, 8, 12] == list(clean.results)
        for name, value in model_state(resumed).items():
            torch.testing.assert_close(value, expected[name])
        for index in (4, 8, 12):
            assert resumed.results[index]["val"]["loss"] == pytest.approx(clean.results[index]["val"]["loss"])


def test_evaluate_batches_limits_epoch_mode_evaluations_too(tmp_path):
    with CountingRunner(toy_config(tmp_path, epochs=2, evaluate_batches=3)) as runner:
        runner.train()
        assert runner.evaluated == [5, 5, 5, 10, 10, 10]  # 3 of the 10 batches after each 5-step epoch


def test_a_metric_scheduler_steps_per_round_when_every_pass_ends_at_an_evaluation(tmp_path):
    # 5 batches per pass and an evaluation every 5 steps: each round's values are in the row
    scheduler = {"scheduler.type": "ReduceLROnPlateau", "scheduler.patience": 0}
    config = tiny_config(tmp_path, epochs=None, steps=15, evaluate_interval=5, **scheduler)
    with TinyRunner(config) as runner:
        runner.train()
        assert list(runner.results) == [5, 10, 15] and runner.train_state.epoch == 3


def test_a_checkpoint_written_on_the_last_batch_of_a_pass_resumes(tmp_path):
    # 20 samples at batch 4: a pass is 5 updates, so the step-5 checkpoint is written after the
    # pass's last batch but before its round ended; resuming it used to raise "a full round
    # ... applied no optimizer step" because the rest of that round had no batches.
    overrides = {"epochs": None, "steps": 10, "checkpoint.interval": 5, "deterministic": True}
    with TinyRunner(tiny_config(tmp_path / "clean", **overrides)) as clean:
        clean.train()
        expected = model_state(clean)
        checkpoint = clean.checkpoint_manager.directory / "step-000005"
    with TinyRunner(tiny_config(tmp_path / "resumed", **overrides, resume=str(checkpoint))) as resumed:
        assert resumed.train_state.global_step == 5
        resumed.train()
        assert resumed.train_state.global_step == 10 and resumed.train_state.epoch == clean.train_state.epoch
        for name, value in model_state(resumed).items():
            torch.testing.assert_close(value, expected[name])


def _shutdown_payload(runner: TinyRunner) -> dict:
    return read_checkpoint(runner.checkpoint_manager.directory / "shutdown.pointer")


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


@pytest.mark.parametrize(("batch_size", "drop_last"), [(4, False), (1, False), (2, True), (3, True)])
def test_one_shard_of_a_padded_split_counts_its_own_samples_only(tmp_path, batch_size, drop_last):
    # Rank 1's shard of 7 samples over 2 ranks, in one process: the sampler pads it with sample 0.
    # The metrics see samples 1, 3 and 5, whatever batches the loader cuts (with batches of 3 and
    # drop_last, the partial batch holding the repeat is dropped: nothing is left out of [1, 3, 5]),
    # and so does the loss, a mean per sample of those three (the criterion is the squared error).
    from torch.utils.data import DataLoader, DistributedSampler

    from danling.metrics import regression_metrics
    from tests.runners._torch_toy import make_data

    with TinyRunner(tiny_config(tmp_path)) as runner:
        data = make_data(7, seed=1)
        sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=False)
        runner.dataloaders["val"] = DataLoader(data, batch_size=batch_size, drop_last=drop_last, sampler=sampler)
        runner.metrics = regression_metrics(metrics=["mse"])
        result = runner.evaluate(["val"])["val"]
        model = runner.unwrap(runner.model).eval()
        with torch.no_grad():
            x, y = data.tensors
            own = [1, 3, 5]
            expected = torch.nn.functional.mse_loss(model(x[own]), y[own]).item()
    assert result["mse"] == pytest.approx(expected, rel=1e-6)
    assert result["loss"] == pytest.approx(expected, rel=1e-6)
