"""A real one-node Slurm cluster for the tests of this folder, started from a temporary configuration.

`slurm_cluster` starts `munged`, `slurmctld` and `slurmd` (Debian's `munge` and `slurm-wlm`
packages, which `.ci/run` installs) with a key, a `slurm.conf`, state and spool directories and
logs under one temporary directory, on free non-default ports, and stops them by PID at the end.
Nothing of the machine's own Slurm or munge setup is read or changed: clients find the cluster
through `SLURM_CONF` in the environment the fixture hands out. Process tracking is
`proctrack/linuxproc` and task binding `task/none`, so no cgroup setup is needed. Where the
binaries are missing, the tests are skipped with the reason.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo")
ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 60.0


@dataclass
class SlurmCluster:
    """A running test cluster: its directory, and the environment its clients (sbatch, ...) need."""

    directory: Path
    env: dict[str, str]

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster."""
        result = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60, check=False)
        if check and result.returncode:
            raise AssertionError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def sbatch(self, script: str, *options: str) -> str:
        """Submit `script` (the text of a batch script) and return the job id."""
        path = Path(tempfile.mkstemp(suffix=".sh", dir=self.directory)[1])
        path.write_text(script)
        result = self.run("sbatch", "--parsable", f"--chdir={ROOT}", *options, str(path))
        return result.stdout.strip().split(";")[0]

    def job_state(self, job_id: str) -> str:
        """`scontrol show job`'s description of `job_id` (for failure messages and state checks)."""
        return self.run("scontrol", "show", "job", job_id, check=False).stdout.strip()

    def wait_for(self, ready: Callable[[], bool], what: str, job_id: str, timeout: float = 240.0) -> None:
        """Poll `ready` until it holds; after `timeout` fail with the job's state and output."""
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                outputs = "\n".join(
                    f"--- {path.name}\n{path.read_text()[-3000:]}" for path in sorted(self.directory.glob("*.out"))
                )
                pytest.fail(f"timed out waiting for {what}\n{self.job_state(job_id)}\n{outputs}")
            time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _config(directory: Path, host: str, user: str) -> str:
    ctld_port, slurmd_port = _free_port(), _free_port()
    return f"""\
ClusterName=danlingtest
SlurmctldHost={host}
SlurmUser={user}
SlurmdUser={user}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job may start again this many seconds after the requeue (default 120).
AuthInfo=socket={directory}/munge/munge.socket,cred_expire=5
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd.pid
SlurmctldLogFile={directory}/log/slurmctld.log
SlurmdLogFile={directory}/log/slurmd.log
PlugStackConfig={directory}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName={host} CPUs=8 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _stop(processes: list[subprocess.Popen]) -> None:
    """SIGTERM each daemon by PID (newest first), then SIGKILL one that does not exit."""
    for process in reversed(processes):
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in reversed(processes):
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    missing = [name for name in BINARIES if shutil.which(name) is None]
    if missing:
        pytest.skip(
            f"Slurm binaries missing ({', '.join(missing)}); install Debian's slurm-wlm and munge (.ci/run does)"
        )
    # A short path: munge's socket path must fit a Unix socket address (108 bytes).
    directory = Path(tempfile.mkdtemp(prefix="dl-slurm-"))
    for name in ("state", "spool", "log", "munge"):
        (directory / name).mkdir(mode=0o700)
    key = directory / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    (directory / "plugstack.conf").touch()  # not the machine's /etc/slurm/plugstack.conf
    host = socket.gethostname().split(".")[0]
    (directory / "slurm.conf").write_text(_config(directory, host, getpass.getuser()))
    env = {**os.environ, "SLURM_CONF": str(directory / "slurm.conf"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env = {name: value for name, value in env.items() if not name.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env["SLURM_CONF"] = str(directory / "slurm.conf")
    munge = directory / "munge"
    daemons = [
        (
            "munged",
            f"--key-file={key}",
            f"--socket={munge / 'munge.socket'}",
            f"--pid-file={munge / 'munged.pid'}",
            f"--log-file={directory / 'log' / 'munged.log'}",
            f"--seed-file={munge / 'seed'}",
            "--foreground",
            "--force",
        ),
        ("slurmctld", "-D", "-i"),
        ("slurmd", "-D"),
    ]
    processes: list[subprocess.Popen] = []
    cluster = SlurmCluster(directory, env)
    try:
        for command in daemons:
            log = open(directory / "log" / f"{command[0]}.stderr", "wb")  # noqa: SIM115 - closed with the process
            processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
            log.close()
            if command[0] == "munged":
                _wait_path(munge / "munge.socket", processes[-1], directory)
        _wait_idle(cluster, processes)
        yield cluster
    finally:
        if processes:
            _drain(cluster)
        _stop(processes)
        _end_strays(directory / "slurm.conf")
        shutil.rmtree(directory, ignore_errors=True)


def _drain(cluster: SlurmCluster, timeout: float = 60.0) -> None:
    """Cancel what is left in the queue and wait (bounded) until the daemons have ended it.

    Stopping `slurmd` under a finishing job would orphan its step daemons (`slurmstepd`).
    """
    queued = cluster.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
    if queued:
        cluster.run("scancel", *queued, check=False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = cluster.run("squeue", "-h", "-o", "%i", check=False)
        if result.returncode or not result.stdout.strip():
            return
        time.sleep(0.2)


def _end_strays(conf: Path) -> None:
    """SIGKILL, by PID, any process still running for this cluster (its environment names `conf`).

    Only a daemon stopped in the middle of a job leaves one (a step daemon, `srun`, a task).
    """
    marker = f"SLURM_CONF={conf}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def _wait_path(path: Path, process: subprocess.Popen, directory: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted((directory / "log").iterdir()))
            raise RuntimeError(f"{process.args[0]} did not start (exit {process.poll()}):\n{logs}")
        time.sleep(0.1)


def _wait_idle(cluster: SlurmCluster, processes: list[subprocess.Popen]) -> None:
    """Wait until the node reports idle, failing early when a daemon died."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        dead = [p.args[0] for p in processes if p.poll() is not None]
        state = cluster.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip() if not dead else ""
        if state == "idle":
            return
        if dead or time.monotonic() > deadline:
            logs = "\n".join(
                f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                for p in sorted((cluster.directory / "log").iterdir())
            )
            raise RuntimeError(f"the test Slurm cluster did not come up (dead: {dead}, node state {state!r}):\n{logs}")
        time.sleep(0.2)
