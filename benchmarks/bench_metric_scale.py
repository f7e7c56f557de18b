"""Exact metrics at evaluation-set scale: peak memory and time against N, danling and torchmetrics.

Every measurement runs in a fresh process (so no run inherits another's heap): it imports both
libraries, builds one metric set, feeds N samples in batches of 10,000 made from a small pool (the
metric is the only holder of the scores), then computes. It reports the time spent in `update`
calls, the time of `compute`, and the peak resident memory above the process's memory just
before the first batch (after a warm-up of 65,536 samples through the same metric set, whose
freed heap is handed back with `malloc_trim`) (Linux `VmHWM`, reset through `/proc/self/clear_refs` at that point; torch
CPU tensors are invisible to tracemalloc). Libraries alternate, repeat by repeat; the table gives
medians, the ratios danling / torchmetrics, and the peak as a multiple of the score tensor
(N x C float32 values, what an exact metric must hold). Values must agree to 1e-5.

Metric sets name danling's catalogue: acc (micro), f1 (macro), mcc, auroc and auprc (macro,
exact: torchmetrics `thresholds=None`); tasks are binary, multiclass (10 classes, logits) and
multilabel (10 labels, logits), all with `ignore_index=-100` on both sides.

`--gather N` measures the distributed gather instead: two gloo processes on this machine each
hold half of N float32 scores (kept as four pieces, as a container keeps chunks) and call
`gather_across_ranks`, which every rank's `avg` read of kept data goes through; each reports its
peak resident memory above the memory before the call, as a multiple of the gathered N scores
(1.0x: every rank's copy held once; a gather that kept the received list and its concatenation
would take 2x).

`--gather-read N` measures a whole 2-rank read instead: two gloo processes each feed half of N
binary samples to AUROC + AUPRC and read `avg`, which gathers every rank's data and ranks it; each
reports its peak resident memory above the memory before the read, as a multiple of the N scores.
Two layouts alternate: the store that keeps scores by label (what `binary_metrics` gives) and the
same batches kept in order (a metric of the task that reads `"data"`), the baseline.

`--instructions` counts the instructions of `compute` instead of timing it: each child runs under
callgrind with instrumentation on around `compute` alone (see `common.count_region`). A compute
under a millisecond (confusion-only sets) is one cold call, whose wall time is mostly cache
misses that change from process to process; its instruction count is the same in every run (to
within 1% for torchmetrics). Needs valgrind, its headers and a C compiler; N = 1e5 runs in about
20 s per child.

`--heap` also counts the peak of live heap bytes over the same span (update loop and compute):
each child runs with a preloaded counter of glibc's allocator (`common.heap_counter`, with
`PYTHONMALLOC=malloc` so that Python's own objects go through it too). Resident memory also holds
freed blocks glibc keeps, and reuses ones freed before the span: at N = 1e5 that moves the
resident peak by a few hundred KiB between fresh processes; the counted peak is what the code
holds, the same in every run. Time and resident memory of a `--heap` run are measured under the
counter (and the malloc-backed Python objects): read them from a run without it.

`--warm-reads K` reads the warm-up container's values K times instead of once, each read after
one more batch (a read right after another returns the cached values in both libraries), as a
training pass reads its metrics at every logged step before the pass's end. A compute under a
millisecond is one call of code that the interpreter specialises only from about its eighth run
(CPython 3.11's warm-up): after one warm-up read, the measured read runs most of danling's read
path unspecialised; after eight, specialised, as in a pass that logged a few steps first. The
default, 1, is the first read of a fresh process.

`--control` measures torchmetrics a second time in every repeat (its own fresh process, in the
same alternation): the ratio of its two medians, peak and compute, is the A/A control of the row,
how far a ratio moves between two runs of the same code on this machine. A danling ratio inside
that spread is no measurable difference.

Run (one heavy run at a time on a shared machine):
`flock /tmp/danling-heavy.lock .venv/bin/python benchmarks/bench_metric_scale.py`
options: `--sizes 1e5 1e6 1e7`, `--tasks multiclass binary multilabel`,
`--sets acc+auroc acc auroc ...`, `--repeats 3`, `--json FILE`, `--plot FILE.png`, `--heap`,
`--control`.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import callgrind_helper, count_region, counted_region, heap_counter, heap_environment, heap_region

BATCH = 10_000
POOL = 8
COLUMNS = 10
DEFAULT_SETS = ("acc", "auroc", "auprc", "f1+mcc", "acc+auroc", "acc+f1+mcc+auroc+auprc")
# The A/A control's runs: torchmetrics again, in processes of their own (`--control`).
CONTROL = "control"


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _torchmetrics(task: str, names: list[str]):
    from torchmetrics import MetricCollection
    from torchmetrics import classification as tm

    common = {"ignore_index": -100}
    prefix = {"binary": "Binary", "multiclass": "Multiclass", "multilabel": "Multilabel"}[task]
    if task == "multiclass":
        common["num_classes"] = COLUMNS
    if task == "multilabel":
        common["num_labels"] = COLUMNS
    averaged = {} if task == "binary" else {"average": "macro"}
    build = {
        "acc": lambda: getattr(tm, prefix + "Accuracy")(**common, **({} if task == "binary" else {"average": "micro"})),
        "f1": lambda: getattr(tm, prefix + "F1Score")(**common, **averaged),
        "mcc": lambda: getattr(tm, prefix + "MatthewsCorrCoef")(**common),
        "auroc": lambda: getattr(tm, prefix + "AUROC")(thresholds=None, **common, **averaged),
        "auprc": lambda: getattr(tm, prefix + "AveragePrecision")(thresholds=None, **common, **averaged),
    }
    return MetricCollection({name: build[name]() for name in names})


def _danling(task: str, names: list[str]):
    from danling.metrics import binary_metrics, multiclass_metrics, multilabel_metrics

    if task == "binary":
        return binary_metrics(names)
    if task == "multiclass":
        return multiclass_metrics(COLUMNS, metrics=names)
    return multilabel_metrics(COLUMNS, metrics=names)


def _batch(task: str, generator, size: int):
    import torch

    if task == "binary":
        target = torch.randint(0, 2, (size,), generator=generator)
        return torch.randn(size, generator=generator) + 1.5 * target, target
    if task == "multiclass":
        target = torch.randint(0, COLUMNS, (size,), generator=generator)
        logits = torch.randn(size, COLUMNS, generator=generator)
        return logits + 1.5 * torch.nn.functional.one_hot(target, COLUMNS), target
    target = torch.randint(0, 2, (size, COLUMNS), generator=generator)
    return torch.randn(size, COLUMNS, generator=generator) + 1.5 * target, target


def feed(metrics, pool: list, size: int) -> float:
    """Update `metrics` with `size` samples made from `pool`; returns the seconds spent in `update`."""

    update_s = 0.0
    for index, offset in enumerate(range(0, size, BATCH)):
        rows = min(BATCH, size - offset)
        scores, labels = pool[index % len(pool)]
        # One new tensor per batch (the pool plus an offset, so that scores do not repeat), as a
        # model's outputs are, with no generator temporaries.
        input, target = scores[:rows] + index * 1e-4, labels[:rows].clone()
        began = time.perf_counter()
        metrics.update(input, target)
        update_s += time.perf_counter() - began
        del input, target
    return update_s


def child(library: str, task: str, names: list[str], size: int, warm_reads: int = 1) -> dict:
    """One measurement, in this (fresh) process."""
    import torch
    import torchmetrics  # noqa: F401

    import danling.metrics  # noqa: F401  both libraries loaded in every run: same baseline

    metrics = _danling(task, names) if library == "danling" else _torchmetrics(task, names)
    generator = torch.Generator().manual_seed(0)
    # First calls load code pages, allocate thread pools and kernels' caches: not the data's cost.
    # The warm-up runs the measured loop itself (`feed`, batches of the measured size, so the
    # paths that join batches run too) over the large-data paths (danling's ranking starts at
    # 8,192 scores), then hands the freed heap back, so neither library starts with slack the
    # measured run could reuse. (With one batch of 65,536, the first join of the measured run
    # paid the start of torch's thread pool: +0.5 MiB at N = 1e5; with batches made outside
    # `feed`, the measured loop's own first calls paged in about 0.25 MiB of code, counted as
    # resident memory in both libraries' peaks.)
    warm = _batch(task, generator, 1 << 16)
    warm_metrics = (_danling if library == "danling" else _torchmetrics)(task, names)
    warm_batches = list(zip(warm[0].split(BATCH), warm[1].split(BATCH)))
    feed(warm_metrics, warm_batches, 1 << 16)
    warm_metrics.compute()
    for _ in range(warm_reads - 1):  # `--warm-reads`: a batch, then a read, as a pass that logs its steps
        feed(warm_metrics, warm_batches, BATCH)
        warm_metrics.compute()
    del warm_metrics, warm, warm_batches
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    pool = [_batch(task, generator, BATCH) for _ in range(POOL)]
    Path("/proc/self/clear_refs").write_text("5")  # peak resident memory := current
    start_kib = _rss_kib("VmRSS")
    with heap_region() as heap:  # live heap bytes are counted here only, under `--heap`
        update_s = feed(metrics, pool, size)
        with counted_region():  # instructions are collected here only, under `--instructions`
            began = time.perf_counter()
            values = metrics.compute()
            compute_s = time.perf_counter() - began
    peak = (_rss_kib("VmHWM") - start_kib) * 1024
    return {
        "update_s": update_s,
        "compute_s": compute_s,
        "peak_bytes": peak,
        "heap_bytes": heap.peak_bytes,
        "values": {name: float(value) for name, value in values.items()},
    }


# `--gather-read` layouts: binary AUROC + AUPRC kept by label, or the same batches kept in order.
READ_LAYOUTS = ("by label", "in order")


def gather_child(rank: int, size: int, port: int, layout: int = -1) -> dict:
    """One rank of the gather (`layout` -1) or of a read (`READ_LAYOUTS[layout]`), in this (fresh) process."""
    import torch
    import torch.distributed as dist

    from danling.metrics.distributed import gather_across_ranks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    shard = size // 2 if rank == 0 else size - size // 2
    if layout >= 0:
        return _read_child(rank, shard, size, READ_LAYOUTS[layout])
    pieces = list(torch.rand(shard, generator=torch.Generator().manual_seed(rank)).chunk(4))
    gather_across_ranks([torch.ones(8)])  # first collective: connections and buffers, not the data's cost
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    start_kib = _rss_kib("VmRSS")
    began = time.perf_counter()
    gathered = gather_across_ranks(pieces)
    seconds = time.perf_counter() - began
    peak = (_rss_kib("VmHWM") - start_kib) * 1024
    result = {"rank": rank, "peak_bytes": peak, "gathered_bytes": gathered.numel() * 4, "seconds": seconds}
    dist.barrier()
    dist.destroy_process_group()
    return result


def _read_child(rank: int, shard: int, size: int, layout: str) -> dict:
    import torch
    import torch.distributed as dist

    from danling.metrics import GlobalMetrics, MetricFunc, binary_metrics

    def build():
        metrics = binary_metrics(["auroc", "auprc"])
        if layout == "by label":
            return metrics
        task = next(iter(metrics.metrics.values())).task
        return GlobalMetrics(**metrics.metrics, ordered=MetricFunc("ordered", lambda state: 0.0, task, "data"))

    generator = torch.Generator().manual_seed(rank)
    warm = build()  # first collectives and the ranking's first calls: not the data's cost
    warm.update(*_batch("binary", generator, 1 << 14))
    warm.avg  # noqa: B018
    del warm
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    metrics = build()
    feed(metrics, [_batch("binary", generator, BATCH) for _ in range(POOL)], shard)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    start_kib = _rss_kib("VmRSS")
    began = time.perf_counter()
    values = metrics.avg
    seconds = time.perf_counter() - began
    peak = (_rss_kib("VmHWM") - start_kib) * 1024
    result = {
        "rank": rank,
        "peak_bytes": peak,
        "gathered_bytes": size * 4,
        "seconds": seconds,
        "values": [values["auroc"], values["auprc"]],
    }
    dist.barrier()
    dist.destroy_process_group()
    return result


def measure_gather(size: int, layout: int = -1) -> list[dict]:
    import socket

    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    ranks = [
        subprocess.Popen(
            [sys.executable, __file__, "--gather-child", str(rank), str(size), str(port), str(layout)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    results = []
    for process in ranks:
        out, err = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"gather of N={size} failed:\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def gather_reads(args: argparse.Namespace) -> None:
    """The `--gather-read` table: each layout's peak per rank (medians over `--repeats`), layouts alternating."""
    print(f"load at start: {Path('/proc/loadavg').read_text().split()[:3]}")
    print("| N | scores MiB | layout | peak MiB rank 0 / 1 | peak / scores rank 0 / 1 | read seconds rank 0 / 1 |")
    print("| ---: | ---: | --- | ---: | ---: | ---: |")
    for size in (int(float(s)) for s in args.gather_read):
        runs: dict[int, list[list[dict]]] = {layout: [] for layout in range(len(READ_LAYOUTS))}
        for _ in range(args.repeats):
            for layout in runs:
                runs[layout].append(measure_gather(size, layout))
        values = {layout: runs[layout][-1][0]["values"] for layout in runs}
        if max(abs(a - b) for a, b in zip(values[0], values[1])) > 1e-9:
            raise AssertionError(f"N={size}: the layouts' values differ: {values}")
        for layout, measured in runs.items():
            peaks = [statistics.median(run[rank]["peak_bytes"] for run in measured) for rank in (0, 1)]
            seconds = [statistics.median(run[rank]["seconds"] for run in measured) for rank in (0, 1)]
            scores = size * 4
            print(
                f"| {size:.0e} | {scores / (1 << 20):,.1f} | {READ_LAYOUTS[layout]} | {_mib(peaks[0])} / "
                f"{_mib(peaks[1])} | {peaks[0] / scores:.2f}x / {peaks[1] / scores:.2f}x | "
                f"{seconds[0]:.3f} / {seconds[1]:.3f} |",
                flush=True,
            )
    print(f"load at end: {Path('/proc/loadavg').read_text().split()[:3]}")


