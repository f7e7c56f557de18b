"""Child process for the run-ending tests: `python -m tests.runners._ending_child <root> <ending>`.

It trains the tiny torch runner for 3 epochs with the default config (background saves), each
save's write slowed down so the last one is still in flight when the script goes on, then ends
the way `<ending>` says. It prints `checkpoints <dir>` first; the parent checks that the run's
last checkpoint is on disk, verifies, and that `latest` points at it.
"""

from __future__ import annotations

import gc
import sys
import time

from danling.checkpoint import FileCheckpointManager
from tests.runners._torch_toy import TinyRunner

# ending -> (exit status, the checkpoint `latest` must name once the process has exited)
ENDINGS = {
    "return": (0, "epoch-000002"),
    "module": (0, "epoch-000002"),
    "exit": (0, "epoch-000002"),
    "exception": (1, "epoch-000002"),
    "failure": (1, "epoch-000001"),
    "collected": (0, "epoch-000002"),
    "manual": (0, "step-000015"),
    "manual-failure": (1, "epoch-000002"),  # that save fails during shutdown: reported, and the exit is not 0
}

_write_payload = FileCheckpointManager._write_payload
FAILING = False  # set before a save whose write must fail


def _slow_write(self, state, directory):
    time.sleep(0.5)  # a slow disk: the final save outlives the script's remaining lines
    if FAILING:
        raise OSError(28, "No space left on device (simulated)")
    return _write_payload(self, state, directory)


class FailingRunner(TinyRunner):
    def train_step(self, data):
        if self.train_state.epoch == 2:  # the save of epoch 1 is still being written
            raise RuntimeError("failure inside training")
        return super().train_step(data)


def config(root: str) -> dict:
    return {
        "workspace_root": root,
        "epochs": 3,
        "seed": 0,
        "log": False,
        "optim.type": "adamw",
        "dataloader.batch_size": 4,
    }


def build(root: str, cls: type = TinyRunner) -> TinyRunner:
    runner = cls(config(root))
    print("checkpoints", runner.checkpoint_manager.directory, flush=True)
    return runner


def in_function(root: str) -> None:
    build(root).train()  # the runner is local: it goes with the function's frame


def main(root: str, ending: str) -> None:
    if ending == "return":
        in_function(root)
    elif ending == "exit":
        build(root).train()
        sys.exit(0)
    elif ending == "exception":
        build(root).train()
        raise RuntimeError("failure after training")
    elif ending == "failure":
        build(root, FailingRunner).train()
    elif ending == "collected":
        runner = build(root)
        runner.train()
        del runner
        gc.collect()
    elif ending == "manual":  # a save started outside train(), still running at interpreter shutdown
        runner = build(root)
        runner.train()
        runner.save_checkpoint(name="export", force=True)
    elif ending == "manual-failure":  # the same, and that save's write fails
        global FAILING
        runner = build(root)
        runner.train()
        FAILING = True
        runner.save_checkpoint(name="export", force=True)
    else:
        raise ValueError(ending)


if __name__ == "__main__":
    FileCheckpointManager._write_payload = _slow_write  # in the child only: the tests import ENDINGS
    if sys.argv[2] == "module":  # the runner is a module global until the interpreter shuts down
        RUNNER = build(sys.argv[1])
        RUNNER.train()
    else:
        main(sys.argv[1], sys.argv[2])
