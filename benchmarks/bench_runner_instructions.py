"""Instructions the `TorchRunner` executes over the hand-written loop, counted by valgrind.

Wall time on this machine drifts by tens of percent within seconds (see `bench_runner.py`), so
this script counts work instead: each candidate runs under `valgrind --tool=callgrind` twice,
once with `--calls 0` and once with `--calls N` timed `train()` calls (the workloads of
`bench_runner.py`: 3 epochs of the small MLP at batch 32, or with ``--workload wide`` one epoch
of the wide MLP at batch 128), and the difference of the two totals divided by N is what one
call executes, startup and import excluded. The counts are exact
and repeatable. They are not time: code that misses the caches costs more per instruction, and
that is where the paired wall-time figures of `bench_runner.py` still differ from these.

Usage: ``python benchmarks/bench_runner_instructions.py [--calls 2] [--jobs 2] [--workload small|wide|both]``
(about 15 minutes for the small workload on 2 cores; the wide one is dominated by matrix kernels,
which callgrind runs so slowly that a single epoch took over 25 minutes; needs ``valgrind``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
CANDIDATES = ("hand-written loop", "runner", "runner, torch loaders")
WORKLOADS = {"small": "small MLP, batch 32", "wide": "wide MLP, batch 128"}  # as in bench_runner.WORKLOADS
WORKLOAD_EPOCHS = {"small MLP, batch 32": 3, "wide MLP, batch 128": 1}


def child(candidate: str, calls: int, workload: str) -> None:
    """Build `candidate`, run one untimed call (warm-up), then `calls` more."""
    import torch

    sys.path.insert(0, HERE)
    from bench_runner import BenchRunner, handwritten_loop, quiet, run_epochs, runner_config

    torch.set_num_threads(1)
    if candidate == "hand-written loop":
        loop = handwritten_loop(workload)

        def call() -> None:
            loop(iter)
    else:
        root = tempfile.mkdtemp(prefix="bench-instructions-")
        config = runner_config(root, workload, torch_loaders=candidate.endswith("torch loaders"))
        runner = quiet(BenchRunner(config))

        def call() -> None:
            run_epochs(runner)

    for _ in range(calls + 1):
        call()


def count(candidate: str, calls: int, workload: str) -> int:
    """Total instructions of a child process running `candidate` with `calls` timed calls."""
    with tempfile.TemporaryDirectory() as directory:
        command = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={os.path.join(directory, 'out')}",
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            candidate,
            str(calls),
            workload,
        ]
        # TMPDIR: the child's workspace (`mkdtemp`) goes with this directory when it is removed.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": directory}
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    match = re.search(r"Collected\s*:\s*([\d,]+)", done.stderr)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"valgrind run of {candidate!r} failed:\n{done.stderr[-2000:]}")
    return int(match.group(1).replace(",", ""))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2, help="timed train() calls per candidate")
    parser.add_argument("--jobs", type=int, default=2, help="valgrind runs at once")
    parser.add_argument("--workload", choices=(*WORKLOADS, "both"), default="small")
    parser.add_argument("--child", nargs=3, metavar=("CANDIDATE", "CALLS", "WORKLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2])
        return
    if shutil.which("valgrind") is None:
        print("skipped: valgrind is not installed (this benchmark counts instructions with callgrind)")
        return
    for key in WORKLOADS if args.workload == "both" else (args.workload,):
        workload = WORKLOADS[key]
        runs = [(candidate, calls, workload) for candidate in CANDIDATES for calls in (0, args.calls)]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            totals = dict(zip(runs, pool.map(lambda run: count(*run), runs)))
        per_call = {c: (totals[c, args.calls, workload] - totals[c, 0, workload]) / args.calls for c in CANDIDATES}
        base = per_call[CANDIDATES[0]]
        epochs = WORKLOAD_EPOCHS[workload]
        print(f"### Instructions per train() call, {workload} ({epochs} epoch(s); valgrind, {args.calls} calls)\n")
        print("| candidate | instructions per call (millions) | ratio |")
        print("| --- | ---: | ---: |")
        for candidate, value in per_call.items():
            print(f"| {candidate} | {value / 1e6:.1f} | {value / base:.3f} |")
        print()


if __name__ == "__main__":
    main()