def measure(
    library: str,
    task: str,
    names: list[str],
    size: int,
    helper: str | None = None,
    heap: str | None = None,
    warm_reads: int = 1,
) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if heap is not None:
        env = heap_environment(heap, env)
    command = [sys.executable, __file__, "--child", library, task, "+".join(names), str(size), str(warm_reads)]
    if helper is not None:
        instructions, out = count_region(command, helper, env)
        return {**json.loads(out.strip().splitlines()[-1]), "instructions": instructions}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{library} {task} {names} N={size} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--gather-child", nargs=4, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--gather", nargs="+", help="measure a 2-rank gloo gather of these N instead")
    parser.add_argument(
        "--gather-read", nargs="+", help="measure a 2-rank read of binary AUROC + AUPRC over these N instead"
    )
    parser.add_argument("--sizes", nargs="+", default=["1e5", "1e6", "1e7"])
    parser.add_argument("--tasks", nargs="+", default=["multiclass", "binary", "multilabel"])
    parser.add_argument("--sets", nargs="+", default=list(DEFAULT_SETS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--warm-reads", type=int, default=1, help="read the warm-up container's values this many times (default 1)"
    )
    parser.add_argument("--json", type=Path, help="write every measurement here")
    parser.add_argument("--plot", type=Path, help="draw memory and compute time against N here (PNG)")
    parser.add_argument("--instructions", action="store_true", help="count compute's instructions (callgrind)")
    parser.add_argument(
        "--heap", action="store_true", help="also count the peak of live heap bytes (a preloaded counter)"
    )
    parser.add_argument(
        "--control", action="store_true", help="measure torchmetrics twice per repeat: the rows' A/A control"
    )
    args = parser.parse_args()
    if args.warm_reads < 1:
        parser.error(f"--warm-reads must be at least 1 (the warm-up's own read), got {args.warm_reads}")
    if args.child:
        library, task, names, size, warm_reads = args.child
        print(json.dumps(child(library, task, names.split("+"), int(size), int(warm_reads))))
        return
    if args.gather_child:
        print(json.dumps(gather_child(*args.gather_child)))
        return
    if args.gather_read:
        gather_reads(args)
        return
    if args.gather:
        print("| N | gathered MiB | peak MiB rank 0 / 1 | peak / gathered rank 0 / 1 | seconds rank 0 / 1 |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for size in (int(float(s)) for s in args.gather):
            r0, r1 = measure_gather(size)
            gathered = r0["gathered_bytes"]
            print(
                f"| {size:.0e} | {gathered / (1 << 20):,.0f} | {r0['peak_bytes'] / (1 << 20):,.0f} / "
                f"{r1['peak_bytes'] / (1 << 20):,.0f} | {r0['peak_bytes'] / gathered:.2f}x / "
                f"{r1['peak_bytes'] / gathered:.2f}x | {r0['seconds']:.3f} / {r1['seconds']:.3f} |",
                flush=True,
            )
        return

    if args.instructions:
        instructions(args)
        return
    import torch
    import torchmetrics

    print(f"torch {torch.__version__}, torchmetrics {torchmetrics.__version__}, OMP_NUM_THREADS=1, fresh process each")
    with tempfile.TemporaryDirectory() as directory:
        heap = heap_counter(directory) if args.heap else None
        rows = scale_rows(args, heap)
    print(f"load at end: {Path('/proc/loadavg').read_text().split()[:3]}")
    print()
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot)


def scale_rows(args: argparse.Namespace, heap: str | None) -> list[dict]:
    """Measure every (task, set, N) of `args`, libraries alternating; one row of medians each."""
    print(f"load at start: {Path('/proc/loadavg').read_text().split()[:3]}")
    rows = []
    for task in args.tasks:
        for names in args.sets:
            for size in (int(float(s)) for s in args.sizes):
                runs: dict[str, list[dict]] = {"danling": [], "torchmetrics": []}
                if args.control:
                    runs[CONTROL] = []
                for _ in range(args.repeats):
                    for library in runs:  # alternate: all share any drift of the machine's load
                        measured = "torchmetrics" if library == CONTROL else library
                        runs[library].append(
                            measure(measured, task, names.split("+"), size, heap=heap, warm_reads=args.warm_reads)
                        )
                ours, theirs = runs["danling"][-1]["values"], runs["torchmetrics"][-1]["values"]
                worst = max(abs(ours[n] - theirs[n]) for n in ours)
                if worst > 1e-5:
                    raise AssertionError(f"{task} {names} N={size}: values differ: {ours} vs {theirs}")
                row = {
                    "task": task,
                    "metrics": names,
                    "n": size,
                    "scores_bytes": size * (1 if task == "binary" else COLUMNS) * 4,
                }
                for library, measured in runs.items():
                    for key in ("update_s", "compute_s", "peak_bytes") + (("heap_bytes",) if heap else ()):
                        row[f"{library}_{key}"] = statistics.median(m[key] for m in measured)
                rows.append(row)
                print(_line(row), flush=True)
    return rows


def instructions(args: argparse.Namespace) -> None:
    """The `--instructions` table: compute's instructions per library, one callgrind child each."""
    with tempfile.TemporaryDirectory() as directory:
        helper = callgrind_helper(directory)
        print("| task | metrics | N | compute instructions danling / torchmetrics | ratio |")
        print("| --- | --- | ---: | ---: | ---: |")
        for task in args.tasks:
            for names in args.sets:
                for size in (int(float(s)) for s in args.sizes):
                    counts = {
                        library: measure(library, task, names.split("+"), size, helper, warm_reads=args.warm_reads)[
                            "instructions"
                        ]
                        for library in ("danling", "torchmetrics")
                    }
                    ours, theirs = counts["danling"], counts["torchmetrics"]
                    print(
                        f"| {task} | {names.replace('+', ', ')} | {size:.0e} | {ours:,} / {theirs:,} | "
                        f"{ours / theirs:.2f}x |",
                        flush=True,
                    )


def _mib(size: float) -> str:
    # Peaks under 10 MiB (counts, small N) with two decimals: whole MiB would read "0 / 0".
    mib = size / (1 << 20)
    return f"{mib:,.0f}" if mib >= 10 else f"{mib:.2f}"


def _seconds(seconds: float) -> str:
    # Sub-millisecond computes (confusion counts) in microseconds: three decimals of a second read 0.000.
    return f"{seconds:.3f} s" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


def _line(row: dict) -> str:
    heap = (
        f", heap {_mib(row['danling_heap_bytes'])} / {_mib(row['torchmetrics_heap_bytes'])} MiB"
        if "danling_heap_bytes" in row
        else ""
    )
    control = (
        f", A/A peak {_control(row, 'peak_bytes')}, compute {_control(row, 'compute_s')}"
        if f"{CONTROL}_peak_bytes" in row
        else ""
    )
    return (
        f"{row['task']} {row['metrics']} N={row['n']:.0e}: peak {_mib(row['danling_peak_bytes'])} / "
        f"{_mib(row['torchmetrics_peak_bytes'])} MiB{heap}, compute {_seconds(row['danling_compute_s'])} / "
        f"{_seconds(row['torchmetrics_compute_s'])}, update {row['danling_update_s']:.3f} / "
        f"{row['torchmetrics_update_s']:.3f} s{control}"
    )


def _control(row: dict, key: str) -> str:
    # The A/A ratio: torchmetrics' second median over its first (1.00: the same in both).
    return f"{row[f'{CONTROL}_{key}'] / row[f'torchmetrics_{key}']:.2f}"


def table(rows: list[dict]) -> str:
    heap = bool(rows) and "danling_heap_bytes" in rows[0]
    control = bool(rows) and f"{CONTROL}_peak_bytes" in rows[0]
    lines = [
        "| task | metrics | N | peak MiB danling / torchmetrics | peak / scores (danling, torchmetrics) | "
        + ("heap peak MiB danling / torchmetrics | heap peak / scores (danling, torchmetrics) | " if heap else "")
        + "compute danling / torchmetrics | compute ratio | update + compute ratio |"
        + (" A/A peak | A/A compute |" if control else ""),
        "| --- | --- | ---: | ---: | ---: | "
        + ("---: | ---: | " if heap else "")
        + "---: | ---: | ---: |"
        + (" ---: | ---: |" if control else ""),
    ]
    for r in rows:
        ours, theirs = r["danling_peak_bytes"], r["torchmetrics_peak_bytes"]
        total = (r["danling_update_s"] + r["danling_compute_s"]) / (
            r["torchmetrics_update_s"] + r["torchmetrics_compute_s"]
        )
        lines.append(
            f"| {r['task']} | {r['metrics'].replace('+', ', ')} | {r['n']:.0e} | "
            f"{_mib(ours)} / {_mib(theirs)} | "
            f"{ours / r['scores_bytes']:.2f}x, {theirs / r['scores_bytes']:.2f}x | "
            + (_heap_cells(r) if heap else "")
            + f"{_seconds(r['danling_compute_s'])} / {_seconds(r['torchmetrics_compute_s'])} | "
            f"{r['danling_compute_s'] / r['torchmetrics_compute_s']:.2f}x | {total:.2f}x |"
            + (f" {_control(r, 'peak_bytes')} | {_control(r, 'compute_s')} |" if control else "")
        )
    return "\n".join(lines)


def _heap_cells(row: dict) -> str:
    ours, theirs, scores = row["danling_heap_bytes"], row["torchmetrics_heap_bytes"], row["scores_bytes"]
    return f"{_mib(ours)} / {_mib(theirs)} | {ours / scores:.2f}x, {theirs / scores:.2f}x | "


def plot(rows: list[dict], path: Path) -> None:
    """Memory (top) and compute time (bottom) against N, one column per task: a colour per metric
    set, solid for danling and dashed for torchmetrics, with one legend under the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    tasks = [task for task in ("multiclass", "binary", "multilabel") if any(r["task"] == task for r in rows)]
    sets = [names for names in DEFAULT_SETS if any(r["metrics"] == names for r in rows)]
    sets += sorted({r["metrics"] for r in rows} - set(sets))
    colours = {names: plt.get_cmap("tab10")(index % 10) for index, names in enumerate(sets)}
    libraries = (("danling", "-"), ("torchmetrics", "--"))
    figure, axes = plt.subplots(2, len(tasks), figsize=(4.2 * len(tasks), 7), squeeze=False, sharex=True)
    for column, task in enumerate(tasks):
        memory, seconds = axes[0][column], axes[1][column]
        for names in sets:
            chosen = sorted((r for r in rows if (r["task"], r["metrics"]) == (task, names)), key=lambda r: r["n"])
            sizes = [r["n"] for r in chosen]
            for library, line in libraries:
                style = {"color": colours[names], "linestyle": line, "marker": "o" if line == "-" else "x"}
                # A peak below the page size reads as 0: drawn at 1 byte on the log axis.
                peaks = [max(r[f"{library}_peak_bytes"], 1) / (1 << 20) for r in chosen]
                memory.loglog(sizes, peaks, **style)
                seconds.loglog(sizes, [r[f"{library}_compute_s"] for r in chosen], **style)
        memory.set(title=f"{task}: peak memory above start (MiB)")
        seconds.set(title=f"{task}: compute() (s)", xlabel="samples N")
        for axis in (memory, seconds):
            axis.grid(True, which="both", alpha=0.3)
    handles = [Line2D([], [], color=colours[names], linewidth=3, label=names.replace("+", ", ")) for names in sets]
    handles += [Line2D([], [], color="black", linestyle=line, label=library) for library, line in libraries]
    figure.legend(handles=handles, loc="lower center", ncol=min(len(handles), 8), fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
