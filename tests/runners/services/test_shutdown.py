"""A real signal to a real training process: finish the step, save `shutdown`, exit 128 + signum."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from danling.checkpoint import read_checkpoint
from tests.dist import free_ports
from tests.runners._torch_toy import TinyRunner, tiny_config
from tests.runners._toy import ToyRunner, toy_config

REPO = Path(__file__).resolve().parents[3]


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


@pytest.mark.distributed
def test_sigterm_stops_both_ddp_ranks_with_a_shutdown_checkpoint(tmp_path, caplog):
    import os

    env = dict(
        os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]), OMP_NUM_THREADS="1"
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.runners._ddp_shutdown_child", str(tmp_path)],
            cwd=REPO,
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        reports = [proc.stdout.readline().split() for proc in procs]  # both ranks inside a step
        assert all(report[:1] == ["inside-loop"] for report in reports), [p.stderr.read() for p in procs]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.stdin.write("continue\n")
            proc.stdin.flush()
        errors = [proc.communicate(timeout=180)[1] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [proc.returncode for proc in procs] == [128 + signal.SIGTERM] * 2, errors[0][-3000:] + errors[1][-3000:]
    checkpoints = Path(reports[0][1])
    assert (checkpoints / "shutdown.pointer").read_text() == (checkpoints / "latest.pointer").read_text()
    # Read back in one process: the per-rank loader positions cannot follow, the rest does.
    resume = {"resume": str(checkpoints / "shutdown.pointer"), "checkpoint.exclude_from_loading": "dataloaders"}
    with caplog.at_level(logging.WARNING, logger="danling"):
        resumed = TinyRunner(tiny_config(tmp_path, epochs=2, **resume))
    with resumed:
        # Stopped after the last batch of the interrupted pass (step 1 -> 2 finished), before its
        # evaluation. Without the loader positions that pass restarts from its first batch on the
        # new layout; the counters keep the 2 updates it applied.
        assert resumed.train_state.epoch == 0 and resumed.train_state.global_step == 2
        assert (resumed.loop_state.split, resumed.loop_state.batch) == ("train", 0) and not resumed.results
    assert "the 2 batch(es) it had trained are trained again" in caplog.text
