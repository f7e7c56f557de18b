"""What a runner restores at construction: `resume`, `pretrained`, `auto_resume`."""

from __future__ import annotations

import logging

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
