"""TFLOP/s and MFU in the training step logs: counted once, read back from CSV and TensorBoard, free when off."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import pytest
import torch

from danling.runners import RunnerConfig
from danling.runners.services.telemetry import PEAK_TFLOPS, FlopsTelemetry, build_flops_telemetry, peak_flops
from tests.runners._torch_toy import TinyRunner

# Forward and backward FLOPs of one batch of the toy MLP (4 -> 8 -> 1): forward 2*b*(4*8 + 8*1);
# backward: the weight gradients of both layers (as much again) and the input gradient of the
# second layer only (the data needs no gradient).
BATCH = 4


def toy_flops(batch: int) -> float:
    forward = 2 * batch * (4 * 8 + 8 * 1)
    return forward + forward + 2 * batch * 8 * 1


def config(tmp_path: Path, **overrides) -> RunnerConfig:
    values = {
        "epochs": 2,
        "seed": 0,
        "log_interval": 2,
        "workspace_root": str(tmp_path),
        "tensorboard": True,
        "optim.type": "sgd",
        "optim.lr": 0.01,
        "dataloader.batch_size": BATCH,
        "checkpoint.load_only": True,
    }
    values.update(overrides)
    return RunnerConfig(**values)


def csv_rows(runner: TinyRunner) -> list[dict[str, str]]:
    with open(runner.workspace.path / "metrics.csv", newline="") as file:
        return [row for row in csv.DictReader(file) if row.get("throughput/steps_per_second")]


def scalars(runner: TinyRunner) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(runner.workspace.path / "tensorboard"))
    accumulator.Reload()
    return {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}


def test_flops_are_counted_once_and_the_logs_hold_flops_times_steps_per_second(tmp_path, monkeypatch):
    import torch.utils.flop_counter as flop_counter

    entered = []
    original = flop_counter.FlopCounterMode.__enter__
    monkeypatch.setattr(flop_counter.FlopCounterMode, "__enter__", lambda self: entered.append(1) or original(self))
    runner = TinyRunner(config(tmp_path, accum_steps=2, **{"telemetry.peak_tflops": 1e-6}))
    runner.train()
    # accumulation: one optimizer step is two micro-batches, both counted
    assert runner.telemetry.flops_per_step == 2 * toy_flops(BATCH)
    assert runner.telemetry.counts == 1 and len(entered) == 1
    assert not runner.model._forward_pre_hooks  # the counting hook is gone after the first step
    runner.close()
    rows = csv_rows(runner)
    # The first step log comes while the first step is still being counted: it has no FLOP rate yet.
    assert len(rows) > 2 and rows[0]["tflops"] == rows[0]["mfu"] == ""
    for row in rows[1:]:
        tflops = float(row["throughput/steps_per_second"]) * runner.telemetry.flops_per_step / 1e12
        assert float(row["tflops"]) == pytest.approx(tflops, rel=1e-9)
        assert float(row["mfu"]) == pytest.approx(tflops / 1e-6, rel=1e-9)
    series = scalars(runner)
    steps = series["throughput/steps_per_second"]
    assert set(series["tflops"]) == set(series["mfu"]) == {int(row["step"]) for row in rows[1:]}
    for step in series["tflops"]:
        tflops = steps[step] * runner.telemetry.flops_per_step / 1e12
        assert series["tflops"][step] == pytest.approx(tflops, rel=1e-5)
        assert series["mfu"][step] == pytest.approx(tflops / 1e-6, rel=1e-5)


def test_given_flops_show_tflops_without_counting_and_the_log_says_once_why_no_mfu(tmp_path, caplog):
    runner = TinyRunner(config(tmp_path, **{"telemetry.flops_per_step": 5e6}))
    with caplog.at_level(logging.INFO, logger="danling"):
        runner.train()
    runner.close()
    assert runner.telemetry.counts == 0 and runner.telemetry.flops_per_step == 5e6
    said = [r.getMessage() for r in caplog.records if "MFU is not shown" in r.getMessage()]
    assert said == ["MFU is not shown: no peak FLOP/s is known for cpu in fp32; set telemetry.peak_tflops to show it"]
    rows = csv_rows(runner)
    assert rows and all(not row.get("mfu") for row in rows)
    for row in rows:
        assert float(row["tflops"]) == pytest.approx(float(row["throughput/steps_per_second"]) * 5e6 / 1e12)


def test_unknown_peak_or_telemetry_off_cost_nothing(tmp_path, caplog):
    runner = TinyRunner(config(tmp_path / "unknown"))
    with caplog.at_level(logging.INFO, logger="danling"):
        runner.train()
    runner.close()
    assert runner.telemetry.counts == 0 and runner.telemetry.flops_per_step is None
    assert not runner.model._forward_pre_hooks
    assert sum("MFU is not shown" in r.getMessage() for r in caplog.records) == 1
    assert not {"tflops", "mfu"} & set(csv_rows(runner)[0])
    off = TinyRunner(config(tmp_path / "off", **{"telemetry.enabled": False, "telemetry.peak_tflops": 1.0}))
    off.train()
    off.close()
    assert off.telemetry is None and off.throughput.telemetry is None
    assert not {"tflops", "mfu"} & set(csv_rows(off)[0])


def test_a_compiled_model_is_not_counted_and_the_reason_is_logged(caplog):
    telemetry = build_flops_telemetry(
        RunnerConfig(**{"telemetry.peak_tflops": 100.0}).telemetry,
        device=torch.device("cpu"),
        precision="bf16",
        compiled=True,
        model=lambda: torch.nn.Linear(2, 2),
        progress=lambda: 0,
        logger=logging.getLogger("danling"),
    )
    from danling.runners.loop.events import PassContext

    with caplog.at_level(logging.INFO, logger="danling"):
        telemetry._pass_start(PassContext(runner=None, split="train", mode="train"))
    assert telemetry.peak == 100e12 and telemetry.counts == 0
    assert "compile.enable is on" in caplog.text and "telemetry.flops_per_step" in caplog.text
    assert FlopsTelemetry(flops_per_step=1e12, peak=1e15).values(2.0) == {"tflops": 2.0, "mfu": 0.002}


def test_the_peak_table_knows_the_gpus_by_dtype():
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp8") == pytest.approx(
        2 * peak_flops("NVIDIA H100 80GB HBM3", "bf16"), rel=1e-3
    )
    assert peak_flops("NVIDIA H200", "bf16") == peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756.5e12
    assert peak_flops("NVIDIA A100-SXM4-40GB", "bf16") == 312e12 and peak_flops("NVIDIA A100", "fp8") is None
    assert peak_flops("NVIDIA L4", "bf16") == 121e12 and peak_flops("NVIDIA L40S", "bf16") == 362e12
    names = [name for name, _ in PEAK_TFLOPS]
    for index, name in enumerate(names):  # a name contained in a later one would shadow it
        assert not any(name in later for later in names[index + 1 :]), name
