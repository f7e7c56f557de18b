"""Replayable failures on one process: bundles written on a NaN, a chosen step and from a checkpoint,
replayed by `danling replay` (in this process; the two-rank test runs it as a real subprocess)."""

from __future__ import annotations

import io
import json
import shutil

import pytest

from danling.cli import main
from danling.runners import Events
from danling.runners.diagnosis.replaying import replay_bundle
from tests.runners._torch_toy import TinyRunner, tiny_config
from tests.runners.diagnosis._replay_toy import BackwardTrapRunner, SpikeTrapRunner, TrapRunner


def _train(runner_class, root, **settings):
    """Train until the trap stops the run (or the end); the runner and its training losses, batch by batch."""
    runner = runner_class(tiny_config(root, **settings))
    losses: list = []

    def record(context):
        if context.split == "train" and context.loss is not None:
            losses.append(context.loss.item())

    runner.events.subscribe(Events.STEP_END, record)
    try:
        runner.train()
    except Exception as error:
        runner.error = error
    runner.close()
    return runner, losses


def _cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    status = main(["replay", *argv], out=out, err=err)
    return status, out.getvalue(), err.getvalue()


def test_off_subscribes_nothing_and_bad_values_are_refused(tmp_path):
    with TinyRunner(tiny_config(tmp_path / "off")) as runner:
        assert runner.diagnosis.replay is None
        assert not runner.events.has_subscribers(Events.STEP_START)
        assert not runner.events.has_subscribers(Events.STEP_END)
    with pytest.raises(ValueError, match=r"replay.capture_steps must hold global steps >= 1, got \[0\]"):
        TinyRunner(tiny_config(tmp_path / "bad", **{"replay.capture_steps": [0]}))
    with pytest.raises(ValueError, match="replay.max_copy_bytes must be an integer >= 0, got -1"):
        TinyRunner(tiny_config(tmp_path / "bad2", **{"replay.max_copy_bytes": -1}))


def test_a_captured_step_replays_to_the_same_losses_bit_for_bit(tmp_path):
    # Two micro-batches per update and dropout: the replay needs the batches and the RNG states.
    runner, losses = _train(TinyRunner, tmp_path, accum_steps=2, **{"replay.capture_steps": [2]})
    (bundle,) = runner.diagnosis.replay.bundles
    assert bundle.name == "step-00000002-rank0-capture"
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["mode"] == "copy" and manifest["runner"] == "tests.runners._torch_toy:TinyRunner"
    assert manifest["code"]["code_id"] == runner.code_id
    status, out, _ = _cli(str(bundle), "--json")
    report = json.loads(out)
    assert status == 0 and report["identical"] and report["finding"] is None
    # The second update is the third and fourth batch: their losses as the run saw them.
    assert report["losses"] == losses[2:4] and report["recorded"] == losses[2:4]


def test_a_nan_in_the_backward_pass_is_named(tmp_path):
    runner, _ = _train(BackwardTrapRunner, tmp_path, **{"replay.on_nonfinite": True, "nonfinite.check": "update"})
    (bundle,) = runner.diagnosis.replay.bundles
    assert bundle.name == f"step-{runner.armed_at:08d}-rank0-nonfinite"
    status, out, _ = _cli(str(bundle))
    assert status == 0
    assert "first non-finite: backward of module `trap`: grad_input" in out
    assert "the gradient of its output was finite" in out and "TrainingDivergedError" in out


def test_a_loss_spike_rollback_is_bundled_and_replays_to_the_spiking_loss(tmp_path):
    # The toy's own losses vary by 10x from step to step; the trap's spike is a million-fold.
    spikes = {"spikes.policy": "rollback", "spikes.factor": 100.0, "spikes.window": 4, "spikes.min_history": 2}
    spikes["checkpoint.interval"] = 2
    runner, losses = _train(SpikeTrapRunner, tmp_path, epochs=None, steps=8, **{"replay.on_rollback": True}, **spikes)
    assert not hasattr(runner, "error")
    assert runner.update.spike_guard.rollbacks == 1 and runner.train_state.global_step == 8
    (bundle,) = runner.diagnosis.replay.bundles
    assert bundle.name == f"step-{runner.armed_at:08d}-rank0-rollback"
    report = replay_bundle(bundle)
    # The replay has no loss history, so nothing spikes: the update runs, to the very loss that spiked.
    assert report.identical and report.error is None and report.finding is None
    assert report.losses == [runner.spiked_loss] and runner.spiked_loss > 1000 * max(losses)


def test_a_bundle_from_a_checkpoint_replays_the_updates_since(tmp_path):
    settings = {"replay.on_nonfinite": True, "replay.max_copy_bytes": 0, "checkpoint.interval": 3}
    runner, _ = _train(TrapRunner, tmp_path, epochs=None, steps=16, **settings)
    (bundle,) = runner.diagnosis.replay.bundles
    manifest = json.loads((bundle / "manifest.json").read_text())
    step = runner.armed_at
    assert manifest["mode"] == "checkpoint" and manifest["step"] == step and not (bundle / "state.pt").exists()
    assert manifest["checkpoint"].endswith(f"checkpoints/step-{(step - 1) // 3 * 3:06d}")  # the newest before it
    report = replay_bundle(bundle)
    # The checkpoint, the updates between it and the failing one (their losses bit for bit), then the failing one.
    assert report.updates == (step - 1) % 3 + 1 and report.identical
    assert report.finding is not None and (report.finding.phase, report.finding.module) == ("forward", "trap")
    assert report.finding.tensor == "output" and report.finding.detail == "its inputs were finite"


def test_a_damaged_bundle_is_refused_with_one_clear_line(tmp_path):
    runner, _ = _train(TinyRunner, tmp_path / "run", **{"replay.capture_steps": [2]})
    (bundle,) = runner.diagnosis.replay.bundles

    def damaged(name, change):
        copy = tmp_path / name
        shutil.copytree(bundle, copy)
        change(copy)
        status, out, err = _cli(str(copy))
        assert status == 2 and not out and err.count("\n") == 1 and err.startswith("danling: error: ")
        return err

    assert "windows.pt is missing" in damaged("missing", lambda b: (b / "windows.pt").unlink())
    err = damaged("changed", lambda b: (b / "state.pt").write_bytes((b / "state.pt").read_bytes()[:-7]))
    assert "state.pt does not match the SHA-256 in manifest.json" in err

    def rename(b):
        manifest = json.loads((b / "manifest.json").read_text())
        (b / "manifest.json").write_text(json.dumps({**manifest, "runner": "nowhere.at_all:Runner"}))

    assert "cannot import the runner class 'nowhere.at_all:Runner'" in damaged("class", rename)
    assert "has no manifest.json: not a replay bundle" in damaged("empty", lambda b: (b / "manifest.json").unlink())
