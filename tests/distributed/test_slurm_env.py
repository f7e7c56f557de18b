"""Slurm's environment read as a launcher's, with fake environments (the real scheduler: tests/slurm)."""

from __future__ import annotations

import pytest

from danling.distributed.slurm import SlurmJob, apply_slurm_launch, first_host, launch_variables, tasks_on_node


def srun_step(**overrides: str) -> dict[str, str]:
    """What `srun -N 2 -n 4` gives task 3 (second node, second task there), as observed on Slurm 22.05."""
    env = {
        "SLURM_JOB_ID": "1234",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS": "4",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_STEP_NODELIST": "gpu[007-008]",
        "SLURM_JOB_NODELIST": "gpu[007-008]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    }
    env.update(overrides)
    return {key: value for key, value in env.items() if value != "-"}


def test_srun_step_gives_torch_variables() -> None:
    assert launch_variables(srun_step()) == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu007",
        "MASTER_PORT": str(15000 + 1234),
    }


def test_every_task_of_a_job_picks_the_same_rendezvous() -> None:
    first = launch_variables(srun_step(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0"))
    last = launch_variables(srun_step())
    assert (first["MASTER_ADDR"], first["MASTER_PORT"]) == (last["MASTER_ADDR"], last["MASTER_PORT"])
    assert first["MASTER_PORT"] != launch_variables(srun_step(SLURM_JOB_ID="1235"))["MASTER_PORT"]


def test_user_rendezvous_is_kept() -> None:
    launch = launch_variables(srun_step(MASTER_ADDR="10.0.0.1", MASTER_PORT="29500"))
    assert (launch["MASTER_ADDR"], launch["MASTER_PORT"]) == ("10.0.0.1", "29500")


def test_step_task_count_wins_over_the_job_task_count() -> None:
    # `srun -n 2` inside a 4-task allocation: the step has 2 tasks.
    assert launch_variables(srun_step(SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="1"))["WORLD_SIZE"] == "2"
    assert launch_variables(srun_step(SLURM_STEP_NUM_TASKS="-"))["WORLD_SIZE"] == "4"


def test_torchrun_inside_a_job_is_left_alone() -> None:
    env = srun_step(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1")
    assert launch_variables(env) == {}
    assert apply_slurm_launch(env) == {} and env["RANK"] == "5"


def test_batch_script_is_one_process() -> None:
    # The batch shell has SLURM_NTASKS=4 and SLURM_PROCID=0 but is not rank 0 of 4.
    assert launch_variables(srun_step(SLURM_STEP_ID="-", SLURM_STEP_NUM_TASKS="-", SLURM_PROCID="0")) == {}


def test_outside_slurm_nothing_changes() -> None:
    assert launch_variables({"RANK": "0"}) == {}
    assert launch_variables({}) == {}


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"RANK": "1"}, "RANK set but WORLD_SIZE, LOCAL_RANK not"),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "WORLD_SIZE, LOCAL_RANK set but RANK not"),
        ({"SLURM_PROCID": "-"}, "lacks SLURM_PROCID"),
        (
            {"SLURM_LOCALID": "-", "SLURM_STEP_NUM_TASKS": "-", "SLURM_NTASKS": "-"},
            "SLURM_LOCALID, SLURM_STEP_NUM_TASKS",
        ),
        ({"SLURM_STEP_NODELIST": "-", "SLURM_JOB_NODELIST": "-"}, "lacks SLURM_STEP_NODELIST"),
        ({"SLURM_PROCID": "4"}, "SLURM_PROCID=4 is outside [0, 4)"),
        ({"SLURM_LOCALID": "x"}, "SLURM_LOCALID='x' is not an integer"),
    ],
)
def test_partial_or_mixed_environment_is_one_clear_error(overrides: dict[str, str], named: str) -> None:
    env = srun_step(**overrides)
    with pytest.raises(ValueError) as caught:
        apply_slurm_launch(env)
    assert named in str(caught.value)
    assert "\n" not in str(caught.value)
    assert "MASTER_ADDR" not in env  # nothing half-applied


def test_apply_sets_the_variables_once() -> None:
    env = srun_step()
    assert apply_slurm_launch(env)["RANK"] == "3"
    assert env["WORLD_SIZE"] == "4"
    assert apply_slurm_launch(env) == {}  # now a complete torch launch


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("vm", "vm"),
        ("node[03-05,9],gpu1", "node03"),
        ("gpu1,node[03-05]", "gpu1"),
        ("rack[2-3]-n[007-010]", "rack2-n007"),
        ("n[5]", "n5"),
    ],
)
def test_first_host(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["", "n[1-2", "n]", ",n"])
def test_first_host_refuses_malformed_lists(nodelist: str) -> None:
    with pytest.raises(ValueError, match="first host"):
        first_host(nodelist)


def test_tasks_on_node() -> None:
    assert [tasks_on_node("2(x2),1", node) for node in range(3)] == [2, 2, 1]
    with pytest.raises(ValueError, match="no entry"):
        tasks_on_node("2(x2)", 2)
    with pytest.raises(ValueError, match="cannot read"):
        tasks_on_node("2x", 0)


def test_job_facts_for_the_launch_history() -> None:
    job = SlurmJob.from_environ(
        {"SLURM_JOB_ID": "17", "SLURM_ARRAY_JOB_ID": "16", "SLURM_ARRAY_TASK_ID": "1", "SLURM_RESTART_COUNT": "2"}
    )
    assert job is not None
    assert job.record() == {"job_id": "17", "array_job_id": "16", "array_task_id": 1, "restart_count": 2}
    assert SlurmJob.from_environ({"SLURM_JOB_ID": "9"}).record()["restart_count"] == 0
