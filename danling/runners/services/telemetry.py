"""TFLOP/s and model FLOPs utilisation (MFU) of the training steps.

[`FlopsTelemetry`][danling.runners.services.telemetry.FlopsTelemetry] (`runner.telemetry`) knows
the FLOPs of one optimizer step, either from `telemetry.flops_per_step` or counted once with
`torch.utils.flop_counter.FlopCounterMode` over the first training step, and the device's peak
FLOP/s, either from `telemetry.peak_tflops` or from the table `PEAK_TFLOPS` of this module.
[`Throughput`][danling.runners.services.observability.Throughput] asks it for `tflops` and `mfu`
at each training step log, from the steps per second it measured: the values cost no
host synchronisation, and nothing at all when the telemetry is off or has nothing to show.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..loop.events import EventBus, Events, PassContext

__all__ = ["PEAK_TFLOPS", "FlopsTelemetry", "build_flops_telemetry", "peak_dtype", "peak_flops"]

# Dense tensor-core peaks in TFLOP/s (no sparsity) by device name and dtype, from the vendors' data
# sheets. The first name contained in `torch.cuda.get_device_name()` wins, so the more specific
# names come first ("H100 PCIe" before "H100"). "tf32" is the peak of fp32 matrix products when
# `torch.backends.cuda.matmul.allow_tf32` (or a float32 matmul precision other than "highest") is on.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("GH200", {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 67.0}),
    ("H200", {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 67.0}),
    ("H100 PCIe", {"fp8": 1513.0, "bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    ("H100 NVL", {"fp8": 1671.0, "bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("H100", {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 67.0}),
    ("H800", {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 67.0}),
    ("B200", {"fp8": 4500.0, "bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 80.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("A800", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"fp8": 733.0, "bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    ("L40", {"fp8": 362.1, "bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5}),
    ("L4", {"fp8": 242.5, "bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("RTX 4090", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    ("A10G", {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
)


def peak_flops(device_name: str, dtype: str = "bf16") -> float | None:
    """The dense peak FLOP/s of a known device for `dtype` (`fp8`, `bf16`, `fp16`, `tf32`, `fp32`), or None.

    Examples:
        >>> peak_flops("NVIDIA H100 80GB HBM3", "bf16") / 1e12
        989.4
        >>> peak_flops("NVIDIA H100 PCIe", "fp8") / 1e12
        1513.0
        >>> peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None, peak_flops("cpu") is None
        (True, True)
    """
    for name, peaks in PEAK_TFLOPS:
        if name in device_name:
            peak = peaks.get(dtype)
            return None if peak is None else peak * 1e12
    return None


def peak_dtype(precision: str | None) -> str:
    """The column of `PEAK_TFLOPS` a run in `precision` computes its matrix products in.

    fp32 runs count as tf32 when float32 matrix products may use TF32 tensor cores.
    """
    if precision in ("bf16", "fp16", "fp8"):
        return precision
    tf32 = torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32
    return "tf32" if tf32 else "fp32"


class FlopsTelemetry:
    """FLOPs per optimizer step and the peak FLOP/s: what turns steps per second into `tflops` and `mfu`.

    Args:
        flops_per_step: FLOPs of one optimizer step (all its micro-batches, forward and backward);
            None counts them once, over the first training step, when the peak is known.
        peak: Peak FLOP/s of the device; None shows no MFU (and counts nothing).
        model: Returns the model whose first training forward starts the count.
        progress: Returns the global step: the count ends at the first forward of the next step.
        unknown_peak: Why the peak is unknown, said once in the log at the first training pass.
        countable: Why the FLOPs cannot be counted (a compiled model), or None when they can.
        logger: Where that reason goes.

    Examples:
        >>> telemetry = FlopsTelemetry(flops_per_step=2e12, peak=1e15)
        >>> telemetry.values(steps_per_second=100.0)
        {'tflops': 200.0, 'mfu': 0.2}
        >>> FlopsTelemetry(flops_per_step=None, peak=None).values(steps_per_second=100.0)
        {}
    """

    def __init__(
        self,
        *,
        flops_per_step: float | None,
        peak: float | None,
        model: Callable[[], Any] = lambda: None,
        progress: Callable[[], int] = lambda: 0,
        unknown_peak: str | None = None,
        countable: str | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self.flops_per_step = flops_per_step
        self.peak = peak
        self.counts = 0  # how many times the FLOPs were counted (once at most)
        self._model, self._progress, self._logger = model, progress, logger
        self._unknown_peak, self._countable = unknown_peak, countable
        self._said = False
        self._counter: Any = None
        self._hook: Any = None
        self._start_step = 0

    def attach(self, bus: EventBus) -> FlopsTelemetry:
        bus.subscribe(Events.PASS_START, self._pass_start)
        bus.subscribe(Events.PASS_END, self._pass_end)
        return self

    def values(self, steps_per_second: float) -> dict[str, float]:
        """`tflops` (per device) and `mfu` (a fraction of the peak) at `steps_per_second`; empty when unknown."""
        if not self.flops_per_step or self._counter is not None:
            return {}
        flops = self.flops_per_step * steps_per_second
        out = {"tflops": flops / 1e12}
        if self.peak:
            out["mfu"] = flops / self.peak
        return out

    def _say_once(self, message: str) -> None:
        if not self._said and self._logger is not None:
            self._logger.info(message)
        self._said = True

    def _pass_start(self, context: PassContext) -> None:
        if context.mode != "train":
            return
        if self.peak is None:
            self._say_once(f"MFU is not shown: {self._unknown_peak}; set telemetry.peak_tflops to show it")
            return
        if self.flops_per_step or self.counts:
            return
        model = self._model()
        if self._countable is not None or not isinstance(model, nn.Module):
            why = self._countable or "the model is not one nn.Module"
            self._say_once(f"MFU is not shown: {why}; set telemetry.flops_per_step to show it")
            return
        # Armed until the model's first training forward, which starts the count.
        self._hook = model.register_forward_pre_hook(self._forward)

    def _forward(self, module: nn.Module, args: Any) -> None:
        if self._counter is None:
            if not module.training:
                return
            from torch.utils.flop_counter import FlopCounterMode

            self._start_step = self._progress()
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()
        elif self._progress() != self._start_step:  # the first forward of the next optimizer step
            self._finish()

    def _pass_end(self, context: PassContext) -> None:
        if self._counter is not None:  # a pass of one step: the count ends with it
            self._finish()
        elif self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _finish(self) -> None:
        counter, self._counter = self._counter, None
        counter.__exit__(None, None, None)
        self._hook.remove()
        self._hook = None
        self.flops_per_step = float(counter.get_total_flops())
        self.counts += 1


def build_flops_telemetry(
    section: Any,
    *,
    device: torch.device,
    precision: str | None,
    compiled: bool,
    model: Callable[[], Any],
    progress: Callable[[], int],
    logger: logging.Logger | None,
) -> FlopsTelemetry | None:
    """The telemetry of a `telemetry.*` section ([`TelemetryConfig`][danling.runners.config_sections.TelemetryConfig])
    for a model on `device` in `precision`; None when `telemetry.enabled` is off.

    Args:
        section: The `telemetry` section.
        device: The device the model trains on; a CUDA device's name selects the peak.
        precision: The run's precision (`fp32`, `bf16`, `fp16`, `fp8` or None).
        compiled: Whether the model is compiled (its FLOPs are then not counted).
        model: Returns the materialized model.
        progress: Returns the global step.
        logger: Where the reason MFU is not shown goes, once.
    """
    if not section.enabled:
        return None
    dtype = peak_dtype(precision)
    peak = None if section.peak_tflops is None else float(section.peak_tflops) * 1e12
    unknown = None
    if peak is None:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        peak = peak_flops(name, dtype) if device.type == "cuda" else None
        unknown = f"no peak FLOP/s is known for {name} in {dtype}"
    countable = "compile.enable is on (FLOPs are counted in eager mode only)" if compiled else None
    flops = None if section.flops_per_step is None else float(section.flops_per_step)
    return FlopsTelemetry(
        flops_per_step=flops,
        peak=peak,
        model=model,
        progress=progress,
        unknown_peak=unknown,
        countable=countable,
        logger=logger,
    )
