"""The training job the Slurm tests submit: `srun python -m tests.slurm._job <out dir> <workspace> [key=value ...]`.

Each task is placed by Slurm alone (no torchrun): the runner reads its rank from `SLURM_*`. Every
task writes `<out dir>/rank<r>-restart<n>.json` at the end of each launch: its rank and world
size, the global step it ended at, its exit status and a digest of its model's weights, so the test
can check that ranks agree and that a requeued job ends like an uninterrupted one.

With `wait_at=<step>`, the first launch (`SLURM_RESTART_COUNT` unset or 0) writes
`<out dir>/waiting-rank<r>` at that global step and waits there (bounded) until its preemption
signal arrived: the test sends it then, so the signal lands mid-epoch whatever the machine's speed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

from tests.runners._torch_toy import TinyRunner, tiny_config

SIGNAL_WAIT = 120.0


class JobRunner(TinyRunner):
    """TinyRunner with enough data for several stop polls per epoch (10 batches a rank on 2 ranks)."""

    n_train = 80
    wait_at: int | None = None
    out: Path

    def train_step(self, data):
        if self.wait_at is not None and self.train_state.global_step == self.wait_at:
            (self.out / f"waiting-rank{self.rank}").touch()
            deadline = time.monotonic() + SIGNAL_WAIT
            while not self.supervisor.stop_requested and time.monotonic() < deadline:
                time.sleep(0.05)  # the signal interrupts the sleep and its handler runs here
            self.wait_at = None
        return super().train_step(data)


def digest(runner: TinyRunner) -> str:
    state = runner.unwrap(runner.model).state_dict()
    hasher = hashlib.sha256()
    for key in sorted(state):
        hasher.update(key.encode())
        hasher.update(state[key].detach().cpu().contiguous().numpy().tobytes())
    return hasher.hexdigest()


def _setting(option: str) -> tuple[str, object]:
    key, text = option.split("=", 1)
    try:
        return key, json.loads(text)  # numbers and booleans typed, as in a YAML file
    except ValueError:
        return key, text


def main(out: str, workspace: str, *options: str) -> None:
    out_dir = Path(out)
    settings = dict(_setting(option) for option in options)
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    wait_at = settings.pop("wait_at", None)
    config = tiny_config(workspace, deterministic=True, auto_resume=True, **settings)
    record: dict = {"restart": restart, "job": os.environ.get("SLURM_JOB_ID"), "exit": 0}
    runner = None
    try:
        runner = JobRunner(config)
        runner.out = out_dir
        runner.wait_at = int(wait_at) if wait_at is not None and restart == 0 else None
        record.update(rank=runner.rank, world_size=runner.world_size, run_dir=str(runner.workspace.dir))
        with runner:
            runner.train()
    except SystemExit as stop:
        record["exit"] = stop.code
        raise
    finally:
        if runner is not None:
            record.update(step=runner.train_state.global_step, digest=digest(runner))
            name = f"rank{record.get('rank', 'x')}-restart{restart}.json"
            (out_dir / name).write_text(json.dumps(record))


if __name__ == "__main__":
    main(*sys.argv[1:])
