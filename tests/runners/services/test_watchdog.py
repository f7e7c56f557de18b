"""The hang watchdog: a frozen or stuck rank ends a multi-process run with a message; SIGTERM to one rank stops all."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from danling.runners.services.watchdog import Watchdog
from tests.dist import free_ports

REPO = Path(__file__).resolve().parents[3]


def _pair(tmp_path, **kwargs):
    fired = []
    dogs = [Watchdog(tmp_path, rank, 2, 10.0, interval=1.0, on_timeout=fired.append, **kwargs) for rank in range(2)]
    for dog in dogs:
        dog.directory.mkdir(parents=True, exist_ok=True)
        dog.active = True
        dog._publish()
    return dogs, fired


def test_a_silent_rank_is_named_with_its_phase_and_step(tmp_path):
    (watcher, frozen), _ = _pair(tmp_path)
    frozen.enter("forward", 3)
    frozen._publish()  # its last heartbeat, then nothing: frozen
    assert watcher.check(100.0) is None
    watcher.enter("backward", 3)
    watcher._publish()
    assert watcher.check(105.0) is None
    watcher.enter("optimizer step", 3)  # the watcher itself still makes progress
    watcher._publish()
    message = watcher.check(110.0)
    assert message is not None and "no heartbeat for 10 s from 1 rank(s): rank 1" in message
    assert "last in forward at step 3" in message and "rank 0 (" not in message


def test_stalled_ranks_are_named_by_who_is_furthest_behind(tmp_path):
    (ahead, behind), _ = _pair(tmp_path)
    ahead.enter("backward", 8)
    behind.enter("data loading", 7)
    for now in (0.0, 5.0, 10.0):  # both threads beat, neither main thread moves
        for dog in (ahead, behind):
            dog._publish()
        verdicts = [dog.check(now) for dog in (ahead, behind)]
    assert verdicts[0] == verdicts[1].replace("(rank 1)", "(rank 0)")  # every live rank says the same
    assert "no progress for 10 s from 1 rank(s): rank 1" in verdicts[0] and "data loading at step 7" in verdicts[0]


def test_ranks_outside_loops_and_closed_ranks_are_not_judged(tmp_path):
    (watcher, other), _ = _pair(tmp_path)
    other.active = False  # between loops: no progress expected
    for now in (0.0, 20.0):
        other._publish()
        watcher.enter("forward", 1)
        watcher._publish()
        assert watcher.check(now) is None
    other.close()  # removes its file: gone on purpose, not frozen
    watcher.enter("forward", 2)
    watcher._publish()
    assert watcher.check(100.0) is None
    with pytest.raises(ValueError, match="watchdog.timeout_seconds"):
        Watchdog(tmp_path, 0, 2, 0)


def test_the_thread_fires_once(tmp_path):
    fired = []
    dog = Watchdog(tmp_path / "dog", 0, 2, 0.3, interval=0.05, on_timeout=fired.append)
    peer = Watchdog(tmp_path / "dog", 1, 2, 0.3, interval=0.05)
    peer.directory.mkdir(parents=True)
    peer._publish()  # a peer that never beats again
    dog.start()
    dog._thread.join(5)
    assert len(fired) == 1 and "rank 1" in fired[0]
    dog.close()


# ---------------------------------------------------------------------------------------- 2 processes


def _launch(root: Path, scenario: str) -> list[subprocess.Popen]:
    env = dict(
        os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]), OMP_NUM_THREADS="1"
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return [
        subprocess.Popen(
            [sys.executable, "-m", "tests.runners._watchdog_child", str(root), scenario],
            cwd=REPO,
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]


def _reap(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.distributed
def test_a_frozen_rank_ends_the_other_within_the_timeout(tmp_path):
    procs = _launch(tmp_path, "sigstop")
    try:
        _, stderr = procs[0].communicate(timeout=120)
        frozen = procs[1].poll() is None  # still there, stopped: the watchdog ended rank 0 alone
    finally:
        _reap(procs)
    assert procs[0].returncode == 124, stderr[-3000:]
    assert frozen
    lines = [line for line in stderr.splitlines() if "watchdog (rank 0)" in line]
    assert len(lines) == 1, stderr[-3000:]
    assert "no heartbeat for 5 s from 1 rank(s): rank 1" in lines[0] and "last in forward at step 3" in lines[0]
    assert "Traceback" not in stderr


@pytest.mark.distributed
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step_with_143(tmp_path):
    procs = _launch(tmp_path, "sigterm")
    try:
        reports = [proc.stdout.readline().split() for proc in procs]  # both ranks inside a step
        assert all(report[:1] == ["inside-loop"] for report in reports), [p.stderr.read() for p in procs]
        procs[1].send_signal(signal.SIGTERM)
        for proc in procs:
            proc.stdin.write("continue\n")
            proc.stdin.flush()
        errors = [proc.communicate(timeout=120)[1] for proc in procs]
    finally:
        _reap(procs)
    assert [proc.returncode for proc in procs] == [143, 143], errors[0][-3000:] + errors[1][-3000:]
    assert not any("Traceback" in error for error in errors)
    assert "another rank asked to stop (exit code 143)" in errors[0]
    checkpoints = next(tmp_path.glob("*/*/checkpoints"))
    assert (checkpoints / "shutdown.pointer").read_text() == (checkpoints / "latest.pointer").read_text()


@pytest.mark.distributed
def test_torchrun_reports_143_for_every_rank_after_a_sigterm_to_one(tmp_path):
    # The first rank to exit makes torchrun's agent SIGTERM the others; a rank still closing
    # used to die by that signal (exitcode -15) instead of leaving with 143.
    child = Path(__file__).resolve().parents[1].joinpath("_torchrun_sigterm_child.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*command, str(child), str(tmp_path)],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    report = done.stdout + done.stderr
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", report)
    assert done.returncode != 0 and codes and set(codes) == {"143"}, report[-3000:]
    # No worker traceback (the agent's own ChildFailedError is torchrun reporting the exit codes).
    assert not re.search(r'File ".*(/danling/|_torchrun_sigterm_child)', report), report[-3000:]
