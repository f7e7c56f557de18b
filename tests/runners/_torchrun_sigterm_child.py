"""A 2-rank run under torchrun whose rank 1 gets SIGTERM inside its step at global step 1.

`python -m torch.distributed.run --standalone --nproc-per-node 2 tests/runners/_torchrun_sigterm_child.py <root>`
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.runners._torch_toy import TinyRunner, tiny_config


class TerminatedRunner(TinyRunner):
    n_train = 16
    _sent = False

    def train_step(self, data):
        if self.rank == 1 and self.train_state.global_step == 1 and not self._sent:
            self._sent = True
            os.kill(os.getpid(), signal.SIGTERM)
        return super().train_step(data)


if __name__ == "__main__":
    runner = TerminatedRunner(tiny_config(sys.argv[1], epochs=3))
    runner.train()
    runner.close()
    sys.exit(3)  # not reached: the stop exits 143
