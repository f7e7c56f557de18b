"""The effective DeepSpeed config of a [`DeepSpeedRunner`][danling.runners.DeepSpeedRunner].

It is the user's `deepspeed` section plus what danling owns (accumulation, batch size, precision,
clipping, the non-finite skip); a setting that disagrees with the runner's is an error naming both.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import deterministic

__all__ = ["build_deepspeed_config"]

_PRECISION_SECTIONS = {"bf16": "bf16", "fp16": "fp16"}
_DEFAULT_BUCKET = 500_000_000  # DeepSpeed's default ZeRO bucket sizes, in elements


def build_deepspeed_config(runner: Any) -> dict[str, Any]:
    """`runner.config.deepspeed` completed and checked against the runner's own settings.

    See [`DeepSpeedRunner.get_deepspeed_config`][danling.runners.deepspeed_runner.DeepSpeedRunner.get_deepspeed_config].
    """
    section = runner.config.get("deepspeed")
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ValueError(f"config.deepspeed must be a mapping of DeepSpeed settings, got {type(section).__name__}")
    config = copy.deepcopy(section.dict() if callable(getattr(section, "dict", None)) else dict(section))
    _agree(config, "gradient_accumulation_steps", 1, f"accum_steps={runner.accum_steps} (danling owns accumulation)")
    config["gradient_accumulation_steps"] = 1
    micro = runner._micro_batch_size()
    if micro is not None:
        _agree(config, "train_micro_batch_size_per_gpu", micro, f"the loader's batch_size={micro}")
        config["train_micro_batch_size_per_gpu"] = micro
        _agree(
            config,
            "train_batch_size",
            micro * runner.world_size,
            f"batch_size x world size = {micro}x{runner.world_size}",
        )
    if runner.precision in _PRECISION_SECTIONS:
        key = _PRECISION_SECTIONS[runner.precision]
        sub = config.setdefault(key, {})
        if sub.get("enabled") is False:
            raise ValueError(f"config.deepspeed.{key}.enabled=False conflicts with precision={runner.precision!r}")
        sub["enabled"] = True
    if runner.max_grad_norm is not None:
        _agree(config, "gradient_clipping", runner.max_grad_norm, f"max_grad_norm={runner.max_grad_norm}")
        config["gradient_clipping"] = runner.max_grad_norm
    config.setdefault("gradient_clipping", 0.0)  # DeepSpeed clips at 1.0 unless told; danling does not
    if runner.config.get("max_grad_value"):
        raise ValueError(f"max_grad_value={runner.config.get('max_grad_value')!r} is not supported by DeepSpeedRunner")
    if runner.config.get("skip_nonfinite_grad"):
        _skip_nonfinite(config)
    if torch.are_deterministic_algorithms_enabled() and deterministic.fill_uninitialized_memory:
        _size_buckets(config, runner.model)
    config.setdefault("steps_per_print", 2**31 - 1)  # the runner logs; keep DeepSpeed quiet
    if runner.optimizer is not None:  # the user chose it (config.optim): ZeRO may shard any torch optimizer
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
