"""ParallelRunner with FSDP2 against a hand-written FSDP2 loop, and its DCP checkpoints against raw `dcp`.

Two gloo ranks on CPU (spawned here, file-store rendezvous), one thread each. Both sides shard the
same residual MLP (each block, then the root) over a 2-rank mesh and train it with SGD on the same
sharded data:

1. per-step overhead: one epoch of the hand loop, one of the runner and one of a second hand loop
   (the A/A control), the order reversed every other round; the ratio of each round (runner /
   hand loop, second hand loop / hand loop), median and interquartile range over the rounds;
2. checkpoints: the runner's synchronous DCP save and load (manifest, pointers, loop state,
   loaders, RNG) against `dcp.save` / `dcp.load` of the same model + optimizer state, in MB/s of
   the global state (medians), and the median over the rounds of each round's runner / raw ratio
   (the side going first alternates). Deleting the checkpoint a save replaces is left out of both
   sides: the runner does it on a helper thread after the save returns (reported separately).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_parallel.py [--repeats 15]``; rank 0
prints Markdown tables.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from chanfig import Config
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import load_line  # this script's directory, as for every benchmark

import danling as dl
from tests.dist import free_ports, rendezvous_ports  # the test suite's rendezvous helpers

# name: (width, depth, batch size per rank, samples)
WORKLOADS = {"small MLP, batch 32": (128, 2, 32, 2048), "compute-bound MLP, batch 64": (1024, 4, 64, 1024)}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def dataset(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 16, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


class BenchConfig(dl.RunnerConfig):
    """The runner config plus `bench.*`, the workload this run measures (a free-form section)."""

    bench: Config = Config()


class BenchRunner(dl.ParallelRunner):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        width, depth, _, samples = WORKLOADS[config.bench.workload]
        torch.manual_seed(0)
        self.model = Net(width, depth)
        self.criterion = nn.MSELoss()
        self.datasets.train = dataset(samples)


def build_runner(root: str, workload: str, *, load_only: bool = True) -> BenchRunner:
    config = BenchConfig(
        stack="parallel",
        workspace_root=root,
        epochs=1,
        seed=0,
        log=False,
        log_interval=10**9,
        **{"parallel.axes.shard": 2, "fsdp.enabled": True},
        **{"optim.type": "sgd", "optim.lr": 1e-3, "optim.momentum": 0.9},
        **{"dataloader.batch_size": WORKLOADS[workload][2], "checkpoint.async_enabled": False},
        **{"checkpoint.load_only": load_only},  # the step comparison leaves checkpoint I/O out (timed in part 2)
    )
    config.bench.workload = workload
    return BenchRunner(config)


class HandLoop:
    """FSDP2 the way a tutorial writes it: shard blocks and root, a DataLoader with a DistributedSampler."""

    def __init__(self, workload: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        width, depth, batch_size, samples = WORKLOADS[workload]
        torch.manual_seed(0)
        self.model = Net(width, depth)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
        for block in self.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.sampler = DistributedSampler(dataset(samples), shuffle=True, seed=0, drop_last=True)
        self.loader = DataLoader(self.sampler.dataset, batch_size=batch_size, sampler=self.sampler, drop_last=True)
        self.criterion = nn.MSELoss()
        self.epoch = 0

    def train_epoch(self) -> float:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        total = torch.zeros(())
        for x, y in self.loader:
            loss = self.criterion(self.model(x), y)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            total += loss.detach()
        return float(total)  # one read per epoch, as the runner's one log line


def runner_epoch(runner: BenchRunner) -> None:
    runner.train_state.epoch = 0
    runner.train()


def timed(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return q1, median, q3


def bench_steps(root: str, workload: str, repeats: int) -> str:
    """One table row: the runner's epoch over the hand loop's, and a second hand loop's (the A/A control)."""
    runner = build_runner(os.path.join(root, "steps"), workload)  # starts the process group
    hand, twin = HandLoop(workload), HandLoop(workload)  # on the runner's group
    runner.logger.setLevel("ERROR")
    steps = len(hand.loader)
    for _ in range(2):  # warm-up
        hand.train_epoch()
        twin.train_epoch()
        runner_epoch(runner)
    ratios, controls, hand_times, runner_times = [], [], [], []
    for round_index in range(repeats):
        order = [("hand", hand.train_epoch), ("runner", lambda: runner_epoch(runner)), ("twin", twin.train_epoch)]
        times = dict((name, timed(fn)) for name, fn in (order if round_index % 2 else order[::-1]))
        hand_times.append(times["hand"])
        runner_times.append(times["runner"])
        ratios.append(times["runner"] / times["hand"])
        controls.append(times["twin"] / times["hand"])
    runner.close()
    q1, median, q3 = quartiles(ratios)
    c1, control, c3 = quartiles(controls)
    return (
        f"| {workload} | {steps} | {statistics.median(hand_times) / steps * 1e3:.3f} | "
        f"{statistics.median(runner_times) / steps * 1e3:.3f} | {median:.3f} | {q1:.3f} - {q3:.3f} | "
        f"{control:.3f} | {c1:.3f} - {c3:.3f} |"
    )


