"""A run of `infer(split, output=...)` that SIGKILLs itself: `python -m tests.runners._infer_child ROOT J K [SIGNAL]`.

Writes `ROOT/out.jsonl`, `ROOT/out.npy` and `ROOT/out.parquet` (when pyarrow is installed) in that
order from an `InferRunner`. While writing output number `J`, the process sends itself SIGKILL
at the start of its `K`-th batch, so nothing gets a chance to clean up. Under 2-rank DDP (started
with `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT` set) rank 1 dies earlier, inside the last
progress commit before that batch, after the ranks agreed but before its record is written: the
records of the ranks then differ by one commit, which the restart must reconcile.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from pathlib import Path
from typing import Any

from danling.runners.inference import progress
from tests.runners._torch_toy import TinyRunner, make_data, tiny_config

INTERVAL = 3  # batches between progress records
LENGTH = 37  # not divisible by 2 ranks: the sampler pads one example


def outputs(root: Path) -> list[Path]:
    suffixes = [".jsonl", ".npy"] + ([".parquet"] if importlib.util.find_spec("pyarrow") else [])
    return [root / f"out{suffix}" for suffix in suffixes]


class InferRunner(TinyRunner):
    """TinyRunner with an `infer` split of `LENGTH` examples, read 2 at a time."""

    length = LENGTH

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.datasets.infer = make_data(self.length, seed=3)


def infer_config(root: Path, **overrides: Any) -> dict[str, Any]:
    return tiny_config(root, **{"dataloader.batch_size": 2, "inference.progress_interval": INTERVAL, **overrides})


class KillingRunner(InferRunner):
    kill_at: int | None = None
    calls = 0
    signum = signal.SIGKILL

    def infer_step(self, data: Any) -> list[Any]:
        self.calls += 1
        if self.calls == self.kill_at:
            os.kill(os.getpid(), self.signum)  # SIGTERM: handled, the batch completes and the run stops
        return super().infer_step(data)


def _kill_inside_commit(number: int) -> None:
    """Make this process die inside its `number`-th progress commit, before the record is replaced."""
    commit = progress.ProgressRecord.commit
    count = [0]

    def dying(self: progress.ProgressRecord, value: progress.Commit) -> None:
        count[0] += 1
        if count[0] == number:
            os.kill(os.getpid(), signal.SIGKILL)
        commit(self, value)

    progress.ProgressRecord.commit = dying


def main(root: str, target: int, kill_at: int, signame: str = "SIGKILL") -> None:
    root_path = Path(root)
    runner = KillingRunner(infer_config(root_path / "workspace"))
    runner.signum = signal.Signals[signame]
    commit_kill = os.environ.get("RANK", "0") == "1" and (kill_at - 1) // INTERVAL >= 1
    for index, output in enumerate(outputs(root_path)):
        runner.calls = 0
        runner.kill_at = kill_at if index == target and not commit_kill else None
        if index == target and commit_kill:
            _kill_inside_commit((kill_at - 1) // INTERVAL)
        runner.infer("infer", output=output)
    sys.exit(3)  # not reached: the kill ends the run first


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
