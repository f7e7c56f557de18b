"""A real signal to a real training process: finish the step, save `shutdown`, exit 128 + signum."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from danling.checkpoint import read_checkpoint
from tests.runners._toy import ToyRunner, toy_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_a_shutdown_checkpoint_and_exits(tmp_path, signum):
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.runners._shutdown_child", str(tmp_path)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        report = proc.stdout.readline().split()  # blocks until the child is inside a training step
        assert report[:1] == ["inside-loop"], proc.stderr.read()
        proc.send_signal(signum)
        proc.stdin.write("continue\n")
        proc.stdin.flush()
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signum, stderr

    checkpoints = Path(report[1])
    shutdown, latest = (checkpoints / f"{alias}.pointer" for alias in ("shutdown", "latest"))
    assert shutdown.read_text() == latest.read_text()
    payload = read_checkpoint(checkpoints / "shutdown.pointer")  # verified against its manifest
    # the interrupted step (global step 7 -> 8) was finished before saving; epoch 1 was in progress
    assert payload["state"]["train"] == {"epoch": 1, "global_step": 8, "micro_step": 8}
    assert list(payload["results"]) == [0]

    with ToyRunner(toy_config(tmp_path, epochs=100, resume=str(checkpoints / "shutdown.pointer"))) as resumed:
        assert resumed.train_state.global_step == 8
        assert resumed.model.weight == payload["model"]["weight"]
