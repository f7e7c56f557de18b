"""One rank of the 2-rank watchdog tests: `python -m tests.runners._watchdog_child <root> <scenario>`.

Started twice by the parent with `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT` set, as torchrun
would. `TinyRunner` trains 3 epochs of 2 batches per rank with a 5 s watchdog.

- `sigstop`: rank 1 freezes itself (SIGSTOP) inside the step that starts at global step 3; rank 0,
  blocked in the next collective, must be ended by its watchdog with a message naming rank 1.
- `sigterm`: inside the step at global step 1 each rank prints `inside-loop` and waits for a line
  on stdin; the parent sends SIGTERM to rank 1 only, then the line to both.
"""

from __future__ import annotations

import os
import signal
import sys

from tests.runners._torch_toy import TinyRunner, tiny_config


class WatchedRunner(TinyRunner):
    n_train = 16  # 8 samples per rank: 2 batches of 4 per pass
    scenario = ""
    _reported = False

    def train_step(self, data):
        step = self.train_state.global_step
        if self.scenario == "sigstop" and self.rank == 1 and step == 3:
            # A heartbeat goes out every 0.5 s; these tiny steps are faster, so send the one a
            # real step would have sent, then freeze.
            self.supervisor.watchdog._publish()
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.scenario == "sigterm" and step == 1 and not self._reported:
            self._reported = True
            sys.__stdout__.write(f"inside-loop {os.getpid()}\n")
            sys.__stdout__.flush()
            sys.stdin.readline()
        return super().train_step(data)


def main(root: str, scenario: str) -> None:
    WatchedRunner.scenario = scenario
    config = tiny_config(root, epochs=3, **{"watchdog.timeout_seconds": 5.0, "watchdog.interval_seconds": 0.5})
    runner = WatchedRunner(config)
    runner.train()
    runner.close()
    sys.exit(3)  # not reached in either scenario


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
