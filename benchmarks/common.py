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


def paired_ratios(
    candidates: Mapping[str, Callable[[], object]], baseline: str, repeats: int = 31, warmup: int = 1
) -> dict[str, tuple[float, float, float, float]]:
    """Per-round ratios against ``baseline``: ``{name: (median seconds, q1, median, q3 of the ratio)}``.

    Each round runs every candidate once, in an order rotated from round to round, and divides
    each time by the baseline's time in the same round. On a virtual machine whose host steals a
    large, drifting share of the CPU, neighbouring runs see similar conditions, so the median of
    these paired ratios is far steadier than a ratio of medians taken over the whole session.
    """
    names = list(candidates)
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        timings = {}
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            candidates[name]()
            timings[name] = time.perf_counter() - start
        for name, value in timings.items():
            seconds[name].append(value)
            ratios[name].append(value / timings[baseline])
    out = {}
    for name in names:
        q1, median, q3 = statistics.quantiles(ratios[name], n=4) if repeats > 1 else [ratios[name][0]] * 3
        out[name] = (statistics.median(seconds[name]), q1, median, q3)
    return out


def ratio_table(title: str, results: Mapping[str, tuple[float, float, float, float]], baseline: str) -> str:
    """Format `paired_ratios` output as a Markdown table."""
    rows = [
        f"### {title}",
        "",
        f"| candidate | median (ms) | ratio vs {baseline}: median of rounds | interquartile range |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, (seconds, q1, median, q3) in results.items():
        rows.append(f"| {name} | {seconds * 1e3:.2f} | {median:.3f} | {q1:.3f} - {q3:.3f} |")
    return "\n".join(rows)
