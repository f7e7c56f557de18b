"""Exact resume of DeepSpeedRunner after a real SIGKILL: ZeRO-2 and ZeRO-3, two processes, `auto_resume`.

The machinery is the torch runner's (`_resume_child.py`, run with `--zero-stages 2 3`): every
scenario runs in its own forked process, and the killed ones SIGKILL themselves right after an
optimizer update. With 5 micro-batches per rank and pass and `accum_steps=2`, dropout, an EMA and a
step-interval cosine schedule (which the engine owns and checkpoints):

- epoch mode, ZeRO-2: an extra checkpoint at update 4, killed at 5: resumes mid-epoch;
- step mode, ZeRO-3 (every parameter partitioned): checkpoints every 4 updates, killed at 7.

The resumed runs must end bit-identical (weights, EMA, global step) to the uninterrupted ones.
"""

from __future__ import annotations

import pytest

from tests.runners import _deepspeed_toy  # noqa: F401 - CPU accelerator and the shared op build dir
from tests.runners.checkpointing.test_exact_resume import _check, _run_child

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(600)]


def test_exact_resume_after_sigkill_zero2_and_zero3(tmp_path):
    args = ("--epoch-save-at", "4", "--epoch-kill-at", "5", "--step-kill-at", "7", "--zero-stages", "2", "3")
    for status in _run_child(tmp_path, 2, *args):
        assert status == {"clean": "exit 0", "kill-epoch": "SIGKILL", "kill-step": "SIGKILL", "resume": "exit 0"}
    _check(tmp_path, 2, {"epoch": 4, "step": 4})
