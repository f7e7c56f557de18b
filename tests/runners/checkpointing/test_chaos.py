"""The chaos harness, short: a few SIGKILLs (at random moments and inside saves), resumed, end bit-exact and clean."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _chaos(tmp_path: Path, kills: int, world_size: int, seed: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    args = ["--kills", str(kills), "--world-size", str(world_size), "--seed", str(seed), "--root", str(tmp_path)]
    # Its own session, so a timeout ends the launches it forked too (they would hold on otherwise).
    harness = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "chaos.py"), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = harness.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(harness.pid, signal.SIGKILL)
        stdout, stderr = harness.communicate()
        pytest.fail(f"the chaos harness did not finish in 240 s: {stderr[-3000:]}")
    assert harness.returncode == 0, stderr[-3000:]
    return json.loads(stdout)


def _assert_clean(report: dict, kills: int) -> None:
    assert report["kills"] == kills and report["resumed_mid_run"] >= 1, report
    # `rows_differ` too: a mid-pass checkpoint carries the pass's running meters and train metrics.
    counts = {key: report[key] for key in ("lost", "corrupt", "wrong_alias", "stale", "leftovers", "rows_differ")}
    assert counts == dict.fromkeys(counts, 0), report["notes"]
    assert report["bit_exact"], report["notes"]


def test_chaos_single_process(tmp_path):
    _assert_clean(_chaos(tmp_path, kills=4, world_size=1, seed=1), kills=4)


@pytest.mark.distributed
def test_chaos_two_process_ddp(tmp_path):
    _assert_clean(_chaos(tmp_path, kills=3, world_size=2, seed=2), kills=3)


def test_the_paths_harness_finds_nothing_lost_overwritten_or_silent(tmp_path):
    """`benchmarks/chaos_paths.py`, short: unverifiable checkpoints under auto_resume, failed last saves."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from chaos_paths import run_paths
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    report = run_paths(tmp_path, runs=1, paths=["unverifiable", "save_errors"])
    assert report["unverifiable"]["runs"] == 3 and report["save_errors"]["runs"] == 2
    for counts in report.values():
        assert all(value == 0 for key, value in counts.items() if key not in ("runs", "seconds")), report
