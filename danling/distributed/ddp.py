"""Wrapping a module for data parallelism and getting the plain module back."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["ddp_options", "unwrap_model", "wrap_ddp"]

# `ddp.*` keys and DistributedDataParallel's defaults for them.
DDP_DEFAULTS = {
    "find_unused_parameters": False,
    "static_graph": False,
    "gradient_as_bucket_view": False,
    "bucket_cap_mb": None,
    "broadcast_buffers": True,
}


def ddp_options(config: Any) -> dict[str, Any]:
    """The `DistributedDataParallel` keyword arguments that `config.ddp` sets away from DDP's defaults.

    Raises:
        ValueError: `ddp.bucket_cap_mb` is not a positive number, naming the value.

    Examples:
        >>> ddp_options({"ddp": {"find_unused_parameters": True, "bucket_cap_mb": None}})
        {'find_unused_parameters': True}
    """
    section = (config.get("ddp") if hasattr(config, "get") else None) or {}
    options = {key: section.get(key, default) for key, default in DDP_DEFAULTS.items()}
    cap = options["bucket_cap_mb"]
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
        raise ValueError(f"config.ddp.bucket_cap_mb must be a positive number of MiB or None, got {cap!r}")
    return {key: value for key, value in options.items() if value != DDP_DEFAULTS[key]}


def wrap_ddp(model: nn.Module, device: torch.device | str | None = None, **ddp_kwargs: Any) -> DistributedDataParallel:
    """Wrap `model` in ``DistributedDataParallel`` for the active default process group.

    The model must already live on `device`. On CUDA the module is bound to that device
    (``device_ids=[index]``); on CPU no device ids are passed. An already wrapped model is returned
    unchanged, so calling this twice never nests wrappers.

    Args:
        model: The module to replicate.
        device: The device the model lives on; defaults to the device of its first parameter.
        **ddp_kwargs: Extra ``DistributedDataParallel`` options (``find_unused_parameters``, ...).

    Raises:
        RuntimeError: no process group is initialised.
    """
    if isinstance(model, DistributedDataParallel):
        return model
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("wrap_ddp needs an initialised process group (see init_process_group_from_env)")
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":  # GPU-only: one device per process
        index = device.index if device.index is not None else torch.cuda.current_device()
        ddp_kwargs.setdefault("device_ids", [index])
        ddp_kwargs.setdefault("output_device", index)
    return DistributedDataParallel(model, **ddp_kwargs)


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP/DataParallel and ``torch.compile`` wrappers, returning the module that holds the weights.

    Examples:
        >>> net = nn.Linear(2, 2)
        >>> unwrap_model(nn.DataParallel(net)) is net
        True
    """
    while True:
        if isinstance(model, (DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):  # torch.compile wrapper
            model = model._orig_mod
        else:
            return model
