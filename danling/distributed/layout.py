"""Parallel layouts that nothing would implement, refused before any model work."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["check_axes", "check_layout"]


def check_axes(axes: Mapping[str, Any], device_type: str) -> None:
    """Refuse a context axis above one (`parallel.axes.context`).

    Raises:
        RuntimeError: `context > 1` on a CPU device.
        NotImplementedError: `context > 1` elsewhere (context parallelism is not built in this version).
    """
    context = axes.get("context", 1)
    if context in (1, -1, None):
        return
    if device_type == "cpu":
        # Measured with torch 2.13 on CPU: SDPA has no CPU sharding strategy for context_parallel
        # and FlexAttention has no CPU backward, so a context-parallel step cannot run here.
        raise RuntimeError(
            f"parallel.axes.context={context} needs CUDA devices: torch's context parallelism shards "
            "attention over the sequence, and on CPU neither scaled-dot-product attention (no CPU sharding "
            "strategy) nor FlexAttention (no CPU backward) can be sharded; set parallel.axes.context to 1"
        )
    raise NotImplementedError(
        f"parallel.axes.context={context}: context parallelism is not built in this version of "
        "danling; shard the sequence in your model or set parallel.axes.context to 1"
    )


def check_layout(topology: Any, *, fsdp: bool, ema: bool) -> None:
    """Refuse parallel layouts whose axes nothing would implement, before any model work.

    Args:
        topology: The run's topology (its `degrees`, `world_size` and data domain's size).
        fsdp: `fsdp.enabled`.
        ema: `ema.enabled` (an EMA follows any sharded layout, but not split experts yet).

    Raises:
        ValueError: `shard > 1` without FSDP2, FSDP2 with `shard == 1`, tensor parallelism over
            several data ranks without FSDP2, or expert parallelism combined with tensor or
            pipeline parallelism or an EMA.
    """
    degrees, data_size = topology.degrees, topology.size("data")
    if topology.world_size == 1:
        return
    if degrees["shard"] > 1 and not fsdp:
        raise ValueError(
            f"parallel.axes.shard={degrees['shard']} shards parameters with FSDP2: set fsdp.enabled to true, "
            "or use parallel.axes.replicate for plain data parallelism"
        )
    if fsdp and degrees["shard"] == 1:
        raise ValueError(
            "fsdp.enabled shards over parallel.axes.shard, which is 1 here: set parallel.axes.shard above 1 "
            f"(degrees: {dict(degrees)})"
        )
    if degrees["tensor"] > 1 and data_size > 1 and not fsdp:
        raise ValueError(
            f"tensor parallelism with {data_size} data-parallel ranks needs FSDP2 over the data "
            "axes: set fsdp.enabled and parallel.axes.shard"
        )
    _check_experts(degrees, ema=ema)


def _check_experts(degrees: Mapping[str, int], *, ema: bool) -> None:
    """Expert parallelism composes with the data axes (DDP, FSDP2, HSDP) only in this version."""
    expert = degrees.get("expert", 1)
    if expert == 1:
        return
    others = [f"{axis}={degrees[axis]}" for axis in ("tensor", "pipeline") if degrees[axis] > 1]
    others += ["ema.enabled"] * ema
    if others:
        # Tensor peers would need the experts split inside (expert_tensor), pipeline stages expert groups
        # of their own, and an EMA a copy split like the experts: none of them is built for experts yet.
        raise ValueError(
            f"parallel.axes.expert={expert} is supported with the data axes (replicate, shard) only in this "
            f"version, not with {', '.join(others)}: drop those or set parallel.axes.expert to 1"
        )
