"""The GPU device check: what only a GPU can show, in one command of a few minutes.

    python benchmarks/gpu_check.py --out DIR [--quick] [--device cpu|cuda] [--only NAME ...]

Runs every check of `benchmarks/gpu_workloads.py` (correctness in bf16/fp16, SIGKILL and exact
resume with the CUDA RNG, DCP of CUDA tensors, FSDP2 on a one-GPU mesh, `torch.compile` through the
runner, no host sync between step logs, and the runner's per-step time, peak memory, tokens/s and
MFU against a hand-written CUDA loop, for a small MLP and a GPT-2-small-sized model), each in a
process of its own with its own time limit, and writes `DIR/gpu_check.json`, `DIR/gpu_check.md`
(the table) and `DIR/gpu_check.log` (every check's output). A check that the machine cannot run
(no CUDA, no `transformers`) is reported as skipped with the reason; the exit status is 1 when a
check failed or ran out of time, else 0.

On a machine without CUDA it runs what a CPU can (`--quick` shrinks every size; the test suite
runs it so), so a GPU's minutes are spent only on what needs the GPU. `make gpu-check` installs the
wheels `make gpu-wheels` fetched and runs this script; see docs/gpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# Seconds each check may take on a GPU (the CPU's quick sizes fit in the same limits).
LIMITS = {
    "environment": 60,
    "sync": 90,
    "precision": 90,
    "resume": 150,
    "dcp": 60,
    "fsdp2": 60,
    "speed-small": 120,
    "gpt2": 180,
    "fp8": 120,
    "metrics": 60,
    "compile": 150,
}


def run_child(name: str, device: str, quick: bool, workdir: Path, result: Path) -> None:
    """Run one check in this process and write its verdict to `result`."""
    sys.path.insert(0, str(HERE))
    import torch
    from gpu_workloads import CHECKS, Context, Skip

    ctx = Context(torch.device(device), quick=quick, workdir=workdir)
    started = time.perf_counter()
    try:
        verdict: dict[str, Any] = {"status": "pass", "values": CHECKS[name](ctx)}
    except Skip as skip:
        verdict = {"status": "skip", "reason": str(skip)}
    except Exception as err:  # the report names any failure; the traceback goes to the log
        traceback.print_exc()
        verdict = {"status": "fail", "reason": f"{type(err).__name__}: {err}"[:600]}
    verdict["seconds"] = round(time.perf_counter() - started, 1)
    result.write_text(json.dumps(verdict, default=str))


def pick_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: --device cuda given, but torch sees no CUDA device")
    return requested


def run_checks(
    out: Path, *, device: str = "auto", quick: bool = False, only: list[str] | None = None, budget: float = 450.0
) -> dict[str, Any]:
    """Run the checks (each in a subprocess with its limit, all within `budget` seconds) and write the report."""
    unknown = sorted(set(only or ()) - set(LIMITS))
    if unknown:
        raise SystemExit(f"gpu_check: unknown check(s) {unknown}; known: {list(LIMITS)}")
    device = pick_device(device)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget
    report: dict[str, Any] = {"device": device, "quick": quick, "checks": {}}
    log_lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="danling-gpu-check-") as scratch:
        for name, limit in LIMITS.items():
            if only and name not in only:
                continue
            left = deadline - time.monotonic()
            if left < 10:
                report["checks"][name] = {"status": "fail", "reason": f"not run: the {budget:.0f} s budget was spent"}
                continue
            workdir, result = Path(scratch, name), Path(scratch, f"{name}.json")
            workdir.mkdir()
            command = [sys.executable, __file__, "--child", name, "--device", device, "--workdir", str(workdir)]
            command += ["--result", str(result)] + (["--quick"] if quick else [])
            timeout = min(limit, left)
            started = time.perf_counter()
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
                output, code = done.stdout + done.stderr, done.returncode
            except subprocess.TimeoutExpired as expired:
                output = (expired.stdout or b"").decode(errors="replace") + (expired.stderr or b"").decode(
                    errors="replace"
                )
                code = None
            if code is None:
                verdict = {"status": "fail", "reason": f"timed out after {timeout:.0f} s"}
            elif result.exists():
                verdict = json.loads(result.read_text())
            else:
                last = output.strip().splitlines()[-1:] or ["no output"]
                verdict = {"status": "fail", "reason": f"exited {code} without a verdict: {last[0][:300]}"}
            verdict.setdefault("seconds", round(time.perf_counter() - started, 1))
            report["checks"][name] = verdict
            log_lines += [f"===== {name}: {verdict['status']} ({verdict['seconds']} s)", output.rstrip()]
            print(f"{name}: {verdict['status']} {verdict.get('reason', '')}".rstrip(), flush=True)
    report["passed"] = all(v["status"] != "fail" for v in report["checks"].values())
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "gpu_check.md").write_text(markdown(report))
    (out / "gpu_check.log").write_text("\n".join(log_lines) + "\n")
    return report


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown(report: dict[str, Any]) -> str:
    """The report as one Markdown table: check, verdict, seconds, and what it measured."""
    env = report["checks"].get("environment", {}).get("values", {})
    title = env.get("name") or report["device"]
    lines = [
        f"### GPU check on {title} (torch {env.get('torch', '?')}, CUDA {env.get('cuda', '-')})",
        "",
        "| check | verdict | seconds | measured |",
        "| --- | --- | ---: | --- |",
    ]
    for name, verdict in report["checks"].items():
        values = verdict.get("values") or {}
        measured = "; ".join(f"{k}: {_fmt(v)}" for k, v in values.items()) or verdict.get("reason", "")
        lines.append(f"| {name} | {verdict['status']} | {verdict.get('seconds', '')} | {measured.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for gpu_check.json, gpu_check.md and gpu_check.log")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="small sizes (what the test suite runs on a CPU)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help=f"run only these of {list(LIMITS)}")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for all checks together")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_child(args.child, args.device, args.quick, args.workdir, args.result)
        return 0
    if args.out is None:
        parser.error("--out DIR is required")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    report = run_checks(args.out, device=args.device, quick=args.quick, only=args.only, budget=args.budget)
    print((args.out / "gpu_check.md").read_text())
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
