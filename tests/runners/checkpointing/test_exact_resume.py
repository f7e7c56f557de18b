"""Exact resume: runs SIGKILLed mid-training and restarted with `auto_resume` end bit-identical to uninterrupted runs.

`_resume_child.py` runs every scenario in its own forked process and the killed ones send themselves
SIGKILL right after an optimizer update, so nothing gets a chance to clean up. With 5 micro-batches
per rank and pass and `accum_steps=2` (3 updates per pass, the last from a partial window):

- epoch mode, one process and 2-process DDP: an extra checkpoint at update 4, killed at 5: resumes
  mid-epoch (the sharded sampler's position, the accumulation window and the EMA all continue);
- step mode, both: checkpoints every 4 updates, killed at 7: resumes mid-pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist import free_ports

pytestmark = pytest.mark.slow

_REPO = Path(__file__).resolve().parents[3]


def _run_child(root: Path, world_size: int, *args: str) -> list[dict]:
    """Run the child on `world_size` ranks and return each rank's scenario statuses."""
    procs = []
    args = (*args, "--ports", ",".join(map(str, free_ports(16))))
    for rank in range(world_size):
        env = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
        env.update(PYTHONPATH=str(_REPO), OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank))
        env["WORLD_SIZE"] = str(world_size)
        command = [sys.executable, "-X", "faulthandler", "-m", "tests.runners._resume_child", "--root", str(root)]
        procs.append(subprocess.Popen([*command, *args], cwd=_REPO, env=env))
    for proc in procs:
        assert proc.wait(timeout=240) == 0, f"the resume child failed; logs are in {root}"
    return [json.loads((root / f"status-rank{rank}.json").read_text()) for rank in range(world_size)]


def _final(root: Path, mode: str, rank: int) -> dict:
    return torch.load(root / mode / f"final-rank{rank}.pt", weights_only=False)


def _assert_identical(reference: dict, resumed: dict) -> None:
    assert resumed["global_step"] == reference["global_step"]
    for part in ("model", "ema"):
        assert reference[part].keys() == resumed[part].keys()
        for key, value in reference[part].items():
            assert torch.equal(value, resumed[part][key]), f"{part}.{key} differs after the resume"


def _check(root: Path, world_size: int, starts: dict[str, int]) -> None:
    for mode, start in starts.items():
        for rank in range(world_size):
            reference, resumed = _final(root / "clean", mode, rank), _final(root / "killed", mode, rank)
            assert reference["start"] == 0 and resumed["start"] == start  # it really resumed there
            _assert_identical(reference, resumed)
        if world_size > 1:  # and the replicas agree
            _assert_identical(_final(root / "killed", mode, 0), _final(root / "killed", mode, 1))


def test_exact_resume_after_sigkill_single_process(tmp_path):
    args = ("--epoch-save-at", "4", "--epoch-kill-at", "5", "--step-kill-at", "7")
    (status,) = _run_child(tmp_path, 1, *args)
    assert status == {"clean": "exit 0", "kill-epoch": "SIGKILL", "kill-step": "SIGKILL", "resume": "exit 0"}
    _check(tmp_path, 1, {"epoch": 4, "step": 4})


@pytest.mark.distributed
def test_exact_resume_after_sigkill_two_process_ddp(tmp_path):
    statuses = _run_child(tmp_path, 2, "--epoch-save-at", "4", "--epoch-kill-at", "5", "--step-kill-at", "7")
    for status in statuses:
        assert status == {"clean": "exit 0", "kill-epoch": "SIGKILL", "kill-step": "SIGKILL", "resume": "exit 0"}
    _check(tmp_path, 2, {"epoch": 4, "step": 4})
