"""The effective DeepSpeed config of a [`DeepSpeedRunner`][danling.runners.DeepSpeedRunner].

It is the user's `deepspeed` section plus what danling owns (accumulation, batch size, precision,
clipping, the non-finite skip); a setting that disagrees with the runner's is an error naming both.
[`build_deepspeed_config`][danling.runners.deepspeed.config.build_deepspeed_config] takes those
settings as explicit values, not the runner, so it can be called (and tested) on its own.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils import deterministic

__all__ = ["build_deepspeed_config"]

_PRECISION_SECTIONS = {"bf16": "bf16", "fp16": "fp16"}
_DEFAULT_BUCKET = 500_000_000  # DeepSpeed's default ZeRO bucket sizes, in elements


def build_deepspeed_config(
    section: Mapping[str, Any] | None,
    *,
    accum_steps: int = 1,
    micro_batch_size: int | None = None,
    world_size: int = 1,
    precision: str | None = None,
    max_grad_norm: float | None = None,
    max_grad_value: float | None = None,
    skip_nonfinite_grad: bool = False,
    model: nn.Module | None = None,
    client_optimizer: bool = False,
) -> dict[str, Any]:
    """`section` (the `deepspeed` config section) completed and checked against the runner's own settings.

    See [`DeepSpeedRunner.get_deepspeed_config`][danling.runners.deepspeed.runner.DeepSpeedRunner.get_deepspeed_config]
    for what is filled in and refused.

    Args:
        section: The user's DeepSpeed settings (`config.deepspeed`); `None` is an empty one.
        accum_steps: danling's accumulation window (the engine's own is forced to 1).
        micro_batch_size: The training loader's batch size per rank, when known.
        world_size: Number of ranks (for `train_batch_size`).
        precision: `config.precision` (`bf16`/`fp16` enable DeepSpeed's section).
        max_grad_norm: `config.max_grad_norm`, becomes `gradient_clipping`.
        max_grad_value: `config.max_grad_value`; DeepSpeed has no counterpart, so a value is refused.
        skip_nonfinite_grad: `config.skip_nonfinite_grad`; keeps the ZeRO optimizer's agreed skip on.
        model: The user's module, to size ZeRO buckets in deterministic mode.
        client_optimizer: Whether danling built the optimizer (`zero_allow_untested_optimizer` defaults on).

    Raises:
        ValueError: `section` is not a mapping, or a setting conflicts (both values are named).

    Examples:
        >>> config = build_deepspeed_config({"zero_optimization": {"stage": 1}}, micro_batch_size=4, world_size=2)
        >>> config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"], config["gradient_clipping"]
        (4, 1, 0.0)
    """
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ValueError(f"config.deepspeed must be a mapping of DeepSpeed settings, got {type(section).__name__}")
    config = copy.deepcopy(section.dict() if callable(getattr(section, "dict", None)) else dict(section))
    _agree(config, "gradient_accumulation_steps", 1, f"accum_steps={accum_steps} (danling owns accumulation)")
    config["gradient_accumulation_steps"] = 1
    if micro_batch_size is not None:
        micro = micro_batch_size
        _agree(config, "train_micro_batch_size_per_gpu", micro, f"the loader's batch_size={micro}")
        config["train_micro_batch_size_per_gpu"] = micro
        _agree(config, "train_batch_size", micro * world_size, f"batch_size x world size = {micro}x{world_size}")
    if precision in _PRECISION_SECTIONS:
        key = _PRECISION_SECTIONS[precision]
        sub = config.setdefault(key, {})
        if sub.get("enabled") is False:
            raise ValueError(f"config.deepspeed.{key}.enabled=False conflicts with precision={precision!r}")
        sub["enabled"] = True
    if max_grad_norm is not None:
        _agree(config, "gradient_clipping", max_grad_norm, f"max_grad_norm={max_grad_norm}")
        config["gradient_clipping"] = max_grad_norm
    config.setdefault("gradient_clipping", 0.0)  # DeepSpeed clips at 1.0 unless told; danling does not
    if max_grad_value:
        raise ValueError(f"max_grad_value={max_grad_value!r} is not supported by DeepSpeedRunner")
    if skip_nonfinite_grad:
        _skip_nonfinite(config)
    if torch.are_deterministic_algorithms_enabled() and deterministic.fill_uninitialized_memory:
        _size_buckets(config, model)
    config.setdefault("steps_per_print", 2**31 - 1)  # the runner logs; keep DeepSpeed quiet
    if client_optimizer:  # the user chose it (config.optim): ZeRO may shard any torch optimizer
        config.setdefault("zero_allow_untested_optimizer", True)
    return config


def _agree(config: dict[str, Any], key: str, value: Any, ours: str) -> None:
    """Refuse a DeepSpeed setting that disagrees with the runner's (`"auto"` and unset agree)."""
    given = config.get(key)
    if given is not None and given != "auto" and given != value:
        raise ValueError(f"config.deepspeed.{key}={given!r} conflicts with {ours}: the runner sets it to {value!r}")


def _skip_nonfinite(config: dict[str, Any]) -> None:
    """Make sure the engine skips non-finite updates, agreed across ranks: `skip_nonfinite_grad`'s mapping.

    ZeRO optimizers reduce the gradient norm over the ranks and skip the step when it is not
    finite: in fp32 and fp16 always, in bf16 while `bf16.check_grad_overflow` is on.
    """
    zero = config.get("zero_optimization") or {}
    bf16 = config.get("bf16") or {}
    if int(zero.get("stage", 0)) < 1 and not (config.get("fp16") or {}).get("enabled"):
        raise ValueError(
            "skip_nonfinite_grad=True needs a ZeRO optimizer (zero_optimization.stage 1-3) or fp16 with "
            f"DeepSpeedRunner, got zero_optimization.stage={zero.get('stage', 0)!r}"
        )
    if bf16.get("enabled"):
        if bf16.get("check_grad_overflow") is False:
            raise ValueError(
                "config.deepspeed.bf16.check_grad_overflow=False conflicts with skip_nonfinite_grad=True: "
                "the runner sets it to True"
            )
        config["bf16"] = {**bf16, "check_grad_overflow": True}
    if zero.get("compute_grad_norm") is False:
        raise ValueError(
            "config.deepspeed.zero_optimization.compute_grad_norm=False conflicts with skip_nonfinite_grad=True: "
            "the engine finds non-finite gradients through their norm"
        )


def _size_buckets(config: dict[str, Any], model: Any) -> None:
    """Size unset ZeRO buckets to the model (at least 2**20 elements) in deterministic mode.

    Deterministic mode fills every new tensor, and ZeRO allocates its buckets (5e8 elements by
    default) again on every step: a second per step on a CPU, whatever the model's size. A bucket
    larger than the whole model buys nothing; the reduction of each element is unchanged.
    """
    if not isinstance(model, torch.nn.Module):
        return
    size = max(sum(p.numel() for p in model.parameters()), 2**20)
    if size >= _DEFAULT_BUCKET:
        return
    zero = config.get("zero_optimization")
    if isinstance(zero, Mapping):
        for key in ("reduce_bucket_size", "allgather_bucket_size"):
            zero.setdefault(key, size)
