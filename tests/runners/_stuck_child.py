"""A single-process run whose step gets stuck: `python -m tests.runners._stuck_child <root> <how> <timeout>`.

`TinyRunner` trains with `watchdog.timeout_seconds=<timeout>`; inside the step that starts at
global step 1 it prints `inside-step <pid>` on stdout and then blocks for good:

- `python`: in `time.sleep`, which runs signal handlers while it waits (the step is stuck in Python);
- `c`: in libc's `system()`, which waits for its shell again whenever a signal interrupts it, so no
  Python signal handler runs (as in a hung collective or device synchronisation). The shell prints
  the line, so the process is inside the C call before the parent reads it; the shell then leaves
  the pipes and waits for this process to be gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

from tests.runners._torch_toy import TinyRunner, tiny_config


class StuckRunner(TinyRunner):
    how = ""

    def train_step(self, data):
        if self.train_state.global_step == 1:
            if self.how == "python":
                sys.__stdout__.write(f"inside-step {os.getpid()}\n")
                sys.__stdout__.flush()
                time.sleep(3600)
            else:
                sys.__stdout__.flush()
                shell = b"echo inside-step $PPID; exec >/dev/null 2>&1; while kill -0 $PPID; do sleep 0.2; done"
                ctypes.CDLL(None).system(shell)
        return super().train_step(data)


def main(root: str, how: str, timeout: str) -> None:
    StuckRunner.how = how
    # Signals a parent ignores stay ignored in its children (a test that left SIGTERM ignored in
    # pytest, say); a script a scheduler starts has the default action, which the second signal uses.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    config = tiny_config(root, **{"watchdog.timeout_seconds": float(timeout), "watchdog.interval_seconds": 0.2})
    with StuckRunner(config) as runner:
        runner.train()
    sys.exit(3)  # not reached


if __name__ == "__main__":
    main(*sys.argv[1:4])
