"""Derived state of a run directory heals: lagging aliases, missing or stale result files, leftovers."""

from __future__ import annotations

import io
import json
import logging

import pytest

from danling.checkpoint.layout import write_pointer
from danling.cli import main as cli_main
from danling.runners import RunnerConfig
from danling.runners.reconcile import _Rows, reconcile_run
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
    assert _Rows(RunnerConfig(), rows).best_index == 2
    scored = {0: {"val": {"acc": 0.5}}, 1: {"val": {"acc": 0.9}}, 2: {"val": {"acc": 0.9}}}
    assert _Rows(RunnerConfig(score_name="acc"), scored).best_index == 2