def bench_checkpoints(root: str, workload: str, repeats: int, profile_lines: int = 0) -> str:
    runner = build_runner(os.path.join(root, "ckpt"), workload, load_only=False)
    runner.logger.setLevel("ERROR")
    runner_epoch(runner)  # optimizer state exists
    model, optimizer = runner.model, runner.optimizer
    raw, twin = RawDcp(Path(root) / "raw-dcp", model, optimizer), RawDcp(Path(root) / "twin-dcp", model, optimizer)

    paths: list[Any] = []
    if profile_lines:
        return profile_checkpoints(runner, profile_lines)
    names = ("dcp.save", "runner save", "dcp.load", "runner load", "A/A: dcp.save", "A/A: dcp.load")
    samples: dict[str, list[float]] = {name: [] for name in names}
    cleanup: list[float] = []

    def runner_save() -> None:
        samples["runner save"].append(timed(lambda: paths.append(runner.save_checkpoint(force=True))))
        # the replaced checkpoint is deleted on a helper thread after the save returns: let that finish
        # before the next measurement instead of inside it, and report how long it still ran
        cleanup.append(timed(runner.checkpoint_manager.wait))

    def dcp_save(side: RawDcp, name: str) -> Callable[[], None]:
        def run() -> None:
            samples[name].append(timed(side.save))
            side.clear()

        return run

    def runner_load() -> None:
        samples["runner load"].append(timed(lambda: runner.load_checkpoint(runner.checkpoint_manager.latest)))

    def dcp_load(side: RawDcp, name: str) -> Callable[[], None]:
        return lambda: samples[name].append(timed(side.load))

    for round_index in range(repeats):  # which side goes first alternates: the disk's state drifts
        saves = [dcp_save(raw, "dcp.save"), runner_save, dcp_save(twin, "A/A: dcp.save")]
        loads = [dcp_load(raw, "dcp.load"), runner_load, dcp_load(twin, "A/A: dcp.load")]
        for step in (saves + loads) if round_index % 2 == 0 else (saves[::-1] + loads[::-1]):
            step()
    local = sum(t.numel() * t.element_size() for t in _tensors(get_state_dict(model, optimizer)))
    total = torch.tensor(float(local))
    dist.all_reduce(total)
    runner.close()
    megabytes = float(total) / 2**20
    medians = {name: statistics.median(values) for name, values in samples.items()}
    cells = [f"{megabytes / medians[name]:.0f} MB/s ({medians[name] * 1e3:.0f} ms)" for name in names[:4]]

    def ratio(mine: str, base: str) -> float:
        # each round's time over the raw time of the same round, then the median over the rounds
        return statistics.median(a / b for a, b in zip(samples[mine], samples[base]))

    ratios = [ratio("runner save", "dcp.save"), ratio("runner load", "dcp.load")]
    ratios += [ratio("A/A: dcp.save", "dcp.save"), ratio("A/A: dcp.load", "dcp.load")]
    row = f"| {workload} | {megabytes:.1f} | " + " | ".join(cells) + " | " + " | ".join(f"{r:.2f}" for r in ratios)
    return row + f" | {statistics.median(cleanup) * 1e3:.0f} ms |"


