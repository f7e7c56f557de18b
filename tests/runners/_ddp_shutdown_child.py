"""One rank of the 2-rank DDP shutdown test: `python -m tests.runners._ddp_shutdown_child <root>`.

The parent starts two of these with `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT` set, as
torchrun would; the runner starts the process group itself. Each rank trains a `TinyRunner` for
2 epochs of 2 batches (plus one evaluation batch each): fewer batches than the ranks let pass
between two agreements on a stop request. Inside the step that reaches global step 2 it prints
`inside-loop <checkpoint dir>` and waits for one line on stdin. The parent signals both ranks,
then sends the line, so the signal lands in the middle of a step on every rank. Both ranks must
stop at the same batch, save a `shutdown` checkpoint together and exit with 128 + the signal.
"""

from __future__ import annotations

import sys

from tests.runners._torch_toy import TinyRunner, tiny_config


class SignalledRunner(TinyRunner):
    n_train = 16  # 8 samples per rank: 2 batches of 4 per pass
    _reported = False

    def train_step(self, data):
        if self.train_state.global_step == 1 and not self._reported:
            self._reported = True
            # the raw stream: a non-main rank's print() is routed away by the workspace
            sys.__stdout__.write(f"inside-loop {self.checkpoint_manager.directory}\n")
            sys.__stdout__.flush()
            sys.stdin.readline()
        return super().train_step(data)


def main(root: str) -> None:
    runner = SignalledRunner(tiny_config(root, epochs=2, log=False))
    runner.train()
    sys.exit(3)  # not reached: the signal ends the run


if __name__ == "__main__":
    main(sys.argv[1])
