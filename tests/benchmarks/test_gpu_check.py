"""The GPU device check runs start to finish on a CPU: every check passes or says why it needs a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_check import LIMITS, markdown  # noqa: E402

from danling.runners.services.telemetry import peak_flops  # noqa: E402


def test_the_quick_check_passes_on_cpu_and_names_what_waits_for_a_gpu(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--out", str(tmp_path), "--quick"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env, cwd=REPO)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    checks = report["checks"]
    assert list(checks) == list(LIMITS) and report["device"] == "cpu" and report["passed"]
    assert checks["sync"] == {
        "status": "skip",
        "reason": checks["sync"]["reason"],
        "seconds": checks["sync"]["seconds"],
    }
    assert checks["sync"]["reason"].startswith("needs CUDA")
    for name in ("precision", "resume", "dcp", "fsdp2", "compile", "speed-small", "metrics"):
        assert checks[name]["status"] == "pass", (name, checks[name])
    assert checks["resume"]["values"]["bit_identical"] is True
    assert 0 < checks["resume"]["values"]["resumed_from"] < checks["resume"]["values"]["killed_at"]
    assert checks["metrics"]["values"]["max_difference"] <= 1e-5
    try:
        import transformers  # noqa: F401
    except ImportError:
        assert checks["gpt2"]["status"] == "skip" and "transformers" in checks["gpt2"]["reason"]
    else:
        assert checks["gpt2"]["status"] == "pass", checks["gpt2"]
        values = checks["gpt2"]["values"]
        assert values["loss_after"] < values["loss_before"] and values["flops_per_step"] > 0
        # the runner's own telemetry: it counted the step as the benchmark did, and logged tflops and mfu
        assert values["runner_counted_flops"] == pytest.approx(values["flops_per_step"], rel=0.01)
        assert values["runner_logged_tflops"] > 0 and values["runner_logged_mfu"] > 0
    # fp8 waits for a GPU of compute capability >= 8.9; on the CPU the comparison runs with float8 emulated
    assert checks["fp8"]["status"] == "skip", checks["fp8"]
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        assert "needs torchao" in checks["fp8"]["reason"]
    else:
        assert checks["fp8"]["reason"].startswith("precision: fp8 needs a CUDA device of compute capability >= 8.9")
        assert "float8 emulated on the CPU instead: validation loss bf16" in checks["fp8"]["reason"]
    table = (tmp_path / "gpu_check.md").read_text()
    assert table == markdown(report) and "| sync | skip |" in table
    assert "===== resume: pass" in (tmp_path / "gpu_check.log").read_text()


def test_a_spent_budget_fails_the_run_and_names_every_check_it_left_out(tmp_path):
    command = [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--out", str(tmp_path), "--budget", "5"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert done.returncode == 1 and not report["passed"] and list(report["checks"]) == list(LIMITS)
    for verdict in report["checks"].values():
        assert verdict == {"status": "fail", "reason": "not run: the 5 s budget was spent"}


def test_a_check_that_raises_is_a_failure_with_its_reason_and_traceback(tmp_path):
    # A working folder that is a file: the run cannot create its workspace, and the check raises.
    result, blocked = tmp_path / "verdict.json", tmp_path / "a-file"
    blocked.write_text("")
    command = [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--child", "dcp", "--device", "cpu"]
    command += ["--workdir", str(blocked), "--result", str(result), "--quick"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    verdict = json.loads(result.read_text())
    assert done.returncode == 0 and verdict["status"] == "fail" and verdict["reason"]
    assert "Traceback" in done.stderr and verdict["seconds"] >= 0


def test_unknown_checks_and_a_missing_gpu_are_refused_before_any_work(tmp_path):
    script = str(REPO / "benchmarks" / "gpu_check.py")
    done = subprocess.run(
        [sys.executable, script, "--out", str(tmp_path), "--only", "speed"], capture_output=True, text=True
    )
    assert done.returncode == 1 and "unknown check(s) ['speed']" in done.stderr
    if not __import__("torch").cuda.is_available():
        done = subprocess.run(
            [sys.executable, script, "--out", str(tmp_path), "--device", "cuda"], capture_output=True, text=True
        )
        assert done.returncode == 1 and "torch sees no CUDA device" in done.stderr
    assert not (tmp_path / "gpu_check.json").exists()


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 PCIe", 756.5e12),
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H200", 989.4e12),
        ("Tesla T4", None),
    ],
)
def test_peak_flops_come_from_the_most_specific_device_name(name, peak):
    # the benchmark reads danling's one table (`PEAK_TFLOPS`), by dtype
    assert peak_flops(name, "bf16") == peak
