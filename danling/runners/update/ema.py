"""Exponential moving average of a model's weights."""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from danling.distributed import unwrap_model

__all__ = ["EMA"]


class EMA(nn.Module):
    """Exponential moving average of a model's weights, usable as a module for evaluation.

    Holds a frozen copy of the (unwrapped) model. `update` moves each floating-point parameter
    towards the live model, ``ema = decay * ema + (1 - decay) * param``, with a fused in-place
    kernel and no host synchronisation; buffers (e.g. batch-norm statistics) are copied. Calling
    the EMA runs the averaged copy. ``ema.module.state_dict()`` has the same keys as the model,
    so the averaged weights can be loaded into it directly; `swap` does that temporarily.

    A sharded model (FSDP2, tensor parallel) or a pipeline stage cannot run as a copy of its own:
    its forward needs the live module's collectives and schedule. With `runnable=False` the EMA
    keeps only the weights, under the model's names, each a copy of the live tensor with the
    same sharding (a `DTensor` keeps its mesh and placements): `update` blends every rank's
    local shard into its own copy without gathering anything, DCP saves and reshards the copies
    like the weights, and the averaged model is evaluated by `swap`ping them into the live one.

    Args:
        model: The model to average; DDP and ``torch.compile`` wrappers are stripped.
        decay: Weight of the running average in ``[0, 1]``.
        runnable: Keep a runnable copy of the model (the default), or only its weights.

    Examples:
        >>> model = nn.Linear(1, 1, bias=False)
        >>> with torch.no_grad():
        ...     _ = model.weight.fill_(0.0)
        >>> ema = EMA(model, decay=0.5)
        >>> with torch.no_grad():
        ...     _ = model.weight.fill_(1.0)
        >>> ema.update(model); ema.module.weight.item()
        0.5
        >>> with ema.swap(model):
        ...     model.weight.item()
        0.5
        >>> model.weight.item()
        1.0
    """

    def __init__(self, model: nn.Module, decay: float = 0.999, *, runnable: bool = True) -> None:
        super().__init__()
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay!r}")
        self.decay = float(decay)
        self.runnable = bool(runnable)
        source = unwrap_model(model)
        self.module = copy.deepcopy(source) if runnable else _weights_copy(source, {})
        self.module.requires_grad_(False)
        # a tuple, so the live module is not registered as a submodule (its weights are not the EMA's state)
        self._live = () if runnable else (source,)

    @property
    def live(self) -> nn.Module | None:
        """The live module a weights-only EMA was made from and follows (`None` for a runnable copy).

        For a pipeline rank this is its local stages laid over one tree: the runner updates the EMA
        from it and swaps the averaged weights into it.
        """
        return self._live[0] if self._live else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.runnable:
            raise RuntimeError(
                "this EMA holds only the (sharded) weights of the model and cannot run: evaluate the "
                "live model inside `ema.swap(model)`"
            )
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Blend the live `model`'s weights into the average (call after each optimizer update).

        Each rank blends its local shards only: the copies are sharded like the weights they follow.
        """
        source = unwrap_model(model)
        if not self.runnable:
            _reshard(source)  # pair shards with shards even if a forward left an FSDP2 module gathered
        averaged, live = [], []
        for mine, theirs in zip(self.module.parameters(), source.parameters()):
            mine, theirs = _local(mine), _local(theirs)
            if mine.is_floating_point():
                averaged.append(mine)
                live.append(theirs.detach().to(mine.device, mine.dtype))
            else:
                mine.copy_(theirs)
        if averaged:
            torch._foreach_lerp_(averaged, live, 1.0 - self.decay)
        for mine, theirs in zip(self.module.buffers(), source.buffers()):
            _local(mine).copy_(_local(theirs))

    @torch.no_grad()
    def reset(self, model: nn.Module) -> None:
        """Make the average equal to `model`'s current weights, as if the copy were made now.

        For weights loaded into the model after the EMA was made (pretrained weights): the average
        would otherwise start from the weights the model had before.
        """
        source = unwrap_model(model)
        if not self.runnable:
            _reshard(source)
        for mine, theirs in zip(_tensors(self.module), _tensors(source)):
            _local(mine).copy_(_local(theirs).detach())

    @contextlib.contextmanager
    def swap(self, model: nn.Module) -> Iterator[nn.Module]:
        """Load the averaged weights into `model` for the duration of the block, then restore its own.

        Only local shards are copied; FSDP2 modules are resharded before and after, so no gathered
        copy of the other weights outlives the change.
        """
        target = unwrap_model(model)
        _reshard(target)  # a gathered FSDP2 module lists its gathered parameters, not its shards
        mine = [_local(tensor) for tensor in _tensors(self.module)]
        theirs = [_local(tensor) for tensor in _tensors(target)]
        if len(mine) != len(theirs):
            raise ValueError(
                f"the EMA holds {len(mine)} tensors but the {type(target).__name__} has {len(theirs)}: "
                "swap into the model (or parts) the EMA was made from"
            )
        with torch.no_grad():
            backup = [tensor.detach().clone() for tensor in theirs]
            torch._foreach_copy_(theirs, mine)
        try:
            yield model
        finally:
            with torch.no_grad():
                _reshard(target)
                torch._foreach_copy_(theirs, backup)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor` (a view, so in-place updates reach the sharded tensor)."""
    # torch.distributed.tensor costs ~0.5 s to import: a tensor can only be a DTensor once it is loaded
    dtensor = sys.modules.get("torch.distributed.tensor")
    return tensor._local_tensor if dtensor is not None and isinstance(tensor, dtensor.DTensor) else tensor


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _reshard(module: nn.Module) -> None:
    """Free the gathered parameters of every FSDP2 module in `module` (a no-op for other modules)."""
    from torch.distributed.fsdp import FSDPModule

    for child in module.modules():
        if isinstance(child, FSDPModule):
            child.reshard()


class _Weights(nn.Module):
    """A container of averaged weights under the model's names; it has no forward of its own."""


def _weights_copy(source: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """The tree of `source`'s modules with a copy of each parameter and buffer, sharded alike.

    `memo` keeps tied tensors and shared modules tied, so the copy's `parameters()` follow the source's.
    """
    if id(source) in memo:
        return memo[id(source)]
    copied = memo[id(source)] = _Weights()
    for name, param in source.named_parameters(recurse=False):
        if id(param) not in memo:
            memo[id(param)] = nn.Parameter(param.detach().clone(), requires_grad=False)
        copied.register_parameter(name, memo[id(param)])
    for name, buffer in source.named_buffers(recurse=False):
        if id(buffer) not in memo:
            memo[id(buffer)] = buffer.detach().clone()
        copied.register_buffer(name, memo[id(buffer)], persistent=name not in source._non_persistent_buffers_set)
    for name, child in source.named_children():
        copied.add_module(name, _weights_copy(child, memo))
    return copied
