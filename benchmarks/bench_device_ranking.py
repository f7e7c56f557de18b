"""Exact AUROC + AUPRC of device data: the curves of all columns at once against `tensor_ranking`.

For each task and N, both paths rank the same kept data (chunks of 50,000 rows, float32 scores,
int8 targets with 5% ignored) on the device; the table gives each path's time (median of
`--repeats`, after a warm-up) and its peak device memory above the kept data, as a multiple of
the float32 scores, and checks that the values agree (AUROC exactly, AUPRC to 1e-9).

    python benchmarks/bench_device_ranking.py [--sizes 1e6 1e7] [--repeats 3] [--device cuda]

On a machine without CUDA it runs on the CPU (peaks are not measured there); the CPU itself uses
the host ranking (`danling.metrics.functional._ranking.ranking`), not this path.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from danling.metrics.functional import _ranking
from danling.metrics.functional._common import auprc_from_curves, auroc_from_curves
from danling.metrics.state import MetricState, MetricTask

COLUMNS = 10
ROWS = 50_000


def sample(kind: str, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` samples of `kind` (10 columns): float32 scores, int64 targets with 5% of rows ignored."""
    shape = (n,) if kind == "binary" else (n, COLUMNS)
    scores = torch.randn(shape, generator=generator)
    if kind == "multiclass":
        target = torch.randint(0, COLUMNS, (n,), generator=generator)
    else:
        target = torch.randint(0, 2, shape, generator=generator)
    target[torch.rand(n, generator=generator) < 0.05] = -100
    return scores, target


def data(kind: str, n: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Kept data as a container keeps it: chunks of `ROWS` rows on `device`, int8 targets."""
    scores, target = sample(kind, n, torch.Generator().manual_seed(0))
    return [(s.to(device), t.to(torch.int8).to(device)) for s, t in zip(scores.split(ROWS), target.split(ROWS))]


def task_of(kind: str) -> MetricTask:
    size = {"binary": {}, "multiclass": {"num_classes": COLUMNS}, "multilabel": {"num_labels": COLUMNS}}[kind]
    return MetricTask(kind, ignore_index=-100, **size)


def curves_path(kind: str, chunks: list) -> tuple[torch.Tensor, torch.Tensor]:
    curves = MetricState(task_of(kind), chunks=chunks).curves()  # joins the chunks, as the curves need
    return auroc_from_curves(curves), auprc_from_curves(curves)


def ranking_path(kind: str, chunks: list) -> tuple[torch.Tensor, torch.Tensor]:
    ranking = _ranking.tensor_ranking(kind, chunks, 1 if kind == "binary" else COLUMNS, -100, False)
    return ranking.auroc, ranking.auprc


def measure(path, kind: str, chunks: list, device: torch.device, repeats: int) -> tuple[float, float | None, tuple]:
    path(kind, chunks)  # warm-up: kernels loaded, allocator primed
    times, peak = [], None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        began = time.perf_counter()
        values = path(kind, chunks)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - began)
        if device.type == "cuda":
            peak = (torch.cuda.max_memory_allocated(device) - before) / sum(s.numel() * 4 for s, _ in chunks)
        values = tuple(v.cpu() for v in values)
    return statistics.median(times), peak, values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}, {args.repeats} repeats (median)")
    print("| task | N | curves ms | ranking ms | time ratio | curves peak / scores | ranking peak / scores |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in (int(size) for size in args.sizes):
        for kind in ("binary", "multiclass", "multilabel"):
            chunks = data(kind, n, device)
            curves_s, curves_peak, (auroc, auprc) = measure(curves_path, kind, chunks, device, args.repeats)
            ranking_s, ranking_peak, (r_auroc, r_auprc) = measure(ranking_path, kind, chunks, device, args.repeats)
            if not torch.equal(auroc.nan_to_num(-1), r_auroc.nan_to_num(-1)) or not torch.allclose(
                auprc, r_auprc, rtol=0, atol=1e-9, equal_nan=True
            ):
                raise SystemExit(f"{kind} N={n}: the paths disagree: {auroc} {r_auroc} / {auprc} {r_auprc}")
            peaks = [f"{p:.2f}x" if p is not None else "-" for p in (curves_peak, ranking_peak)]
            print(
                f"| {kind} | {n:,} | {curves_s * 1e3:.2f} | {ranking_s * 1e3:.2f} | "
                f"{ranking_s / curves_s:.2f} | {peaks[0]} | {peaks[1]} |"
            )
            del chunks
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
