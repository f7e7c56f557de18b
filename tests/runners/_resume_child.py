"""Child process of the exact-resume tests (one per rank).

After importing everything once, it forks one real subprocess per scenario (so the slow imports are
paid once) and runs them concurrently:

- `clean`: uninterrupted training in epoch mode, then in step mode;
- `kill-epoch` / `kill-step`: the same run with `auto_resume`, SIGKILLed right after the optimizer
  update that reaches the requested global step (the epoch one optionally saves an extra checkpoint
  first);

then, once both were killed, `resume` restarts them with `auto_resume` and trains to the end.
Each run writes its final weights to `<root>/{clean,killed}/<mode>/final-rank<r>.pt`, and the exit
status of every scenario is written to `<root>/status-rank<r>.json`. For two processes the parent
sets `RANK`/`WORLD_SIZE` and `--ports`; the runners of each scenario start the process group
themselves (a runner owns it), rendezvousing on that scenario's port. With `--zero-stages E S` the
runs use `DeepSpeedRunner` instead, ZeRO stage `E` in epoch mode and `S` in step mode.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
import torch.distributed.checkpoint.state_dict  # imported once, before forking

from tests.dist import fork_scenario, scenario_status
from tests.runners._torch_toy import TinyRunner, model_state, tiny_config

ZERO_STAGES: dict[str, int] = {}  # mode -> ZeRO stage, set by --zero-stages before forking


def _runner_class(stage: int | None) -> type:
    if stage is None:
        return TinyRunner
    from danling.runners import DeepSpeedRunner

    return type("TinyDeepSpeedRunner", (TinyRunner, DeepSpeedRunner), {})


def _train(root: str, mode: str, world_size: int, kill_at: int, save_at: int) -> None:
    stage = ZERO_STAGES.get(mode)

    class Child(_runner_class(stage)):
        n_train = 20 * world_size  # 5 batches of 4 per rank and pass

        def optimizer_step(self) -> bool:
            applied = super().optimizer_step()
            if applied and self.train_state.global_step == save_at:
                self.save_checkpoint(force=True)
            if applied and self.train_state.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return applied

    budget = {"epochs": 3} if mode == "epoch" else {"epochs": None, "steps": 10, "checkpoint.interval": 4}
    config = tiny_config(
        os.path.join(root, mode),
        accum_steps=2,  # windows of 2, 2 and 1 micro-batches per pass
        deterministic=True,
        auto_resume=True,
        **budget,
        **{"ema.enabled": True, "ema.decay": 0.9, "scheduler.type": "cosine", "scheduler.warmup_steps": 2},
    )
    if stage is not None:  # every parameter partitioned under ZeRO-3
        config["deepspeed"] = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    with Child(config) as runner:
        start = runner.train_state.global_step
        runner.train()
        final = {
            "start": start,
            "global_step": runner.train_state.global_step,
            "model": runner.model_state_dict() if stage is not None else model_state(runner),
            "ema": {k: v.clone() for k, v in runner.ema.module.state_dict().items()},
        }
        os.makedirs(os.path.join(root, mode), exist_ok=True)
        torch.save(final, os.path.join(root, mode, f"final-rank{runner.rank}.pt"))


_PORTS: dict[str, list[int]] = {}


def _fork(root: str, directory: str, tag: str, modes: list[str], *, kill_at: int = 0, save_at: int = 0) -> int:
    """Run one scenario in a forked subprocess (logs and rendezvous named by `tag`); return its pid."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))

    def body() -> None:
        for mode in modes:
            _train(os.path.join(root, directory), mode, world_size, kill_at, save_at)

    # each runner starts (and destroys) the group, on a port of its own
    return fork_scenario(f"{root}/{tag}-rank{rank}.log", _PORTS[tag] if world_size > 1 else None, body)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--epoch-kill-at", type=int, required=True)
    parser.add_argument("--epoch-save-at", type=int, default=0)
    parser.add_argument("--step-kill-at", type=int, required=True)
    parser.add_argument("--zero-stages", type=int, nargs=2, metavar=("EPOCH", "STEP"))
    parser.add_argument("--ports", default="", help="rendezvous ports, 4 per scenario, comma-separated")
    args = parser.parse_args()
    ports = [int(port) for port in args.ports.split(",") if port]
    for index, tag in enumerate(("clean", "kill-epoch", "kill-step", "resume")):
        _PORTS[tag] = ports[4 * index : 4 * index + 4]
    torch.set_num_threads(1)
    if args.zero_stages:
        import deepspeed  # noqa: F401 - imported once, before forking

        ZERO_STAGES.update(zip(("epoch", "step"), args.zero_stages))
    os.makedirs(args.root, exist_ok=True)
    pids = {
        "clean": _fork(args.root, "clean", "clean", ["epoch", "step"]),
        "kill-epoch": _fork(
            args.root, "killed", "kill-epoch", ["epoch"], kill_at=args.epoch_kill_at, save_at=args.epoch_save_at
        ),
        "kill-step": _fork(args.root, "killed", "kill-step", ["step"], kill_at=args.step_kill_at),
    }
    status = {name: scenario_status(pid) for name, pid in pids.items()}
    status["resume"] = scenario_status(_fork(args.root, "killed", "resume", ["epoch", "step"]))
    rank = int(os.environ.get("RANK", 0))
    with open(os.path.join(args.root, f"status-rank{rank}.json"), "w") as file:
        json.dump(status, file)


if __name__ == "__main__":
    main()
