"""What the per-batch metric calls cost inside a real training loop, before and after a change.

A `timeit` loop runs the same few lines over and over, so every Python line and every torch
dispatch finds its code and data in the CPU caches. Between two batches of a real training
loop the forward, backward and optimizer step evict them, and the same call costs several times
more. This benchmark therefore times the calls where they run: interleaved with the
forward/backward/AdamW step of a small MLP (64 -> 128 -> 128 -> 10, batch 32, one thread).

Each epoch runs `--steps` training steps, then reads the split's result (accuracy and mean
loss) and resets, as a runner does at the end of a split. Three variants, one epoch each per
round in rotated order:

- `bare`: no metric code at all;
- `hand-written`: `correct += (logits.argmax(-1) == target).sum()` and `loss_sum += loss.detach()`,
  read with two `.item()` calls;
- `danling`: `multiclass_metrics(num_classes=10, metrics=["acc"])` (a `GlobalMetrics`) and an
  `AverageMeter` of the loss, read through `metrics.avg` and `meter.avg`.

Per variant the table gives the in-loop cost of each call (median and mean of `perf_counter_ns`
around it; the mean includes work that is deferred to occasional calls), the cost of the
end-of-epoch read, and the epoch time as a median of per-round ratios to `bare`.

To compare two versions of danling, the script launches worker processes that import danling
from different places, alternating between them: `--before PATH` names a directory holding an
older `danling/` package (`--before HEAD` extracts the last commit there with `git archive`).
Without `--before` one worker measures the installed danling. Pin it for stable figures:

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/bench_metric_inloop.py --before HEAD
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

FEATURES, HIDDEN, CLASSES, BATCH = 64, 128, 10, 32
VARIANTS = ("bare", "hand-written", "danling")


def make_loop(variant: str, steps: int) -> Callable[[], dict[str, list[int]]]:
    """One epoch of training with the metric code of `variant`; returns per-call timings (ns)."""
    import danling.metrics as dm

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    criterion = nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(BATCH, FEATURES, generator=generator), torch.randint(0, CLASSES, (BATCH,), generator=generator))
        for _ in range(16)
    ]
    metrics = dm.multiclass_metrics(num_classes=CLASSES, metrics=["acc"])
    meter = dm.AverageMeter()
    clock = time.perf_counter_ns

    def epoch() -> dict[str, list[int]]:
        metric_ns, meter_ns = [], []
        correct = torch.zeros((), dtype=torch.long)
        loss_sum = torch.zeros(())
        seen = 0
        for step in range(steps):
            data, target = batches[step % len(batches)]
            logits = model(data)
            loss = criterion(logits, target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if variant == "hand-written":
                start = clock()
                correct += (logits.detach().argmax(-1) == target).sum()
                middle = clock()
                loss_sum += loss.detach()
                end = clock()
                seen += BATCH
            elif variant == "danling":
                start = clock()
                metrics.update(logits.detach(), target)
                middle = clock()
                meter.update(loss)
                end = clock()
            else:
                continue
            metric_ns.append(middle - start)
            meter_ns.append(end - middle)
        start = clock()
        if variant == "hand-written":
            result = (correct.item() / seen, loss_sum.item() / steps)
        elif variant == "danling":
            result = (metrics.avg["acc"], meter.avg)
            metrics.reset()
            meter.reset()
        else:
            result = ()
        read_ns = clock() - start
        assert all(value == value for value in result)  # read values are numbers, not nan
        return {"metric": metric_ns, "meter": meter_ns, "read": [read_ns]}

    return epoch


def worker(rounds: int, steps: int) -> dict:
    """Run every variant once per round (order rotated); return raw timings."""
    torch.set_num_threads(1)
    loops = {name: make_loop(name, steps) for name in VARIANTS}
    for loop in loops.values():
        loop()  # warm-up: lazily built tables, allocator, first-call paths
    out: dict = {name: {"epoch": [], "metric": [], "meter": [], "read": []} for name in VARIANTS}
    for index in range(rounds):
        shift = index % len(VARIANTS)
        for name in VARIANTS[shift:] + VARIANTS[:shift]:
            start = time.perf_counter_ns()
            calls = loops[name]()
            out[name]["epoch"].append(time.perf_counter_ns() - start)
            for key, values in calls.items():
                out[name][key].extend(values)
    import danling

    out["danling_path"] = str(Path(danling.__file__).parent)
    return out


def extract_head(root: Path) -> Path:
    """The last commit's `danling/` package under `root` (read-only use of git)."""
    repo = Path(__file__).resolve().parents[1]
    archive = subprocess.run(["git", "archive", "HEAD", "danling"], cwd=repo, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root


def run_worker(path: str | None, rounds: int, steps: int) -> dict:
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
    command = [sys.executable, __file__, "--worker", "--rounds", str(rounds), "--steps", str(steps)]
    result = subprocess.run(command, env=env, check=True, capture_output=True, text=True, cwd=tempfile.gettempdir())
    return json.loads(result.stdout)


def summarise(label: str, runs: list[dict], steps: int) -> list[str]:
    """Table rows of one version, pooling the workers' samples (epoch ratios paired per round)."""
    rows = []
    bare = [t for run in runs for t in run["bare"]["epoch"]]
    for name in VARIANTS[1:]:
        pooled = {key: [t for run in runs for t in run[name][key]] for key in ("epoch", "metric", "meter", "read")}
        ratio = statistics.median(t / b for t, b in zip(pooled["epoch"], bare))
        per_step = statistics.median(t - b for t, b in zip(pooled["epoch"], bare)) / steps / 1e3
        cells = [
            f"{statistics.median(pooled['metric']) / 1e3:.1f} / {statistics.fmean(pooled['metric']) / 1e3:.1f}",
            f"{statistics.median(pooled['meter']) / 1e3:.1f} / {statistics.fmean(pooled['meter']) / 1e3:.1f}",
            f"{statistics.median(pooled['read']) / 1e3:.0f}",
            f"{per_step:.1f}",
            f"{ratio:.3f}",
        ]
        rows.append(f"| {label} | {name} | " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", action="append", default=[], help="directory holding an older danling/, or HEAD")
    parser.add_argument("--workers", type=int, default=4, help="worker processes per version (alternating)")
    parser.add_argument("--rounds", type=int, default=20, help="epochs of each variant per worker")
    parser.add_argument("--steps", type=int, default=100, help="training steps per epoch")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.rounds, args.steps)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        versions: dict[str, str | None] = {}
        for before in args.before:
            versions[f"before ({before})"] = str(extract_head(Path(scratch))) if before == "HEAD" else before
        versions["installed" if not args.before else "after"] = None
        runs: dict[str, list[dict]] = {label: [] for label in versions}
        for _ in range(args.workers):
            for label, path in versions.items():
                runs[label].append(run_worker(path, args.rounds, args.steps))
    print(f"torch {torch.__version__}; {args.workers} workers x {args.rounds} epochs x {args.steps} steps per version")
    for label, version_runs in runs.items():
        print(f"- {label}: danling from {version_runs[0]['danling_path']}")
    print()
    print(
        "| version | variant | metric update median / mean (us) | meter update median / mean (us) "
        "| end-of-epoch read (us) | epoch time over bare, per step (us) | epoch time / bare |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for label, version_runs in runs.items():
        print("\n".join(summarise(label, version_runs, args.steps)))


if __name__ == "__main__":
    main()
