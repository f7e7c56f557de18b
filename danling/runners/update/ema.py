"""Exponential moving average of a model's weights."""

from __future__ import annotations

import contextlib
import copy
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

    Args:
        model: The model to average; DDP and ``torch.compile`` wrappers are stripped.
        decay: Weight of the running average in ``[0, 1]``.

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

    def __init__(self, model: nn.Module, decay: float = 0.999) -> None:
        super().__init__()
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay!r}")
        self.decay = float(decay)
        self.module = copy.deepcopy(unwrap_model(model))
        self.module.requires_grad_(False)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Blend the live `model`'s weights into the average (call after each optimizer update)."""
        source = unwrap_model(model)
        averaged, live = [], []
        for mine, theirs in zip(self.module.parameters(), source.parameters()):
            if mine.is_floating_point():
                averaged.append(mine)
                live.append(theirs.detach().to(mine.device, mine.dtype))
            else:
                mine.copy_(theirs)
        if averaged:
            torch._foreach_lerp_(averaged, live, 1.0 - self.decay)
        for mine, theirs in zip(self.module.buffers(), source.buffers()):
            mine.copy_(theirs)

    @contextlib.contextmanager
    def swap(self, model: nn.Module) -> Iterator[nn.Module]:
        """Load the averaged weights into `model` for the duration of the block, then restore its own."""
        target = unwrap_model(model)
        backup = {k: v.detach().clone() for k, v in target.state_dict().items()}
        target.load_state_dict(self.module.state_dict())
        try:
            yield model
        finally:
            target.load_state_dict(backup)
