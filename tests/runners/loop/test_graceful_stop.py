"""Graceful stops: a stop request ends the run at an exact point a resume continues from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from danling.checkpoint import read_checkpoint
from tests.runners._torch_toy import TinyRunner, model_state, tiny_config


def _reference(root: Path, **overrides) -> tuple[int, dict[str, torch.Tensor], dict]:
    """Global step, weights and result rows of an uninterrupted run."""
    with TinyRunner(tiny_config(root, deterministic=True, **overrides)) as runner:
        runner.train()
        return runner.train_state.global_step, model_state(runner), runner.results.dict()


def _assert_same_weights(expected: dict[str, torch.Tensor], runner: TinyRunner) -> None:
    got = model_state(runner)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(value, got[key]), f"{key} differs from the uninterrupted run"


def _shutdown_payload(runner: TinyRunner) -> dict:
    return read_checkpoint(runner.checkpoint_manager.directory / "shutdown.pointer")


def test_stop_during_evaluation_resumes_with_evaluation_not_training(tmp_path):
    ref_step, ref_weights, ref_results = _reference(tmp_path / "clean")

    class StopInEval(TinyRunner):
        def evaluate_step(self, data):
            if self.train_state.epoch == 0:
                self.supervisor.request_stop()
            return super().evaluate_step(data)

    config = tiny_config(tmp_path / "run", deterministic=True)
    with pytest.raises(SystemExit) as stop, StopInEval(config) as runner:
        runner.train()
    assert stop.value.code == 0
    loop = _shutdown_payload(runner)["loop"]
    assert loop["split"] is None and loop["trained"] is True  # epoch 0 was evaluating
    assert loop["round"]["train"]["loss"] == pytest.approx(ref_results[0]["train"]["loss"])

    with TinyRunner({**config, "auto_resume": True}) as resumed:
        assert resumed.train_state.global_step == 5
        resumed.train()
        assert resumed.train_state.global_step == ref_step  # epoch 0 was not trained again
        _assert_same_weights(ref_weights, resumed)
        assert resumed.results.dict() == ref_results  # the row of epoch 0 is complete


def test_graceful_stop_inside_accumulation_window_finishes_the_window(tmp_path):
    ref_step, ref_weights, _ = _reference(tmp_path / "clean", accum_steps=2)

    class StopAtMicroStep3(TinyRunner):
        def train_step(self, data):
            out = super().train_step(data)
            if self.train_state.micro_step == 3 and not self.config.auto_resume:
                self.supervisor.request_stop()  # inside the second window of 2 micro-steps
            return out

    config = tiny_config(tmp_path / "run", deterministic=True, accum_steps=2)
    with pytest.raises(SystemExit), StopAtMicroStep3(config) as runner:
        runner.train()
    payload = _shutdown_payload(runner)
    # micro-step 4 closed the window and stepped; no partial window was applied
    assert payload["state"]["train"] == {"epoch": 0, "global_step": 2, "micro_step": 4}
    assert payload["loop"]["split"] == "train"

    with StopAtMicroStep3({**config, "auto_resume": True}) as resumed:
        resumed.train()
        assert resumed.train_state.global_step == ref_step
        assert resumed.train_state.micro_step == 10
        _assert_same_weights(ref_weights, resumed)


def test_an_overridden_stop_check_is_asked_after_every_batch(tmp_path):
    class StopAfterThreeBatches(TinyRunner):
        asked = 0

        def _stop_requested(self):
            self.asked += 1
            return self.asked >= 4  # the first call is the loop's check before any batch

    with pytest.raises(SystemExit), StopAfterThreeBatches(tiny_config(tmp_path)) as runner:
        runner.train()
    assert runner.train_state.micro_step == 3 and runner.asked == 4


def test_the_stop_check_after_each_batch_does_not_query_the_process_group(tmp_path, monkeypatch):
    """Whether ranks must agree on a stop is settled once per loop, not asked of torch.distributed per batch.

    The query cost ten Python calls a batch: 1.8% of a small model's step with the runner's own
    loaders (benchmarks/bench_runner_calls.py).
    """
    from danling.runners.loop import passes

    queries = []
    real = passes.is_distributed
    monkeypatch.setattr(passes, "is_distributed", lambda *args: queries.append(args) or real(*args))
    with TinyRunner(tiny_config(tmp_path)) as runner:
        runner.train()
        batches = runner.train_state.micro_step
    assert batches >= 10 and len(queries) <= 2, f"{len(queries)} queries for {batches} training batches"
