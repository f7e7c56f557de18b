"""The `danling` command on runs the test suite trains: runs, diff, ckpt, report and their errors."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from danling.cli import main
from tests.cli.conftest import train
from tests.runners._torch_toy import TinyRunner, tiny_config

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main([str(arg) for arg in argv], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def assert_usage_error(code: int, out: str, err: str, *fragments: str) -> None:
    assert code == 2 and out == ""
    assert err.startswith("danling: error: ") and err.count("\n") == 1 and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err


# ---------------------------------------------------------------------------------------- runs


def test_runs_lists_every_run_with_status_progress_and_best_score(workspace):
    code, out, err = run_cli("runs", workspace["root"], "--json")
    assert code == 0 and err == ""
    summaries = {summary["experiment"]: summary for summary in json.loads(out)}
    assert set(summaries) == {"base", "highlr"}  # the DCP run lives under another root
    for name in ("a", "b"):
        best = json.loads((workspace[name] / "best.json").read_text())
        summary = summaries["base" if name == "a" else "highlr"]
        assert summary["path"] == str(workspace[name]) and summary["status"] == "finished"
        assert summary["progress"] == {"unit": "epochs", "done": 2, "total": 2, "global_step": 10, "history": [2]}
        assert summary["best"] == {"name": "val/loss", "value": pytest.approx(best["val"]["loss"])}
        assert summary["duration"] > 0 and summary["start_time"]
    assert summaries["base"]["heartbeat_age"] >= 0 and summaries["highlr"]["heartbeat_age"] is None
    code, table, _ = run_cli("runs", workspace["root"])
    lines = table.splitlines()
    assert code == 0 and lines[0].split()[:4] == ["experiment", "run", "status", "progress"]
    base = next(line for line in lines if line.startswith("base "))
    assert "finished" in base and "2/2 epochs" in base and "val/loss=" in base


def test_runs_reports_failed_and_preempted_runs(tmp_path):
    class Failing(TinyRunner):
        def train_step(self, data):
            if self.train_state.global_step == 3:
                raise RuntimeError("loss exploded")
            return super().train_step(data)

    class Preempted(TinyRunner):
        def train_step(self, data):
            if self.train_state.global_step == 7:
                self.supervisor.request_stop()
            return super().train_step(data)

    failing = Failing(tiny_config(tmp_path, experiment="failing"))
    with pytest.raises(RuntimeError, match="exploded"):
        failing.train()
    failing.close()
    preempted = Preempted(tiny_config(tmp_path, experiment="preempted"))
    with pytest.raises(SystemExit):
        preempted.train()
    # A run whose process died without recording an end (SIGKILL, OOM killer): its pid is gone.
    killed = train(tmp_path, experiment="killed")
    status = json.loads((killed / "status.json").read_text())
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    status.update(status="running", pid=int(gone.stdout))
    (killed / "status.json").write_text(json.dumps(status))
    code, out, _ = run_cli("runs", tmp_path, "--json")
    summaries = {summary["experiment"]: summary for summary in json.loads(out)}
    assert code == 0
    assert summaries["failing"]["status"] == "failed" and "RuntimeError: loss exploded" in summaries["failing"]["note"]
    assert summaries["preempted"]["status"] == "preempted"
    assert summaries["preempted"]["progress"]["global_step"] == 8  # stopped after the step that asked
    assert summaries["killed"]["status"] == "failed" and "process gone" in summaries["killed"]["note"]


def test_runs_errors_and_empty_roots(tmp_path):
    assert_usage_error(*run_cli("runs", tmp_path / "missing"), "missing", "not a directory")
    code, out, _ = run_cli("runs", tmp_path)
    assert code == 0 and out == f"no runs under {tmp_path}\n"


def test_runs_lists_a_damaged_run_and_reads_fields_of_the_wrong_type_as_absent(tmp_path):
    # A run whose metadata.json was damaged vanished from the listing; status.json holding a list,
    # a heartbeat time that is no number or a start time that is no text ended in a traceback.
    odd = tmp_path / "lin" / "exp-aaaa"
    (odd / "heartbeats").mkdir(parents=True)
    (odd / "metadata.json").write_text(json.dumps({"experiment": "exp", "id": "aaaa", "start_time": 5}))
    (odd / "status.json").write_text("[1, 2]")
    (odd / "heartbeats" / "heartbeat-rank0.json").write_text(json.dumps({"time": "soon", "step": "x"}))
    damaged = tmp_path / "lin" / "exp-bbbb"
    damaged.mkdir(parents=True)
    (damaged / "metadata.json").write_text("{not json")
    code, out, err = run_cli("runs", tmp_path, "--json")
    assert code == 0 and err == ""
    runs = {run["id"]: run for run in json.loads(out)}
    assert runs["bbbb"]["status"] == "damaged" and "metadata.json" in runs["bbbb"]["note"]
    assert runs["aaaa"]["start_time"] is None and runs["aaaa"]["heartbeat_age"] is None
    code, out, _ = run_cli("runs", tmp_path)
    assert code == 0 and "damaged (metadata.json" in out


def test_runs_in_a_real_subprocess(workspace):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "danling", "runs", str(workspace["root"]), "--json"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert sorted(summary["experiment"] for summary in json.loads(result.stdout)) == ["base", "highlr"]
    bad = subprocess.run([*command[:4], str(workspace["a"] / "nope")], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and bad.stderr.startswith("danling: error: ") and "Traceback" not in bad.stderr


# ---------------------------------------------------------------------------------------- diff


def test_diff_shows_config_changes_and_results_side_by_side(workspace):
    code, out, _ = run_cli("diff", workspace["a"], workspace["b"], "--json")
    diff = json.loads(out)
    assert code == 0
    assert diff["config"]["optim.lr"] == [0.01, 0.05]
    assert diff["config"]["experiment"] == ["base", "highlr"]
    assert diff["config"]["heartbeat.enabled"] == [True, False]
    assert "epochs" not in diff["config"]  # equal keys are left out
    best_a = json.loads((workspace["a"] / "best.json").read_text())
    best_b = json.loads((workspace["b"] / "best.json").read_text())
    assert diff["results"]["best"]["val/loss"] == [best_a["val"]["loss"], best_b["val"]["loss"]]
    code, text, _ = run_cli("diff", workspace["a"], workspace["b"])
    lr_line = next(line for line in text.splitlines() if line.startswith("optim.lr"))
    assert code == 0 and lr_line.split() == ["optim.lr", "0.01", "0.05"]
    assert "best result" in text and "latest result" in text


def test_runs_diff_and_report_show_the_budget_of_an_extended_run_and_its_history(workspace, tmp_path):
    root = tmp_path / "extended"
    first = train(root, experiment="long", epochs=2)
    extended = train(root, experiment="long", epochs=4, auto_resume=True)  # the same run, continued
    assert extended == first
    code, out, _ = run_cli("runs", root, "--json")
    progress = json.loads(out)[0]["progress"]
    assert code == 0 and (progress["done"], progress["total"], progress["history"]) == (4, 4, [2, 4])
    code, text, _ = run_cli("runs", root)
    assert code == 0 and "4/4 epochs (budget 2 -> 4)" in text and "4/2" not in text
    code, out, _ = run_cli("diff", workspace["a"], extended, "--json")
    diff = json.loads(out)
    assert diff["config"]["epochs"] == [2, 4] and diff["budgets"] == [[2], [2, 4]]
    code, text, _ = run_cli("diff", workspace["a"], extended)
    assert "budget by launch: A 2, B 2 -> 4" in text
    pytest.importorskip("matplotlib")
    assert run_cli("report", extended, "--out", tmp_path)[0] == 0
    assert "4/4 epochs (budget 2 -&gt; 4)" in (tmp_path / "report.html").read_text()


def test_diff_json_tells_a_key_one_run_lacks_from_a_key_set_to_none(workspace, tmp_path):
    runs = []
    for name, extra in (("a", {"note": None}), ("b", {"depth": 3})):
        run = tmp_path / name
        shutil.copytree(workspace[name], run)
        metadata = json.loads((run / "metadata.json").read_text())
        metadata["config"].update(extra)
        (run / "metadata.json").write_text(json.dumps(metadata))
        runs.append(run)
    code, out, _ = run_cli("diff", *runs, "--json")
    diff = json.loads(out)
    assert code == 0 and diff["config"]["note"] == [None, None] and diff["config"]["depth"] == [None, 3]
    assert diff["unset"] == {"a": ["depth"], "b": ["note"]}
    text = run_cli("diff", *runs)[1]
    assert "note" in text and "<unset>" in text


class NonFinite(TinyRunner):
    """Rows whose validation split holds a NaN and an infinite metric beside the finite loss."""

    def collect_result(self, split):
        result = super().collect_result(split)
        if split == "val":
            result.update(nan=float("nan"), inf=float("inf"))
        return result


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def test_result_files_and_json_output_are_strict_json_with_null_for_non_finite_values(workspace, tmp_path):
    runner = NonFinite(tiny_config(tmp_path / "nonfinite"))
    try:
        runner.train()
    finally:
        runner.close()
    run = runner.workspace.path
    assert runner.results[1]["val"]["nan"] != runner.results[1]["val"]["nan"]  # the rows keep the float
    for name in ("results.json", "latest.json", "best.json"):
        text = (run / name).read_text()
        data = json.loads(text, parse_constant=_refuse_constant)  # Python's NaN or Infinity would raise
        row = data["results"]["1"] if name == "results.json" else data
        assert row["val"]["nan"] is None and row["val"]["inf"] is None and row["val"]["loss"] > 0, name
    code, out, _ = run_cli("diff", workspace["a"], run, "--json")
    diff = json.loads(out, parse_constant=_refuse_constant)
    assert code == 0 and diff["results"]["best"]["val/nan"][1] is None
    assert "val/nan" in run_cli("diff", workspace["a"], run)[1]  # the table reads null back
    # A best.json with Python's NaN, as earlier versions wrote it: `runs --json` stays strict too.
    best = json.loads((run / "best.json").read_text())
    best["val"]["loss"] = float("nan")
    (run / "best.json").write_text(json.dumps(best))
    code, out, _ = run_cli("runs", tmp_path / "nonfinite", "--json")
    (summary,) = json.loads(out, parse_constant=_refuse_constant)
    assert code == 0 and summary["best"] == {"name": "val/loss", "value": None}


def test_diff_rejects_a_directory_that_is_not_a_run(workspace, tmp_path):
    assert_usage_error(*run_cli("diff", workspace["a"], tmp_path), str(tmp_path), "not a run directory")


# ---------------------------------------------------------------------------------------- ckpt


def test_ckpt_takes_an_alias_by_its_short_name_as_from_checkpoint_does(workspace):
    best = json.loads((workspace["a"] / "best.json").read_text())["index"]
    code, out, err = run_cli("ckpt", workspace["a"] / "checkpoints" / "best", "--json")
    assert code == 0 and err == ""
    assert json.loads(out)["path"] == str(workspace["a"] / "checkpoints" / f"epoch-{best:06d}")


def test_ckpt_reads_the_checkpoints_of_a_run_whose_metadata_is_damaged(workspace, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(workspace["a"], run)
    latest = json.loads(run_cli("ckpt", workspace["a"], "--json")[1])["path"]
    for damaged in ("", "[]", '{"config": 3}'):
        (run / "metadata.json").write_text(damaged)
        code, out, err = run_cli("ckpt", run, "--json")
        assert code == 0 and err == "" and Path(json.loads(out)["path"]).name == Path(latest).name


def test_ckpt_describes_file_and_dcp_checkpoints(workspace):
    code, out, _ = run_cli("ckpt", workspace["a"], "--json")  # a run directory: its latest checkpoint
    info = json.loads(out)
    assert code == 0
    assert info["path"] == str(workspace["a"] / "checkpoints" / "epoch-000001")
    assert (info["format"], info["step"], info["epoch"]) == ("file", 10, 2)
    assert info["verification"]["ok"] is True
    # 2 Linear layers: 4 parameter tensors of 4*8 + 8 + 8 + 1 floats; AdamW holds 3 tensors per parameter
    assert info["components"]["model"] == {"tensors": 4, "bytes": 49 * 4, "objects": 0}
    assert info["components"]["optimizer"]["tensors"] == 12
    code, out, _ = run_cli("ckpt", workspace["dcp"] / "checkpoints" / "latest.pointer", "--json")
    dcp = json.loads(out)
    assert code == 0 and dcp["format"] == "dcp" and (dcp["step"], dcp["epoch"]) == (10, 2)
    assert dcp["components"]["model"] == info["components"]["model"] and dcp["verification"]["ok"] is True
    code, text, _ = run_cli("ckpt", workspace["a"] / "checkpoints" / "epoch-000000")
    assert code == 0 and "step:       5" in text and "manifest:   ok" in text


def test_ckpt_reports_a_corrupt_checkpoint(workspace, tmp_path):
    source = workspace["a"] / "checkpoints" / "epoch-000000"
    copy = tmp_path / "epoch-000000"
    copy.mkdir()
    for name in ("manifest.json", "state.pt"):
        (copy / name).write_bytes((source / name).read_bytes())
    data = bytearray((copy / "state.pt").read_bytes())
    data[-30] ^= 0xFF
    (copy / "state.pt").write_bytes(bytes(data))
    code, out, _ = run_cli("ckpt", copy)
    assert code == 1 and "manifest:   FAILED" in out and "XXH3-128 does not match" in out


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_ckpt_never_runs_code_from_a_checkpoint(tmp_path):
    marker = tmp_path / "code-was-run"
    torch.save({"model": {"w": torch.ones(2)}, "evil": _Payload(str(marker))}, tmp_path / "evil.pt")
    code, out, err = run_cli("ckpt", tmp_path / "evil.pt")
    assert_usage_error(code, out, err, "weights_only")
    assert not marker.exists()
    torch.save({"model": {"w": torch.ones(2)}}, tmp_path / "plain.pt")  # a plain torch.save file works
    code, out, _ = run_cli("ckpt", tmp_path / "plain.pt", "--json")
    info = json.loads(out)
    assert code == 0 and info["tensors"] == 1 and info["bytes"] == 8 and info["verification"]["ok"] is None


def test_ckpt_rejects_paths_that_are_not_checkpoints(tmp_path):
    assert_usage_error(*run_cli("ckpt", tmp_path / "missing"), "does not exist")
    assert_usage_error(*run_cli("ckpt", tmp_path), "not a checkpoint of any known format")
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    assert_usage_error(*run_cli("ckpt", tmp_path / "notes.pt"), "weights_only")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metadata.json").write_text('{"id": "abc", "config": {}}')
    assert_usage_error(*run_cli("ckpt", run), "run directory without checkpoints")


# ---------------------------------------------------------------------------------------- report


def test_report_writes_html_and_png_plots(workspace, tmp_path):
    code, out, _ = run_cli("report", workspace["a"])
    assert code == 0 and out.splitlines()[0] == f"wrote {workspace['a'] / 'report.html'}"
    page = (workspace["a"] / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 4 and "http" not in page  # self-contained
    for plot in ("loss", "validation", "lr", "throughput"):
        assert (workspace["a"] / "plots" / f"{plot}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, _ = run_cli("report", workspace["a"], workspace["b"], "--out", tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert code == 0 and "base-" in page and "highlr-" in page  # both runs in the tables


def test_report_into_a_place_it_cannot_write_is_a_usage_error(workspace, tmp_path):
    pytest.importorskip("matplotlib")
    taken = tmp_path / "a-file"
    taken.write_text("")
    assert_usage_error(*run_cli("report", workspace["a"], "--out", taken), "cannot write the report", str(taken))


def test_report_series_hold_what_the_plots_need(workspace):
    from danling.cli.records import load_run
    from danling.cli.report import run_series

    series, xlabel = run_series(load_run(workspace["a"]))
    assert xlabel == "global step"
    assert [step for step, _ in series["train_step/loss"]] == list(range(1, 11))
    assert series["lr"] == [(step, 0.01) for step in range(1, 11)]
    assert [step for step, _ in series["val/loss"]] == [5, 10]
    assert all(value > 0 for _, value in series["throughput/samples_per_second"])


def test_the_metrics_figure_draws_train_and_validation_metrics_and_nothing_about_the_run(workspace):
    pytest.importorskip("matplotlib")
    from danling.cli.records import load_run
    from danling.cli.report import _figure, run_series

    run = load_run(workspace["a"])
    series, xlabel = run_series(run)
    assert "memory/peak_rss_mib" in series  # recorded, but a fact about the run, not a metric
    figure = _figure("validation", [(run, series, xlabel)])
    panels = {ax.get_title(): sorted(line.get_label() for line in ax.get_lines()) for ax in figure.axes}
    assert panels == {"loss": ["train", "val"]}


def test_report_names_the_extra_when_matplotlib_is_missing(workspace, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # what an environment without it raises
    assert_usage_error(*run_cli("report", workspace["a"]), "pip install 'danling[report]'")


def test_usage_errors_exit_with_status_2(capsys):
    assert main([]) == 2
    assert main(["frobnicate"]) == 2
    assert "invalid choice" in capsys.readouterr().err
