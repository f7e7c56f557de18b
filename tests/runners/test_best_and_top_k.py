"""One tie rule for the best row, best.json and the `best` alias; `checkpoint.save_top_k` retention."""

from __future__ import annotations

import json

import pytest

from danling.runners.reconcile import reconcile_run
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
