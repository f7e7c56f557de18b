"""Child process of the parallel exact-resume test (one per rank).

For each layout it forks, one after the other: `clean` (uninterrupted training), `killed` (the same
run with `auto_resume`, saving after update `--save-at` and sending itself SIGKILL right after update
`--kill-at`) and `resume` (the killed run restarted with the same config). Final full weights go to
`<root>/<layout>/<scenario>.pt` (rank 0) and the exit status of every scenario to
`<root>/status-rank<r>.json`. The runner of each scenario starts the process group itself (a runner
owns it), on that scenario's port of `--ports`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
import torch.distributed.checkpoint.state_dict

from tests.dist import fork_scenario, scenario_status
from tests.runners._parallel_toy import TENSOR_PLAN, ParallelRegression, full_weights, parallel_config

LAYOUTS = {
    "fsdp": {"parallel.axes.shard": 2, "fsdp.enabled": True},
    "tensor": {"parallel.axes.tensor": 2, "parallel.tensor_plan": TENSOR_PLAN},
    "pipeline": {
        "parallel.axes.pipeline": 2,
        "parallel.module_fqns_per_model_part": [["inp", "layers.0"], ["layers.1", "head"]],
    },
}


def _train(root: str, layout: str, scenario: str, save_at: int, kill_at: int) -> None:
    class Child(ParallelRegression):
        def optimizer_step(self) -> bool:
            applied = super().optimizer_step()
            if scenario == "killed" and applied and self.train_state.global_step == save_at:
                self.save_checkpoint(force=True)
            if scenario == "killed" and applied and self.train_state.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return applied

    name = "clean" if scenario == "clean" else "killed"
    overrides = {"accum_steps": 2, "auto_resume": True, "dataloader.batch_size": 2, "dataloader.train.shuffle": True}
    config = parallel_config(os.path.join(root, layout), name, **LAYOUTS[layout], **overrides)
    with Child(config) as runner:
        start = runner.train_state.global_step
        runner.train()
        weights = full_weights(runner)
        if runner.rank == 0:
            result = {"start": start, "global_step": runner.train_state.global_step, "weights": weights}
            torch.save(result, os.path.join(root, layout, f"{scenario}.pt"))


def _fork(root: str, layout: str, scenario: str, save_at: int, kill_at: int, ports: list[int]) -> str:
    log = f"{root}/{layout}-{scenario}-rank{os.environ['RANK']}.log"
    return scenario_status(fork_scenario(log, ports, lambda: _train(root, layout, scenario, save_at, kill_at)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--save-at", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=3)
    parser.add_argument("--ports", required=True, help="rendezvous ports, 2 per scenario, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ports = iter(int(port) for port in args.ports.split(","))
    status = {}
    for layout in args.layouts.split(","):
        os.makedirs(os.path.join(args.root, layout), exist_ok=True)
        for scenario in ("clean", "killed", "resume"):
            spare = [next(ports), next(ports)]
            status[f"{layout}-{scenario}"] = _fork(args.root, layout, scenario, args.save_at, args.kill_at, spare)
    with open(os.path.join(args.root, f"status-rank{os.environ['RANK']}.json"), "w") as file:
        json.dump(status, file)


if __name__ == "__main__":
    main()
