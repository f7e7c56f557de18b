"""RunnerSupervisor: signals become stop requests, heartbeats, GC pacing."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from danling.checkpoint import FileCheckpointManager
from danling.runners.services.supervisor import RunnerSupervisor

CHILD = Path(__file__).resolve().parents[1].joinpath("_graceful_child.py")
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def supervisor():
    supervisors = []

    def make(**kwargs):
        supervisors.append(RunnerSupervisor(**kwargs))
        return supervisors[-1]

    yield make
    for item in supervisors:
        item.close()


def test_sigterm_to_self_sets_stop_requested(supervisor):
    before = signal.getsignal(signal.SIGTERM)
    sup = supervisor()
    assert not sup.stop_requested and sup.signum is None and sup.exit_code == 0
    assert sup.install_signal_handlers()
    os.kill(os.getpid(), signal.SIGTERM)
    assert sup.stop_requested
    assert sup.signum == signal.SIGTERM and sup.exit_code == 128 + signal.SIGTERM
    sup.restore_signal_handlers()
    assert signal.getsignal(signal.SIGTERM) is before


def test_second_signal_goes_to_previous_handler(supervisor):
    calls = []
    original = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    try:
        sup = supervisor(signals=(signal.SIGUSR1,))
        sup.install_signal_handlers()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert sup.stop_requested and calls == []
        os.kill(os.getpid(), signal.SIGUSR1)  # impatient second signal
        assert calls == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, original)


def test_handlers_need_the_main_thread(supervisor):
    sup = supervisor()
    result = []
    thread = threading.Thread(target=lambda: result.append(sup.install_signal_handlers()))
    thread.start()
    thread.join()
    assert result == [False]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_mid_step_finishes_step_saves_and_exits(tmp_path, signum):
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    try:
        assert proc.stdout.readline() == b"in-step 3\n", proc.stderr.read().decode()
        os.kill(proc.pid, signum)
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:  # only when an assertion above failed
            proc.kill()
            proc.wait()
        stderr = proc.stderr.read().decode()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            stream.close()
    assert proc.returncode == 128 + signum, stderr
    manager = FileCheckpointManager(tmp_path / "checkpoints", load_only=True)
    assert manager.load("shutdown")["finished"] == [1, 2, 3]
    assert manager.latest == manager.alias("shutdown") == tmp_path / "checkpoints" / "step-000003"
    heartbeat = json.loads((tmp_path / "heartbeats" / "heartbeat-rank0.json").read_text())
    assert heartbeat["step"] == 3 and heartbeat["phase"] == "closed" and heartbeat["stop_requested"]


def test_heartbeat_throttling_and_content(tmp_path, supervisor):
    sup = supervisor(heartbeat_dir=tmp_path, heartbeat_interval=3600, rank=3)
    assert sup.heartbeat_file == tmp_path / "heartbeat-rank3.json"
    assert sup.beat(1, 0, "train")
    first = json.loads(sup.heartbeat_file.read_text())
    assert {k: first[k] for k in ("rank", "step", "epoch", "phase", "pid")} == {
        "rank": 3,
        "step": 1,
        "epoch": 0,
        "phase": "train",
        "pid": os.getpid(),
    }
    assert isinstance(first["time"], float)
    assert not sup.beat(2, 0, "train")  # within the interval: nothing written
    assert json.loads(sup.heartbeat_file.read_text())["step"] == 1
    assert sup.beat(3, 1, "evaluate", force=True)
    assert json.loads(sup.heartbeat_file.read_text())["phase"] == "evaluate"
    assert [p.name for p in tmp_path.iterdir()] == ["heartbeat-rank3.json"]


def test_heartbeat_disabled_writes_nothing(tmp_path, supervisor):
    sup = supervisor()
    assert not sup.beat(1, 0, "train") and sup.heartbeat_file is None


def test_gc_pacing(supervisor):
    sup = supervisor(gc_interval=2, gc_generation=1)
    before = gc.get_stats()[1]["collections"]
    ran = [sup.gc_step(step) for step in (0, 1, 2, 2, 3, 4)]
    assert ran == [False, False, True, False, False, True]
    assert gc.get_stats()[1]["collections"] >= before + 2
    assert not supervisor().gc_step(10)


def test_gc_disable_automatic_is_restored_on_close():
    assert gc.isenabled()
    sup = RunnerSupervisor(gc_interval=5, gc_disable_automatic=True)
    try:
        assert not gc.isenabled()
    finally:
        sup.close()
    assert gc.isenabled()
    RunnerSupervisor(gc_disable_automatic=True).close()  # no pacing: automatic GC untouched
    assert gc.isenabled()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gc_interval": 0}, "gc_interval"),
        ({"gc_generation": 5}, "gc_generation"),
        ({"heartbeat_interval": -1}, "heartbeat_interval"),
    ],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RunnerSupervisor(**kwargs)
