"""`dry_run: N` runs N batches of every split and one checkpoint round trip, away from the real run."""

from __future__ import annotations

from collections import Counter

import pytest

from danling.runners.loop.events import Events
from tests.runners._toy import ToyRunner, toy_config


class Watched(ToyRunner):
    """Counts the batches of each split and the checkpoint saves and loads."""

    def __init__(self, config):
        super().__init__(config)
        self.batches: Counter = Counter()
        self.saved, self.loaded = [], []
        self.dataloaders["val"] = [float(value) for value in range(10)]
        self.events.subscribe(Events.STEP_END, lambda context: self.batches.update([context.split]))
        self.events.subscribe(Events.CHECKPOINT_SAVED, lambda context: self.saved.append(context.path))
        self.events.subscribe(Events.CHECKPOINT_LOADED, lambda context: self.loaded.append(context.path))


@pytest.mark.parametrize("budget", [{"epochs": 50}, {"epochs": None, "steps": 1000}])
def test_dry_run_runs_n_batches_per_split_and_one_checkpoint_round_trip(tmp_path, budget):
    real = ToyRunner(toy_config(tmp_path, **budget))
    real_dir = real.workspace.path
    real.close()
    with Watched(toy_config(tmp_path, dry_run=2, **budget)) as runner:
        results = runner.train()
        assert runner.batches == Counter({"train": 2, "val": 2})
        assert len(runner.saved) == 1 and len(runner.loaded) == 1
        assert runner.train_state.global_step == 2 and runner.loaded == [str(runner.saved[0])]
        assert len(results) == 1 and set(results[next(iter(results))]) == {"train", "val"}
        # its own run directory: the real run's history is untouched
        assert runner.workspace.path.name.endswith("-dry-run") and runner.workspace.path != real_dir
        assert (runner.workspace.path / "results.json").exists()
    assert not (real_dir / "checkpoints").exists() and not (real_dir / "results.json").exists()


def test_dry_run_catches_a_broken_evaluate_step_in_seconds(tmp_path):
    class Broken(Watched):
        def evaluate_step(self, data):
            raise KeyError("target")  # a typo a long job would only hit after its first epoch

    with Broken(toy_config(tmp_path, epochs=50, dry_run=3)) as runner:
        with pytest.raises(KeyError, match="target"):
            runner.train()
        assert runner.batches["train"] == 3 and runner.saved == []


def test_dry_run_is_validated(tmp_path):
    with pytest.raises(ValueError, match="dry_run must be an integer >= 1"):
        ToyRunner(toy_config(tmp_path, dry_run=0))
