"""Launch a TorchFT job for the tests and the benchmark: a lighthouse and replica-group processes.

Each replica group is one process (`_replica_child.py`) with its own environment. The caller
reads the groups' progress files and holds them at a step through `hold-<id>` files; every wait
polls with a deadline.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

CHILD = Path(__file__).with_name("_replica_child.py")
ROOT = Path(__file__).resolve().parents[3]
DEADLINE = 150.0  # seconds any one wait may take on a loaded two-core machine


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def wait(
    what: str, ready: Callable[[], bool], deadline: float = DEADLINE, procs: tuple = (), logs: Path | None = None
) -> None:
    """Poll `ready` until it holds; a group in `procs` that fails, or the deadline, raises (with `logs`' tails)."""
    end = time.monotonic() + deadline
    while not ready():
        for proc in procs:
            if proc.poll() is not None and proc.returncode != 0:
                raise AssertionError(f"{what}: a replica group exited with {proc.returncode}{_tails(logs)}")
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline:.0f}s waiting for {what}{_tails(logs)}")
        time.sleep(0.05)


def _tails(control: Path | None, lines: int = 25) -> str:
    """The last lines of the groups' and the lighthouse's logs: what a failed wait needs to be diagnosed."""
    if control is None:
        return ""
    parts = []
    for path in sorted(control.glob("log-*")) + sorted(control.glob("lighthouse.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"\n--- {path.name} (last {len(tail)} lines) ---\n" + "\n".join(tail))
    return "".join(parts)


def step(control: Path, name: str) -> int:
    try:
        return int((control / f"progress-{name}").read_text() or -1)
    except (FileNotFoundError, ValueError):
        return -1


def events(control: Path, name: str) -> list[dict]:
    path = control / f"events-{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class Job:
    """A lighthouse and the replica groups of one test, torn down (by process id) at the end."""

    def __init__(self, control: Path, steps: int = 40, workspace: Path | None = None, **ft: object) -> None:
        control.mkdir(parents=True, exist_ok=True)
        self.steps = steps
        self.control = control
        self.workspace = workspace or control
        self.ft = ft
        self.procs: dict[str, subprocess.Popen] = {}
        port = _free_port()
        binary = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
        command = [binary, "--bind", f"[::]:{port}", "--min_replicas", "1", "--quorum_tick_ms", "50"]
        # Heartbeats stop with a killed group: after a second the others form a quorum without it.
        command += ["--join_timeout_ms", "60000", "--heartbeat_timeout_ms", "1000"]
        with open(control / "lighthouse.log", "w") as log:
            self.lighthouse = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        lighthouse = f"http://localhost:{port}"
        self.env = dict(os.environ, TORCHFT_LIGHTHOUSE=lighthouse, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
            self.env.pop(key, None)

    def start(self, name: str, ranks: int = 1, **overrides: object) -> subprocess.Popen | Group:
        """Start replica group `name`: one process, or `ranks` processes with the env torchrun would set."""
        (self.control / f"ready-{name}").unlink(missing_ok=True)
        config = {
            "steps": self.steps,
            "seed": 1,
            "optim.type": "sgd",
            "optim.lr": 0.01,
            "dataloader.batch_size": 4,
            "workspace_root": str(self.workspace / f"workspace-{name}"),
            "log": False,
            "checkpoint.async_enabled": False,
            "ft.enabled": True,
            "ft.replica_id": int(name),
            "ft.group_size": 2,
            **{f"ft.{key}": value for key, value in self.ft.items()},
            **overrides,
        }
        spec = json.dumps({"control": str(self.control), "name": name, "config": config, "debug": True})
        port, procs = _free_port(), []
        for rank in range(ranks):
            env = self.env
            if ranks > 1:
                env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks))
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            with open(self.control / f"log-{name}-{len(self.procs)}", "w") as log:
                command = [sys.executable, str(CHILD), spec]
                proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
            self.procs[f"{name}-{len(self.procs)}"] = proc
            procs.append(proc)
        return procs[0] if ranks == 1 else Group(procs)

    def start_both(self, ranks: int = 1, **overrides: object) -> subprocess.Popen | Group:
        """Start groups 0 and 1 so that they train together from their first updates; returns group 1.

        Group 0 waits after its first update until group 1 is built, then goes on. Left to run,
        it trained on in quorums of itself while group 1 was still being built: on a loaded
        two-core machine 22 of a test's 24 updates, which left none for the kill the test makes.
        """
        self.hold("0", 1)
        self.start("0", ranks=ranks, **overrides)
        second = self.start("1", ranks=ranks, **overrides)
        built = lambda: (self.control / "ready-1").exists()  # noqa: E731
        wait("group 1 to be built", built, procs=tuple(self.procs.values()), logs=self.control)
        self.release("0")
        return second

    def hold(self, name: str, step: int) -> None:
        (self.control / f"hold-{name}").write_text(str(step))

    def release(self, name: str) -> None:
        (self.control / f"hold-{name}").unlink(missing_ok=True)

    def finish(self) -> dict[str, dict]:
        live = tuple(p for p in self.procs.values() if p.returncode is None)
        done = lambda: all((self.control / f"done-{n}.pt").exists() for n in ("0", "1"))  # noqa: E731
        wait("both replica groups to finish", done, procs=live, logs=self.control)
        return {n: torch.load(self.control / f"done-{n}.pt") for n in ("0", "1")}

    def close(self) -> None:
        for proc in (*self.procs.values(), self.lighthouse):
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


class Group:
    """The processes of one replica group, signalled and awaited together."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.procs = procs

    def send_signal(self, sig: int) -> None:
        for proc in self.procs:
            proc.send_signal(sig)

    def wait(self, timeout: float | None = None) -> None:
        for proc in self.procs:
            proc.wait(timeout=timeout)
