"""Child process for the runner shutdown test: `python -m tests.runners._shutdown_child <root>`.

It trains a ToyRunner for many epochs. Inside the step that reaches global step 8 it prints
`inside-loop <checkpoint dir>` and waits for one line on stdin; the parent sends the signal
first and the line second, so the signal always lands in the middle of a step. The runner must
finish that step, save a `shutdown` checkpoint and exit with 128 + the signal number.
"""

from __future__ import annotations

import sys

from tests.runners._toy import ToyRunner, toy_config


class SignalledRunner(ToyRunner):
    def train_step(self, data):
        if self.train_state.global_step == 7:
            print("inside-loop", self.checkpoint_manager.directory, flush=True)
            sys.stdin.readline()
        return super().train_step(data)


def main(root: str) -> None:
    runner = SignalledRunner(toy_config(root, epochs=100))
    runner.train()
    sys.exit(3)  # not reached: the signal ends the run


if __name__ == "__main__":
    main(sys.argv[1])
