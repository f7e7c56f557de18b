"""Per-step cost of danling's metric containers and of peer frameworks on one small training workload.

Question: on the same workload, what does each candidate add over a hand-written loop? Every
candidate trains the same small MLP (64 -> 128 -> 128 -> 10, batch 32, AdamW, one thread) for
one epoch of 128 steps from torch's own `DataLoader` and counts top-1 accuracy:

- `hand-written`: `correct += (logits.argmax(-1) == target).sum()`, read once at the end;
- `danling StreamMetrics(acc=accuracy)` / `GlobalMetrics` / `multiclass_metrics`: the same loop
  with a danling metric container instead of the counter;
- `Lightning Fabric`: `fabric.setup` / `fabric.setup_dataloaders` / `fabric.backward`;
- `Lightning Trainer`: a `LightningModule` whose `training_step` counts the same accuracy, one
  `fit` of one epoch per round (the epoch is timed from its start to its end hook, so the
  trainer's set-up is excluded);
- `Accelerate`: `accelerator.prepare` / `accelerator.backward`;
- `danling TorchRunner, <container>`: a `TorchRunner` given the same model, the same `DataLoader`,
  the same loss function (`nn.functional.cross_entropy`) and one of the three containers as its
  metrics, training one epoch per round with its default step (forward, loss, metrics, backward,
  optimizer step). Like the Trainer's, the epoch is timed from its start event to its end
  event, so the runner's construction and the set-up of its `train()` call are excluded; what
  it does every epoch is counted: its per-step bookkeeping (running loss, loop position, stop
  checks), the metric and loss read at the pass's end, the result row and its hand-over to the
  writer of `results.json` (which writes from a helper thread at most every two seconds; here
  when `train()` returns, after the timed epoch). Like the other candidates it writes no
  checkpoint (`checkpoint.load_only`), no log file, no `metrics.csv` and no console log (its
  logger at ERROR, as the Trainer runs without a logger or progress bar).

A second hand-written loop is timed as an A/A control: its ratio is the noise floor. Peers that
are not installed are skipped with a note (`pip install -e ".[bench]"` installs them). Every
round builds every candidate afresh, in a shuffled order (where a model lands in memory moves
its speed by a percent or two; see `common.build_shuffled`), warms each up with one epoch, then
times one epoch of each in a random order. The table gives the median epoch time, and the
median and interquartile range over the rounds of each round's ratio to the hand-written loop.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import logging
import random
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from functools import partial

import torch
from bench_metric_containers import epoch as container_epoch  # the same hand loop, one copy
from bench_runner import quiet
from common import build_shuffled
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import danling as dl
from danling.metrics import GlobalMetrics, StreamMetrics, multiclass_metrics
from danling.metrics.functional import accuracy
from danling.runners import Events

Epoch = Callable[[], float]


def workload() -> tuple[nn.Module, DataLoader]:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    return model, DataLoader(data, batch_size=32)


def plain_loop(model: nn.Module, loader: DataLoader, metrics_factory: Callable[[], object] | None) -> Epoch:
    optimizer = torch.optim.AdamW(model.parameters())
    return lambda: container_epoch(model, optimizer, loader, metrics_factory)


def fabric_loop(model: nn.Module, loader: DataLoader) -> Epoch:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    loader = fabric.setup_dataloaders(loader)

    return lambda: container_epoch(model, optimizer, loader, None, fabric.backward)


def trainer_loop(model: nn.Module, loader: DataLoader) -> Epoch:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model
            self.correct, self.seen = torch.zeros((), dtype=torch.long), 0

        def training_step(self, batch, batch_idx):
            inputs, target = batch
            logits = self.net(inputs)
            self.correct += (logits.detach().argmax(-1) == target).sum()
            self.seen += len(target)
            return nn.functional.cross_entropy(logits, target)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    class EpochTimer(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            pl_module.correct, pl_module.seen = torch.zeros((), dtype=torch.long), 0
            self.start = time.perf_counter()

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            _ = (pl_module.correct / pl_module.seen).item()
            self.elapsed = time.perf_counter() - self.start

    module, timer = Module(), EpochTimer()

    def epoch() -> float:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=1,
            logger=False,
            callbacks=[timer],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(module, loader)
        return timer.elapsed

    return epoch


def accelerate_loop(model: nn.Module, loader: DataLoader) -> Epoch:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters()), loader)

    return lambda: container_epoch(model, optimizer, loader, None, accelerator.backward)


def runner_loop(
    model: nn.Module, loader: DataLoader, cleanup: contextlib.ExitStack, metrics_factory: Callable[[], object]
) -> Epoch:
    """A `TorchRunner` training `model` on `loader` one epoch per call, timed from `EPOCH_START` to `EPOCH_END`."""

    class PeerRunner(dl.TorchRunner):
        def __init__(self, config: dl.RunnerConfig) -> None:
            super().__init__(config)
            self.model, self.metrics = model, metrics_factory()
            self.criterion = nn.functional.cross_entropy  # the loss function every other candidate calls
            self.dataloaders.train = loader  # torch's own loader, as every other candidate uses

    root = tempfile.mkdtemp(prefix="bench-peers-")
    cleanup.callback(shutil.rmtree, root, ignore_errors=True)
    config = dl.RunnerConfig(
        workspace_root=root,
        epochs=1,
        seed=0,
        log=False,  # no log file
        **{"csv.enabled": False, "checkpoint.load_only": True},  # no metrics.csv, no checkpoint
        **{"optim.type": "adamw", "optim.lr": 1e-3, "optim.weight_decay": 1e-2},  # torch's AdamW defaults
    )
    runner = quiet(PeerRunner(config))
    cleanup.callback(runner.close)
    marks: dict[str, float] = {}
    runner.events.subscribe(Events.EPOCH_START, lambda _: marks.__setitem__("start", time.perf_counter()))
    runner.events.subscribe(Events.EPOCH_END, lambda _: marks.__setitem__("end", time.perf_counter()))

    def epoch() -> float:
        runner.train_state.epoch = 0  # one more epoch of the same model
        runner.train()
        return marks["end"] - marks["start"]

    return epoch


Build = Callable[[nn.Module, DataLoader, contextlib.ExitStack], Epoch]
CONTAINERS = {
    "StreamMetrics(acc=accuracy)": lambda: StreamMetrics(acc=accuracy),
    "GlobalMetrics(acc=accuracy)": lambda: GlobalMetrics(acc=accuracy),
    "multiclass_metrics(acc)": lambda: multiclass_metrics(num_classes=10, metrics=["acc"]),
}
BASELINE = "hand-written"
# name -> (the package it needs, or None, and how to build it on a fresh model)
CANDIDATES: dict[str, tuple[str | None, Build]] = {
    BASELINE: (None, lambda model, loader, _: plain_loop(model, loader, None)),
    "hand-written, second copy (A/A control)": (None, lambda model, loader, _: plain_loop(model, loader, None)),
    **{
        f"danling {name}": (None, lambda model, loader, _, factory=factory: plain_loop(model, loader, factory))
        for name, factory in CONTAINERS.items()
    },
    **{
        f"danling TorchRunner, {name}": (None, partial(runner_loop, metrics_factory=factory))
        for name, factory in CONTAINERS.items()
    },
    "Lightning Fabric": ("lightning", lambda model, loader, _: fabric_loop(model, loader)),
    "Lightning Trainer": ("lightning", lambda model, loader, _: trainer_loop(model, loader)),
    "Accelerate": ("accelerate", lambda model, loader, _: accelerate_loop(model, loader)),
}


def candidates(only: list[str] | None) -> tuple[dict[str, Build], list[str]]:
    """The candidates to time (the hand-written loop always); notes for peers that are not installed."""
    chosen, notes = {}, []
    for name, (package, build) in CANDIDATES.items():
        if only and name != BASELINE and name not in only:
            continue
        if package is not None and importlib.util.find_spec(package) is None:
            notes.append(f"{name} skipped: `{package}` is not installed (pip install -e '.[bench]')")
            continue
        chosen[name] = build
    return chosen, notes


def run_rounds(builds: dict[str, Build], rounds: int, seed: int = 0) -> dict[str, list[float]]:
    """Each candidate's epoch time in each of `rounds` rounds.

    Every round builds every candidate afresh on a copy of the same initial model (in a shuffled
    order, see `common.build_shuffled`), warms each up with one untimed epoch, then times one
    epoch of each in a random order: a loop runs faster right after its twin (its code is still
    cached), so no candidate may always follow the same other one.
    """
    rng = random.Random(seed)
    model, loader = workload()
    samples: dict[str, list[float]] = {name: [] for name in builds}
    for _ in range(rounds):
        with contextlib.ExitStack() as cleanup:
            builders = {name: partial(build, copy.deepcopy(model), loader, cleanup) for name, build in builds.items()}
            loops, padding = build_shuffled(builders, rng)
            for name in ("lightning.pytorch", "lightning.fabric", "accelerate"):  # set after their import sets them
                logging.getLogger(name).setLevel(logging.ERROR)
            for loop in loops.values():  # warm-up: first-touch allocations, the optimizer's lazy state
                loop()
            for name in rng.sample(list(loops), len(loops)):
                samples[name].append(loops[name]())
            del padding
    return samples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    parser.add_argument("--only", action="append", help="candidate to time besides the hand-written loop")
    args = parser.parse_args(argv)
    rounds = 3 if args.quick else args.rounds
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # peers' advice about workers and logging, once per fit
    builds, notes = candidates(args.only)
    samples = run_rounds(builds, rounds)
    print(f"### Per-step cost on one workload (small MLP, batch 32, 128 steps, torch DataLoader, {rounds} rounds)\n")
    print("| candidate | epoch (ms) | ratio to hand-written: median | interquartile range |")
    print("| --- | ---: | ---: | ---: |")
    for name, times in samples.items():
        ratios = [mine / base for mine, base in zip(times, samples[BASELINE])]
        q1, median, q3 = statistics.quantiles(ratios, n=4) if rounds > 1 else ratios * 3
        print(f"| {name} | {statistics.median(times) * 1e3:.1f} | {median:.3f} | {q1:.3f} - {q3:.3f} |")
    for note in notes:
        print(f"\n{note}")


if __name__ == "__main__":
    main()
