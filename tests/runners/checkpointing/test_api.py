"""The runner checkpoint API: payloads, saving with aliases, resume paths and auto_resume."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from danling.checkpoint import CheckpointError, read_checkpoint
from danling.runners import RunnerConfig
from tests.runners._torch_toy import TinyRunner, tiny_config
from tests.runners._toy import ToyRunner, toy_config


def fingerprint(runner):
    """Everything a resumed run must reproduce."""
    return (
        runner.train_state.state_dict(),
        runner.model.weight,
        {index: row.dict() for index, row in runner.results.items()},
    )


def test_state_dict_payload(make_runner):
    runner = make_runner()
    payload = runner.state_dict()
    assert set(payload) == {"runner", "state", "rng", "dataloaders", "results", "topology", "model"}
    assert payload["runner"]["epochs"] == 3 and set(payload["state"]) == {"train", "elastic"}
    assert payload["rng"]["python"] is not None  # captured on export, per rank
    assert payload["topology"]["data_size"] == payload["topology"]["world_size"] == 1


def test_checkpoint_round_trip_through_runner_api(make_runner):
    runner = make_runner()
    runner.train()
    manager = runner.checkpoint_manager
    assert [path.name for path in manager.checkpoints()] == ["epoch-000002", "epoch-000001", "epoch-000000"]
    assert manager.latest.name == "epoch-000002"
    assert manager.best is not None

    restored = ToyRunner.from_checkpoint(manager.latest / "state.pt")
    try:
        assert fingerprint(restored) == fingerprint(runner)
        assert restored.config.config_id == runner.config.config_id
        assert restored.best_index == runner.best_index and restored.is_best == runner.is_best
    finally:
        restored.close()

    other = make_runner(experiment="other")
    other.load_checkpoint(manager.latest)
    assert fingerprint(other) == fingerprint(runner)
    assert other.config.resume == str(manager.latest)
    # bytes and in-memory payloads take the same path
    other.load_checkpoint(runner.state_dict())
    assert other.model.weight == runner.model.weight


def test_resumed_run_matches_uninterrupted_run(tmp_path):
    with ToyRunner(toy_config(tmp_path / "a", epochs=4)) as straight:
        straight.train()
        expected = fingerprint(straight)

    class Crashing(ToyRunner):
        def train_epoch(self, split="train"):
            if self.train_state.epoch == 2:
                raise RuntimeError("simulated crash")
            return super().train_epoch(split)

    with Crashing(toy_config(tmp_path / "b", epochs=4)) as first, pytest.raises(RuntimeError, match="simulated"):
        first.train()
    random.random()  # disturb the global RNG: the checkpoint must restore it
    with ToyRunner(toy_config(tmp_path / "b", epochs=4, auto_resume=True)) as resumed:
        assert resumed.train_state.epoch == 2
        resumed.train()
        assert fingerprint(resumed) == expected


def test_auto_resume_falls_back_past_a_corrupted_checkpoint(tmp_path, caplog):
    with ToyRunner(toy_config(tmp_path)) as runner:
        runner.train()
        latest = runner.checkpoint_manager.latest
    with ToyRunner(toy_config(tmp_path, auto_resume=True)) as intact:
        assert intact.train_state.epoch == 3 and intact.config.resume == str(latest)  # the latest one
    payload = latest / "state.pt"
    payload.write_bytes(payload.read_bytes()[:-16] + b"\0" * 16)  # same size, different bytes
    with caplog.at_level(logging.WARNING):
        resumed = ToyRunner(toy_config(tmp_path, auto_resume=True))
    try:
        assert resumed.train_state.epoch == 2  # restored from epoch-000001, the newest that verifies
        assert str(resumed.config.resume).endswith("epoch-000001")
        messages = " ".join(record.getMessage() for record in caplog.records)
        assert "epoch-000002" in messages and "resuming from" in messages
    finally:
        resumed.close()


def test_auto_resume_without_checkpoints_starts_fresh(make_runner):
    runner = make_runner(auto_resume=True)
    assert runner.train_state.epoch == 0 and runner.config.resume is None


def test_restore_precedence(make_runner, tmp_path):
    pretrained_path = str(tmp_path / "weights.pt")
    torch.save({"model": {"weight": 42.0}}, pretrained_path)
    source = make_runner(pretrained=pretrained_path)
    assert source.train_state.epoch == 0 and source.model.weight == 42.0
    assert source.config.pretrained == pretrained_path
    source.train()
    trained = source.model.weight

    # resume beats pretrained (and auto_resume)
    both = make_runner(resume=str(source.checkpoint_manager.latest), pretrained=pretrained_path, auto_resume=True)
    assert both.train_state.epoch == 3 and both.model.weight == trained
    # auto_resume beats pretrained: the run directory already holds checkpoints
    auto = make_runner(pretrained=pretrained_path, auto_resume=True)
    assert auto.train_state.epoch == 3 and auto.model.weight == trained


def test_load_pretrained_prefers_ema_and_validates(make_runner):
    runner = make_runner()
    runner.load_pretrained({"model": {"weight": 1.0}, "ema": {"weight": 2.0}})
    assert runner.model.weight == 2.0 and runner.train_state.epoch == 0
    with pytest.raises(ValueError, match="no 'ema', 'model'"):
        runner.load_pretrained({"optimizer": {}})
    runner.model = None
    with pytest.raises(ValueError, match="self.model"):
        runner.load_pretrained({"model": {"weight": 1.0}})


def test_load_checkpoint_requires_bound_components(make_runner):
    runner = make_runner()
    payload = dict(runner.state_dict())
    del payload["model"]
    with pytest.raises(ValueError, match="no 'model' state"):
        runner.load_checkpoint(payload)
    lenient = make_runner(experiment="lenient", **{"checkpoint.exclude_from_loading": ["model"]})
    lenient.model.weight = 5.0
    lenient.load_checkpoint(payload)
    assert lenient.model.weight == 5.0


def test_load_state_dict_refuses_a_different_experiment(make_runner):
    runner = make_runner()
    other = make_runner(accum_steps=2, experiment="other")
    with pytest.raises(ValueError, match=r"accum_steps: 2 -> 1"):
        runner.load_state_dict(other.state_dict())
    # paths, logging settings and the budget are not part of the experiment
    same = make_runner(experiment="renamed", log_interval=3, epochs=7)
    runner.load_state_dict(same.state_dict())


def test_dataloader_progress_is_saved_and_restored(make_runner):
    class StatefulLoader(list):
        position = 0

        def state_dict(self):
            return {"position": self.position}

        def load_state_dict(self, state):
            self.position = state["position"]

    runner = make_runner()
    runner.dataloaders["train"] = StatefulLoader([1.0, 2.0])
    runner.dataloaders["train"].position = 4
    payload = runner.state_dict()
    assert payload["dataloaders"] == {"train": {"position": 4}}
    runner.dataloaders["train"].position = 0
    runner.load_checkpoint(payload)
    assert runner.dataloaders["train"].position == 4


def test_read_config_and_read_checkpoint(make_runner):
    runner = make_runner()
    path = runner.save_checkpoint(force=True)
    config = ToyRunner.read_config(path)
    assert isinstance(config, RunnerConfig) and config.config_id == runner.config.config_id
    assert runner.read_checkpoint("latest")["model"] == {"weight": 0.0}
    assert read_checkpoint(path)["state"]["train"]["epoch"] == 0
    with pytest.raises(ValueError, match="no runner config"):
        ToyRunner.read_config({"model": {}})


def test_save_checkpoint_cadence_and_aliases(make_runner):
    runner = make_runner(**{"checkpoint.interval": 2})
    assert runner.save_checkpoint(epochs=0) is None  # one finished epoch: not on the cadence
    assert runner.save_checkpoint(epochs=1).name == "epoch-000001"
    assert runner.checkpoint_manager.best is None  # no result row yet: never a phantom best
    runner._append_result({"val": {"loss": 1.0}}, index=1)  # as the loops store a row
    path = runner.save_checkpoint(name="manual", epochs=1)
    aliases = runner.checkpoint_manager.aliases()
    assert aliases["manual"] == aliases["latest"] == aliases["best"] == path


def test_save_seed_checkpoint(make_runner):
    runner = make_runner(**{"checkpoint.keep_latest_k": 1})
    seed = runner.save_seed_checkpoint()
    assert seed.name == "step-000000" and runner.checkpoint_manager.alias("seed") == seed
    runner.train()
    names = [path.name for path in runner.checkpoint_manager.checkpoints()]
    assert "step-000000" in names and "epoch-000000" not in names  # the `seed` alias keeps it from retention
    assert runner.checkpoint_manager.alias("seed") == seed and runner.checkpoint_manager.best != seed
    fresh = make_runner(experiment="fresh", resume=str(seed))
    assert fresh.train_state.epoch == 0 and fresh.model.weight == 0.0


def test_save_seed_checkpoint_goes_through_save_checkpoint(make_runner):
    runner = make_runner()
    saved = {}

    def save_checkpoint(name="latest", epochs=None, save_best=True, last_step=False, force=False):
        """A user's override that keeps payloads in memory: `save_checkpoint` is the only way in."""
        saved[name] = (dict(runner.checkpointing.checkpoint_payload(last_step=last_step)), save_best, last_step)
        return runner.checkpoint_manager.directory / name

    runner.save_checkpoint = save_checkpoint
    assert runner.save_seed_checkpoint() == runner.checkpoint_manager.directory / "seed"
    payload, save_best, last_step = saved["seed"]
    assert last_step and not save_best  # the final-save payload, never published as `best`
    assert payload["model"]["weight"] == runner.model.weight == 0.0
    assert runner.checkpoint_manager.checkpoints() == []  # nothing reached the manager


