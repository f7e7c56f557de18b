"""Child process of the elastic-resume test (one per rank): `python -m tests.runners._elastic_child`.

The parent starts it on every rank of a launch with `RANK`/`WORLD_SIZE` set. After importing
everything once it forks one subprocess per scenario (`tests.dist.fork_scenario`), all at once;
a scenario may use fewer ranks than the launch (its own `WORLD_SIZE`), the surplus ranks skip it.

Every run trains a 4 -> 8 -> 1 MLP without dropout on 24 samples whose third tensor is the sample
index, with per-rank batches of 2, AdamW and a cosine schedule, for 2 epochs. Each rank appends
`[pass epoch, global step, indices]` per micro-batch to `<root>/<scenario>/samples-rank<r>.jsonl`
and, when it finishes, saves its final weights, step, `accum_steps` and the runner's warnings to
`<root>/<scenario>/final-rank<r>.pt`.

- `--phase kill` (2 ranks): `clean` trains 2 ranks to the end; `kill-file` / `kill-dcp` train 2 ranks
  with that checkpoint backend, save a checkpoint at step 3 (mid-epoch: 12 of 24 samples) and
  SIGKILL themselves at step 4; `kill-one` does the same on 1 rank with `accum_steps=2` (DCP).
- `--phase resume` (3 ranks): `file-on-1`, `dcp-on-1` (1 rank), `file-on-3`, `dcp-on-3` (3 ranks)
  resume the step-3 checkpoints of the 2-rank runs, `one-on-2` (2 ranks) the one of `kill-one`.

Each scenario's exit status goes to `<root>/status-<phase>-rank<r>.json`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
from pathlib import Path

import torch
import torch.distributed.checkpoint.state_dict
from torch.utils.data import TensorDataset

from tests.dist import fork_scenario, scenario_status
from tests.runners._torch_toy import TinyRunner, make_data, model_state, tiny_config

N_TRAIN, SAVE_AT, KILL_AT = 24, 3, 4

# scenario -> (ranks, checkpoint backend, accum_steps, checkpoint to resume: (scenario, step) or None, kill)
SCENARIOS = {
    "kill": {
        "clean": (2, "file", 1, None, False),
        "kill-file": (2, "file", 1, None, True),
        "kill-dcp": (2, "dcp", 1, None, True),
        "kill-one": (1, "dcp", 2, None, True),
    },
    "resume": {
        "file-on-1": (1, "file", 1, "kill-file", False),
        "dcp-on-1": (1, "dcp", 1, "kill-dcp", False),
        "file-on-3": (3, "file", 1, "kill-file", False),
        "dcp-on-3": (3, "dcp", 1, "kill-dcp", False),
        "one-on-2": (2, "dcp", 2, "kill-one", False),
    },
}


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _checkpoint(root: Path, scenario: str) -> str:
    found = sorted(root.glob(f"{scenario}/**/checkpoints/step-{SAVE_AT:06d}"))
    if len(found) != 1:
        raise FileNotFoundError(f"expected one step-{SAVE_AT} checkpoint of {scenario}, found {found}")
    return str(found[0])


def _run(root: Path, scenario: str, spec: tuple) -> None:
    world_size, backend, accum, source, kill = spec
    rank = int(os.environ["RANK"])
    os.environ.update(WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    out = root / scenario
    out.mkdir(parents=True, exist_ok=True)
    record = open(out / f"samples-rank{rank}.jsonl", "a", buffering=1)  # noqa: SIM115 - line-flushed, kept to the end

    class Elastic(TinyRunner):
        n_train, dropout = N_TRAIN, 0.0

        def __init__(self, config) -> None:
            super().__init__(config)
            data = make_data(N_TRAIN, seed=0)
            self.datasets.train = TensorDataset(*data.tensors, torch.arange(N_TRAIN))

        def train_step(self, data):
            epoch = self.dataloaders["train"].sampler.epoch
            record.write(json.dumps([epoch, self.train_state.global_step, data[2].tolist()]) + "\n")
            return super().train_step(data)

        def optimizer_step(self) -> bool:
            applied = super().optimizer_step()
            if applied and kill and self.train_state.global_step == SAVE_AT:
                self.save_checkpoint(force=True)
            if applied and kill and self.train_state.global_step == KILL_AT:
                os.kill(os.getpid(), signal.SIGKILL)
            return applied

    overrides = {
        "dataloader.batch_size": 2,
        "checkpoint.backend": backend,
        "accum_steps": accum,
        "scheduler.type": "cosine",
        "scheduler.warmup_steps": 2,
    }
    if source is not None:
        overrides["resume"] = _checkpoint(root, source)
    warnings = _Warnings()
    logging.getLogger("danling").addHandler(warnings)
    with Elastic(tiny_config(out, epochs=2, **overrides)) as runner:
        start = runner.train_state.global_step
        runner.train()
        final = {
            "start": start,
            "global_step": runner.train_state.global_step,
            "accum_steps": runner.accum_steps,
            "model": model_state(runner),
            "warnings": warnings.messages,
        }
    torch.save(final, out / f"final-rank{rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--phase", choices=sorted(SCENARIOS), required=True)
    parser.add_argument("--ports", required=True, help="rendezvous ports, 4 per scenario, comma-separated")
    args = parser.parse_args()
    root, rank = Path(args.root), int(os.environ["RANK"])
    ports = [int(port) for port in args.ports.split(",")]
    torch.set_num_threads(1)
    pids = {}
    for index, (scenario, spec) in enumerate(SCENARIOS[args.phase].items()):
        if rank < spec[0]:
            own = ports[4 * index : 4 * index + 4] if spec[0] > 1 else None
            pids[scenario] = fork_scenario(
                str(root / f"{scenario}-rank{rank}.log"), own, lambda s=scenario, p=spec: _run(root, s, p)
            )
    status = {scenario: scenario_status(pid) for scenario, pid in pids.items()}
    (root / f"status-{args.phase}-rank{rank}.json").write_text(json.dumps(status))


if __name__ == "__main__":
    main()