class RawDcp:
    """`dcp.save` / `dcp.load` of the model + optimizer into two directories used in turn.

    Like the runner, a save writes the new checkpoint while the previous one still exists, and
    `clear` deletes that one afterwards (untimed on both sides): writing into pages just freed by
    deleting the previous copy is much faster on this VM, which would favour whichever side
    deleted first.
    """

    def __init__(self, base: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.dirs = [base.with_name(base.name + "-0"), base.with_name(base.name + "-1")]  # newest first
        self.model, self.optimizer = model, optimizer

    def clear(self) -> None:
        if dist.get_rank() == 0:
            shutil.rmtree(self.dirs[1], ignore_errors=True)
        dist.barrier()

    def save(self) -> None:
        self.dirs.reverse()
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=self.dirs[0])

    def load(self) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=self.dirs[0])
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def profile_checkpoints(runner: BenchRunner, lines: int) -> str:
    """cProfile of one runner save and one load on this rank (after a warm-up save and load)."""
    import io

    from common import profile_call

    out = io.StringIO()
    calls = {
        "runner save": lambda: runner.save_checkpoint(force=True),
        "runner load": lambda: runner.load_checkpoint(runner.checkpoint_manager.latest),
    }
    for call in calls.values():  # warm up both first: a load sets `resume`, which the next save records
        timed(call)
    for name, call in calls.items():
        runner.checkpoint_manager.wait()  # as in the timed rounds: the deletion a save deferred is not the load's
        dist.barrier()
        out.write(profile_call(call, f"rank {dist.get_rank()}: {name}", lines))
    for turn in range(dist.get_world_size()):  # rank by rank, so the outputs do not interleave
        if turn == dist.get_rank():  # the runner routes other ranks' sys.stdout to the null device
            print(out.getvalue(), file=sys.__stdout__, flush=True)
        dist.barrier()
    runner.close()
    return ""


def _tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor of a nested state, as this rank's local part (a DTensor's shard)."""
    if isinstance(state, torch.Tensor):
        return [state.to_local() if hasattr(state, "to_local") else state]
    if isinstance(state, dict):
        return [t for value in state.values() for t in _tensors(value)]
    if isinstance(state, (list, tuple)):
        return [t for value in state for t in _tensors(value)]
    return []


def worker(
    rank: int,
    root: str,
    ports: list[int],
    repeats: int,
    workloads: list[str],
    profile_lines: int = 0,
    steps: bool = True,
) -> None:
    # Each runner starts (and ends) the process group itself; every one rendezvouses on a fresh port.
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    rendezvous_ports(ports)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    if profile_lines:  # only the checkpoint part, profiled on each rank
        bench_checkpoints(root, workloads[-1], 1, profile_lines)
        return
    rows = [bench_steps(root, workload, repeats) for workload in workloads] if steps else []
    # checkpoint speed only means something for the larger state
    checkpoints = [bench_checkpoints(root, workload, max(5, repeats // 3)) for workload in workloads[-1:]]
    if rank == 0 and rows:
        print(load_line("after"))
        print("### ParallelRunner (FSDP2, shard=2) vs a hand-written FSDP2 loop, 2 gloo ranks\n")
        print(
            "| workload | steps/epoch | hand loop (ms/step) | runner (ms/step) | ratio: median | IQR "
            "| A/A (second hand loop): median | A/A IQR |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        print("\n".join(rows))
    if rank == 0:
        print("\n### DCP checkpoints: runner vs raw dcp.save / dcp.load (model + SGD momentum, 2 ranks)\n")
        print(
            "| workload | MB | dcp.save | runner save | dcp.load | runner load | save ratio | load ratio "
            "| A/A save | A/A load | deletion still running after the save |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        print("\n".join(checkpoints))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--workload", action="append", choices=list(WORKLOADS))
    parser.add_argument("--checkpoints-only", action="store_true", help="skip the per-step comparison")
    parser.add_argument("--profile", type=int, default=0, metavar="LINES", help="cProfile one checkpoint save/load")
    args = parser.parse_args()
    print(load_line("before"))
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as root:  # shared: DCP files are written by both
        mp.start_processes(
            worker,
            args=(
                root,
                free_ports(8),
                args.repeats,
                args.workload or list(WORKLOADS),
                args.profile,
                not args.checkpoints_only,
            ),
            nprocs=2,
            start_method="spawn",
        )


if __name__ == "__main__":
    main()
