"""Smoke tests of the demos: a couple of epochs or steps each, driven through their CLI arguments."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "demo"
sys.path.insert(0, str(DEMO))  # run.py imports its neighbour `digits`


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"demo_{name}", DEMO / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def demo_run():
    return _load("run")


def test_run_trains_resumes_and_infers(demo_run, tmp_path, capsys):
    workdir = tmp_path / "runs"
    status = demo_run.main(["--workdir", str(workdir), "--epochs", "2", "--min-accuracy", "0.5"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "resumed from" in out and "at epoch 1" in out
    assert "identical accuracy, identical test predictions" in out
    (run_dir,) = [path for path in workdir.glob("*/*") if path.is_dir()]
    results = json.loads((run_dir / "results.json").read_text())
    assert len(results["results"]) == 2  # one row per epoch, the resumed run kept the first
    assert (run_dir / "checkpoints" / "epoch-000000").is_dir()
    assert (run_dir / "checkpoints" / "epoch-000001").is_dir()
    assert any((run_dir / "tensorboard").iterdir())
    for label in ("run directory", "results.json", "tensorboard --logdir"):
        assert label in out


def test_run_fails_below_the_accuracy_bar(demo_run, tmp_path, capsys):
    args = ["--workdir", str(tmp_path), "--epochs", "2", "--min-accuracy", "1.01", "--tensorboard", "false"]
    status = demo_run.main(args)
    assert status == 1
    assert "FAILED: validation accuracy" in capsys.readouterr().out


def test_digits_script_reads_yaml_and_cli_overrides(tmp_path):
    command = [sys.executable, str(DEMO / "digits.py"), "--config", str(DEMO / "digits.yaml")]
    command += ["--workspace_root", str(tmp_path), "--epochs", "1", "--optim.lr", "0.02", "--hidden", "32"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "val accuracy" in done.stdout
    (metadata,) = tmp_path.glob("*/*/metadata.json")
    config = json.loads(metadata.read_text())["config"]
    assert config["optim"]["lr"] == 0.02 and config["hidden"] == 32  # CLI values win
    assert config["optim"]["type"] == "adamw" and config["score_name"] == "acc"  # YAML values kept


def test_char_lm_trains_in_step_mode_and_samples(tmp_path):
    char_lm = _load("char_lm")
    summary = char_lm.main(["--workspace_root", str(tmp_path), "--steps", "4", "--sample_length", "30"])
    assert set(summary["row"]) == {"train", "val"}
    assert math.isfinite(summary["row"]["val"]["loss"])
    assert summary["sample"].startswith("The ") and len(summary["sample"]) == 4 + 30
    assert (Path(summary["dir"]) / "checkpoints" / "step-000004").is_dir()
