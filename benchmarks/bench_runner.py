"""What the `TorchRunner` costs over a hand-written PyTorch loop doing the same work.

Three measurements, each run in this process on one thread (`torch.set_num_threads(1)`) pinned
to one core:

1. Training wall time: the same model, data, AdamW optimizer, cross-entropy loss and an
   accuracy metric; each round is one `train()` call of 3 epochs (small MLP) or 1 epoch (wide
   MLP), an epoch being a train pass and a validation pass. Two models: a small MLP at batch 32,
   where per-step bookkeeping matters most, and a wide MLP at batch 128 where the matrix
   multiplications dominate. (`train()` returns only when its result files are written, a
   one-off cost per call that a one-epoch call of a tiny model would overstate.) A second,
   identical hand-written loop is timed as a control: its ratio shows the noise floor.
   Every round builds all candidates afresh, in a shuffled order with allocations of random
   size in between, and warms each up with one untimed call: where a model's tensors land in
   memory moves a loop's speed by a percent or two, and this way no candidate keeps a lucky or
   unlucky placement for the whole session (see `build_round`). Two ways of interleaving,
   because the speed of this virtual machine's CPU drifts by tens of percent within seconds:
   - whole calls in turn (``--method paired``): every round runs each candidate once, in a
     random order, and divides its time by the hand-written loop's time in that round; the table
     gives the median and interquartile range of these paired ratios. Each loop runs as it
     would alone, but the drift between neighbouring calls still shows.
   - batches in turn (``--method lockstep``, small MLP only): all candidates run in
     `common.Lockstep`, ``--turn`` batches (default 8) each in turn, every loop in a thread of
     its own, and the ratio compares their totals. The drift cancels almost entirely; the
     caches are shared between the loops, so
     each turn starts with some of its working set evicted (``--turn 1`` makes that the rule:
     a pessimistic figure). ``--method passes`` hands the turn on once per pass instead.
   ``runner`` builds its own (resumable) dataloaders, which fetch the `TensorDataset` batches
   whole (`danling.data.fetch`); ``runner, torch loaders`` is given the plain
   `torch.utils.data.DataLoader`s the hand-written loop uses, which fetch example by example:
   that row is the loop's own overhead, the first one what a user gets. With ``--ablate`` two
   more variants switch off the per-epoch result files and replace danling's metric container
   by the loop's plain running count, to show what each service costs.
2. Time to first step: constructing everything (model, optimizer, loaders; for the runner also
   the workspace, logging and metadata) plus one optimizer step (median of alternating runs).
3. Checkpoint throughput (MB of model + optimizer state per second) of the runner's file and
   DCP backends against `torch.save` / `torch.load` and `dcp.save` / `dcp.load` of the same
   state, synchronous writes.

Usage: ``python benchmarks/bench_runner.py [--repeats 31] [--ablate] [--method both] [--turn 8] [--only training]
[--quick]`` (``--method``: ``both`` = ``paired`` and ``lockstep``, or one of ``paired``, ``lockstep``, ``passes``).

Instruction counts of the same comparison (deterministic): ``benchmarks/bench_runner_instructions.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
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
from chanfig import Config
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Lockstep, alternate, build_shuffled, fsync_file, ratio_table, table

import danling as dl

# name -> (features, hidden, classes, batch size, train samples, val samples, epochs per timed run)
WORKLOADS = {
    "small MLP, batch 32": (64, 128, 10, 32, 4096, 1024, 3),
    # The same model over a dataset four times as large: a quarter of the per-epoch costs per step.
    "small MLP, batch 32, 4x data": (64, 128, 10, 32, 16384, 4096, 1),
    "wide MLP, batch 128": (512, 1024, 10, 128, 12288, 512, 1),
}
TRAINING = tuple(WORKLOADS)
# A bigger model for checkpoint I/O: about 21 MB of weights plus twice that of AdamW moments.
WORKLOADS["checkpoint"] = (512, 2048, 10, 128, 256, 128, 1)


def make_model(features: int, hidden: int, classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes)
    )


def make_splits(features: int, classes: int, n_train: int, n_val: int) -> dict[str, TensorDataset]:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(features, classes, generator=generator)
    splits = {}
    for name, n in (("train", n_train), ("val", n_val)):
        x = torch.randn(n, features, generator=generator)
        splits[name] = TensorDataset(x, (x @ weight).argmax(-1))
    return splits


def torch_loaders(splits: dict[str, TensorDataset], batch_size: int) -> dict[str, DataLoader]:
    return {
        "train": DataLoader(splits["train"], batch_size=batch_size, shuffle=True, drop_last=True),
        "val": DataLoader(splits["val"], batch_size=batch_size),
    }


# --------------------------------------------------------------------------- hand-written loop
def handwritten_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, loaders: dict[str, DataLoader]) -> dict:
    """One train pass and one validation pass, tracking mean loss and accuracy without per-step syncs."""
    criterion = nn.CrossEntropyLoss()
    row = {}
    for split in ("train", "val"):
        training = split == "train"
        model.train(training)
        loss_sum, correct, seen, batches = torch.zeros(()), torch.zeros((), dtype=torch.long), 0, 0
        with torch.inference_mode(not training):
            for x, y in loaders[split]:
                logits = model(x)
                loss = criterion(logits, y)
                if training:
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                loss_sum += loss.detach()
                correct += (logits.argmax(-1) == y).sum()
                seen += len(y)
                batches += 1
        row[split] = {"loss": loss_sum.item() / batches, "acc": correct.item() / seen}
    return row


# --------------------------------------------------------------------------- runner
class BenchConfig(dl.RunnerConfig):
    """The runner config plus `bench.*`, the workload this run measures (a free-form section)."""

    bench: Config = Config()


class BenchRunner(dl.TorchRunner):
    """The same training problem through the runner; `config.bench` names the workload."""

    def __init__(self, config: dl.RunnerConfig) -> None:
        super().__init__(config)
        features, hidden, classes, batch_size, n_train, n_val, _ = WORKLOADS[config.bench.workload]
        splits = make_splits(features, classes, n_train, n_val)
        self.datasets.train, self.datasets.val = splits["train"], splits["val"]
        if config.bench.torch_loaders:
            self.dataloaders.update(torch_loaders(splits, batch_size))
        self.model = make_model(features, hidden, classes)
        self.criterion = nn.CrossEntropyLoss()
        self.metrics = dl.multiclass_metrics(num_classes=classes, metrics=["acc"])


def runner_config(root: str, workload: str, *, torch_loaders: bool = False, **overrides: Any) -> dl.RunnerConfig:
    batch_size, epochs = WORKLOADS[workload][3], WORKLOADS[workload][6]
    config = BenchConfig(
        workspace_root=root,
        epochs=epochs,
        seed=0,
        log=False,
        log_interval=10**9,  # one step log per pass (the last batch), like the hand-written loop's one read
        score_name="acc",
        **{"optim.type": "adamw", "optim.lr": 1e-3, "dataloader.batch_size": batch_size},
        **{"checkpoint.load_only": True},  # the loop comparison excludes checkpoint I/O (timed in part 3)
    )
    config.bench.workload, config.bench.torch_loaders = workload, torch_loaders
    config.merge(overrides)
    return config


def quiet(runner: dl.TorchRunner) -> dl.TorchRunner:
    # ERROR: in `Lockstep` threads every train() call would warn that signal handlers need the main thread.
    runner.logger.setLevel(logging.ERROR)
    return runner


# --------------------------------------------------------------------------- 1. loop overhead
class PlainAccuracy:
    """The hand-written loop's accuracy (a running count on the device) behind the metrics interface."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.correct, self.seen = torch.zeros((), dtype=torch.long), 0

    def update(self, pred: torch.Tensor, target: torch.Tensor) -> None:
        self.correct += (pred.argmax(-1) == target).sum()
        self.seen += len(target)

    @property
    def avg(self) -> dict[str, float]:
        return {"acc": self.correct.item() / max(self.seen, 1)}


