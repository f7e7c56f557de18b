"""HSDP across TorchFT replica groups: 2 groups x 2 FSDP2 shards on 4 processes (gloo), a SIGKILL and a restart.

Each group is a `ParallelRunner` sharding the model over its 2 ranks (`parallel.axes.shard=2`); the
groups are HSDP's replicate dimension, averaged by TorchFT's all-reduce hooks on FSDP2's gradient shards.
"""

from __future__ import annotations

import signal

import pytest
import torch

pytest.importorskip("torchft")

from tests.runners.ft._harness import Job, events, step, wait

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
STEPS = 24
SHARDED = {"stack": "parallel", "fsdp.enabled": True, "parallel.axes.shard": 2}


def test_a_killed_sharded_group_rejoins_from_its_peer_while_the_other_keeps_training(tmp_path):
    ft = Job(tmp_path / "hsdp", steps=STEPS)
    try:
        ft.hold("1", 6)
        victim = ft.start_both(ranks=2, **SHARDED)
        wait(
            "group 1 to reach step 6",
            lambda: step(ft.control, "1") >= 6,
            procs=tuple(ft.procs.values()),
            logs=ft.control,
        )
        at_kill = step(ft.control, "0")
        ft.hold("0", at_kill + 4)  # the survivor trains 4 more updates alone, then waits for the restart
        victim.send_signal(signal.SIGKILL)  # both of its ranks
        victim.wait(timeout=30)
        wait(
            "group 0 to train on alone",
            lambda: step(ft.control, "0") >= at_kill + 3,
            procs=tuple(p for k, p in ft.procs.items() if k.startswith("0-")),
            logs=ft.control,
        )
        ft.release("1")
        ft.start("1", ranks=2, **SHARDED)
        wait("the restarted group to be built", lambda: (ft.control / "ready-1").exists(), logs=ft.control)
        ft.release("0")
        results = ft.finish()
    finally:
        ft.close()

    assert results["0"]["summary"]["global_step"] == results["1"]["summary"]["global_step"] == STEPS
    for name in ("0", "1"):  # sharded inside each group, averaged across the groups by the shard hooks
        assert results[name]["summary"]["parameter"] == "DTensor" and results[name]["summary"]["shard_hooks"]
    first, second = results["0"]["model"], results["1"]["model"]
    assert all(torch.equal(first[key], second[key]) for key in first), "the groups' full weights differ"
    recovered = [e for e in events(ft.control, "1") if e["event"] == "replica_recovered"]
    assert recovered and recovered[-1]["from_step"] == 0 and recovered[-1]["step"] >= at_kill + 3
    # The peer's count (one batch per update, in the first pass), and the loaders of both ranks stand
    # there too: no batch of the group's share skipped.
    position = [e for e in events(ft.control, "1") if e["event"] == "data_position"][-1]
    assert position == {"event": "data_position", "batch": recovered[-1]["step"], "yielded": recovered[-1]["step"]}
    survivor = [e["event"] for e in events(ft.control, "0")]
    assert "replica_left" in survivor and "replica_joined" in survivor
    assert results["0"]["summary"]["uncommitted"] <= 1
