"""One TorchFT replica group for the fault-tolerance tests: `python worker.py <json>`.

The JSON names the config overrides and a control directory. The worker records its progress
there (`progress-<id>`: the global step after each batch, `events-<id>.jsonl`: fault-tolerance
events, `ready-<id>`: constructed, `done-<id>.pt`: the final weights and counters) and, while
`hold-<id>` exists and holds a step it has reached, waits at the end of a batch (the test's
release; bounded by the test's own timeouts).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from danling.runners import ParallelRunner, TorchRunner
from danling.runners.loop.events import Events


class Replica(TorchRunner):
    def __init__(self, config):
        super().__init__(config)
        torch.manual_seed(0)  # the same initial weights on every rank of every group
        self.model = nn.Linear(4, 1)
        self.criterion = nn.MSELoss()
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(1024, 4, generator=generator)
        self.datasets.train = list(zip(x, x.sum(dim=1, keepdim=True)))


class ShardedReplica(Replica, ParallelRunner):  # a replica group of FSDP2 shards (HSDP across the groups)
    pass


def _full_weights(runner) -> dict[str, torch.Tensor]:
    """The whole model's weights (a collective over the group's ranks when they are sharded)."""
    state = runner.unwrap(runner.model).state_dict()
    return {key: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for key, v in state.items()}


def _write(path: Path, text: str) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    os.replace(partial, path)


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec.get("debug"):
        import logging

        logging.basicConfig(level=logging.INFO, format=f"[{spec['name']}] %(name)s %(message)s")
    control, name = Path(spec["control"]), str(spec["name"])
    runner = (ShardedReplica if spec["config"].get("stack") == "parallel" else Replica)(spec["config"])
    leader = runner.rank == 0  # writes the group's progress, events and result
    progress, hold, events = control / f"progress-{name}", control / f"hold-{name}", control / f"events-{name}.jsonl"

    def on_step_end(context) -> None:
        if leader:
            _write(progress, str(runner.train_state.global_step))
        while hold.exists():
            try:
                if runner.train_state.global_step < int(hold.read_text() or 0):
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.01)

    def record(event):
        def handler(context) -> None:
            if not leader:
                return
            keys = ("step", "replicas", "previous", "from_step", "steps_missed")
            fields = {k: getattr(context, k, None) for k in keys}
            line = {"event": event.name, **{k: v for k, v in fields.items() if v is not None}}
            with events.open("a") as file:
                file.write(json.dumps(line) + "\n")

        return handler

    runner.events.subscribe(Events.STEP_END, on_step_end)
    for event in (Events.QUORUM_CHANGED, Events.REPLICA_LEFT, Events.REPLICA_JOINED, Events.REPLICA_RECOVERED):
        runner.events.subscribe(event, record(event))
    runner.events.subscribe(Events.REPLICA_UNCOMMITTED, record(Events.REPLICA_UNCOMMITTED))

    def data_position(context) -> None:  # where the recovered group's loop and loader stand
        if not leader:
            return
        loader = runner.dataloaders.get("train")
        yielded = loader.state_dict().get("_num_yielded") if loader is not None else None
        line = {"event": "data_position", "batch": runner.loop_state.batch, "yielded": yielded}
        with events.open("a") as file:
            file.write(json.dumps(line) + "\n")

    runner.events.subscribe(Events.REPLICA_RECOVERED, data_position)

    def saved(context) -> None:
        if not leader:
            return
        with events.open("a") as file:
            file.write(json.dumps({"event": "checkpoint_saved", "step": runner.train_state.global_step}) + "\n")

    runner.events.subscribe(Events.CHECKPOINT_SAVED, saved)
    if leader:
        _write(control / f"ready-{name}", "1")
    runner.train()
    state = _full_weights(runner)
    summary = {
        "global_step": runner.train_state.global_step,
        "uncommitted": runner.ft.uncommitted if runner.ft else 0,
        "checkpoint_manager": type(runner.checkpoint_manager).__name__,
        "parameter": type(next(runner.unwrap(runner.model).parameters())).__name__,  # DTensor when sharded
        "shard_hooks": bool(runner.ft and runner.ft._shard_hooks),
    }
    if leader:
        torch.save({"model": state, "summary": summary}, control / f"done-{name}.pt.partial")
        os.replace(control / f"done-{name}.pt.partial", control / f"done-{name}.pt")
    runner.close()


if __name__ == "__main__":
    main()
