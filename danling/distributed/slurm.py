"""Slurm's environment read as a launcher's: `srun python train.py` runs without torchrun.

`srun -n N` starts N tasks itself and tells each its place through `SLURM_*` variables; torch's
`env://` rendezvous reads torchrun's (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
`MASTER_PORT`). [`apply_slurm_launch`][danling.distributed.slurm.apply_slurm_launch] translates
the first into the second inside an `srun` step, and leaves a process alone when:

- torchrun (or the user) already set the torch variables: `torchrun` inside an `sbatch` script,
  one agent per node started by `srun`, keeps working as it always did;
- the process is the batch script itself (`SLURM_JOB_ID` but no `SLURM_STEP_ID`): the batch
  shell sees `SLURM_NTASKS=N` and `SLURM_PROCID=0`, yet it is one process, not rank 0 of N.

A partial environment (some of the torch variables, or an `srun` step missing one of the Slurm
variables it needs) is refused with an error naming the variables, instead of a rendezvous that
hangs until its timeout.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

__all__ = ["SlurmJob", "apply_slurm_launch", "first_host", "launch_variables", "tasks_on_node"]

# What torchrun sets for every worker; the runner needs all three to place a process.
TORCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# What an `srun` step must provide for the translation (the world size may come from either name).
STEP_VARIABLES = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_ID")
# The rendezvous port is derived from the job id, so every task of a job picks the same one
# without talking, and two jobs sharing a node rarely collide; it stays clear of the ephemeral range.
PORT_BASE, PORT_SPAN = 15000, 20000


@dataclass(frozen=True)
class SlurmJob:
    """The facts of the Slurm job this process runs in, as recorded in a run's launch history.

    Attributes:
        job_id: `SLURM_JOB_ID` (for an array task, its own id).
        array_job_id: `SLURM_ARRAY_JOB_ID`, the id shared by an array's tasks; None outside arrays.
        array_task_id: `SLURM_ARRAY_TASK_ID`, this task's index in the array; None outside arrays.
        restart_count: `SLURM_RESTART_COUNT`: how often the job was requeued (0 on its first run).
        step_id: `SLURM_STEP_ID` inside an `srun` step; None in the batch script.
        nodelist: `SLURM_JOB_NODELIST`, in Slurm's compressed form.
    """

    job_id: str
    array_job_id: str | None = None
    array_task_id: int | None = None
    restart_count: int = 0
    step_id: str | None = None
    nodelist: str | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> SlurmJob | None:
        """The job of `environ` (default: this process's), or None outside a Slurm job.

        Examples:
            >>> SlurmJob.from_environ({"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"}).restart_count
            1
            >>> SlurmJob.from_environ({}) is None
            True
        """
        env = os.environ if environ is None else environ
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job_id:
            return None
        task = env.get("SLURM_ARRAY_TASK_ID")
        return cls(
            job_id=job_id,
            array_job_id=env.get("SLURM_ARRAY_JOB_ID") or None,
            array_task_id=_integer(env, "SLURM_ARRAY_TASK_ID") if task else None,
            restart_count=_integer(env, "SLURM_RESTART_COUNT") if env.get("SLURM_RESTART_COUNT") else 0,
            step_id=env.get("SLURM_STEP_ID") or None,
            nodelist=env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or None,
        )

    def record(self) -> dict[str, object]:
        """The fields for a launch record (`metadata.json["launches"][i]["slurm"]`)."""
        return {
            "job_id": self.job_id,
            "array_job_id": self.array_job_id,
            "array_task_id": self.array_task_id,
            "restart_count": self.restart_count,
        }


def launch_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The torch launch variables an `srun` step implies; empty when there is nothing to translate.

    Returns `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`
    for a process of an `srun` step that no torch launcher placed; `MASTER_ADDR`/`MASTER_PORT`
    already set are kept (a rendezvous the user chose). Nothing for a process outside a step,
    or one torchrun placed.

    Raises:
        ValueError: some but not all of `RANK`, `WORLD_SIZE`, `LOCAL_RANK` are set inside a Slurm
            job, or an `srun` step lacks a variable the translation needs; the message names them.

    Examples:
        >>> step = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
        ...         "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "gpu[03-04]", "SLURM_NODEID": "0",
        ...         "SLURM_STEP_TASKS_PER_NODE": "2,1"}
        >>> launch = launch_variables(step)
        >>> [launch[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")]
        ['1', '2', '2', 'gpu03', '15007']
    """
    env = os.environ if environ is None else environ
    if not (env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")):
        return {}
    present = [name for name in TORCH_VARIABLES if env.get(name)]
    if present:
        if len(present) < len(TORCH_VARIABLES):
            missing = [name for name in TORCH_VARIABLES if name not in present]
            raise ValueError(
                f"partial launch environment in Slurm job {env.get('SLURM_JOB_ID')}: {', '.join(present)} set but "
                f"{', '.join(missing)} not; set all of {', '.join(TORCH_VARIABLES)} (torchrun does) or none (srun)"
            )
        return {}  # torchrun (or the user) placed this process
    if not env.get("SLURM_STEP_ID"):
        return {}  # the batch script: one process, whatever SLURM_NTASKS says
    missing = [name for name in STEP_VARIABLES if not env.get(name)]
    if not (env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")):
        missing.append("SLURM_STEP_NUM_TASKS")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist and not env.get("MASTER_ADDR"):
        missing.append("SLURM_STEP_NODELIST")
    if missing:
        raise ValueError(
            f"srun step {env.get('SLURM_JOB_ID')}.{env.get('SLURM_STEP_ID')} lacks {', '.join(missing)}; "
            "launch with srun (which sets them) or with torchrun (RANK, WORLD_SIZE, LOCAL_RANK)"
        )
    world_size = _integer(env, "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS")
    rank = _integer(env, "SLURM_PROCID")
    if not 0 <= rank < world_size:
        raise ValueError(f"SLURM_PROCID={rank} is outside [0, {world_size}) given by the step's task count")
    job_id = _integer(env, "SLURM_JOB_ID")
    variables = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(_integer(env, "SLURM_LOCALID")),
        "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(nodelist or ""),
        "MASTER_PORT": env.get("MASTER_PORT") or str(PORT_BASE + job_id % PORT_SPAN),
    }
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node and env.get("SLURM_NODEID"):
        variables["LOCAL_WORLD_SIZE"] = str(tasks_on_node(per_node, _integer(env, "SLURM_NODEID")))
    return variables


def apply_slurm_launch(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the torch launch variables of an `srun` step in `environ` (default `os.environ`).

    Idempotent: once set, the variables read as a torchrun launch and nothing changes. Returns
    the variables it set (empty when none).

    Raises:
        ValueError: as [`launch_variables`][danling.distributed.slurm.launch_variables].

    Examples:
        >>> apply_slurm_launch({})  # not in a Slurm job
        {}
    """
    env = os.environ if environ is None else environ
    variables = launch_variables(env)
    env.update(variables)
    return variables


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list (`node[03-05,9],gpu1` gives `node03`).

    Every bracket group of the first entry contributes its first element, with its zero padding.

    Raises:
        ValueError: `nodelist` is empty or its brackets do not close.

    Examples:
        >>> first_host("rack[2-3]-n[007-010]"), first_host("vm"), first_host("a,b")
        ('rack2-n007', 'vm', 'a')
    """
    text = nodelist.strip()
    entry = re.match(r"(?:[^,\[\]]|\[[^\]]*\])+", text)
    if entry is None or text[entry.end() :][:1] not in ("", ","):
        raise ValueError(f"cannot read the first host of the Slurm node list {nodelist!r}")
    return re.sub(r"\[([^\]]*)\]", lambda group: group.group(1).split(",")[0].split("-")[0], entry.group(0))


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks on node `node_id` from Slurm's `SLURM_STEP_TASKS_PER_NODE` (`2(x3),1` means 2, 2, 2, 1).

    Raises:
        ValueError: the spec is malformed or has no entry for `node_id`.

    Examples:
        >>> tasks_on_node("2(x3),1", 2), tasks_on_node("2(x3),1", 3)
        (2, 1)
    """
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ValueError(f"cannot read the Slurm tasks-per-node spec {tasks_per_node!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise ValueError(f"SLURM_NODEID={node_id} has no entry in the tasks-per-node spec {tasks_per_node!r}")
    return counts[node_id]


def _integer(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