def test_load_only_never_writes(make_runner):
    runner = make_runner(**{"checkpoint.load_only": True})
    runner.train()
    assert runner.checkpoint_manager.checkpoints() == []


def test_resuming_adopts_the_seed_the_first_run_drew(tmp_path):
    with ToyRunner(toy_config(tmp_path, seed=None)) as first:
        first.train()
        drawn = first.config.seed
    with ToyRunner(toy_config(tmp_path, seed=None, auto_resume=True)) as resumed:
        assert resumed.train_state.epoch == 3 and resumed.config.seed == drawn


@pytest.mark.parametrize("checksum", ["xxh3_128", "sha256"])
def test_checkpoint_checksum_is_configurable_and_verifies(make_runner, checksum):
    import json

    runner = make_runner(**{"checkpoint.checksum": checksum})
    runner.train()
    latest = runner.checkpoint_manager.latest
    entries = json.loads((latest / "manifest.json").read_text())["files"].values()
    assert entries and all(set(entry) == {"size", checksum} for entry in entries)
    restored = ToyRunner.from_checkpoint(latest)
    try:
        assert fingerprint(restored) == fingerprint(runner)
    finally:
        restored.close()


def test_an_unknown_checkpoint_checksum_is_refused(make_runner):
    with pytest.raises(ValueError, match="checkpoint.checksum"):
        make_runner(**{"checkpoint.checksum": "md5"})


