"""Derived state of a run directory heals: lagging aliases, missing or stale result files, leftovers."""

from __future__ import annotations

import io
import json
import logging

import pytest

from danling.checkpoint.layout import write_pointer
from danling.cli import main as cli_main
from danling.runners import RunnerConfig
from danling.runners.reconcile import reconcile_run
from danling.runners.services import RunnerResults
from tests.runners._toy import ToyRunner, toy_config


@pytest.fixture
def finished_run(tmp_path):
    """A finished 4-epoch toy run: its run directory, the true best row index and the result files."""
    with ToyRunner(toy_config(tmp_path, epochs=4)) as runner:
        runner.train()
        run_dir, best = runner.workspace.path, runner.best_index
    files = {name: json.loads((run_dir / name).read_text()) for name in ("results.json", "latest.json", "best.json")}
    return run_dir, best, files


def _break(run_dir, best):
    """A kill-like state: lagging latest, stale best, missing best.json, stale results.json, leftovers."""
    checkpoints = run_dir / "checkpoints"
    write_pointer(checkpoints, "latest", "epoch-000001")
    write_pointer(checkpoints, "best", f"epoch-{(best + 1) % 4:06d}")
    (run_dir / "best.json").unlink()
    results = json.loads((run_dir / "results.json").read_text())
    results["results"].pop("3")
    (run_dir / "results.json").write_text(json.dumps(results))
    leftovers = [run_dir / ".config.yaml.4242.tmp", run_dir / ".results.json.1a2b3c4d.tmp"]
    leftovers.append(run_dir / ".status.json.tmp-3ecabb2a0b3240dd91a9f5cbc94d092f")  # atomic_write_text's
    for path in leftovers:
        path.write_text("partial")
    staging = checkpoints / ".tmp-epoch-000004-0123456789abcdef"
    staging.mkdir()
    (staging / "state.pt").write_bytes(b"half")
    return [*leftovers, staging]


def _assert_healed(run_dir, best, files, leftovers):
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest.pointer").read_text().strip() == "epoch-000003"
    assert (checkpoints / "best.pointer").read_text().strip() == f"epoch-{best:06d}"
    for name, content in files.items():
        assert json.loads((run_dir / name).read_text()) == content, name
    assert not any(path.exists() for path in leftovers)


def test_reconcile_run_repairs_a_killed_run(finished_run, caplog):
    run_dir, best, files = finished_run
    leftovers = _break(run_dir, best)
    with caplog.at_level(logging.WARNING):
        report = reconcile_run(run_dir)
    assert report["latest"] == ["epoch-000001", "epoch-000003"]
    assert report["best"] == [f"epoch-{(best + 1) % 4:06d}", f"epoch-{best:06d}"]
    assert sorted(report["rebuilt"]) == ["best.json", "results.json"]
    assert len(report["removed"]) == 4
    assert any("'latest' pointed to epoch-000001" in r.getMessage() for r in caplog.records)
    _assert_healed(run_dir, best, files, leftovers)
    assert reconcile_run(run_dir) == {**report, "latest": None, "best": None, "rebuilt": [], "removed": []}


def test_next_start_heals_and_auto_resume_takes_the_newest_valid_checkpoint(finished_run, tmp_path):
    run_dir, best, files = finished_run
    leftovers = _break(run_dir, best)
    with ToyRunner(toy_config(tmp_path, epochs=4, auto_resume=True)) as resumed:
        assert resumed.train_state.epoch == 4  # not epoch 2 from the lagging pointer
        assert resumed.workspace.path == run_dir
        _assert_healed(run_dir, best, files, leftovers)


def test_reconcile_command(finished_run):
    run_dir, best, files = finished_run
    leftovers = _break(run_dir, best)
    out = io.StringIO()
    assert cli_main(["reconcile", str(run_dir)], out=out) == 0
    assert "latest:     epoch-000001 -> epoch-000003" in out.getvalue()
    _assert_healed(run_dir, best, files, leftovers)
    out = io.StringIO()
    assert cli_main(["reconcile", str(run_dir), "--json"], out=out) == 0
    assert json.loads(out.getvalue())["latest"] is None
    err = io.StringIO()
    assert (
        cli_main(["reconcile", str(run_dir / "checkpoints")], err=err) == 2 and "not a run directory" in err.getvalue()
    )


def test_best_ties_go_to_the_latest_row():
    rows = {0: {"val": {"loss": 2.0}}, 1: {"val": {"loss": 1.0}}, 2: {"val": {"loss": 1.0}}, 3: {"val": {"loss": 1.5}}}
    assert RunnerResults(RunnerConfig(), rows).best_index == 2
    scored = {0: {"val": {"acc": 0.5}}, 1: {"val": {"acc": 0.9}}, 2: {"val": {"acc": 0.9}}}
    assert RunnerResults(RunnerConfig(score_name="acc"), scored).best_index == 2


class FractionRunner(ToyRunner):
    """Saves a `fractions.Fraction`: harmless, but outside the restricted unpickler's allow-list."""

    def state_dict(self, cls=dict):
        from fractions import Fraction

        payload = super().state_dict(cls)
        payload["ratio"] = Fraction(1, 3)
        return payload


@pytest.mark.parametrize("how", ["auto_resume", "resume"])
def test_trust_pickle_is_honoured_by_the_reconcile_on_start(tmp_path, how):
    trusted = {"checkpoint.trust_pickle": True}
    with FractionRunner(toy_config(tmp_path, epochs=1, **trusted)) as runner:
        runner.train()
        run_dir = runner.workspace.path
    source = {"auto_resume": True} if how == "auto_resume" else {"resume": str(run_dir / "checkpoints" / "latest")}
    with FractionRunner(toy_config(tmp_path, epochs=2, **trusted, **source)) as resumed:
        assert resumed.train_state.epoch == 1 and resumed.workspace.path == run_dir
    out = io.StringIO()
    assert cli_main(["reconcile", str(run_dir), "--trust-pickle"], out=out) == 0
    err = io.StringIO()
    assert cli_main(["reconcile", str(run_dir)], err=err) == 2 and "fractions.Fraction" in err.getvalue()


def test_garbage_in_latest_pointer_falls_back_with_a_warning(finished_run, tmp_path, caplog):
    run_dir, _, _ = finished_run
    (run_dir / "checkpoints" / "latest.pointer").write_bytes(b"\xff\xfe\x00garbage\x9c")
    out = io.StringIO()
    assert cli_main(["reconcile", str(run_dir)], out=out) == 0
    assert "latest:     - -> epoch-000003" in out.getvalue()
    (run_dir / "checkpoints" / "latest.pointer").write_bytes(b"\xff\xfe\x00garbage\x9c")
    config = toy_config(tmp_path, epochs=4, auto_resume=True)
    with caplog.at_level(logging.WARNING), ToyRunner(config) as resumed:
        assert resumed.train_state.epoch == 4
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("'latest' pointed to None; corrected to epoch-000003" in message for message in warnings)


def test_a_lagging_latest_moved_by_reconcile_is_not_called_unusable(finished_run, tmp_path, caplog):
    run_dir, _, _ = finished_run
    write_pointer(run_dir / "checkpoints", "latest", "epoch-000001")  # fine, only behind
    config = toy_config(tmp_path, epochs=4, auto_resume=True)
    with caplog.at_level(logging.WARNING), ToyRunner(config) as resumed:
        assert resumed.train_state.epoch == 4
    messages = [r.getMessage() for r in caplog.records]
    assert any("'latest' pointed to epoch-000001; corrected to epoch-000003" in message for message in messages)
    assert not any("is not usable" in message for message in messages)
