"""Single-process runs: a stuck step ends within the watchdog timeout, and a second SIGTERM ends it at once.

The child (`tests.runners._stuck_child`) blocks for good inside the step that starts at global
step 1, either in Python code (`time.sleep`) or in C code that runs no Python signal handler.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from danling.runners.services.watchdog import LocalWatchdog
from tests.runners._torch_toy import TinyRunner, tiny_config
from tests.runners._toy import ToyRunner, toy_config

REPO = Path(__file__).resolve().parents[3]
LINE = "watchdog (rank 0): no progress for {t:g} s from 1 rank(s): rank 0 ("
_KILLERS: dict[subprocess.Popen, threading.Timer] = {}  # cancelled by _finish: no timer outlives its test


def _start(root: Path, how: str, timeout: float) -> tuple[subprocess.Popen, int]:
    """Start the child; return it and its pid once it is inside the stuck step.

    A child still alive after 120 s is killed, so that no read of its pipes can block the test for good.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.runners._stuck_child", str(root), how, str(timeout)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    killer = threading.Timer(120, proc.kill)
    killer.daemon = True
    killer.start()
    _KILLERS[proc] = killer
    line = proc.stdout.readline()  # blocks until the step is entered (or the child dies)
    if not line.startswith("inside-step"):
        proc.kill()
        _KILLERS.pop(proc).cancel()
        raise AssertionError(f"the child never reached the step: {line!r} {proc.communicate()[1][-3000:]}")
    return proc, int(line.split()[1])


def _stderr_until(proc: subprocess.Popen, *texts: str) -> list[str]:
    """Read the child's stderr line by line until a line holds one of `texts` (all lines so far if it exits first)."""
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if any(text in line for text in texts):
            break
    return lines


def _finish(proc: subprocess.Popen, seconds: float) -> str:
    try:
        return proc.communicate(timeout=seconds)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        killer = _KILLERS.pop(proc, None)
        if killer is not None:
            killer.cancel()


@pytest.mark.parametrize("how", ["python", "c"])
def test_a_stuck_single_process_run_ends_within_the_timeout_with_the_message(tmp_path, how):
    proc, pid = _start(tmp_path, how, 3.0)
    started = time.monotonic()
    stderr = _finish(proc, 60)
    elapsed = time.monotonic() - started
    assert proc.returncode == 124, stderr[-3000:]
    assert elapsed < 30, elapsed  # 3 s timeout + 0.2 s interval, with room for a loaded machine
    lines = [line for line in stderr.splitlines() if "watchdog (rank 0)" in line]
    assert len(lines) == 1, stderr[-3000:]
    assert LINE.format(t=3.0) in lines[0] and f"pid {pid}): last in forward at step 1. " in lines[0]
    assert "Ending this rank with exit code 124 (watchdog.timeout_seconds)" in lines[0]
    # The main thread's stack shows where the step is stuck; no traceback of an unwound exception.
    assert "main thread when the watchdog fired" in stderr and "in train_step" in stderr
    assert ("time.sleep(3600)" if how == "python" else "ctypes.CDLL(None).system(shell)") in stderr
    assert "Traceback" not in stderr


def test_a_second_sigterm_ends_a_step_stuck_in_python_at_once(tmp_path):
    proc, pid = _start(tmp_path, "python", 600.0)
    try:
        os.kill(pid, signal.SIGTERM)
        seen = _stderr_until(proc, "received SIGTERM; finishing the current step")  # the graceful stop is pending
        assert "finishing the current step" in seen[-1], "".join(seen)[-3000:]
        os.kill(pid, signal.SIGTERM)
        stderr = _finish(proc, 30)  # far below the 600 s watchdog
    finally:
        _finish(proc, 1)
    assert proc.returncode == -signal.SIGTERM, stderr[-3000:]
    assert "received SIGTERM again; no longer waiting for a graceful stop" in stderr


def test_a_second_sigterm_ends_a_step_stuck_in_c_at_once(tmp_path):
    proc, pid = _start(tmp_path, "c", 600.0)
    try:
        os.kill(pid, signal.SIGTERM)
        seen = _stderr_until(proc, "sending it again ends the process")  # said once the handler could not run
        assert "main thread is stuck outside Python code" in seen[-1], "".join(seen)[-3000:]
        os.kill(pid, signal.SIGTERM)
        stderr = _finish(proc, 30)
    finally:
        _finish(proc, 1)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "received SIGTERM again while the main thread is stuck outside Python code" in stderr
    assert "ctypes.CDLL(None).system(shell)" in stderr  # the main thread's stack says where


def test_the_single_process_watchdog_keeps_the_fused_pass(tmp_path):
    with TinyRunner(tiny_config(tmp_path)) as runner:  # the watchdog is on by default
        runner.train()
        watchdog = runner.supervisor.local_watchdog
        assert isinstance(watchdog, LocalWatchdog) and watchdog._thread.is_alive()
        assert runner.supervisor.watchdog is None  # the loops report to no one
        assert runner.loop.fused_step is True
    assert runner.supervisor.local_watchdog is None and watchdog._thread is None
    with TinyRunner(tiny_config(tmp_path / "off", **{"watchdog.enabled": False})) as runner:
        runner.train()
        assert runner.supervisor.local_watchdog is None


def test_the_single_process_watchdog_judges_only_loops_that_stop_moving():
    state = {"inside": True, "counters": (0,)}
    dog = LocalWatchdog(lambda: (state["inside"], state["counters"]), lambda: ("backward", 7), 10.0, interval=1.0)
    assert dog.check(0.0) is None
    state["counters"] = (1,)
    assert dog.check(9.0) is None  # moved at 9 s
    assert dog.check(18.0) is None
    message = dog.check(19.0)
    assert message is not None and message.startswith("watchdog (rank 0): no progress for 10 s from 1 rank(s)")
    assert "last in backward at step 7" in message
    state["inside"] = False  # between loops: nothing is expected
    assert dog.check(20.0) is None and dog.check(100.0) is None


@pytest.mark.parametrize(("key", "value"), [("timeout_seconds", -1), ("interval_seconds", 0)])
def test_a_watchdog_time_that_cannot_work_is_refused_in_a_single_process_too(tmp_path, key, value):
    # Refused as the runner validates its config, before it builds anything: `train()` used to find it.
    with pytest.raises(ValueError, match=rf"watchdog\.{key} must be .*got {value}"):
        ToyRunner(toy_config(tmp_path, **{f"watchdog.{key}": value}))


def test_inference_after_training_is_progress_to_the_watchdog_and_a_stuck_batch_is_named(tmp_path):
    from tests.runners._infer_child import InferRunner, infer_config

    class Watched(InferRunner):
        verdicts: list = []
        stuck = False

        def infer_step(self, data):
            dog, base = self.supervisor.local_watchdog, time.monotonic()
            if self.stuck:  # the same batch, seen again 700 s later: no progress
                self.verdicts += [dog.check(base), dog.check(base + 700.0)]
            else:  # one batch every 400 s, under a timeout of 600 s
                self.verdicts.append(dog.check(base + 400.0 * len(self.verdicts)))
            return super().infer_step(data)

    with Watched(infer_config(tmp_path, epochs=1)) as runner:
        runner.train()  # starts the watchdog, which stays for the inference that follows
        runner.infer("infer")
        runner.infer("infer", output=tmp_path / "out.jsonl")
        assert len(runner.verdicts) == 38 and runner.verdicts == [None] * 38  # was ended as hung
        runner.verdicts, runner.stuck = [], True
        runner.infer("infer", steps=1)
        assert runner.verdicts[0] is None and "last in inference at step 10" in runner.verdicts[1]
