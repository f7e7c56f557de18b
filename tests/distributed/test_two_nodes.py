"""Two torchrun agents on this machine acting as two nodes (c10d rendezvous): DDP trains and resumes exactly.

Each "node" is one `torchrun --nnodes 2 --nproc-per-node 1` agent; they meet through a c10d
rendezvous on a free local port, as two machines would through the first node's address. The
training job is the one the Slurm tests submit (`tests/slurm/_job.py`), which records each
rank's final weights.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _two_nodes(out: Path, workspace: Path, *options: str) -> list[subprocess.Popen]:
    """Start the two agents of one two-node job; returns them running."""
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = {name: value for name, value in os.environ.items() if not name.startswith("SLURM_")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        out.name,
        "-m",
        "tests.slurm._job",
        str(out),
        str(workspace),
        *options,
    ]
    return [
        subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]


def _finish(agents: list[subprocess.Popen]) -> None:
    for agent in agents:
        output, _ = agent.communicate(timeout=TIMEOUT)
        assert agent.returncode == 0, output[-4000:]


def _records(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{rank}-restart0.json").read_text()) for rank in range(2)]


def test_two_node_ddp_trains_and_resumes_exactly(tmp_path):
    # The uninterrupted two-epoch run and the first epoch of the resumed one, side by side.
    reference = _two_nodes(tmp_path / "reference", tmp_path / "ws-reference")
    first = _two_nodes(tmp_path / "first", tmp_path / "ws-resumed", "epochs=1")
    _finish(reference)
    _finish(first)
    # The second launch: the budget extended to two epochs, resumed from the first one's checkpoint.
    _finish(_two_nodes(tmp_path / "second", tmp_path / "ws-resumed", "epochs=2"))

    expected = _records(tmp_path / "reference")
    assert [record["world_size"] for record in expected] == [2, 2]
    assert expected[0]["digest"] == expected[1]["digest"]
    stopped, resumed = _records(tmp_path / "first"), _records(tmp_path / "second")
    assert stopped[0]["step"] == expected[0]["step"] // 2
    assert resumed[0]["run_dir"] == stopped[0]["run_dir"]
    assert [record["step"] for record in resumed] == [expected[0]["step"]] * 2
    assert [record["digest"] for record in resumed] == [expected[0]["digest"]] * 2
