"""demo/gpt2.py at a tiny size: one process, then DDP, FSDP2 and tensor parallel on 2 gloo ranks, FSDP2 x TP on 4.

Each layout trains the same global batch of the same data from the same initial weights, so its
per-step losses match the single-process run's to 1e-5 relative (measured: under 1e-6; the
layouts only change how the sums are split and reduced).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from tests.dist import run_distributed

pytest.importorskip("transformers")

DEMO = Path(__file__).resolve().parents[2] / "demo" / "gpt2.py"
STEPS = 6
COMMON = ["--steps", str(STEPS), "--sequences", "64", "--log", "false", "--checkpoint.async_enabled", "false"]
COMMON += ["--dataloader.train.shuffle", "false", "--evaluate_interval", "0", "--optim.lr", "0.01"]
# Two-rank layouts; data-parallel ranks read 4 sequences each, tensor-parallel ranks share a batch of 8.
LAYOUTS = {
    "ddp": ["--dataloader.batch_size", "4"],
    "fsdp2": ["--stack", "parallel", "--parallel.axes.shard", "2", "--fsdp.enabled", "true"]
    + ["--dataloader.batch_size", "4"],
    "tensor": ["--stack", "parallel", "--parallel.axes.tensor", "2", "--dataloader.batch_size", "8"],
}
FSDP_TP = ["--stack", "parallel", "--parallel.axes.shard", "2", "--parallel.axes.tensor", "2"]
FSDP_TP += ["--fsdp.enabled", "true", "--dataloader.batch_size", "4"]


def _demo():
    spec = importlib.util.spec_from_file_location("demo_gpt2", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train(root: str, name: str, extra: list[str]) -> dict:
    summary = _demo().main([*COMMON, "--workspace_root", f"{root}/{name}", *extra])
    return {"losses": summary["losses"], "val": summary["row"]["val"]["loss"], "world_size": summary["world_size"]}


def _layouts(rank: int, world_size: int, root: str, layouts: dict[str, list[str]]) -> dict:
    return {name: _train(root, name, extra) for name, extra in layouts.items()}


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return _train(str(tmp_path_factory.mktemp("single")), "single", ["--dataloader.batch_size", "8"])


def _assert_matches(result: dict, reference: dict, name: str) -> None:
    assert len(result["losses"]) == STEPS, name
    assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6), name
    assert result["val"] == pytest.approx(reference["val"], rel=1e-5), name


def test_single_process_learns_the_synthetic_language(single):
    losses = single["losses"]
    assert single["world_size"] == 1 and len(losses) == STEPS
    assert losses[0] == pytest.approx(math.log(64), rel=0.1)  # random init: about uniform
    assert losses[-1] < losses[0] - 0.1 and single["val"] < losses[0]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_ddp_fsdp2_and_tensor_parallel_match_one_process(single, tmp_path):
    ranks = run_distributed(_layouts, str(tmp_path), LAYOUTS, world_size=2, init_process_group=False)
    for name in LAYOUTS:
        assert ranks[0][name] == ranks[1][name], name  # reduced losses: every rank logs the same
        assert ranks[0][name]["world_size"] == 2
        _assert_matches(ranks[0][name], single, name)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_fsdp2_by_tensor_parallel_on_four_ranks_matches_one_process(single, tmp_path):
    ranks = run_distributed(_layouts, str(tmp_path), {"fsdp2-tp": FSDP_TP}, world_size=4, init_process_group=False)
    assert all(rank["fsdp2-tp"] == ranks[0]["fsdp2-tp"] for rank in ranks)
    _assert_matches(ranks[0]["fsdp2-tp"], single, "fsdp2-tp")
