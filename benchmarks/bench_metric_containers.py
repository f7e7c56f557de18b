"""Per-step cost of each metric container inside a training loop, against a hand-written accuracy.

Question: what does a metric container add to a training step when everything else is the same?
A small MLP (64 -> 128 -> 128 -> 10, batch 32, AdamW, one thread) trains one epoch of 128 steps
per candidate, with torch's own `DataLoader` in every candidate:

- `hand-written`: `correct += (logits.argmax(-1) == target).sum()`, read once with `.item()`;
- `StreamMetrics(acc=accuracy)`: the functional accuracy evaluated on every batch;
- `GlobalMetrics(acc=accuracy)`: batches kept, accuracy computed at the read;
- `multiclass_metrics(num_classes=10, metrics=["acc"])`: the running label table;
- `A/A: hand-written`: the hand-written loop again, the run's noise floor.

Rounds alternate the candidates (reversing the order every other round); the table gives the
median epoch time and the median of per-round ratios to the hand-written loop.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from common import load_line
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from danling.metrics import GlobalMetrics, StreamMetrics, multiclass_metrics
from danling.metrics.functional import accuracy

CONTAINERS: dict[str, Callable[[], object] | None] = {
    "hand-written": None,
    "StreamMetrics(acc=accuracy)": lambda: StreamMetrics(acc=accuracy),
    "GlobalMetrics(acc=accuracy)": lambda: GlobalMetrics(acc=accuracy),
    "multiclass_metrics(acc)": lambda: multiclass_metrics(num_classes=10, metrics=["acc"]),
    "A/A: hand-written": None,
}


def epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    factory: Callable[[], object] | None,
    backward: Callable[[torch.Tensor], object] = torch.Tensor.backward,
) -> float:
    """One timed epoch counting top-1 accuracy by hand (`factory` None) or with the container `factory()` builds.

    `backward(loss)` back-propagates (a framework's own call, e.g. `fabric.backward`, for the peers).
    """
    metrics = factory() if factory is not None else None
    correct, seen = torch.zeros((), dtype=torch.long), 0
    start = time.perf_counter()
    for inputs, target in loader:
        logits = model(inputs)
        loss = nn.functional.cross_entropy(logits, target)
        optimizer.zero_grad()
        backward(loss)
        optimizer.step()
        if metrics is None:
            correct += (logits.detach().argmax(-1) == target).sum()
            seen += len(target)
        else:
            metrics.update(logits.detach(), target)
    _ = (correct / seen).item() if metrics is None else metrics.avg
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    args = parser.parse_args(argv)
    rounds = 3 if args.quick else args.rounds
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,))), batch_size=32)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters())
    names = list(CONTAINERS)
    for name in names:  # warm-up
        epoch(model, optimizer, loader, CONTAINERS[name])
    samples: dict[str, list[float]] = {name: [] for name in names}
    print(load_line("before"))
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            samples[name].append(epoch(model, optimizer, loader, CONTAINERS[name]))
    print("### Metric containers in a training loop (small MLP, batch 32, 128 steps, torch DataLoader)\n")
    print("| container | epoch (ms) | ratio to hand-written |\n| --- | ---: | ---: |")
    for name in names:
        ratios = [mine / base for mine, base in zip(samples[name], samples["hand-written"])]
        print(f"| {name} | {statistics.median(samples[name]) * 1e3:.1f} | {statistics.median(ratios):.3f} |")
    print("\n" + load_line("after"))


if __name__ == "__main__":
    main()
