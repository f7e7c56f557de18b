"""What a runner restores at construction: `resume`, `pretrained`, `auto_resume`."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.runners._torch_toy import TinyRunner, tiny_config
from tests.runners._toy import ToyRunner, toy_config


def test_a_backend_free_runner_restores_nothing_at_construction(tmp_path):
    from danling.runners import BaseRunner

    class Bare(BaseRunner):  # no model: nothing a checkpoint's weights could load into
        pass

    with ToyRunner(toy_config(tmp_path / "done")) as done:
        done.train()
        latest = str(done.checkpoint_manager.latest)
    for key in ("resume", "pretrained"):
        with Bare({"workspace_root": str(tmp_path / key), "log": False, key: latest}) as bare:
            assert bare.train_state.epoch == 0 and not bare.results and bare.config[key] == latest
    # A concrete runner restores at construction.
    with TinyRunner(tiny_config(tmp_path / "tiny", epochs=1)) as tiny:
        tiny.train()
        tiny_latest = str(tiny.checkpoint_manager.latest)
    with TinyRunner(tiny_config(tmp_path / "tiny", epochs=1, resume=tiny_latest)) as resumed:
        assert resumed.train_state.epoch == 1


def test_auto_resume_on_a_fresh_run_starts_from_pretrained(tmp_path, caplog):
    with ToyRunner(toy_config(tmp_path / "base")) as base:
        base.train()
        source, weight = str(base.checkpoint_manager.latest), base.model.weight
    config = toy_config(tmp_path / "tuned", pretrained=source, auto_resume=True, epochs=1)
    with caplog.at_level(logging.INFO), ToyRunner(config) as first:
        assert first.model.weight == weight and first.train_state.epoch == 0  # weights only
        first.train()
        trained = first.model.weight
    assert any("starting from the pretrained weights" in r.getMessage() for r in caplog.records)
    with ToyRunner(config) as again:  # the resubmitted job resumes its own checkpoint instead
        assert again.model.weight == trained and again.train_state.epoch == 1


# ------------------------------------------------------------------ resume_allow_changes


def _trained_run(root, **overrides) -> str:
    with TinyRunner(tiny_config(root, epochs=1, **overrides)) as runner:
        runner.train()
        return runner.dir


def test_allowed_optimizer_and_scheduler_changes_take_effect(tmp_path, caplog):
    # The docs' use: a lower learning rate (and other changed optim/scheduler keys) for the rest of
    # training. The checkpoint's optimizer and scheduler states must not bring the old values back.
    before = {"optim.weight_decay": 0.01, "scheduler.type": "cosine"}
    run = _trained_run(tmp_path, **before)
    changed = {"optim.lr": 0.001, "optim.weight_decay": 0.1}
    changed |= {"scheduler.type": "linear", "scheduler.final_lr_ratio": 0.1}
    config = tiny_config(tmp_path, epochs=2, resume=run, resume_allow_changes=True, **changed)
    with caplog.at_level(logging.WARNING, logger="danling"), TinyRunner(config) as resumed:
        group, scheduler = resumed.optimizer.param_groups[0], resumed.scheduler
        assert resumed.optimizer.state  # the moments are continued
        assert group["weight_decay"] == 0.1 and group["initial_lr"] == 0.001
        assert (scheduler.method, scheduler.final_lr_ratio, scheduler.base_lrs) == ("linear", 0.1, [0.001])
        assert scheduler.last_epoch == resumed.train_state.global_step == 5
        assert group["lr"] == scheduler.get_last_lr()[0] == scheduler.lr_at(0.001, 6)
    # The log says the rate the run really continues at (the "schedule rebuilt" line computed the old one).
    said = f"initial learning rates [0.001]: the next update uses [{group['lr']}]"
    assert any(said in record.getMessage() for record in caplog.records)


def test_an_allowed_learning_rate_change_without_a_scheduler_takes_effect(tmp_path):
    run = _trained_run(tmp_path)
    config = tiny_config(tmp_path, epochs=2, resume=run, resume_allow_changes=True, **{"optim.lr": 0.001})
    with TinyRunner(config) as resumed:
        assert [group["lr"] for group in resumed.optimizer.param_groups] == [0.001]
        assert resumed.optimizer.state


def test_an_allowed_optimizer_type_change_starts_the_new_optimizer_afresh(tmp_path, caplog):
    run = _trained_run(tmp_path, **{"optim.type": "sgd", "optim.momentum": 0.9})
    config = tiny_config(tmp_path, epochs=2, resume=run, resume_allow_changes=True)  # adamw
    with caplog.at_level(logging.WARNING, logger="danling"), TinyRunner(config) as resumed:
        assert not resumed.optimizer.state and "momentum" not in resumed.optimizer.param_groups[0]
        resumed.train()
        assert resumed.train_state.global_step == 10
    assert any("optim.type changed" in record.getMessage() for record in caplog.records)


def test_an_allowed_accum_steps_change_is_the_one_trained_with(tmp_path):
    # The checkpoint's global batch must not win over a changed accum_steps (it does on another
    # number of ranks, where the configured value is the old run's).
    run = _trained_run(tmp_path)  # 5 updates of 1 micro-batch
    config = tiny_config(tmp_path, epochs=2, resume=run, resume_allow_changes=True, accum_steps=2)
    with TinyRunner(config) as resumed:
        assert resumed.accum_steps == resumed.update.accum_steps == 2
        resumed.train()
        assert resumed.train_state.global_step == 5 + 3  # the new epoch: updates of 2, 2 and 1 batches


def test_a_resume_in_the_other_counting_mode_is_refused(tmp_path):
    # Rows are indexed by epoch in epoch mode and by step in step mode: an epoch-mode run resumed
    # with `steps: 12` evaluated again and stored row 15 beside rows 0-2.
    with TinyRunner(tiny_config(tmp_path, epochs=3)) as runner:
        runner.train()
        checkpoint = str(runner.checkpoint_manager.directory / "latest.pointer")
        assert list(runner.results) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"trained in epoch mode .* this run is in step mode"):
        TinyRunner(tiny_config(tmp_path, epochs=None, steps=12, resume=checkpoint))  # refused while restoring
    with TinyRunner(tiny_config(tmp_path, epochs=4, resume=checkpoint)) as resumed:  # same mode: continues
        resumed.train()
        assert list(resumed.results) == [0, 1, 2, 3]


def test_best_does_not_name_a_checkpoint_a_resumed_run_rewrote(tmp_path):
    # Resumed in its own run directory from epoch 0, on data that makes every later epoch worse,
    # the run saved epoch-000002 again: `best` still named it, so `best` gave the worst weights.
    class Scrambled(TinyRunner):
        def __init__(self, config) -> None:
            super().__init__(config)
            x, y = self.datasets.train.tensors
            self.datasets.train = torch.utils.data.TensorDataset(x, -50 * y)

    config = tiny_config(tmp_path, epochs=3, **{"optim.lr": 0.05})
    with TinyRunner(config) as runner:
        runner.train()
        assert runner.best_index == 2 and runner.checkpoint_manager.best.name == "epoch-000002"
        source = runner.checkpoint_manager.directory / "epoch-000000"
    with Scrambled({**config, "resume": str(source)}) as resumed:
        resumed.train()
        assert resumed.checkpoint_manager.directory == source.parent  # the same run, continued
        assert resumed.best_index == 0  # epochs 1 and 2 of this continuation scored worse
        best = resumed.checkpoint_manager.best
        assert best is None or best.name == "epoch-000000"
