"""Resuming on another number of data-parallel ranks: the same decision on every rank.

A checkpoint that records global data positions continues its pass on the new layout (see
`tests/runners/checkpointing/test_elastic.py` for sample coverage and weights); excluding `dataloaders` restarts it.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_distributed
from tests.runners._torch_toy import TinyRunner, tiny_config


class ResizeRunner(TinyRunner):
    n_train = 24


def _config(root: str, **overrides) -> dict:
    # Step mode with a checkpoint every 4 updates: step 8 is in the middle of the second pass on 2
    # ranks (6 updates per pass of 24 samples).
    return tiny_config(
        root, epochs=None, steps=20, **{"dataloader.batch_size": 2, "checkpoint.interval": 4}, **overrides
    )


def _train_on_two(rank: int, world_size: int, root: str) -> str:
    torch.set_num_threads(1)
    with ResizeRunner(_config(root)) as runner:
        runner.train()
        return str(runner.checkpoint_manager.directory / "step-000008")


def _resume(root: str, checkpoint: str, exclude: bool) -> dict:
    overrides = {"resume": checkpoint}
    if exclude:
        overrides["checkpoint.exclude_from_loading"] = ["dataloaders"]
    try:
        runner = ResizeRunner(_config(root, **overrides))
    except ValueError as error:
        return {"error": str(error)}
    with runner:
        restored = runner.train_state.global_step
        runner.train()
        return {"restored": restored, "final": runner.train_state.global_step}


def _resume_on_three(rank: int, world_size: int, root: str, checkpoint: str) -> dict:
    torch.set_num_threads(1)
    return {
        "elastic": _resume(f"{root}/elastic", checkpoint, False),
        "excluded": _resume(f"{root}/ok", checkpoint, True),
    }


@pytest.mark.distributed
def test_resume_on_another_data_parallel_size_restores_everywhere(tmp_path):
    checkpoint = run_distributed(_train_on_two, str(tmp_path / "two"), world_size=2, init_process_group=False)[0]
    three = run_distributed(
        _resume_on_three, str(tmp_path / "three"), checkpoint, world_size=3, init_process_group=False
    )
    for out in three:  # every rank, rank 2 included
        assert out["elastic"] == {"restored": 8, "final": 20}
        assert out["excluded"] == {"restored": 8, "final": 20}
    assert _resume(str(tmp_path / "one"), checkpoint, False) == {"restored": 8, "final": 20}
    assert _resume(str(tmp_path / "one-ok"), checkpoint, True) == {"restored": 8, "final": 20}
