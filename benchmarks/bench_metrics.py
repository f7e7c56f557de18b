"""danling.metrics against torchmetrics, in one process, alternating runs, median of repeats.

1. Exact multiclass metrics (10 classes, 1,000,000 samples in 1,000 batches of logits):
   danling `multiclass_metrics(10)` (acc, macro f1, mcc, macro auroc, macro auprc) against a
   torchmetrics `MetricCollection` of the same five metrics (exact curves, `thresholds=None`).
   Update loop and compute are timed separately.
2. Streaming metrics, per batch: danling `multiclass_metrics(10, mode="stream")` (acc, f1, mcc
   evaluated and averaged every batch) against the same torchmetrics collection's `update()`
   (accumulate only) and `forward()` (accumulate and return the batch values, what a
   StreamMetrics update does).

A second, identical torchmetrics run in the same rounds is the A/A control: its ratio to the first
is the run's noise floor. The machine's load average is printed before and after.

Run: `.venv/bin/python benchmarks/bench_metrics.py [--repeats 5] [--batches 1000]`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from common import load_line
from torchmetrics import MetricCollection
from torchmetrics.classification import (
    MulticlassAccuracy,
    MulticlassAUROC,
    MulticlassAveragePrecision,
    MulticlassF1Score,
    MulticlassMatthewsCorrCoef,
)

from danling.metrics import multiclass_metrics

NUM_CLASSES = 10
BATCH = 1000


def make_data(batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    data = []
    for _ in range(batches):
        target = torch.randint(0, NUM_CLASSES, (BATCH,), generator=generator)
        logits = torch.randn(BATCH, NUM_CLASSES, generator=generator) + 1.5 * torch.nn.functional.one_hot(
            target, NUM_CLASSES
        )
        data.append((logits, target))
    return data


def torchmetrics_collection(exact: bool) -> MetricCollection:
    common = dict(num_classes=NUM_CLASSES, ignore_index=-100)
    metrics = {
        "acc": MulticlassAccuracy(average="micro", **common),
        "f1": MulticlassF1Score(average="macro", **common),
        "mcc": MulticlassMatthewsCorrCoef(**common),
    }
    if exact:
        metrics["auroc"] = MulticlassAUROC(average="macro", thresholds=None, **common)
        metrics["auprc"] = MulticlassAveragePrecision(average="macro", thresholds=None, **common)
    return MetricCollection(metrics)


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run_global(data, library: str) -> tuple[float, float, dict[str, float]]:
    metrics = multiclass_metrics(NUM_CLASSES) if library == "danling" else torchmetrics_collection(exact=True)
    # "torchmetrics" and "A/A: torchmetrics" build the same collection

    def updates() -> None:
        for logits, target in data:
            metrics.update(logits, target)

    update_time, _ = timed(updates)
    compute_time, result = timed(metrics.compute)
    return update_time, compute_time, {k: float(v) for k, v in result.items()}


def run_stream(data, library: str) -> tuple[float, dict[str, float]]:
    if library == "danling":
        metrics = multiclass_metrics(NUM_CLASSES, mode="stream")
        step = metrics.update
    else:
        collection = torchmetrics_collection(exact=False)
        step = collection.forward if library == "torchmetrics-forward" else collection.update  # update, A/A too
        metrics = collection

    def updates() -> None:
        for logits, target in data:
            step(logits, target)

    elapsed, _ = timed(updates)
    values = metrics.avg if library == "danling" else metrics.compute()
    return elapsed / len(data), {k: float(v) for k, v in values.items()}


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=1000)
    args = parser.parse_args()
    data = make_data(args.batches)
    run_global(data[:20], "torchmetrics"), run_global(data[:20], "danling")  # warm-up
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.batches} batches of {BATCH}")
    print(load_line("before"))

    timings: dict[str, dict[str, list[float]]] = {"danling": {}, "torchmetrics": {}, "A/A: torchmetrics": {}}
    results = {}
    for _ in range(args.repeats):
        for library in timings:  # alternate to share any drift in machine load
            update_time, compute_time, results[library] = run_global(data, library)
            timings[library].setdefault("update", []).append(update_time)
            timings[library].setdefault("compute", []).append(compute_time)
            timings[library].setdefault("total", []).append(update_time + compute_time)
    for name, value in results["torchmetrics"].items():
        assert abs(value - results["danling"][name]) < 1e-5, (name, value, results["danling"][name])

    print(f"\n### GlobalMetrics, multiclass ({NUM_CLASSES} classes, {args.batches * BATCH:,} samples)\n")
    print("| phase | torchmetrics (s) | danling (s) | ratio danling / torchmetrics | A/A ratio |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for phase in ("update", "compute", "total"):
        base, ours = median(timings["torchmetrics"][phase]), median(timings["danling"][phase])
        twin = median(timings["A/A: torchmetrics"][phase])
        print(f"| {phase} | {base:.3f} | {ours:.3f} | {ours / base:.3f} | {twin / base:.3f} |")

    stream: dict[str, list[float]] = {}
    stream_results = {}
    for _ in range(args.repeats):
        for library in ("torchmetrics-update", "torchmetrics-forward", "danling", "A/A: torchmetrics-update"):
            per_batch, stream_results[library] = run_stream(data, library)
            stream.setdefault(library, []).append(per_batch)
    exact = stream_results["torchmetrics-update"]
    assert abs(exact["acc"] - stream_results["danling"]["acc"]) < 1e-6  # accuracy averages exactly

    ours = median(stream["danling"])
    print(f"\n### StreamMetrics update, per batch of {BATCH} (acc, f1, mcc)\n")
    twin = median(stream["A/A: torchmetrics-update"]) / median(stream["torchmetrics-update"])
    print("| baseline | baseline (us) | danling (us) | ratio danling / baseline |")
    print("| --- | ---: | ---: | ---: |")
    for library in ("torchmetrics-update", "torchmetrics-forward"):
        base = median(stream[library])
        print(f"| {library} | {base * 1e6:.1f} | {ours * 1e6:.1f} | {ours / base:.3f} |")
    print(f"\nA/A control (a second torchmetrics-update): {twin:.3f}")
    print(load_line("after"))


if __name__ == "__main__":
    main()
