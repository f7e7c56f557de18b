"""A NaN injected on one rank of a two-rank DDP run (gloo, one launch) is bundled, and `danling replay`
(a real subprocess, one process) names the module it came from and the pass it appeared in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from danling.runners.diagnosis.replaying import replay_bundle
from tests.dist import run_distributed
from tests.runners._torch_toy import tiny_config
from tests.runners.diagnosis._replay_toy import RankOneTrapRunner

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[3]


def _nan_on_rank_one(rank: int, world_size: int, root: str) -> dict:
    import torch

    torch.set_num_threads(1)
    # nonfinite.check=update: the ranks agree that the update is not finite and stop together.
    config = tiny_config(root, **{"replay.on_nonfinite": True, "nonfinite.check": "update"})
    runner = RankOneTrapRunner(config)
    try:
        runner.train()
    except Exception as error:
        failure = type(error).__name__
    else:
        failure = None
    out = {
        "failure": failure,
        "armed_at": runner.armed_at,
        "step": runner.train_state.global_step,
        "bundles": [str(path) for path in runner.diagnosis.replay.bundles],
    }
    runner.close()
    return out


def test_a_nan_on_one_rank_replays_on_one_process_and_names_the_module(tmp_path):
    first, second = run_distributed(_nan_on_rank_one, str(tmp_path), world_size=2, init_process_group=False)

    # Rank 1 met the marked sample in its fourth batch; both ranks stopped before that update.
    assert first["armed_at"] is None and second["armed_at"] == 4 and first["step"] == second["step"] == 3
    assert first["failure"] == second["failure"] == "TrainingDivergedError"
    (bundle,) = second["bundles"]
    assert Path(bundle).name == f"step-{second['armed_at']:08d}-rank1-nonfinite"
    manifest = json.loads((Path(bundle) / "manifest.json").read_text())
    assert (manifest["rank"], manifest["world_size"], manifest["mode"]) == (1, 2, "copy")

    # One process, its own interpreter: the module and the pass are named.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run(
        [sys.executable, "-m", "danling", "replay", bundle],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "first non-finite: forward of module `trap`: output, micro-batch 0; its inputs were finite" in done.stdout
    assert f"global step {second['armed_at']} on rank 1 of 2" in done.stdout

    # Rank 0 bundled the same update (the agreed non-finite check stopped it): nothing is wrong on its batches.
    (other,) = first["bundles"]
    assert Path(other).name == f"step-{second['armed_at']:08d}-rank0-nonfinite"
    report = replay_bundle(other)
    assert report.finding is None and report.identical
    assert "the non-finite value arose on another rank" in "\n".join(report.lines())
