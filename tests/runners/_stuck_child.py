"""A single-process run whose step gets stuck: `python -m tests.runners._stuck_child <root> <how> <timeout>`.

`TinyRunner` trains with `watchdog.timeout_seconds=<timeout>`; inside the step that starts at
global step 1 it prints `inside-step <pid>` on stdout and then blocks for good:

- `python`: in `time.sleep`, which runs signal handlers while it waits (the step is stuck in Python);
- `c`: in `torch.futures.Future().wait()`, a C++ wait that runs no Python code until it returns,
  so no Python signal handler runs either (as a hung collective or device synchronisation).
"""

from __future__ import annotations

import os
import sys
import time

import torch

from tests.runners._torch_toy import TinyRunner, tiny_config


class StuckRunner(TinyRunner):
    how = ""

    def train_step(self, data):
        if self.train_state.global_step == 1:
            sys.__stdout__.write(f"inside-step {os.getpid()}\n")
            sys.__stdout__.flush()
            if self.how == "python":
                time.sleep(3600)
            else:
                torch.futures.Future().wait()
        return super().train_step(data)


def main(root: str, how: str, timeout: str) -> None:
    StuckRunner.how = how
    config = tiny_config(root, **{"watchdog.timeout_seconds": float(timeout), "watchdog.interval_seconds": 0.2})
    with StuckRunner(config) as runner:
        runner.train()
    sys.exit(3)  # not reached


if __name__ == "__main__":
    main(*sys.argv[1:4])
