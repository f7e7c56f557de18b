"""Chaos harness, second part: the ways a run ends or resumes that SIGKILLs never take.

`benchmarks/chaos.py` kills runs and resumes them. This script checks the other paths where a
checkpoint can be lost, overwritten or made to run code, each over many runs:

- `endings`: a real script per run that trains with background saves (each write slowed down, so
  the last one is still in flight when `train()` is done) and then ends by a return, the end of the
  script, `sys.exit`, an exception after or inside training, the runner garbage-collected, or a
  save still running at interpreter shutdown. Counted: runs whose last checkpoint is missing, does
  not verify, or is not `latest`, and runs with the wrong exit status;
- `unverifiable`: every checkpoint of a run made unverifiable (manifests removed, payloads
  truncated, a flipped byte), then `auto_resume`. Counted: checkpoint files changed or removed,
  and runs that did not start in a new version directory;
- `save_errors`: the last save of a run fails (full disk) under `checkpoint.continue_on_save_error`,
  with synchronous and background saves. Counted: runs that ended without an error, without
  `failed` in `status.json`, or without an ERROR line for the save before it that failed too;
- `deepspeed`: a pickle payload planted in DeepSpeed's own files (`mp_rank_00_model_states.pt`,
  `zero_pp_rank_0_*_optim_states.pt`, manifest recomputed) and loaded through `resume` and
  `pretrained`. Counted: payloads that ran, and loads that were neither refused nor harmless.

Run it as

    PYTHONPATH=. python benchmarks/chaos_paths.py --runs 5

It prints one JSON object; every count but the totals must be 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DAMAGES = ("manifest removed", "truncated", "flipped byte")


def endings(root: Path, runs: int) -> dict[str, Any]:
    """Run the ending child of the test suite `runs` times per ending; count what was lost."""
    from danling.checkpoint import FileCheckpointManager
    from danling.checkpoint.manifest import CheckpointError
    from tests.runners._ending_child import ENDINGS

    counts = {"runs": 0, "lost_last_checkpoint": 0, "wrong_exit_status": 0}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for ending, (code, expected) in ENDINGS.items():
        for run in range(runs):
            work = root / "endings" / f"{ending}-{run}"
            done = subprocess.run(
                [sys.executable, "-m", "tests.runners._ending_child", str(work), ending],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            counts["runs"] += 1
            counts["wrong_exit_status"] += done.returncode != code
            directory = Path(done.stdout.split("checkpoints", 1)[1].split()[0])
            manager = FileCheckpointManager(directory, load_only=True)
            try:
                manager.verify("latest")
                durable = manager.latest.name == expected
            except CheckpointError:
                durable = False
            counts["lost_last_checkpoint"] += not durable
    return counts


def unverifiable(root: Path, runs: int) -> dict[str, Any]:
    """Make every checkpoint of a run unverifiable, then `auto_resume`; count what the new run touched."""
    from tests.runners._toy import ToyRunner, toy_config
    from tests.runners.services.test_run_identity import _damage, _snapshot

    counts = {"runs": 0, "checkpoints_overwritten": 0, "not_a_new_version": 0}
    for how in DAMAGES:
        for run in range(runs):
            work = root / "unverifiable" / f"{how.replace(' ', '-')}-{run}"
            with ToyRunner(toy_config(work, epochs=3, seed=run, auto_resume=True)) as first:
                first.train()
                checkpoints = first.checkpoint_manager.directory
            for checkpoint in sorted(checkpoints.glob("epoch-*")):
                _damage(checkpoint, how)
            evidence = _snapshot(checkpoints)
            with ToyRunner(toy_config(work, epochs=3, seed=run, auto_resume=True)) as second:
                second.train()
                moved = second.checkpoint_manager.directory != checkpoints
            counts["runs"] += 1
            counts["checkpoints_overwritten"] += _snapshot(checkpoints) != evidence
            counts["not_a_new_version"] += not moved
    return counts


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _full_disk_after_one(writes: Any, writer: type) -> Any:
    from tests.checkpoint.test_save_failures import _FullDisk  # a raw file that is full past `limit` bytes

    return lambda self, raw: writer(_FullDisk(raw, 0 if next(writes) >= 1 else 1 << 40))


def save_errors(root: Path, runs: int) -> dict[str, Any]:
    """The last two saves of a run find the disk full under `continue_on_save_error`; count silent endings."""
    from danling.checkpoint import FileCheckpointManager
    from danling.checkpoint.failures import CheckpointSaveError
    from danling.checkpoint.manifest import HashingWriter
    from tests.runners._toy import ToyRunner, toy_config

    counts = {"runs": 0, "ended_without_error": 0, "status_not_failed": 0, "skipped_save_not_logged": 0}
    original = FileCheckpointManager._payload_stream
    for async_save in (False, True):
        for run in range(runs):
            writes = iter(range(1000))  # the first save lands, the ones after it find the disk full
            FileCheckpointManager._payload_stream = _full_disk_after_one(writes, HashingWriter)
            errors = _Errors()
            logging.getLogger("danling").addHandler(errors)
            config = toy_config(root / "save-errors" / f"{async_save}-{run}", epochs=3, seed=run)
            config.update({"checkpoint.continue_on_save_error": True, "checkpoint.async_enabled": async_save})
            runner = ToyRunner(config)
            try:
                runner.train()
                raised = False
            except CheckpointSaveError:
                raised = True
            finally:
                with contextlib.suppress(CheckpointSaveError):  # raised here, not by train(), is still silent
                    runner.close()
                FileCheckpointManager._payload_stream = original
                logging.getLogger("danling").removeHandler(errors)
            status = json.loads((runner.workspace.path / "status.json").read_text())
            counts["runs"] += 1
            counts["ended_without_error"] += not raised
            counts["status_not_failed"] += status.get("status") != "failed"
            counts["skipped_save_not_logged"] += not any("epoch-000001" in message for message in errors.messages)
    return counts


def deepspeed(root: Path, runs: int) -> dict[str, Any]:
    """Plant a payload in DeepSpeed's own files and load the tag through `resume` and `pretrained`."""
    from tests.runners._deepspeed_toy import Regression, ds_config

    counts = {"loads": 0, "payloads_ran": 0, "refused": 0, "not_read": 0, "other_errors": 0}
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints to stdout, where the report goes
        with Regression(ds_config(root / "deepspeed", "source", stage=2, epochs=1)) as source:
            source.train()
            tag = source.checkpoint_manager.latest
        _plant_and_load(root, tag, runs, counts)
    return counts


