"""Python function calls one runner `train()` call makes, counted exactly, and where two source trees differ.

Wall-clock ratios on a shared 2-core machine cannot resolve a change of one or two percent, and
valgrind (`bench_runner_instructions.py`) takes a quarter of an hour. For the runner's small-model
workload most of its own time is Python calls, so counting them is a cheap, exact proxy: each
candidate of `bench_runner.py` (``runner`` with its own loaders, or ``runner, torch loaders``) is
built, warmed up with one `train()` call of 3 epochs, and the next call runs under `cProfile`.
The counts repeat to the call between runs.

With ``--before DIR`` the same count runs against another checkout (its `danling/` and
`benchmarks/`) in a fresh process, and the functions whose call counts changed most are listed:
that is how the 1.8% of the reshaping's own-loader row was traced to a distributed-state query
after every batch.

Usage: ``python benchmarks/bench_runner_calls.py [--torch-loaders] [--before DIR] [--top 15]``
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import re
import subprocess
import sys
import tempfile
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))


def count_calls(torch_loaders: bool) -> dict[str, int]:
    """Calls per function (`file:function`) of one `train()` call after a warm-up call, in this process."""
    import torch

    sys.path.insert(0, HERE)
    from bench_runner import BenchRunner, quiet, run_epochs, runner_config

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-calls-") as root:
        runner = quiet(BenchRunner(runner_config(root, "small MLP, batch 32", torch_loaders=torch_loaders)))
        run_epochs(runner)  # warm-up: first-call caches and lazy imports are not the steady state
        profile = cProfile.Profile()
        profile.enable()
        run_epochs(runner)
        profile.disable()
        runner.close()
    counts: Counter[str] = Counter()
    # Line numbers and directories differ between trees; the file's name and the function's do not.
    for (filename, _line, function), (_primitive, calls, *_rest) in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        counts[f"{os.path.basename(filename)}:{re.sub(' at 0x[0-9a-f]+', '', function)}"] += calls
    return dict(counts)


def count_in(tree: str, torch_loaders: bool) -> dict[str, int]:
    """`count_calls` of another checkout, in a fresh process that imports danling from `tree`."""
    script = os.path.join(os.path.abspath(tree), "benchmarks", "bench_runner_calls.py")
    if not os.path.exists(script):  # an older tree without this script: run ours against its code
        script = os.path.abspath(__file__)
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "OMP_NUM_THREADS": "1", "BENCH_CALLS_TREE": tree}
    command = [sys.executable, os.path.abspath(__file__), "--child", *(["--torch-loaders"] if torch_loaders else [])]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise SystemExit(f"counting in {tree} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch-loaders", action="store_true", help="the 'runner, torch loaders' candidate")
    parser.add_argument("--before", metavar="DIR", help="another checkout to compare with (e.g. a git worktree)")
    parser.add_argument("--top", type=int, default=15, help="how many changed functions to list")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        if os.environ.get("BENCH_CALLS_TREE"):  # import the other tree's bench_runner, not ours
            sys.path.insert(0, os.path.join(os.environ["BENCH_CALLS_TREE"], "benchmarks"))
        print(json.dumps(count_calls(args.torch_loaders)))
        return
    after = count_in(os.path.dirname(HERE), args.torch_loaders)
    candidate = "runner, torch loaders" if args.torch_loaders else "runner"
    print(f"{candidate}: {sum(after.values()):,} Python calls per train() call (3 epochs, small MLP, batch 32)")
    if not args.before:
        return
    before = count_in(args.before, args.torch_loaders)
    total_before, total_after = sum(before.values()), sum(after.values())
    change = total_after - total_before
    print(f"before ({args.before}): {total_before:,}; change {change:+,} ({total_after / total_before - 1:+.2%})")
    changed = sorted(set(before) | set(after), key=lambda name: -abs(after.get(name, 0) - before.get(name, 0)))
    for name in changed[: args.top]:
        was, now = before.get(name, 0), after.get(name, 0)
        print(f"  {now - was:+7,}  {name}  ({was:,} -> {now:,})")


if __name__ == "__main__":
    main()
