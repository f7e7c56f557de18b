"""`oom.policy` on two gloo ranks (one launch): rank 1 runs out of memory in its forward pass; both
ranks agree, skip or split the micro-batch together, and neither waits alone in a collective."""

from __future__ import annotations

import pytest
import torch

from danling.runners import Events
from tests.dist import run_distributed
from tests.runners._torch_toy import model_state, tiny_config
from tests.runners.diagnosis._oom_toy import OomRunner

pytestmark = pytest.mark.distributed


def _train(root: str, fail: set[int] = frozenset(), fits: int = 2, fail_backward=frozenset(), **settings) -> dict:
    config = tiny_config(root, epochs=1, **settings)
    out: dict = {}
    with OomRunner(config, fail=fail, fits=fits, fail_backward=fail_backward) as runner:
        seen = []
        runner.events.subscribe(Events.OUT_OF_MEMORY, lambda c: seen.append((c.ranks, c.phase, c.action, c.pieces)))
        try:
            runner.train()
        except RuntimeError as error:
            out["error"] = f"{type(error).__name__}: {error}"
        guard = runner.diagnosis.oom
        out.update(
            weights=model_state(runner),
            step=runner.train_state.global_step,
            skipped=runner.update.skipped_steps,
            seen=seen,
            counts=None if guard is None else (guard.count, guard.splits, guard.skipped),
        )
    return out


def _scenarios(rank: int, world_size: int, root: str) -> dict:
    torch.set_num_threads(1)
    return {
        "plain": _train(f"{root}/plain"),
        "split": _train(f"{root}/split", {3}, **{"oom.policy": "split"}),
        # A piece runs out too: the first half is halved again (pieces of 1 sample fit).
        "split twice": _train(f"{root}/twice", {3, 4}, fits=1, **{"oom.policy": "split"}),
        "skip": _train(f"{root}/skip", {3}, **{"oom.policy": "skip"}),
        "plain accum": _train(f"{root}/plain-accum", accum_steps=2),
        # The error lands on the second micro-batch of a window (its backward keeps gradients local).
        "split accum": _train(f"{root}/split-accum", {4}, accum_steps=2, **{"oom.policy": "split"}),
        "skip accum": _train(f"{root}/skip-accum", {3}, accum_steps=2, **{"oom.policy": "skip"}),
        "repeated": _train(f"{root}/repeated", set(range(3, 40)), **{"oom.policy": "skip", "oom.max_consecutive": 1}),
    }


def _close(first: dict, second: dict) -> bool:
    return all(torch.allclose(first[name], second[name], atol=1e-6) for name in first)


def test_an_out_of_memory_on_one_rank_is_survived_by_both(tmp_path):
    first, second = run_distributed(_scenarios, str(tmp_path), world_size=2, init_process_group=False, timeout=400)
    plain = first["plain"]
    assert plain["step"] == 4 and plain["counts"] is None  # 32 samples / 2 ranks / batch 4
    for out in (first, second):
        # Split: the global batch is kept: the weights are those of the run without the error.
        split = out["split"]
        assert split["step"] == 4 and split["counts"] == (1, 1, 0) and split["seen"] == [([1], "forward", "split", 2)]
        assert _close(split["weights"], plain["weights"])
        twice = out["split twice"]
        assert twice["counts"] == (2, 2, 0) and [s[2:] for s in twice["seen"]] == [("split", 2), ("split", 3)]
        assert _close(twice["weights"], plain["weights"])
        assert _close(out["split accum"]["weights"], out["plain accum"]["weights"])
        assert out["split accum"]["step"] == out["plain accum"]["step"] == 2
        # Skip: that update is dropped on both ranks.
        skip = out["skip"]
        assert skip["step"] == 3 and skip["skipped"] == 1 and skip["seen"] == [([1], "forward", "skipped", 0)]
        assert out["skip accum"]["step"] == 1 and out["skip accum"]["skipped"] == 1
        # Repeated: the third error in a row stops both ranks, with the counts in the message.
        repeated = out["repeated"]
        assert "OutOfMemoryAbort" in repeated["error"] and "2 in a row (oom.max_consecutive=1)" in repeated["error"]
        assert "2 out-of-memory errors in this run" in repeated["error"] and repeated["step"] == 2
    for name in ("split", "split twice", "skip", "split accum", "skip accum"):
        for key, value in first[name]["weights"].items():
            assert torch.equal(value, second[name]["weights"][key]), (name, key)