def test_save_checkpoint_overrides_change_the_save_policy(tmp_path):
    class RecordingRunner(ToyRunner):
        """A user's policy: records each request, and writes every other one with the default policy."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.requests = []

        def save_checkpoint(self, name="latest", epochs=None, save_best=True, last_step=False, force=False):
            self.requests.append((name, epochs, last_step, force))
            if len(self.requests) % 2:
                return None
            return super().save_checkpoint(name, epochs, save_best, last_step, force)

    with RecordingRunner(toy_config(tmp_path, epochs=3)) as runner:
        manager = runner.checkpoint_manager
        runner.train()
        expected = [("latest", 0, False, False), ("latest", 1, False, False), ("latest", 2, True, False)]
        assert runner.requests == expected
        assert [path.name for path in manager.checkpoints()] == ["epoch-000001"]  # the policy above: 2nd only
        assert manager.alias("best") is not None and manager.latest.name == "epoch-000001"
        assert runner.save_checkpoint(name="manual", force=True).name == "step-000015"  # the 4th request
        assert manager.alias("manual").name == "step-000015"
        assert runner.save_checkpoint(name="again", force=True) is None and manager.alias("again") is None


@pytest.mark.parametrize("source", ["path", "mapping", "bytes"])
def test_exclude_from_loading_honours_dotted_keys_and_runner(tmp_path, source):
    import io

    with ToyRunner(toy_config(tmp_path / "done")) as done:
        done.train()
        payload = done.state_dict()
        sources = {"path": done.checkpoint_manager.latest, "mapping": payload}
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        sources["bytes"] = buffer.getvalue()
    checkpoint = sources[source]
    excluded = {"checkpoint.exclude_from_loading": ["state.train"]}
    with ToyRunner(toy_config(tmp_path / "fresh", **excluded)) as runner:
        runner.load_checkpoint(checkpoint)
        assert runner.train_state.epoch == 0 and runner.train_state.global_step == 0  # counters kept
        assert runner.model.weight == done.model.weight and list(runner.results) == [0, 1, 2]
    assert payload["state"]["train"]["epoch"] == 3  # the caller's payload is left as it was
    # Excluding the saved config skips the check that it describes the same experiment.
    other = {"checkpoint.exclude_from_loading": "runner", "max_grad_norm": 1.0}
    with ToyRunner(toy_config(tmp_path / "other", **other)) as runner:
        runner.load_checkpoint(checkpoint)
        assert runner.train_state.epoch == 3 and runner.config.max_grad_norm == 1.0
    checked = toy_config(tmp_path / "checked", max_grad_norm=1.0)
    with ToyRunner(checked) as runner, pytest.raises(ValueError, match="max_grad_norm: None -> 1.0"):
        runner.load_checkpoint(checkpoint)


def test_from_checkpoint_of_a_fine_tuned_run(tmp_path):
    with ToyRunner(toy_config(tmp_path / "base")) as base:
        base.train()
        source = str(base.checkpoint_manager.latest)
    with ToyRunner(toy_config(tmp_path / "tuned", pretrained=source, epochs=2)) as tuned:
        tuned.train()
        latest, weight = tuned.checkpoint_manager.latest, tuned.model.weight
    for checkpoint in (latest, latest / "state.pt"):
        with ToyRunner.from_checkpoint(checkpoint) as restored:
            assert restored.config.pretrained == source and restored.config.epochs == 2
            assert restored.model.weight == weight and restored.train_state.epoch == 2


def test_truncated_plain_checkpoint_names_the_file(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"model": {"w": torch.ones(64)}}, path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"weights\.pt is truncated or corrupt"):
        TinyRunner(tiny_config(tmp_path / "run", pretrained=str(path)))


def test_exclude_from_loading_refuses_a_name_no_checkpoint_part_has(tmp_path):
    # A misspelt part excluded nothing, so the state it meant to keep out was loaded all the same.
    with pytest.raises(ValueError, match=r"names 'optimiser'.*did you mean 'optimizer'\?"):
        RunnerConfig(**{"checkpoint.exclude_from_loading": ["model.head", "optimiser"]})
    config = tiny_config(tmp_path, **{"ema.enabled": True, "scheduler.type": "cosine"})
    with TinyRunner(config) as runner:
        runner.train()
        payload = runner.state_dict()
        parts = set(payload)
        # Every part a checkpoint holds may be excluded: the accepted names follow what runners write.
        RunnerConfig(**{"checkpoint.exclude_from_loading": sorted(parts)})
    assert {"model", "optimizer", "ema", "scheduler", "dataloaders", "rng"} <= parts
