"""Training under a real Slurm: `srun` without torchrun, preemption with requeue, and a job array.

Every job is submitted at once by `jobs` (a launch costs seconds of imports and start-up, so they
run side by side) and each test waits for its own: by polling for the files the tasks write, with
a bounded timeout that fails with the job's state and output.

- A: `srun -n 2` trains two epochs uninterrupted (the reference).
- B: the same config with `slurm.requeue: true`; mid-epoch the test sends `SIGUSR1` to the job's
  tasks (what `#SBATCH --signal=USR1@<seconds>` does), the ranks agree on a step, checkpoint there,
  the job requeues itself and its second run resumes (`auto_resume`) to the end.
- The same preemption with `torchrun` inside `sbatch` (`srun -n 1 torchrun --nproc-per-node 2`),
  ending with the same weights as the `srun` job.
- An array of two tasks trains two configs (two learning rates) into two run directories.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from .conftest import SlurmCluster

EPOCHS_STEPS = 20  # 2 epochs of 10 batches a rank (80 samples, batch size 4, 2 ranks)


def _launch(out: Path, workspace: Path, *options: str) -> str:
    command = [sys.executable, "-m", "tests.slurm._job", str(out), str(workspace), *options]
    return " ".join(shlex.quote(part) for part in command)


def _record(out: Path, rank: int, restart: int) -> dict:
    return json.loads((out / f"rank{rank}-restart{restart}.json").read_text())


def _has_records(out: Path, restart: int, ranks: int = 2):
    return lambda: all((out / f"rank{rank}-restart{restart}.json").exists() for rank in range(ranks))


@pytest.fixture(scope="module")
def jobs(slurm_cluster: SlurmCluster, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("slurm-jobs")
    outs = {name: root / f"out-{name}" for name in ("clean", "preempted", "torchrun", "array0", "array1")}
    for out in outs.values():
        out.mkdir()
    log = slurm_cluster.directory
    preempt = ("wait_at=3", "slurm.requeue=true")
    python, array_out = shlex.quote(sys.executable), shlex.quote(str(root / "out-array"))
    submitted = {
        "clean": slurm_cluster.sbatch(
            f"#!/bin/bash\nsrun {_launch(outs['clean'], root / 'ws-clean')}\n", "-n", "2", f"--output={log}/clean.out"
        ),
        "preempted": slurm_cluster.sbatch(
            f"#!/bin/bash\nsrun {_launch(outs['preempted'], root / 'ws-preempted', *preempt)}\n",
            "-n",
            "2",
            "--requeue",
            f"--output={log}/preempted-%j.out",
            "--open-mode=append",
        ),
        "torchrun": slurm_cluster.sbatch(
            f"#!/bin/bash\nsrun {python} -m torch.distributed.run --standalone --nproc-per-node 2 "
            "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout 120 "
            f"{_launch(outs['torchrun'], root / 'ws-torchrun', *preempt).split(' ', 1)[1]}\n",
            "-n",
            "1",
            "--requeue",
            f"--output={log}/torchrun-%j.out",
            "--open-mode=append",
        ),
        "array": slurm_cluster.sbatch(
            "#!/bin/bash\nLR=(0.01 0.02)\n"
            f"srun {python} -m tests.slurm._job {array_out}$SLURM_ARRAY_TASK_ID "
            f"{shlex.quote(str(root / 'ws-array'))} optim.lr=${{LR[$SLURM_ARRAY_TASK_ID]}}\n",
            "--array=0-1",
            "-n",
            "1",
            f"--output={log}/array-%a.out",
        ),
    }
    return {"root": root, "outs": outs, "ids": submitted, "cluster": slurm_cluster}


def test_srun_job_trains_two_ranks_that_agree(jobs):
    cluster, out, job = jobs["cluster"], jobs["outs"]["clean"], jobs["ids"]["clean"]
    cluster.wait_for(_has_records(out, 0), "both ranks of the srun job to finish", job)
    first, second = _record(out, 0, 0), _record(out, 1, 0)
    assert (first["world_size"], second["world_size"]) == (2, 2)
    assert (first["exit"], first["step"]) == (0, EPOCHS_STEPS)
    assert first["digest"] == second["digest"], "the ranks of the srun job ended with different weights"
    assert first["run_dir"] == second["run_dir"]
    launches = json.loads(Path(first["run_dir"], "metadata.json").read_text())["launches"]
    assert [launch["slurm"]["job_id"] for launch in launches] == [job]
    assert launches[0]["world_size"] == 2


@pytest.mark.parametrize("launch", ["preempted", "torchrun"])
def test_preempted_job_checkpoints_requeues_and_ends_as_uninterrupted(jobs, launch):
    """`srun` alone, and torchrun inside sbatch (whose agent forwards the signal its workers also get)."""
    cluster, out, job = jobs["cluster"], jobs["outs"][launch], jobs["ids"][launch]
    waiting = [out / f"waiting-rank{rank}" for rank in range(2)]
    cluster.wait_for(lambda: all(path.exists() for path in waiting), "both ranks to reach step 3", job)
    cluster.run("scancel", "--signal=USR1", job)  # to the tasks of the job's steps, as --signal=USR1@s does

    cluster.wait_for(_has_records(out, 0), "both ranks to stop on the signal", job)
    stopped = [_record(out, rank, 0) for rank in range(2)]
    assert [record["exit"] for record in stopped] == [138, 138]  # 128 + SIGUSR1
    assert stopped[0]["step"] == stopped[1]["step"], "the ranks checkpointed at different steps"
    assert 3 < stopped[0]["step"] < EPOCHS_STEPS and stopped[0]["step"] % 10, "the stop was not mid-epoch"

    cluster.wait_for(_has_records(out, 1), "the requeued job to finish", job, timeout=300)
    resumed = [_record(out, rank, 1) for rank in range(2)]
    assert [record["job"] for record in resumed] == [job, job]
    assert [record["exit"] for record in resumed] == [0, 0]
    assert resumed[0]["step"] == EPOCHS_STEPS
    assert resumed[0]["run_dir"] == stopped[0]["run_dir"]
    assert resumed[0]["digest"] == resumed[1]["digest"]
    clean = jobs["outs"]["clean"]
    cluster.wait_for(_has_records(clean, 0), "the uninterrupted job", jobs["ids"]["clean"])
    assert resumed[0]["digest"] == _record(clean, 0, 0)["digest"], "the requeued run ended with other weights"
    launches = json.loads(Path(resumed[0]["run_dir"], "metadata.json").read_text())["launches"]
    assert [(launch["slurm"]["job_id"], launch["slurm"]["restart_count"]) for launch in launches] == [
        (job, 0),
        (job, 1),
    ]
    assert (Path(resumed[0]["run_dir"]) / "checkpoints" / "shutdown.pointer").exists()


def test_job_array_trains_two_configs_into_two_run_directories(jobs):
    cluster, job = jobs["cluster"], jobs["ids"]["array"]
    outs = [jobs["outs"][f"array{index}"] for index in range(2)]
    for out in outs:
        cluster.wait_for(_has_records(out, 0, ranks=1), f"array task {out.name[-1]}", job)
    records = [_record(out, 0, 0) for out in outs]
    assert [record["exit"] for record in records] == [0, 0]
    assert records[0]["run_dir"] != records[1]["run_dir"]
    assert records[0]["digest"] != records[1]["digest"]
    for index, record in enumerate(records):
        metadata = json.loads(Path(record["run_dir"], "metadata.json").read_text())
        assert metadata["config"]["optim"]["lr"] == (0.01, 0.02)[index]
        assert metadata["launches"][0]["slurm"]["array_job_id"] == job
        assert metadata["launches"][0]["slurm"]["array_task_id"] == index
