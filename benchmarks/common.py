"""Timing helpers every benchmark shares: same process, alternating runs, medians, ratios."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping


def alternate(candidates: Mapping[str, Callable[[], object]], repeats: int = 5, warmup: int = 1) -> dict[str, float]:
    """Time each callable ``repeats`` times, interleaving them, and return the median seconds.

    Interleaving spreads machine noise (other processes, frequency scaling) evenly over every
    candidate, which matters more than the absolute figures on a shared 2-core machine.
    """
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def table(title: str, medians: Mapping[str, float], baseline: str) -> str:
    """Format medians as a Markdown table with each ratio against ``baseline``."""
    base = medians[baseline]
    rows = [f"### {title}", "", "| candidate | median (ms) | ratio vs " + baseline + " |", "| --- | ---: | ---: |"]
    rows += [f"| {name} | {value * 1e3:.2f} | {value / base:.3f} |" for name, value in medians.items()]
    return "\n".join(rows)
