"""Runs that continue and never overwrite: identity vs budget, versions, the run lock, loud changes,
resume path forms and read-only restores (issue 18, items 1-5)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from danling.checkpoint import FileCheckpointManager
from danling.checkpoint.manifest import CheckpointNotFoundError
from danling.runners.services.run_lock import RunDirectoryLockedError, RunLock, read_lock_holder
from tests.runners._torch_toy import TinyRunner, model_state, tiny_config

_REPO = Path(__file__).resolve().parents[3]
STEPS_PER_EPOCH = 5  # 20 samples, batch size 4


def _train(root: Path, **overrides) -> tuple[Path, TinyRunner]:
    runner = TinyRunner(tiny_config(root, **overrides))
    runner.train()
    runner.close()
    return Path(runner.dir), runner


def _snapshot(directory: Path) -> dict[str, str]:
    """Every file under `directory` with the hash of its bytes."""
    return {
        os.fspath(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def _messages(caplog) -> str:
    return "\n".join(record.getMessage() for record in caplog.records)


# ------------------------------------------------------------------------------- identity vs budget


def test_raising_the_budget_continues_the_run_and_trains_only_what_is_new(tmp_path, caplog):
    first, _ = _train(tmp_path, auto_resume=True)
    assert first.parent.name == "lin" and first.name.startswith("exp-")  # no git hash in the path
    with caplog.at_level(logging.INFO, logger="danling"):
        runner = TinyRunner(tiny_config(tmp_path, auto_resume=True, epochs=3))
        assert Path(runner.dir) == first and runner.train_state.epoch == 2
        assert runner.train_state.global_step == 2 * STEPS_PER_EPOCH
        runner.train()
        runner.close()
    assert runner.train_state.epoch == 3 and runner.train_state.global_step == 3 * STEPS_PER_EPOCH
    assert sorted(runner.results) == [0, 1, 2]
    metadata = json.loads((first / "metadata.json").read_text())
    assert [launch["epochs"] for launch in metadata["launches"]] == [2, 3]


def test_lowering_the_budget_below_what_is_done_finishes_at_once(tmp_path, caplog):
    run_dir, _ = _train(tmp_path, auto_resume=True, epochs=3)
    before = _snapshot(run_dir / "checkpoints")
    with caplog.at_level(logging.INFO, logger="danling"):
        runner = TinyRunner(tiny_config(tmp_path, auto_resume=True, epochs=2))
        weights = model_state(runner)
        runner.train()
        runner.close()
    assert runner.train_state.epoch == 3 and runner.train_state.global_step == 3 * STEPS_PER_EPOCH
    assert all(torch.equal(weights[key], value) for key, value in model_state(runner).items())
    assert _snapshot(run_dir / "checkpoints") == before
    spent = [r for r in caplog.records if "training budget already spent" in r.getMessage()]
    assert spent and spent[0].levelno == logging.WARNING and "3 epochs are done and epochs=2" in spent[0].getMessage()


def test_an_extended_schedule_is_rebuilt_for_the_new_total_and_continued_from_the_saved_step(tmp_path, caplog):
    schedule = {"scheduler.type": "linear", "scheduler.warmup_steps": 0, "scheduler.cooldown_steps": 0}
    _train(tmp_path, auto_resume=True, **schedule)
    with caplog.at_level(logging.WARNING, logger="danling"):
        runner = TinyRunner(tiny_config(tmp_path, auto_resume=True, epochs=4, **schedule))
        scheduler = runner.scheduler
        assert scheduler.total_steps == 4 * STEPS_PER_EPOCH and scheduler.last_epoch == 2 * STEPS_PER_EPOCH
        expected = scheduler.lr_at(scheduler.base_lrs[0], 2 * STEPS_PER_EPOCH + 1)
        assert runner.optimizer.param_groups[0]["lr"] == pytest.approx(expected)
        runner.train()
        runner.close()
    assert "schedule rebuilt for total_steps=20 (the saved run had 10)" in _messages(caplog)
    assert scheduler.last_epoch == 4 * STEPS_PER_EPOCH


# ------------------------------------------------------------------------------------ never overwrite


def test_a_new_run_never_writes_into_another_runs_directory(tmp_path, caplog):
    first, _ = _train(tmp_path)
    before = _snapshot(first)
    with caplog.at_level(logging.WARNING, logger="danling"):
        second, runner = _train(tmp_path)  # same config, no auto_resume: a new run
    assert second == first.with_name(first.name + "-v2") and runner.workspace.version == 2
    assert f"{first} already holds the checkpoints of an earlier run" in _messages(caplog)
    assert "set auto_resume: true" in _messages(caplog)
    assert _snapshot(first) == before
    third, _ = _train(tmp_path)
    assert third.name.endswith("-v3")
    resumed = TinyRunner(tiny_config(tmp_path, auto_resume=True, epochs=3))
    assert Path(resumed.dir) == third and resumed.train_state.epoch == 2  # the newest version continues
    resumed.close()


def test_continuing_a_later_version_does_not_announce_a_new_run(tmp_path, caplog):
    first, _ = _train(tmp_path)
    second, _ = _train(tmp_path)  # -v2, beside the first
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="danling"):
        resumed = TinyRunner(tiny_config(tmp_path, auto_resume=True, epochs=3))
        assert Path(resumed.dir) == second and resumed.train_state.epoch == 2
        resumed.close()
    # the run continues -v2: a warning that it is a new run beside an earlier one would be false
    assert "already holds the checkpoints of an earlier run" not in _messages(caplog)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="danling"):
        resumed = TinyRunner(tiny_config(tmp_path, resume=os.fspath(second), epochs=3))
        assert Path(resumed.dir) == second
        resumed.close()
    assert "already holds the checkpoints of an earlier run" not in _messages(caplog)


def _child(mode: str, directory: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(_REPO), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "tests.runners._lock_child", mode, str(directory)]
    proc = subprocess.Popen(command, cwd=_REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()  # printed once the child's state is in place
    assert line, f"child {mode} failed (exit {proc.wait()})"
    return proc, line


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    proc.stdin.close()


def test_a_live_lock_refuses_a_second_process_and_a_dead_ones_lock_is_taken_over(tmp_path, caplog):
    config = tiny_config(tmp_path, auto_resume=True)
    probe = TinyRunner(config)
    run_dir = Path(probe.workspace.path)
    probe.close()
    assert read_lock_holder(run_dir) is None  # released on close
    proc, _ = _child("lock", run_dir)
    try:
        before = _snapshot(run_dir)
        with pytest.raises(RunDirectoryLockedError, match=rf"in use by pid {proc.pid} on host"):
            TinyRunner(config)
        assert _snapshot(run_dir) == before  # the refused process wrote nothing into the live run
        with pytest.raises(RunDirectoryLockedError, match=str(proc.pid)):
            RunLock(run_dir).acquire()
    finally:
        _kill(proc)
    assert read_lock_holder(run_dir)["pid"] == proc.pid  # a killed holder leaves its record behind
    with caplog.at_level(logging.WARNING, logger="danling"):  # runners close inside: they restore log levels
        runner = TinyRunner(config)
        assert read_lock_holder(run_dir)["pid"] == os.getpid()
        runner.train()
        runner.close()
    assert f"taking over the lock of pid {proc.pid}" in _messages(caplog)
    assert read_lock_holder(run_dir) is None


def test_checkpoint_recovery_spares_a_live_writers_save_and_cleans_a_dead_ones(tmp_path):
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    proc, name = _child("save", directory)
    try:
        FileCheckpointManager(directory)  # opening a manager recovers the directory
        assert (directory / name / "payload.part").is_file()
    finally:
        _kill(proc)
    FileCheckpointManager(directory)
    assert not (directory / name).exists()


# ------------------------------------------------------------------------------------ loud differences


def test_auto_resume_names_runs_of_the_experiment_whose_identity_differs(tmp_path, caplog):
    first, _ = _train(tmp_path, auto_resume=True)
    with caplog.at_level(logging.WARNING, logger="danling"):
        runner = TinyRunner(tiny_config(tmp_path, auto_resume=True, **{"optim.lr": 0.02}))
        runner.close()
    assert runner.train_state.epoch == 0 and Path(runner.dir) != first
    assert f"run {first} of experiment 'exp' trained a different config" in _messages(caplog)
    assert "optim.lr: 0.01 -> 0.02" in _messages(caplog)


def test_a_non_finite_value_recorded_as_null_is_no_difference(tmp_path, caplog):
    unclipped = {"max_grad_norm": float("inf"), "auto_resume": True}
    TinyRunner(tiny_config(tmp_path, **unclipped)).close()  # metadata.json records the inf as null
    with caplog.at_level(logging.WARNING, logger="danling"):
        TinyRunner(tiny_config(tmp_path, **unclipped, **{"optim.lr": 0.02})).close()
    assert "optim.lr: 0.01 -> 0.02" in _messages(caplog)
    assert "max_grad_norm" not in _messages(caplog)


def test_explicit_resume_of_another_identity_raises_unless_changes_are_allowed(tmp_path, caplog):
    first, _ = _train(tmp_path)
    changed = {"optim.lr": 0.02, "resume": os.fspath(first)}
    with pytest.raises(ValueError, match=r"keys that differ: \['optim.lr'\].*resume_allow_changes"):
        TinyRunner(tiny_config(tmp_path, **changed))
    with caplog.at_level(logging.WARNING, logger="danling"):
        runner = TinyRunner(tiny_config(tmp_path, resume_allow_changes=True, epochs=3, **changed))
        runner.close()
    assert runner.train_state.epoch == 2
    assert "optim.lr was 0.01 in the checkpoint's run, now 0.02" in _messages(caplog)


def test_explicit_resume_with_an_equal_value_spelled_apart_is_the_same_config(tmp_path):
    # `weight_decay: 0` in one launch and `--optim.weight_decay 0.0` in the next hash apart, but nothing differs:
    # the resume used to be refused with "keys that differ: []"
    first, _ = _train(tmp_path, **{"optim.weight_decay": 0})
    runner = TinyRunner(tiny_config(tmp_path, epochs=3, resume=os.fspath(first), **{"optim.weight_decay": 0.0}))
    runner.close()
    assert runner.train_state.epoch == 2


def test_continuing_across_a_commit_warns_with_both_commits(tmp_path, caplog, monkeypatch):
    repo = tmp_path / "code"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "train.py").write_text("v = 1\n")
    subprocess.run([*git, "-C", str(repo), "add", "."], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-qm", "one"], check=True)
    clone = tmp_path / "code2"  # a second checkout: the process caches a directory's HEAD
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    (clone / "train.py").write_text("v = 2\n")
    subprocess.run([*git, "-C", str(clone), "commit", "-qam", "two"], check=True)
    head = subprocess.check_output(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], text=True).strip()
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "__file__", str(repo / "train.py"), raising=False)
    first, runner = _train(tmp_path / "runs", auto_resume=True)
    old = runner.code_id
    monkeypatch.setattr(main, "__file__", str(clone / "train.py"), raising=False)
    with caplog.at_level(logging.WARNING, logger="danling"):
        resumed = TinyRunner(tiny_config(tmp_path / "runs", auto_resume=True, epochs=3))
        resumed.close()
    new = resumed.code_id
    assert old and new and old != new and Path(resumed.dir) == first and resumed.train_state.epoch == 2
    assert head == old
    assert f"previous launch ran commit {old}, this one runs commit {new}" in _messages(caplog)


# ------------------------------------------------------------------------------------ resume path forms


def test_every_resume_path_form_resumes_the_run(tmp_path):
    run_dir, _ = _train(tmp_path)
    checkpoints = run_dir / "checkpoints"
    forms = [
        run_dir,
        checkpoints,
        "latest",
        checkpoints / "latest",
        checkpoints / "latest.pointer",
        checkpoints / "epoch-000001",
    ]
    for form in forms:
        runner = TinyRunner(tiny_config(tmp_path, resume=os.fspath(form), epochs=3))
        assert runner.train_state.epoch == 2, form
        assert Path(runner.dir) == run_dir, form  # resuming a run continues it
        runner.close()


def test_a_bad_resume_path_lists_what_was_looked_for(tmp_path):
    run_dir, _ = _train(tmp_path)
    missing = run_dir / "checkpoints" / "nothing"
    with pytest.raises(CheckpointNotFoundError, match=r"looked for: .*nothing \(no such file.*nothing\.pointer"):
        TinyRunner(tiny_config(tmp_path, resume=os.fspath(missing)))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"looked for: .*manifest\.json.*checkpoints/latest\.pointer"):
        TinyRunner(tiny_config(tmp_path, resume=os.fspath(empty)))
    assert sorted(path.name for path in run_dir.parent.iterdir()) == [run_dir.name]  # refused before writing


# ------------------------------------------------------------------------------------ read-only


def test_from_checkpoint_and_load_pretrained_leave_the_source_run_untouched(tmp_path, caplog):
    run_dir, _ = _train(tmp_path, log=True)
    before = _snapshot(run_dir)
    with caplog.at_level(logging.INFO, logger="danling"):
        runner = TinyRunner.from_checkpoint(run_dir / "checkpoints" / "latest")
        runner.evaluate(["val"])
        runner.close()
        other = TinyRunner(tiny_config(tmp_path, log=True))
        other.load_pretrained(run_dir)
        other.evaluate(["val"])
        other.close()
    assert _snapshot(run_dir) == before
    assert Path(runner.dir) != run_dir and Path(other.dir) != run_dir
    assert (Path(runner.dir) / "run.log").is_file()  # the outputs went to a new run directory
    assert f"restored checkpoint '{run_dir / 'checkpoints' / 'latest'}'" in _messages(caplog)
    assert "<dict>" not in _messages(caplog)


def test_reconcile_refuses_a_run_that_another_process_trains_in(tmp_path):
    from danling.runners.reconcile import reconcile_run

    run_dir, _ = _train(tmp_path)
    assert reconcile_run(run_dir)["checkpoint"] is not None  # a stopped run: repaired as usual
    proc, _ = _child("lock", run_dir)
    try:
        with pytest.raises(RunDirectoryLockedError, match=rf"cannot reconcile .*pid {proc.pid}"):
            reconcile_run(run_dir)
    finally:
        _kill(proc)
    assert reconcile_run(run_dir)["checkpoint"] is not None


def test_the_version_rule(tmp_path):
    from danling.runners.services.run_dirs import choose_run_dir

    base = tmp_path / "lin" / "exp-0123456789ab"

    def choose(auto_resume=False, resume=None):
        return choose_run_dir(base, dir_name="checkpoints", auto_resume=auto_resume, resume=resume)

    def checkpoint(run_dir):
        FileCheckpointManager(run_dir / "checkpoints").save({"step": 0}, "epoch-000000")

    assert choose() == base and choose(auto_resume=True) == base
    checkpoint(base)
    v2 = base.with_name(base.name + "-v2")
    assert choose() == v2 and choose(auto_resume=True) == base and choose(resume="latest") == base
    checkpoint(v2)
    v3 = base.with_name(base.name + "-v3")
    assert choose() == v3 and choose(auto_resume=True) == v2 and choose(resume="best") == v2
    assert choose(resume=os.fspath(base / "checkpoints" / "latest")) == base  # the run a path lies in
    checkpoint(tmp_path / "other")
    elsewhere = os.fspath(tmp_path / "other" / "checkpoints" / "latest")
    assert choose(resume=elsewhere, auto_resume=True) == v3  # resume wins: another run's checkpoint
    (base / "checkpoints" / ".tmp-epoch-000001-x").mkdir()  # hidden entries are not checkpoints
    assert choose() == v3


def test_a_step_budget_extends_and_lowers_the_same_way(tmp_path, caplog):
    run_dir, _ = _train(tmp_path, auto_resume=True, epochs=None, steps=6)
    with caplog.at_level(logging.INFO, logger="danling"):
        runner = TinyRunner(tiny_config(tmp_path, auto_resume=True, epochs=None, steps=9))
        assert Path(runner.dir) == run_dir and runner.train_state.global_step == 6
        runner.train()
        runner.close()
        assert runner.train_state.global_step == 9
        lowered = TinyRunner(tiny_config(tmp_path, auto_resume=True, epochs=None, steps=4))
        lowered.train()
        lowered.close()
    assert lowered.train_state.global_step == 9
    assert "9 optimizer steps are done and steps=4" in _messages(caplog)


def _damage(checkpoint: Path, how: str) -> None:
    payload = checkpoint / "state.pt"
    if how == "manifest removed":
        (checkpoint / "manifest.json").unlink()
    elif how == "truncated":
        payload.write_bytes(payload.read_bytes()[:100])
    else:  # a flipped byte
        data = bytearray(payload.read_bytes())
        data[len(data) // 2] ^= 0xFF
        payload.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["manifest removed", "truncated", "flipped byte"])
def test_auto_resume_never_overwrites_checkpoints_it_cannot_verify(tmp_path, caplog, how):
    first, _ = _train(tmp_path, auto_resume=True, epochs=3)
    checkpoints = first / "checkpoints"
    for checkpoint in sorted(checkpoints.glob("epoch-*")):
        _damage(checkpoint, how)
    evidence = _snapshot(checkpoints)
    with caplog.at_level(logging.WARNING):
        second, runner = _train(tmp_path, auto_resume=True, epochs=3)
    assert second == first.with_name(first.name + "-v2") and runner.train_state.epoch == 3
    assert _snapshot(checkpoints) == evidence  # nothing replaced, nothing pruned
    message = next(m for m in _messages(caplog).splitlines() if "verifies, so this run" in m)
    assert str(checkpoints) in message and str(second) in message
    assert all(f"epoch-00000{epoch}: " in message for epoch in range(3))  # each one, with why it was refused
    third = TinyRunner(tiny_config(tmp_path, auto_resume=True, epochs=3))  # the new version continues from now on
    assert Path(third.dir) == second and third.train_state.epoch == 3
    third.close()


def test_auto_resume_can_stop_instead_of_starting_a_new_version_beside_unverifiable_checkpoints(tmp_path):
    from danling.checkpoint import CheckpointError

    first, _ = _train(tmp_path, auto_resume=True, epochs=2)
    checkpoints = first / "checkpoints"
    for checkpoint in sorted(checkpoints.glob("epoch-*")):
        _damage(checkpoint, "truncated")
    evidence, before = _snapshot(checkpoints), sorted(first.parent.iterdir())
    config = tiny_config(tmp_path, auto_resume=True, epochs=2, **{"checkpoint.unverifiable": "stop"})
    with pytest.raises(
        CheckpointError, match=r"no checkpoint in .* verifies \(refused: epoch-00000[01]: .*'stop'"
    ) as err:
        TinyRunner(config)
    assert (
        str(checkpoints) in str(err.value) and "epoch-000000: " in str(err.value) and "epoch-000001: " in str(err.value)
    )
    assert _snapshot(checkpoints) == evidence and sorted(first.parent.iterdir()) == before  # nothing written
    with pytest.raises(ValueError, match=r"checkpoint.unverifiable"):
        TinyRunner(tiny_config(tmp_path, **{"checkpoint.unverifiable": "ignore"}))


def test_a_subclass_that_extends_config_id_ignores_resumes_after_a_budget_change(tmp_path):
    from danling.runners import RunnerConfig

    class InferConfig(RunnerConfig):
        CONFIG_ID_IGNORES = (*RunnerConfig.CONFIG_ID_IGNORES, "infer_only")
        infer_only: bool = False

    def config(**overrides):
        return InferConfig(**tiny_config(tmp_path, auto_resume=True, **overrides))

    first = TinyRunner(config(epochs=1))
    first.train()
    first.close()
    resumed = TinyRunner(config(epochs=2))  # raised "infer_only: False -> None" before
    assert Path(resumed.dir) == Path(first.dir) and resumed.train_state.epoch == 1
    resumed.train()
    resumed.close()
    assert resumed.train_state.epoch == 2


def test_checkpoints_auto_resume_skips_are_set_aside_not_replaced_by_the_saves_after(tmp_path, caplog):
    first, _ = _train(tmp_path, auto_resume=True, epochs=3)
    checkpoints = first / "checkpoints"
    _damage(checkpoints / "epoch-000002", "flipped byte")
    evidence = _snapshot(checkpoints / "epoch-000002")
    with caplog.at_level(logging.WARNING):
        second, runner = _train(tmp_path, auto_resume=True, epochs=3)
    assert second == first and runner.train_state.epoch == 3  # resumed from epoch 1, trained epoch 2 again
    kept = list((checkpoints / ".refused").iterdir())
    assert [path.name.rsplit("-", 1)[0] for path in kept] == ["epoch-000002"]
    assert _snapshot(kept[0]) == evidence  # the corrupt one, as it was
    FileCheckpointManager(checkpoints).verify("epoch-000002")  # the new save of that name
    messages = _messages(caplog)
    assert "['epoch-000002'] do not verify; moved to" in messages
    assert "latest checkpoint" in messages and "is not usable" in messages  # latest was the refused one
