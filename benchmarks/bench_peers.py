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
- `Accelerate`: `accelerator.prepare` / `accelerator.backward`.

Peers that are not installed are skipped with a note (`pip install -e ".[bench]"` installs them).
Rounds alternate the candidates (reversing the order every other round); the table gives the
median epoch time and the median of per-round ratios to the hand-written loop.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import logging
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from bench_metric_containers import epoch as container_epoch  # the same hand loop, one copy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from danling.metrics import GlobalMetrics, StreamMetrics, multiclass_metrics
from danling.metrics.functional import accuracy

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

    def epoch() -> float:
        correct, seen = torch.zeros((), dtype=torch.long), 0
        start = time.perf_counter()
        for inputs, target in loader:
            logits = model(inputs)
            loss = nn.functional.cross_entropy(logits, target)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            correct += (logits.detach().argmax(-1) == target).sum()
            seen += len(target)
        _ = (correct / seen).item()
        return time.perf_counter() - start

    return epoch


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

    def epoch() -> float:
        correct, seen = torch.zeros((), dtype=torch.long), 0
        start = time.perf_counter()
        for inputs, target in loader:
            logits = model(inputs)
            loss = nn.functional.cross_entropy(logits, target)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            correct += (logits.detach().argmax(-1) == target).sum()
            seen += len(target)
        _ = (correct / seen).item()
        return time.perf_counter() - start

    return epoch


DANLING = {
    "danling StreamMetrics(acc=accuracy)": lambda: StreamMetrics(acc=accuracy),
    "danling GlobalMetrics(acc=accuracy)": lambda: GlobalMetrics(acc=accuracy),
    "danling multiclass_metrics(acc)": lambda: multiclass_metrics(num_classes=10, metrics=["acc"]),
}
PEERS = {
    "Lightning Fabric": ("lightning", fabric_loop),
    "Lightning Trainer": ("lightning", trainer_loop),
    "Accelerate": ("accelerate", accelerate_loop),
}


def candidates(only: list[str] | None) -> tuple[dict[str, Epoch], list[str]]:
    """Every candidate on its own copy of the same initial model; notes for skipped peers."""
    model, loader = workload()
    loops: dict[str, Epoch] = {"hand-written": plain_loop(copy.deepcopy(model), loader, None)}
    for name, factory in DANLING.items():
        if not only or name in only:
            loops[name] = plain_loop(copy.deepcopy(model), loader, factory)
    notes = []
    for name, (package, build) in PEERS.items():
        if only and name not in only:
            continue
        if importlib.util.find_spec(package) is None:
            notes.append(f"{name} skipped: `{package}` is not installed (pip install -e '.[bench]')")
            continue
        loops[name] = build(copy.deepcopy(model), loader)
    return loops, notes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    parser.add_argument("--only", action="append", help="candidate to time besides the hand-written loop")
    args = parser.parse_args(argv)
    rounds = 3 if args.quick else args.rounds
    warnings.filterwarnings("ignore")  # peers' advice about workers and logging, once per fit
    loops, notes = candidates(args.only)
    for name in ("lightning.pytorch", "lightning.fabric", "accelerate"):  # set after their import sets them
        logging.getLogger(name).setLevel(logging.ERROR)
    names = list(loops)
    for name in names:  # warm-up
        loops[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            samples[name].append(loops[name]())
    print("### Per-step cost on one workload (small MLP, batch 32, 128 steps, torch DataLoader)\n")
    print("| candidate | epoch (ms) | ratio to hand-written |\n| --- | ---: | ---: |")
    for name in names:
        ratios = [mine / base for mine, base in zip(samples[name], samples["hand-written"])]
        print(f"| {name} | {statistics.median(samples[name]) * 1e3:.1f} | {statistics.median(ratios):.3f} |")
    for note in notes:
        print(f"\n{note}")


if __name__ == "__main__":
    main()
