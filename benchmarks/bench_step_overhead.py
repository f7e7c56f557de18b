"""The runner's per-step overhead in microseconds as the model's compute per step grows.

Question: is what the `TorchRunner` adds to a training step a fixed cost in microseconds (so its
share shrinks as the model grows), and how large is it against the noise of the measurement?

Workload: the MLP of `bench_runner.py` (64 features, two hidden layers of width H, 10 classes),
batch 32, AdamW, cross-entropy, one epoch of a train pass and a short validation pass, for
H = 64 ... 2048 (about 0.3 ms to 30 ms of compute per step on one thread). Candidates per width,
built afresh every round as in `bench_runner.py` (`training_rounds`, in a random order each
round, one untimed warm-up call each): the hand-written loop, a second copy of
it (the A/A control), the runner with the loop's own `DataLoader`s (the runner's own overhead)
and the runner with its own loaders (what a user gets).

Up to H = 512 the candidates run in lockstep, 8 batches each in turn (`common.Lockstep`; the
CPU's drift cancels, see `bench_runner.py`); wider models time whole calls in turn (see
`LOCKSTEP_UP_TO`), which the drift makes several times noisier; `--turn N` sets one method for all. Per width it
reports the hand-written loop's time per train step and, for the other candidates, the extra
time per train step in microseconds: (median of the per-round ratios to the hand-written loop -
1) x its time per step, with the interquartile range of those ratios turned into microseconds
the same way. The time per step includes the epoch's bookkeeping spread over its steps.
`--plot FILE` draws the extra time against the compute per step (the figure on the benchmarks
page is `docs/images/step-overhead.png`); `--json FILE` keeps the numbers.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/bench_step_overhead.py [--rounds 7] [--turn 8]
[--widths 64 256 1024] [--plot FILE.png] [--json FILE] [--quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_runner import HANDWRITTEN, WORKLOADS, training_rounds

# Train steps per call by width: each call takes about 0.2-0.6 s, long enough to time, short enough
# for several rounds of four candidates within a few minutes.
STEPS = {64: 512, 128: 384, 256: 256, 512: 96, 1024: 48, 2048: 16}
BATCH = 32
# Lockstep cancels the CPU's drift, but from H = 1024 on the four models' weights and AdamW states
# (13 MB each at 1024) evict each other at every turn, which no loop running alone suffers (the A/A
# control and the runners then read 0.7-0.95x): those widths time whole calls in turn.
LOCKSTEP_UP_TO = 512


def workload(width: int, steps: int) -> str:
    name = f"MLP 64-{width}-{width}-10, batch {BATCH}"
    WORKLOADS[name] = (64, width, 10, BATCH, steps * BATCH, 4 * BATCH, 1)
    return name


def measure(width: int, rounds: int, root: str, steps: int, turn: int) -> dict:
    name = workload(width, steps)
    summary = training_rounds(root, name, ablate=False, rounds=rounds, turn=turn)
    base = summary[HANDWRITTEN[0]][0] / steps * 1e6  # the hand-written loop's time per train step (us)
    row: dict = {"width": width, "steps": steps, "rounds": rounds, "turn": turn, "step_ms": base / 1e3, "extra_us": {}}
    for candidate, (_, q1, median, q3) in summary.items():
        if candidate != HANDWRITTEN[0]:  # the paired ratios, turned into microseconds of a hand-written step
            row["extra_us"][candidate] = {
                "median": (median - 1) * base,
                "q1": (q1 - 1) * base,
                "q3": (q3 - 1) * base,
                "ratio": median,
            }
    return row


def table(rows: list[dict]) -> str:
    names = list(rows[0]["extra_us"])
    lines = [
        "| width H | method | hand-written step (ms) | "
        + " | ".join(f"{name}: extra us per step (IQR)" for name in names)
        + " |",
        "| ---: | --- | ---: | " + " | ".join("---:" for _ in names) + " |",
    ]
    for row in rows:
        cells = []
        for name in names:
            extra = row["extra_us"][name]
            cells.append(f"{extra['median']:+.0f} ({extra['q1']:+.0f} to {extra['q3']:+.0f}), {extra['ratio']:.3f}x")
        method = f"{row['turn']} batches per turn" if row["turn"] else "whole calls in turn"
        lines.append(f"| {row['width']} | {method} | {row['step_ms']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (extra, share) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, marker in zip(rows[0]["extra_us"], ("o", "s", "^")):
        for lockstep in (True, False):
            chosen = [row for row in rows if bool(row["turn"]) == lockstep]
            if not chosen:
                continue
            compute = [row["step_ms"] for row in chosen]
            points = [row["extra_us"][name] for row in chosen]
            medians = [p["median"] for p in points]
            spread = [
                [max(p["median"] - p["q1"], 0.0) for p in points],
                [max(p["q3"] - p["median"], 0.0) for p in points],
            ]
            style = {"marker": marker, "capsize": 3, "color": f"C{list(rows[0]['extra_us']).index(name)}"}
            if not lockstep:
                style.update(markerfacecolor="none", linestyle=":")
            label = name if lockstep else f"{name} (whole calls in turn)"
            extra.errorbar(compute, medians, yerr=spread, label=label, **style)
            share.errorbar(compute, [(p["ratio"] - 1) * 100 for p in points], label=label, **style)
    extra.set_xscale("log")
    extra.set_yscale("symlog", linthresh=100)  # tens of microseconds and the noise of milliseconds, both legible
    share.set_xscale("log")
    extra.axhline(0, color="black", linewidth=0.6)
    share.axhline(0, color="black", linewidth=0.6)
    extra.set(xlabel="hand-written loop: compute per train step (ms)", ylabel="extra time per train step (us)")
    extra.set_title("Per-step overhead (median and IQR of the rounds)")
    share.set(xlabel="hand-written loop: compute per train step (ms)", ylabel="extra time (% of the step)")
    share.set_title("The same as a share of the step")
    for axis in (extra, share):
        axis.grid(True, which="both", alpha=0.3)
    share.legend(fontsize=7, loc="upper left")  # the empty corner of the two panels
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--turn", type=int, help="batches per turn, 0: whole calls in turn (default: 8 up to H = 512, 0 above)"
    )
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048])
    parser.add_argument("--quick", action="store_true", help="2 rounds of a quarter of the steps (a smoke run)")
    parser.add_argument("--plot", type=Path, help="draw the overhead against the compute per step here (PNG)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    bad = [width for width in args.widths if width not in STEPS]
    if bad:
        parser.error(f"--widths {bad}: choose from {sorted(STEPS)}")
    with contextlib.suppress(AttributeError, OSError):  # one core for the whole run: migrations add noise
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    rounds = 2 if args.quick else args.rounds
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for width in args.widths:
            steps = max(8, STEPS[width] // 4) if args.quick else STEPS[width]
            turn = args.turn if args.turn is not None else (8 if width <= LOCKSTEP_UP_TO else 0)
            rows.append(measure(width, rounds, root, steps, turn))
            print(f"H={width}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    load = os.getloadavg()[0]
    print(f"### Extra time per train step, {rounds} rounds per width\n\n{table(rows)}\n")
    print(f"1-minute load average at the end: {load:.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
