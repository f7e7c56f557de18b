"""What a torch run tells about itself: the start-of-run summary and the step profiler."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from .services.profiling import StepProfiler

__all__ = ["TorchInsightMixin"]


class TorchInsightMixin:
    """`run_summary` (logged once when training starts) and `init_profiler`; mixed into `TorchRunner`."""

    profiler: StepProfiler | None = None

    def init_profiler(self) -> None:
        """Profile a bounded window of training steps with `torch.profiler` when `profiling.enabled`.

        Called by `__post_init__` on every rank. The window is `profiling.wait` skipped,
        `profiling.warmup` discarded and `profiling.active` recorded steps, `profiling.repeat`
        times; `profiling.record_shapes`, `profiling.profile_memory`, `profiling.with_stack` and
        `profiling.with_flops` go to the profiler. Traces (one per cycle and rank) are written to
        `profiling.trace_dir` under the run directory; see
        [`StepProfiler`][danling.runners.services.profiling.StepProfiler].
        """
        profiling = self.config.profiling
        if not profiling.enabled:
            return
        self.profiler = StepProfiler(
            os.path.join(self.dir, profiling.trace_dir),
            rank=self.rank,
            wait=profiling.wait,
            warmup=profiling.warmup,
            active=profiling.active,
            repeat=profiling.repeat,
            record_shapes=profiling.record_shapes,
            profile_memory=profiling.profile_memory,
            with_stack=profiling.with_stack,
            with_flops=profiling.with_flops,
            logger=self.logger,
        ).attach(self.events)

    def run_summary(self) -> dict[str, Any]:
        """What the run is about to do: model size, precision, device, layout, budget and run directory.

        Parameter counts are of the whole model (a sharded parameter counts in full), or of this
        rank's pipeline stages when the model is split into stages.
        """
        model = self.unwrap(self.checkpoint_model) if self.model is not None else None
        params = list(model.parameters()) if isinstance(model, nn.Module) else []
        degrees = {axis: degree for axis, degree in self.topology.degrees.items() if degree > 1}
        return {
            "model": type(model).__name__ if model is not None else None,
            "parameters": sum(p.numel() for p in params),
            "trainable": sum(p.numel() for p in params if p.requires_grad),
            "bytes": sum(p.numel() * p.element_size() for p in params),
            "precision": self.precision or "fp32",
            "device": str(self.device),
            "world_size": self.world_size,
            "layout": degrees,
            "epochs": self.epochs,
            "steps": self.steps,
            "optimizer_steps": self._total_steps(),
            "accum_steps": self.accum_steps,
            "run_dir": str(self.dir),
        }

    def _log_run_summary(self, context: Any) -> None:
        """One block at the start of the first `train()`, on the main process."""
        if context.mode != "train" or self.__dict__.get("_summary_logged"):
            return
        self._summary_logged = True
        s = self.run_summary()
        layout = ", ".join(f"{axis}={degree}" for axis, degree in s["layout"].items()) or "data parallel"
        budget = f"{s['epochs']} epochs" if s["epochs"] is not None else f"{s['steps']} steps"
        if s["optimizer_steps"] is not None:
            budget += f" ({s['optimizer_steps']} optimizer steps, {s['accum_steps']} micro-batch(es) each)"
        self.logger.info(
            "run summary\n  model      %s: %s parameters (%s trainable), %s\n  precision  %s on %s\n"
            "  ranks      %d (%s)\n  budget     %s\n  run dir    %s",
            s["model"],
            f"{s['parameters']:,}",
            f"{s['trainable']:,}",
            _size(s["bytes"]),
            s["precision"],
            s["device"],
            s["world_size"],
            layout,
            budget,
            s["run_dir"],
        )


def _size(num_bytes: int) -> str:
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"
