"""Updates lost per failure: TorchFT replica groups vs a restart from the last checkpoint, on the same run.

Two replica groups (one process each, gloo, a lighthouse started here) train `--steps` updates
with the default checkpoint cadence (a tenth of `steps` in step mode). Group 1 is SIGKILLed
mid-update shortly after `--kill-at`, restarted once the survivor has trained `--alone` updates
without it, and both finish. From that one run it reads:

- TorchFT: the updates no group applied (the survivor's uncommitted updates), and the updates
  the killed group missed (trained by the survivor, handed over live on its restart);
- restart from checkpoint: the updates between the killed group's last checkpoint and the kill,
  which every group of a plain job would train again.

Run from the repository root: `python benchmarks/bench_ft_steps_lost.py [--steps 200 --kill-at 110]`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.runners.ft._harness import Job, events, step, wait


def measure(steps: int, kill_at: int, alone: int, root: Path) -> dict[str, object]:
    job = Job(root / "job", steps=steps)
    try:
        job.hold("1", kill_at)
        victim = job.start_both()
        wait("group 1 to reach the kill point", lambda: step(job.control, "1") >= kill_at, procs=(victim,))
        pause = kill_at + alone  # the survivor trains on alone up to here, then waits for the restart
        job.hold("0", pause)
        job.release("1")
        wait("group 1 to start its next update", lambda: step(job.control, "1") > kill_at, deadline=60)
        victim.send_signal(signal.SIGKILL)  # mid-update: between its quorum and its commit, or later
        victim.wait(timeout=30)
        killed_at = step(job.control, "1")
        wait("the survivor to train alone", lambda: step(job.control, "0") >= pause)
        first_life = events(job.control, "1")  # the restarted process appends to the same record
        started = time.monotonic()
        job.start("1")
        recovered = lambda: any(e["event"] == "replica_recovered" for e in events(job.control, "1")[len(first_life) :])  # noqa: E731
        # Released once the restarted group is built (and heartbeating): the next quorum waits for it.
        wait("the restarted group to be built", lambda: (job.control / "ready-1").exists())
        job.release("0")
        wait("the restarted group to recover from its peer", recovered)
        rejoin_seconds = time.monotonic() - started
        results = job.finish()
    finally:
        job.close()
    saved = [e["step"] for e in first_life if e["event"] == "checkpoint_saved"]
    last_checkpoint = max(saved, default=0)
    recovery = [e for e in events(job.control, "1")[len(first_life) :] if e["event"] == "replica_recovered"][0]
    return {
        "steps": steps,
        "checkpoint_interval": max(1, steps // 10),
        "killed_at_step": killed_at,
        "torchft_updates_lost": results["0"]["summary"]["uncommitted"],
        # trained by the survivor alone while the killed group was down, handed over live at the restart
        "torchft_updates_missed_by_killed_group": recovery["step"] - killed_at,
        "torchft_restart_loaded_step": recovery["step"],
        "restart_last_checkpoint": last_checkpoint,
        "restart_updates_lost_per_group": killed_at - last_checkpoint,
        "restart_updates_lost_expected": (max(1, steps // 10) - 1) / 2,  # a failure at a uniformly random step
        "rejoin_seconds_incl_process_start": round(rejoin_seconds, 1),
        "final_steps": [results[n]["summary"]["global_step"] for n in ("0", "1")],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kill-at", type=int, default=110)
    parser.add_argument("--alone", type=int, default=10, help="updates the survivor trains before the restart")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-ft-"))
    figures = measure(args.steps, args.kill_at, args.alone, root)
    shutil.rmtree(root)  # kept when the run fails: its logs say why
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
