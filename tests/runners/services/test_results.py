"""One tie rule for the best row, best.json and the `best` alias; `checkpoint.save_top_k` retention."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from danling.runners.reconcile import reconcile_run
from tests.runners._torch_toy import TinyRunner, tiny_config
from tests.runners._toy import ToyRunner, toy_config


class ScriptedRunner(ToyRunner):
    """Validation loss of epoch `e` is `LOSSES[e]`, whatever the weights."""

    LOSSES: list[float] = []

    def evaluate_step(self, data: float) -> tuple[float, float]:
        return self.model.weight, self.LOSSES[self.train_state.epoch]


def scripted(tmp_path, losses, **overrides):
    runner_class = type("Scripted", (ScriptedRunner,), {"LOSSES": list(losses)})
    return runner_class(toy_config(tmp_path, epochs=len(losses), **overrides))


def kept(runner) -> list[int]:
    return sorted(int(path.name.split("-")[1]) for path in runner.checkpoint_manager.checkpoints())


def test_tied_scores_pick_the_latest_row_everywhere(tmp_path):
    losses = [5.0, 4.0, 3.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 1.0, 3.0]  # epochs 3 and 11 tie
    runner = scripted(tmp_path, losses)
    try:
        runner.train()
        runner.bookkeeping.flush()
        best_file = json.loads((runner.workspace.path / "best.json").read_text())
        assert runner.best_index == 11 and runner.best_result["index"] == 11
        assert best_file["index"] == 11
        assert runner.checkpoint_manager.best.name == "epoch-000011"
        # Reconciling the run directory on a restart applies the same rule and changes nothing.
        report = reconcile_run(runner.workspace.path, config=runner.config)
        assert report["best"] is None and runner.checkpoint_manager.best.name == "epoch-000011"
    finally:
        runner.close()


def test_save_top_k_keeps_the_best_beside_the_latest(tmp_path):
    losses = [5.0, 1.0, 4.0, 0.5, 3.0, 2.0, 6.0]
    runner = scripted(tmp_path, losses, **{"checkpoint.save_top_k": 2, "checkpoint.keep_latest_k": 1})
    try:
        runner.train()
        assert kept(runner) == [1, 3, 6]  # the two best (0.5, 1.0) and the latest
        assert runner.checkpoint_manager.best.name == "epoch-000003"
        manifest = json.loads((runner.checkpoint_manager.directory / "epoch-000001" / "manifest.json").read_text())
        assert manifest["metadata"]["score"] == 1.0 and manifest["metadata"]["score_mode"] == "min"
    finally:
        runner.close()


def test_save_top_k_alone_breaks_ties_like_best_and_keeps_alias_targets(tmp_path):
    runner = scripted(tmp_path, [3.0, 1.0, 2.0, 1.0, 4.0], **{"checkpoint.save_top_k": 1})
    try:
        runner.train()
        # Epochs 1 and 3 tie: the later one is the top 1 and the best; the latest is kept as `latest`.
        assert kept(runner) == [3, 4]
        assert runner.best_index == 3 and runner.checkpoint_manager.best.name == "epoch-000003"
    finally:
        runner.close()


def test_save_top_k_is_validated(tmp_path):
    with pytest.raises(ValueError, match="save_top_k must be an integer >= 0"):
        ToyRunner(toy_config(tmp_path, **{"checkpoint.save_top_k": -1}))


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


def test_a_metric_that_is_nan_from_out_of_range_labels_warns_once(tmp_path, caplog):
    from danling.metrics import StreamMetrics
    from danling.metrics.functional import accuracy

    class OutOfRange(TinyRunner):
        def __init__(self, config):
            super().__init__(config)
            self.model = nn.Sequential(nn.Linear(4, 3))
            self.criterion = nn.CrossEntropyLoss(ignore_index=5)  # the loss skips label 5; accuracy cannot
            x = torch.randn(8, 4)
            self.datasets.train = TensorDataset(x, torch.zeros(8, dtype=torch.long))
            self.datasets.val = TensorDataset(x, torch.full((8,), 5))  # class 5 of 3
            self.evaluate_metrics = StreamMetrics(acc=accuracy)

    with caplog.at_level(logging.WARNING), OutOfRange(tiny_config(tmp_path, epochs=2)) as runner:
        runner.train()
    assert runner.results[1]["val"]["acc"] != runner.results[1]["val"]["acc"]  # NaN, as documented
    warnings = [r.getMessage() for r in caplog.records if "metric 'acc' of split 'val' is NaN" in r.getMessage()]
    assert len(warnings) == 1 and "outside [0, num_classes)" in warnings[0]  # once, over both epochs


def test_a_run_resumed_from_an_older_checkpoint_rewrites_the_result_files_from_its_rows(tmp_path):
    first = scripted(tmp_path, [3.0, 2.0, 1.0])
    with first:
        first.train()
    run_dir = first.workspace.path
    assert json.loads((run_dir / "best.json").read_text())["index"] == 2
    # resumed after epoch 0; the new epochs 1 and 2 are worse than epoch 0 (no new best row)
    resumed_class = type("Worse", (ScriptedRunner,), {"LOSSES": [3.0, 5.0, 6.0]})
    config = toy_config(tmp_path, epochs=3, resume=str(run_dir / "checkpoints" / "epoch-000000"))
    with resumed_class(config) as second:
        assert second.workspace.path == run_dir
        second.evaluate()  # no row is stored: the files stay those of the run it was resumed from
        second.bookkeeping.flush()
        assert json.loads((run_dir / "best.json").read_text())["index"] == 2
        second.train()
        assert second.best_index == 0
    best = json.loads((run_dir / "best.json").read_text())
    results = json.loads((run_dir / "results.json").read_text())["results"]
    assert best["index"] == 0 and best["val"] == results["0"]["val"]
    assert [row["val"]["loss"] for row in results.values()] == [3.0, 5.0, 6.0]


def test_an_early_stopped_run_is_finished_and_a_stopped_infer_leaves_the_status_alone(tmp_path):
    runner = scripted(tmp_path, [3.0, 2.0, 2.5, 2.6, 2.7, 2.8, 1.0], patience=2)
    status_file = runner.workspace.path / "status.json"
    with runner:
        runner.train()  # stops early after epoch 4: train() returns, the run is complete
        assert runner.train_state.epoch == 5
        assert json.loads(status_file.read_text())["status"] == "finished"  # was "preempted" (early stop)
        original = runner.infer_step

        def stopping(data):
            runner.supervisor.request_stop()  # e.g. a SIGTERM while the finished run scores a split
            return original(data)

        runner.infer_step = stopping
        with pytest.raises(SystemExit):
            runner.infer("infer")
    assert json.loads(status_file.read_text())["status"] == "finished"
