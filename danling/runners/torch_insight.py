"""What a torch run tells about itself: the start-of-run summary.

[`run_summary`][danling.runners.torch_insight.run_summary] gathers the facts (model size,
precision, device, layout, budget, run directory) and
[`format_run_summary`][danling.runners.torch_insight.format_run_summary] renders the block the
main process logs once when training starts. The step profiler is
[`StepProfiler`][danling.runners.services.profiling.StepProfiler].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["format_run_summary", "run_summary"]


def run_summary(
    model: nn.Module | None,
    *,
    precision: str | None,
    device: Any,
    world_size: int,
    degrees: Mapping[str, int],
    epochs: int | None,
    steps: int | None,
    optimizer_steps: int | None,
    accum_steps: int,
    run_dir: str,
) -> dict[str, Any]:
    """What a run is about to do, as a dict: model size, precision, device, layout, budget and run directory.

    Parameter counts are of `model` (pass the unwrapped one: a sharded parameter counts in full);
    `degrees` is the parallel layout, axes of degree 1 left out.

    Examples:
        >>> summary = run_summary(nn.Linear(2, 1), precision=None, device="cpu", world_size=1, degrees={},
        ...                       epochs=2, steps=None, optimizer_steps=8, accum_steps=1, run_dir="runs/a")
        >>> summary["parameters"], summary["precision"], summary["layout"]
        (3, 'fp32', {})
    """
    params = list(model.parameters()) if isinstance(model, nn.Module) else []
    return {
        "model": type(model).__name__ if model is not None else None,
        "parameters": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "bytes": sum(p.numel() * p.element_size() for p in params),
        "precision": precision or "fp32",
        "device": str(device),
        "world_size": world_size,
        "layout": {axis: degree for axis, degree in degrees.items() if degree > 1},
        "epochs": epochs,
        "steps": steps,
        "optimizer_steps": optimizer_steps,
        "accum_steps": accum_steps,
        "run_dir": str(run_dir),
    }


def format_run_summary(s: Mapping[str, Any]) -> str:
    """The `run summary` block of the log, from a [`run_summary`][danling.runners.torch_insight.run_summary]."""
    layout = ", ".join(f"{axis}={degree}" for axis, degree in s["layout"].items()) or "data parallel"
    budget = f"{s['epochs']} epochs" if s["epochs"] is not None else f"{s['steps']} steps"
    if s["optimizer_steps"] is not None:
        budget += f" ({s['optimizer_steps']} optimizer steps, {s['accum_steps']} micro-batch(es) each)"
    return (
        f"run summary\n  model      {s['model']}: {s['parameters']:,} parameters ({s['trainable']:,} trainable), "
        f"{_size(s['bytes'])}\n  precision  {s['precision']} on {s['device']}\n"
        f"  ranks      {s['world_size']} ({layout})\n  budget     {budget}\n  run dir    {s['run_dir']}"
    )


def _size(num_bytes: int) -> str:
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"
