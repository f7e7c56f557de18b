"""What the diagnosis plug-ins cost when on: calls and time per step on two gloo ranks, and a checksum's cost.

Part 1 trains `bench_runner.py`'s small MLP (batch 32, 3 epochs, 64 updates per rank and epoch)
on two CPU ranks under each setting in turn: plug-ins off, `stragglers.enabled`,
`consistency.interval=1` and `=100`, `oom.policy=split` (no error is raised: the cost of the
agreements alone), replay bundles (`replay.capture_steps` of one step that the
timed calls never reach: what every other step pays; `replay.on_nonfinite` in copy mode and in
checkpoint mode), then off again (drift check); `--settings` picks some of them. For each it reports rank 0's
Python calls per `train()` (under `cProfile`, exact and repeatable; waiting in a collective is no
Python call) and the median wall time per update over `--repeats` timed `train()` calls after a
warm-up. Step logs are on every `--log-interval` batches in every setting, since the straggler
monitor works at step logs.

Part 2 times one checksum pass (`tensor_checksum` over every tensor, what a consistency check
computes before its one small all-gather) over float32 parameters of several sizes, on this CPU.

Usage: ``python benchmarks/bench_diagnosis.py [--repeats 3] [--log-interval 16] [--settings off "oom on" ...]``
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
SETTINGS = {
    "off": {},
    "stragglers on": {"stragglers.enabled": True},
    "consistency every step": {"consistency.interval": 1},
    "consistency every 100 steps": {"consistency.interval": 100},
    "oom on": {"oom.policy": "split"},
    "replay capture (other steps)": {"replay.capture_steps": [10**9]},
    "replay on_nonfinite, copy": {"replay.on_nonfinite": True},
    "replay on_nonfinite, ckpt": {"replay.on_nonfinite": True, "replay.max_copy_bytes": 0},
    "off (again)": {},
}


def _ports(count: int) -> list[int]:
    sockets, ports = [], []
    for _ in range(count):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sockets.append(sock)
        ports.append(sock.getsockname()[1])
    for sock in sockets:
        sock.close()
    return ports


def _rank(rank: int, ports: list[int], repeats: int, log_interval: int, names: list[str], queue) -> None:
    sys.path.insert(0, HERE)
    from bench_runner import BenchRunner, quiet, run_epochs, runner_config

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-diagnosis-") as root:
        for port, name in zip(ports, names):
            overrides = SETTINGS[name]
            os.environ["MASTER_PORT"] = str(port)  # a fresh rendezvous for each runner's process group
            config = runner_config(f"{root}/{len(rows)}", "small MLP, batch 32", log_interval=log_interval, **overrides)
            runner = quiet(BenchRunner(config))
            run_epochs(runner)  # warm-up
            profile = cProfile.Profile()
            profile.enable()
            run_epochs(runner)
            profile.disable()
            calls = sum(entry[1] for entry in pstats.Stats(profile).stats.values())  # type: ignore[attr-defined]
            steps_before = runner.train_state.global_step
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                run_epochs(runner)
                times.append(time.perf_counter() - start)
            steps = (runner.train_state.global_step - steps_before) // repeats
            rows[name] = (calls, steps, statistics.median(times) / steps)
            runner.close()
    queue.put((rank, rows))


def bench_training(repeats: int, log_interval: int, names: list[str]) -> None:
    context = mp.get_context("spawn")
    queue = context.Queue()
    ports = _ports(len(names))
    args = (ports, repeats, log_interval, names, queue)
    procs = [context.Process(target=_rank, args=(rank, *args)) for rank in range(2)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=1800) for _ in procs)
    for proc in procs:
        proc.join()
    rows = results[0]
    base_calls, steps, base_time = rows["off"]
    print(f"2 gloo ranks, small MLP batch 32, {steps} updates per train(), step log every {log_interval} batches")
    print(f"{'setting':<30}{'calls/train()':>14}{'calls/update':>14}{'ms/update':>11}{'vs off':>9}")
    for name, (calls, _, seconds) in rows.items():
        extra = (calls - base_calls) / steps
        print(f"{name:<30}{calls:>14,}{extra:>+14.1f}{1000 * seconds:>11.3f}{seconds / base_time:>9.3f}")


def bench_checksum() -> None:
    sys.path.insert(0, os.path.dirname(HERE))
    from danling.runners.diagnosis import tensor_checksum

    torch.set_num_threads(1)
    print("\none checksum pass over float32 parameters (CPU, 1 thread), tensors of 1M elements")
    for millions in (1, 10, 50):
        tensors = [torch.randn(1_000_000) for _ in range(millions)]
        tensor_checksum(tensors[0])
        start = time.perf_counter()
        for _ in range(3):
            torch.stack([tensor_checksum(tensor) for tensor in tensors])
        seconds = (time.perf_counter() - start) / 3
        print(f"{millions:>4}M parameters: {1000 * seconds:8.2f} ms ({1000 * seconds / millions:.2f} ms per M)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed train() calls per setting")
    parser.add_argument("--log-interval", type=int, default=16, help="batches between step logs")
    parser.add_argument("--no-training", action="store_true", help="part 2 only")
    parser.add_argument("--no-checksum", action="store_true", help="part 1 only")
    parser.add_argument(
        "--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS), help="settings of part 1 (off first)"
    )
    args = parser.parse_args(argv)
    if "off" not in args.settings:
        parser.error("--settings must include off (the baseline of every ratio)")
    if not args.no_training:
        bench_training(args.repeats, args.log_interval, args.settings)
    if not args.no_checksum:
        bench_checksum()


if __name__ == "__main__":
    main()
