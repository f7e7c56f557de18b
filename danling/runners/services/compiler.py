"""`Compiler`: the runner's `torch.compile` policy, read from the `compile` config section."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["Compiler"]

_COMPILE_KEYS = ("backend", "fullgraph", "dynamic", "mode", "options")


class Compiler:
    """Decide whether and how modules are compiled with `torch.compile`.

    Args:
        config: The `compile` config section (`enable`, `backend`, `fullgraph`, `dynamic`, `mode`,
            `options`, `optimize_ddp`); keys left as `None` keep torch's defaults.

    Examples:
        >>> compiler = Compiler({"enable": True, "backend": "eager"})
        >>> compiler.enabled, compiler.kwargs
        (True, {'backend': 'eager'})
        >>> model = compiler.compile(nn.Linear(2, 1))
        >>> model(torch.ones(1, 2)).shape
        torch.Size([1, 1])
        >>> Compiler({}).compile(nn.Linear(2, 1))
        Linear(in_features=2, out_features=1, bias=True)
    """

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        config = dict(config or {})
        self.enabled = bool(config.get("enable"))
        self.kwargs = {key: config[key] for key in _COMPILE_KEYS if config.get(key) is not None}
        if "options" in self.kwargs:
            self.kwargs["options"] = dict(self.kwargs["options"])
        self.optimize_ddp = config.get("optimize_ddp")

    def __repr__(self) -> str:
        return f"Compiler(enabled={self.enabled}, kwargs={self.kwargs})"

    def compile(self, module: nn.Module, *, distributed: bool = False) -> nn.Module:
        """Return `torch.compile(module, **kwargs)` when enabled, else `module` itself.

        With `distributed`, dynamo's DDP graph-splitting mode is set first (`optimize_ddp`,
        `"ddp_optimizer"` unless configured), so graphs break at DDP's bucket boundaries and the
        gradient all-reduce still overlaps with the backward pass.
        """
        if not self.enabled:
            return module
        if distributed:
            from torch import _dynamo

            _dynamo.config.optimize_ddp = self.optimize_ddp or "ddp_optimizer"
        return torch.compile(module, **self.kwargs)
