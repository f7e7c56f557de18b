"""TorchFT replica groups for real: a lighthouse, two replica-group processes, a SIGKILL and a restart.

The job (lighthouse, groups, progress and hold files) is `_harness.Job`; every wait polls with a deadline.
"""

from __future__ import annotations

import signal
import time

import pytest
import torch

pytest.importorskip("torchft")

from tests.runners.ft._harness import Job, events, step, wait

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
STEPS = 40


@pytest.fixture
def job(tmp_path):
    made = []

    def make(name: str = "job", **options):
        made.append(Job(tmp_path / name, **options))
        return made[-1]

    yield make
    for each in made:
        each.close()


def _same_weights(results: dict[str, dict]) -> bool:
    first, second = results["0"]["model"], results["1"]["model"]
    return all(torch.equal(first[key], second[key]) for key in first)


def _kill_and_restart(ft, **overrides) -> tuple[int, dict[str, dict]]:
    """Kill group 1 after its 8th update (mid-epoch), let group 0 train on alone, restart group 1, finish.

    Returns group 0's step when group 1 was killed and both groups' results.
    """
    ft.hold("1", 8)
    victim = ft.start_both(**overrides)
    wait("group 1 to reach step 8", lambda: step(ft.control, "1") >= 8, procs=tuple(ft.procs.values()), logs=ft.control)
    at_kill = step(ft.control, "0")
    ft.hold("0", at_kill + 6)  # the survivor may train 6 more updates alone, then waits for the restart
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    survivor = (ft.procs["0-0"],)
    wait("group 0 to train on alone", lambda: step(ft.control, "0") >= at_kill + 5, procs=survivor, logs=ft.control)
    ft.release("1")
    ft.start("1", **overrides)
    wait("the restarted group to be built", lambda: (ft.control / "ready-1").exists(), logs=ft.control)
    ft.release("0")
    return at_kill, ft.finish()


def test_a_killed_group_rejoins_from_its_peer_while_the_other_keeps_training(job):
    ft = job()
    # a fresh process at the restart: nothing on disk to resume from, only the live peer
    at_kill, results = _kill_and_restart(ft)

    assert results["0"]["summary"]["global_step"] == results["1"]["summary"]["global_step"] == STEPS
    assert _same_weights(results)
    recovered = [e for e in events(ft.control, "1") if e["event"] == "replica_recovered"]
    assert recovered and recovered[-1]["from_step"] == 0 and recovered[-1]["step"] >= at_kill + 5
    # Without its own dataloader checkpoint the group continues at the peer's count (one batch per
    # update, in the first pass), and its loader stands there too: no batch of its share skipped.
    position = [e for e in events(ft.control, "1") if e["event"] == "data_position"][-1]
    assert position == {"event": "data_position", "batch": recovered[-1]["step"], "yielded": recovered[-1]["step"]}
    survivor = [e["event"] for e in events(ft.control, "0")]
    assert "replica_left" in survivor and "replica_joined" in survivor
    # Steps lost: the updates the survivor could not commit when its peer died (the killed group's
    # own missed updates were trained by the survivor and handed over at the restart).
    lost = results["0"]["summary"]["uncommitted"]
    print(f"steps lost by the survivor: {lost}; updates the killed group took over: {recovered[-1]['steps_missed']}")
    assert lost <= 1


def test_a_restarted_group_resumes_its_own_data_position_from_its_dataloader_checkpoint(job):
    # Group 1 dies after its 8th update; its usual checkpoint is that of step 4 (every 4 updates), its
    # dataloader checkpoint that of step 8, and the peer it recovers from is at step 13 or later.
    own = {"checkpoint.enable_ft_dataloader_checkpoints": True, "auto_resume": True}
    ft = job()
    at_kill, results = _kill_and_restart(ft, **own)

    assert results["0"]["summary"]["global_step"] == results["1"]["summary"]["global_step"] == STEPS
    assert _same_weights(results)
    assert results["1"]["summary"]["checkpoint_manager"] == "TorchFTCheckpointManager"
    recovered = [e for e in events(ft.control, "1") if e["event"] == "replica_recovered"]
    assert recovered and recovered[-1]["from_step"] == 4 and recovered[-1]["step"] >= at_kill + 5
    position = [e for e in events(ft.control, "1") if e["event"] == "data_position"][-1]
    # Its own 8 batches: not the peer's count (13 or more), the usual checkpoint's 4, nor the start.
    assert position == {"event": "data_position", "batch": 8, "yielded": 8}
    assert list((ft.workspace / "workspace-1").rglob("ft-replica-1/latest.pointer"))


def test_min_replica_size_two_waits_for_the_missing_group(job):
    ft = job(min_replica_size=2)
    ft.hold("1", 5)
    ft.start("0")
    victim = ft.start("1")
    wait("group 1 to reach step 5", lambda: step(ft.control, "1") >= 5, procs=tuple(ft.procs.values()), logs=ft.control)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    left = lambda: any(e["event"] == "replica_left" for e in events(ft.control, "0"))  # noqa: E731
    wait("group 0 to see its peer leave", left, procs=(ft.procs["0-0"],), logs=ft.control)
    waiting_at = step(ft.control, "0")
    end = time.monotonic() + 3.0  # an observation window: the counter must not move in it
    while time.monotonic() < end:
        assert step(ft.control, "0") == waiting_at, "group 0 trained alone below ft.min_replica_size"
        time.sleep(0.1)
    assert "training waits at step" in "".join(p.read_text() for p in ft.control.glob("log-0-*"))
    ft.release("1")
    ft.start("1")
    results = ft.finish()
    assert results["0"]["summary"]["global_step"] == results["1"]["summary"]["global_step"] == STEPS
    assert _same_weights(results)


def test_a_whole_job_restart_from_the_usual_checkpoints_resumes_exactly(job, tmp_path):
    # The same job straight through, and stopped at step 24 then resumed (budget raised) from the
    # checkpoints each group wrote: the weights must be the same to the bit.
    straight = job("straight", steps=STEPS)
    first = job("first", steps=24, workspace=tmp_path / "resumed")
    for name in ("0", "1"):
        straight.start(name)
        first.start(name)
    first.finish()
    first.close()
    second = job("second", steps=STEPS, workspace=tmp_path / "resumed")
    for name in ("0", "1"):
        second.start(name, auto_resume=True)
    resumed, reference = second.finish(), straight.finish()
    for name in ("0", "1"):
        assert resumed[name]["summary"]["global_step"] == STEPS
        for key, value in reference[name]["model"].items():
            assert torch.equal(resumed[name]["model"][key], value), f"group {name}: {key} differs after the resume"
    assert _same_weights(resumed)
