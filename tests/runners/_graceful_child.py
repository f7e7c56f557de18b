"""Child process for the graceful-shutdown test.

Run as `python _graceful_child.py <run_dir>`. During step 3 it reports `in-step 3` and waits
for one line on stdin; the parent sends the signal first and then that line, so the signal
always arrives in the middle of a step. The loop finishes the step, saves a `shutdown`
checkpoint, closes everything and exits with the supervisor's exit code.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(run_dir: str) -> None:
    from danling.checkpoint import FileCheckpointManager
    from danling.runners.services.supervisor import RunnerSupervisor

    root = Path(run_dir)
    supervisor = RunnerSupervisor(heartbeat_dir=root / "heartbeats", heartbeat_interval=0)
    supervisor.install_signal_handlers()
    manager = FileCheckpointManager(root / "checkpoints")
    finished: list[int] = []
    step = 0
    while not supervisor.stop_requested:
        step += 1
        if step == 3:
            print("in-step 3", flush=True)
            sys.stdin.readline()
        finished.append(step)
        supervisor.beat(step, 0, "train")
    manager.save({"finished": finished}, f"step-{step:06d}", aliases=("latest", "shutdown"))
    manager.close()
    supervisor.close()
    sys.exit(supervisor.exit_code)


if __name__ == "__main__":
    main(sys.argv[1])
