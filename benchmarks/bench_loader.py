"""One pass of the runner's dataloader against torch's `DataLoader`, per batch, over in-memory tensors.

Both iterate the same `TensorDataset` (64 float features and an integer label per example) with
the same batch size, shuffled, one process, one thread: `torch DataLoader` fetches every
example with `__getitem__` and stacks them in `default_collate`; `danling build_dataloader`
fetches each batch with one index op per tensor (`danling.data.fetch`). A third row runs
danling's loader with a `collate_fn` that forces the per-example path, which isolates the
resumable sampler and `StatefulDataLoader` from the fetch. A `Subset` (as `random_split` makes
it) is timed as well. Median of alternating passes.

Usage: ``python benchmarks/bench_loader.py [--repeats 15] [--quick]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate, random_split

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import alternate

from danling.data import build_dataloader


def per_example(batch: list) -> list:
    return default_collate(batch)


def one_pass(loader: object) -> None:
    for _ in loader:
        pass


def bench(dataset: object, batch_size: int, repeats: int) -> tuple[str, int]:
    batches = len(dataset) // batch_size
    config = {"batch_size": batch_size}
    candidates = {
        "torch DataLoader": DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True),
        "danling build_dataloader": build_dataloader(dataset, split="train", config=config),
        "danling build_dataloader, per-example fetch": build_dataloader(
            dataset, split="train", config=config, collate_fn=per_example
        ),
    }
    passes = {name: (lambda loader=loader: one_pass(loader)) for name, loader in candidates.items()}
    medians = alternate(passes, repeats)
    base = medians["torch DataLoader"]
    rows = [f"| {name} | {seconds / batches * 1e6:.1f} | {seconds / base:.3f} |" for name, seconds in medians.items()]
    return "\n".join(rows), batches


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="danling's dataloader against torch's over a TensorDataset")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="2 repeats, a smoke run of the script")
    args = parser.parse_args(argv)
    repeats = 2 if args.quick else args.repeats
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(8192, 64, generator=generator), torch.randint(0, 10, (8192,)))
    subset, _ = random_split(dataset, [0.75, 0.25], generator=generator)
    print(f"torch {torch.__version__}, 1 thread; median of {repeats} alternating passes, shuffled, drop_last\n")
    for title, data in (("TensorDataset", dataset), ("Subset of a TensorDataset (random_split)", subset)):
        for batch_size in (32, 256):
            rows, batches = bench(data, batch_size, repeats)
            print(f"### {title}, batch {batch_size} ({batches} batches per pass)\n")
            print("| loader | us per batch | ratio vs torch DataLoader |\n| --- | ---: | ---: |")
            print(rows + "\n")


if __name__ == "__main__":
    main()
