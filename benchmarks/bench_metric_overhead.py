"""Per-call Python overhead of the metric containers a runner touches, against hand-written code.

The case is the one `bench_runner.py` trains (batch 32, 10 classes); each row is one call:

- `metrics.update`: `multiclass_metrics(num_classes=10, metrics=["acc"])` updated with detached
  float32 `(32, 10)` scores and int64 `(32,)` targets, against `correct += (pred.argmax(-1) ==
  target).sum()`.
- `meters.update`: `AverageMeters().update(loss=loss)` with a 0-d loss tensor, against
  `loss_sum += loss.detach()`.
- `read`: `metrics.avg` and `meters.avg` as read at the end of a split (the container's result
  cache, which would answer a repeated read, is dropped first), against the two `.item()`
  calls a hand-written loop makes there.

Each figure is the time of one call: timeit-style, `--number` calls per repeat, min and median
over `--repeats` repeats, the candidates of a row interleaved. The script pins nothing; for
stable figures run it on one idle core with one thread:

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/bench_metric_overhead.py
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from collections.abc import Callable

import torch

from danling.metrics import AverageMeters, multiclass_metrics

BATCH, NUM_CLASSES = 32, 10
READ = "read metrics.avg + meters.avg"


def make_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    pred = torch.randn(BATCH, NUM_CLASSES, generator=generator)
    target = torch.randint(0, NUM_CLASSES, (BATCH,), generator=generator)
    loss = torch.nn.functional.cross_entropy(pred, target)
    return pred, target, loss


def rows() -> dict[str, dict[str, Callable[[], object]]]:
    pred, target, loss = make_batch()
    metrics = multiclass_metrics(num_classes=NUM_CLASSES, metrics=["acc"])
    meters = AverageMeters()
    metrics.update(pred, target)  # the read row reads containers that hold data
    meters.update(loss=loss)
    state = {"correct": torch.zeros((), dtype=torch.long), "loss_sum": torch.zeros(())}

    def hand_update() -> None:
        state["correct"] += (pred.argmax(-1) == target).sum()

    def hand_meter() -> None:
        state["loss_sum"] += loss.detach()

    # A read right after updates: drop the result cache that would answer a repeated read.
    def danling_read() -> object:
        metrics._cache.clear()
        return metrics.avg, meters.avg

    def hand_read() -> object:
        return state["correct"].item(), state["loss_sum"].item()

    return {
        "metrics.update": {"hand-written": hand_update, "danling": lambda: metrics.update(pred, target)},
        "meters.update": {"hand-written": hand_meter, "danling": lambda: meters.update(loss=loss)},
        READ: {"hand-written": hand_read, "danling": danling_read},
    }


def measure(candidates: dict[str, Callable[[], object]], number: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each candidate, one sample per repeat, candidates interleaved."""
    timers = {name: timeit.Timer(fn) for name, fn in candidates.items()}
    for timer in timers.values():
        timer.timeit(max(number // 10, 1))  # warm caches and lazily built tables
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, timer in timers.items():
            samples[name].append(timer.timeit(number) / number)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=2000, help="calls per repeat")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.repeats} x {args.number} calls")
    print()
    print("| call | hand-written min / median (us) | danling min / median (us) | ratio (min) |")
    print("| --- | ---: | ---: | ---: |")
    # Reads are much slower than updates: fewer calls keep the run short.
    numbers = {READ: max(args.number // 10, 1)}
    for title, candidates in rows().items():
        samples = measure(candidates, numbers.get(title, args.number), args.repeats)
        hand, ours = samples["hand-written"], samples["danling"]
        cells = [f"{min(s) * 1e6:.2f} / {statistics.median(s) * 1e6:.2f}" for s in (hand, ours)]
        print(f"| {title} | {cells[0]} | {cells[1]} | {min(ours) / min(hand):.2f} |")


if __name__ == "__main__":
    main()
