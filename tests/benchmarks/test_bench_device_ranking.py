"""`bench_device_ranking.py` runs on a CPU (the GPU's minutes go to measuring, not to debugging it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_both_paths_agree_and_every_task_gets_a_row():
    command = [sys.executable, str(REPO / "benchmarks" / "bench_device_ranking.py"), "--sizes", "2e4", "--repeats", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=REPO, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "20,000" in line]
    assert [row.split(" | ")[0] for row in rows] == ["| binary", "| multiclass", "| multilabel"]
