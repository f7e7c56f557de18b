"""Run one benchmark against two source trees of danling, alternating, and compare the ratios.

A refactor is measured by its ratio against the hand-written loop before and after, each ratio
from the same run as its baseline. The two builds alternate round by round (before, after,
before, ...) so that a machine's drift hits both alike:

    python benchmarks/compare_builds.py --before /work/base --after . --rounds 5 -- \\
        benchmarks/bench_runner.py --only training --method lockstep --repeats 3

Each build runs its own copy of the benchmark script with its own `danling` first on
`PYTHONPATH`. Every row of the markdown tables the script prints (`| name | time | ratio | ...`)
is collected; the summary gives, per table and row, the median ratio of each build over the
rounds and after/before.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

_ROW = re.compile(r"^\|\s*([^|]+?)\s*\|\s*[\d.,]+\s*\|\s*([\d.]+)x?\s*\|")


def parse_ratios(text: str) -> dict[tuple[str, str], float]:
    """`{(table heading, row name): ratio}` from the markdown tables in a benchmark's output."""
    ratios, heading = {}, ""
    for line in text.splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
            continue
        match = _ROW.match(line)
        if match:
            ratios[(heading, match.group(1))] = float(match.group(2))
    return ratios


def run(build: Path, command: list[str]) -> str:
    """One run of `command` (a benchmark script and its arguments) against `build`'s danling."""
    env = {**os.environ, "PYTHONPATH": str(build), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run([sys.executable, *command], cwd=build, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{command} against {build} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="source tree of the build before the change")
    parser.add_argument("--after", type=Path, required=True, help="source tree of the build after the change")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each build, alternating")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- benchmark script and its arguments")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the benchmark after --, e.g. -- benchmarks/bench_runner.py --quick")
    builds = {"before": args.before.resolve(), "after": args.after.resolve()}
    seen: dict[str, dict[tuple[str, str], list[float]]] = {name: defaultdict(list) for name in builds}
    for round_index in range(args.rounds):
        order = list(builds) if round_index % 2 == 0 else list(reversed(builds))
        for name in order:
            for key, ratio in parse_ratios(run(builds[name], command)).items():
                seen[name][key].append(ratio)
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)
    print(f"### {' '.join(command)}: {args.rounds} alternating rounds per build\n")
    print("| table | row | before (median ratio) | after (median ratio) | after / before |")
    print("| --- | --- | ---: | ---: | ---: |")
    for key in seen["before"]:
        if key not in seen["after"]:
            continue
        before, after = statistics.median(seen["before"][key]), statistics.median(seen["after"][key])
        change = after / before if before else float("nan")
        print(f"| {key[0]} | {key[1]} | {before:.3f} | {after:.3f} | {change:.3f} |")


if __name__ == "__main__":
    main()