def _plant_and_load(root: Path, tag: Path, runs: int, counts: dict[str, int]) -> None:
    import shutil

    import torch

    from danling.checkpoint.unpickling import UnsafePickleError
    from tests.checkpoint.test_safe_loading import _rehash
    from tests.runners._deepspeed_toy import Regression, ds_config
    from tests.runners.deepspeed.test_safe_loading import Planted  # runs os.system when unpickled

    for run in range(runs):
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
            for entry in ("resume", "pretrained"):
                work = root / "deepspeed" / f"{run}-{name[:8]}-{entry}"
                planted, marker = work / "planted" / tag.name, work / "marker"
                shutil.copytree(tag, planted)
                state = torch.load(planted / name, weights_only=False)
                state["planted"] = Planted(marker)
                torch.save(state, planted / name)
                _rehash(planted)
                counts["loads"] += 1
                try:
                    Regression(ds_config(work, "victim", stage=2, epochs=1, **{entry: str(planted)})).close()
                    counts["not_read"] += 1
                except UnsafePickleError:
                    counts["refused"] += 1
                except Exception:  # counted: neither refused nor harmless
                    counts["other_errors"] += 1
                counts["payloads_ran"] += marker.exists()


PATHS = {"endings": endings, "unverifiable": unverifiable, "save_errors": save_errors, "deepspeed": deepspeed}


def run_paths(root: str | os.PathLike, *, runs: int, paths: list[str] | None = None) -> dict[str, Any]:
    """Run the chosen paths (all by default) `runs` times each; the counts and seconds of each."""
    report: dict[str, Any] = {}
    for name in paths or list(PATHS):
        began = time.monotonic()
        report[name] = PATHS[name](Path(root), runs)
        report[name]["seconds"] = round(time.monotonic() - began, 1)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each case")
    parser.add_argument("--paths", nargs="*", choices=sorted(PATHS), default=None)
    parser.add_argument("--root", default=None, help="working directory (default: a fresh temporary one)")
    args = parser.parse_args(argv)
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="danling-chaos-paths-"))
    print(json.dumps(run_paths(root, runs=args.runs, paths=args.paths), indent=2))
    if not args.root:  # kept when a path fails, for its logs
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