class TurnLoader:
    """A loader whose every pass hands the turn on before each batch (see `common.Lockstep`)."""

    def __init__(self, loader: Any, wrap: Callable[[Any], Any]) -> None:
        self.loader, self.wrap = loader, wrap

    def __iter__(self) -> Any:
        return self.wrap(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # sampler, state_dict, ... of the real loader
        return getattr(self.loader, name)


HANDWRITTEN = ("hand-written loop", "hand-written loop, second copy")  # the second is the A/A control


def handwritten_loop(workload: str) -> Callable[[Callable], None]:
    """A freshly built hand-written loop as `fn(wrap)`: one call trains the workload's epochs."""
    features, hidden, classes, batch_size, n_train, n_val, epochs = WORKLOADS[workload]
    torch.manual_seed(0)
    model = make_model(features, hidden, classes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loaders = torch_loaders(make_splits(features, classes, n_train, n_val), batch_size)

    def loop(wrap: Callable) -> None:
        turns = {split: TurnLoader(loader, wrap) for split, loader in loaders.items()}
        for _ in range(epochs):
            handwritten_epoch(model, optimizer, turns)

    return loop


def runner_options(ablate: bool) -> dict[str, dict[str, bool]]:
    """The runner as a user gets it, with the loop's torch loaders, and (``--ablate``) with services off."""
    variants = {"runner": {}, "runner, torch loaders": {"torch_loaders": True}}
    if ablate:  # switch off one runner service at a time to see what each costs
        variants["runner, torch loaders, no result files"] = {"torch_loaders": True, "files": False}
        variants["runner, torch loaders, no result files, plain accuracy"] = {
            "torch_loaders": True,
            "files": False,
            "plain": True,
        }
    return variants


def runner_variant(root: str, workload: str, options: dict[str, bool]) -> dl.TorchRunner:
    runner = quiet(BenchRunner(runner_config(root, workload, torch_loaders=options.get("torch_loaders", False))))
    if not options.get("files", True):
        runner._save_result = lambda r=runner: r.trackers.log({}, step=0)
    if options.get("plain"):
        runner.metrics = PlainAccuracy()
    return runner


def build_round(
    root: str, workload: str, ablate: bool, rng: random.Random
) -> tuple[dict[str, Callable[[Callable], None]], list[dl.TorchRunner], list[torch.Tensor]]:
    """Every candidate built afresh, in a shuffled order, each after an allocation of random size
    (see `common.build_shuffled`, which says why).

    Returns the loops (as `fn(wrap)`, in a fixed order), the runners to close and the padding to
    keep alive until the round is over.
    """
    options = runner_options(ablate)
    runners: list[dl.TorchRunner] = []

    def runner_loop(name: str) -> Callable[[Callable], None]:
        runner = runner_variant(os.path.join(root, f"{len(os.listdir(root))}"), workload, options[name])
        runners.append(runner)
        return lambda wrap: run_epochs(runner, wrap)

    builders: dict[str, Callable[[], Callable[[Callable], None]]] = {
        name: lambda: handwritten_loop(workload) for name in HANDWRITTEN
    }
    builders.update({name: lambda name=name: runner_loop(name) for name in options})
    loops, padding = build_shuffled(builders, rng)
    return loops, runners, padding


def run_epochs(runner: dl.TorchRunner, wrap: Callable | None = None) -> None:
    """`runner.train()` over the configured epochs again (the model keeps training)."""
    loaders = dict(runner.dataloaders)
    if wrap is not None:
        runner.dataloaders.update({split: TurnLoader(loader, wrap) for split, loader in loaders.items()})
    try:
        runner.train_state.epoch = 0
        runner.train()
    finally:
        runner.dataloaders.update(loaders)


def bench_training(
    root: str,
    repeats: int,
    ablate: bool = False,
    method: str = "both",
    turn: int = 8,
    workloads: tuple[str, ...] = TRAINING,
) -> list[str]:
    out = []
    for workload in workloads:
        _, _, _, batch_size, n_train, n_val, epochs = WORKLOADS[workload]
        # The compute-bound workload takes seconds per round: fewer rounds, still >= 5.
        rounds = repeats if workload.startswith("small") else max(5, repeats // 6)
        steps = epochs * (n_train // batch_size)
        batches = f"{n_train // batch_size} train + {-(-n_val // batch_size)} val batches"
        if method in ("paired", "both"):
            summary = training_rounds(root, workload, ablate, rounds, turn=0)
            title = f"Training, {workload}: {epochs} epoch(s) of {batches}; whole calls in turn, {rounds} rounds"
            out.append(_training_table(title, summary, steps))
        # Lockstep only for the bookkeeping-bound model: with the wide one, the models' weights and
        # AdamW states (about 36 MB each) evict each other between turns, which no standalone loop
        # suffers, and one run measured the runner at 1.19x that way against 1.03x epoch-paired.
        if method in ("lockstep", "both") and workload.startswith("small"):
            summary = training_rounds(root, workload, ablate, rounds, turn=turn)
            title = f"Training, {workload}: {epochs} epoch(s) of {batches}; {turn} batches per turn, {rounds} rounds"
            out.append(_training_table(title, summary, steps))
        if method == "passes" and workload.startswith("small"):  # noisier than both of the above; on request
            summary = training_rounds(root, workload, ablate, rounds, turn=None)
            title = f"Training, {workload}: {epochs} epoch(s) of {batches}; passes in turn, {rounds} rounds"
            out.append(_training_table(title, summary, steps))
    return out


def training_rounds(
    root: str, workload: str, ablate: bool, rounds: int, turn: int | None
) -> dict[str, tuple[float, float, float, float]]:
    """`rounds` rounds of fresh candidates (see `build_round`), each warmed up by one untimed call.

    ``turn=0`` times whole `train()` calls one after the other (in a random order each round);
    otherwise the candidates run in `Lockstep`, `turn` batches (``None``: a pass) each in turn.
    Returns ``{name: (median seconds, q1, median, q3 of the ratio to the hand-written loop)}``.
    """
    rng = random.Random(0)
    seconds: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    for _ in range(rounds):
        loops, runners, padding = build_round(root, workload, ablate, rng)
        for loop in loops.values():
            loop(iter)  # warm-up: first-touch allocations, the optimizer's lazily built state
        # A fresh random order every round: a loop runs faster right after its own twin (the code
        # it needs is still cached), so a fixed or rotated order, in which the same candidate
        # always follows the same other one, measured the A/A control 1.5% fast.
        names = list(loops)
        order = {name: loops[name] for name in rng.sample(names, len(names))}
        if turn == 0:
            timed = {}
            for name, loop in order.items():
                started = time.perf_counter()
                loop(iter)
                timed[name] = time.perf_counter() - started
        else:
            timed = Lockstep(turn).run(order)
        for runner in runners:
            runner.close()
        del padding
        for name in names:
            seconds.setdefault(name, []).append(timed[name])
            ratios.setdefault(name, []).append(timed[name] / timed[HANDWRITTEN[0]])
    summary = {}
    for name in seconds:
        q1, median, q3 = statistics.quantiles(ratios[name], n=4) if rounds > 1 else [ratios[name][0]] * 3
        summary[name] = (statistics.median(seconds[name]), q1, median, q3)
    return summary


def _training_table(title: str, summary: dict, steps: int) -> str:
    base = summary[HANDWRITTEN[0]][0]
    extra = {name: (value[0] - base) / steps * 1e6 for name, value in summary.items() if name not in HANDWRITTEN}
    note = "; ".join(f"{name} {value:+.0f} us" for name, value in extra.items())
    return ratio_table(title, summary, "hand-written loop") + f"\n\nextra time per train step (medians): {note}"


# --------------------------------------------------------------------------- 2. time to first step
def bench_first_step(root: str, repeats: int) -> list[str]:
    workload = "small MLP, batch 32"
    features, hidden, classes, batch_size, n_train, n_val, _ = WORKLOADS[workload]
    splits = make_splits(features, classes, n_train, n_val)

    def handwritten() -> None:
        model = make_model(features, hidden, classes)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = torch_loaders(splits, batch_size)["train"]
        x, y = next(iter(loader))
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    def construct() -> dl.TorchRunner:
        return quiet(BenchRunner(runner_config(root, workload, steps=1, epochs=None, evaluate_splits=["train"])))

    def runner_built() -> None:
        construct().close()

    def runner_first_step() -> None:
        runner = construct()
        runner.train_steps(["train"], [])
        runner.close()

    candidates = {
        "hand-written: build + 1 step": handwritten,
        "A/A: hand-written again": handwritten,  # the run's noise floor
        "runner: construct": runner_built,
        "runner: construct + train_steps(steps=1)": runner_first_step,
    }
    return [
        table("Time to first step (small MLP)", alternate(candidates, repeats=repeats), "hand-written: build + 1 step")
    ]


# --------------------------------------------------------------------------- 3. checkpoint throughput
def state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    return 0


def raw_file_ops(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> dict[str, Callable]:
    """`torch.save` (+ fsync, since the runner's writes are durable) and `torch.load` of model + optimizer."""
    path = os.fspath(directory / "checkpoint.pt")

    def save() -> None:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
        fsync_file(path)

    def load() -> None:
        payload = torch.load(path, weights_only=False)
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])

    return {"torch.save + fsync": save, "torch.load + load_state_dict": load}


def raw_dcp_ops(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> dict[str, Callable]:
    """`dcp.save` / `dcp.load` of the parameter-name-keyed model + optimizer state, in one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def save() -> None:
        shutil.rmtree(directory, ignore_errors=True)
        model_state, optim_state = get_state_dict(model, optimizer)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=directory, no_dist=True)

    def load() -> None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=directory, no_dist=True)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    return {"dcp.save": save, "dcp.load + set_state_dict": load}


def bench_checkpoint_backend(root: str, backend: str, repeats: int) -> str:
    overrides = {
        "steps": 1,
        "epochs": None,
        "checkpoint.backend": backend,
        "checkpoint.async_enabled": False,
        "checkpoint.load_only": False,
    }
    runner = quiet(BenchRunner(runner_config(os.path.join(root, backend), "checkpoint", **overrides)))
    runner.train_steps(["train"], [])  # one optimizer step, so AdamW has its moment buffers
    model, optimizer = runner.unwrap(runner.model), runner.optimizer
    size = state_bytes(model.state_dict()) + state_bytes(optimizer.state_dict())
    directory = Path(root) / f"raw-{backend}"
    directory.mkdir(parents=True, exist_ok=True)
    raw = (raw_file_ops if backend == "file" else raw_dcp_ops)(model, optimizer, directory)
    (raw_save, save), (raw_load, load) = raw.items()
    save()  # the load candidates read what the save candidates wrote
    medians = alternate({raw_save: save, "runner.save_checkpoint": lambda: runner.save_checkpoint(force=True)}, repeats)
    medians.update(
        alternate({raw_load: load, "runner.load_checkpoint": lambda: runner.load_checkpoint("latest")}, repeats)
    )
    runner.close()
    rows = [f"### Checkpoint, {backend} backend: {size / 2**20:.1f} MiB of model + AdamW state, synchronous", ""]
    rows += ["| operation | median (ms) | MB/s | ratio |", "| --- | ---: | ---: | ---: |"]
    for base, mine in ((raw_save, "runner.save_checkpoint"), (raw_load, "runner.load_checkpoint")):
        for name in (base, mine):
            seconds = medians[name]
            rows.append(
                f"| {name} | {seconds * 1e3:.1f} | {size / 1e6 / seconds:.0f} | {seconds / medians[base]:.3f} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="TorchRunner overhead against a hand-written loop")
    parser.add_argument("--repeats", type=int, default=31, help="rounds (training) or repeats (other parts)")
    parser.add_argument("--quick", action="store_true", help="2 repeats, a smoke run of the script")
    parser.add_argument("--only", choices=("training", "first-step", "checkpoint"), default=None)
    parser.add_argument("--ablate", action="store_true", help="add runner variants with services switched off")
    parser.add_argument(
        "--method",
        choices=("paired", "lockstep", "passes", "both"),
        default="both",
        help="how training runs are interleaved (both = paired and lockstep)",
    )
    parser.add_argument("--turn", type=int, default=8, help="batches per turn of the lockstep method")
    parser.add_argument("--workload", choices=TRAINING, action="append", help="training workload(s) to run (all)")
    args = parser.parse_args(argv)
    repeats = 2 if args.quick else args.repeats
    other = max(2 if args.quick else 5, repeats // 3)  # first step and checkpoints: steadier, costlier
    with contextlib.suppress(AttributeError, OSError):  # one core for the whole run: migrations add noise
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    started = time.perf_counter()
    root = tempfile.mkdtemp(prefix="bench-runner-")
    sections = []
    try:
        if args.only in (None, "training"):
            workloads = tuple(args.workload or TRAINING)
            sections += bench_training(root, repeats, args.ablate, args.method, args.turn, workloads)
        if args.only in (None, "first-step"):
            sections += bench_first_step(root, other)
        if args.only in (None, "checkpoint"):
            sections += [bench_checkpoint_backend(root, backend, other) for backend in ("file", "dcp")]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"torch {torch.__version__}, 1 thread, pinned to one core; training: median of {repeats} paired rounds, ")
    print(f"first step and checkpoints: median of {other} alternating runs\n")
    print("\n\n".join(sections))
    print(f"\n(total {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
