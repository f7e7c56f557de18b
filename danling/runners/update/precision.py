"""Numeric precision of the training step: the autocast context and, for fp16 on CUDA, gradient scaling."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["Precision"]

_PRECISIONS = {
    None: "fp32",
    "fp32": "fp32",
    "float32": "fp32",
    "32": "fp32",
    "no": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "16": "fp16",
    "fp8": "fp8",
    "float8": "fp8",
}
# fp8 runs its float8 linears (see `update/fp8.py`) inside bf16 autocast, which covers the rest.
_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


# `nullcontext` holds no state and may be entered any number of times: one instance serves every fp32 step.
_NO_AUTOCAST = contextlib.nullcontext()


class Precision:
    """Mixed-precision policy: an autocast context plus, for fp16 on CUDA, a gradient scaler.

    ``"bf16"`` and ``"fp16"`` run the forward pass under ``torch.autocast`` with that dtype;
    parameters and gradients stay in fp32. bf16 autocast works on CPU too. A ``GradScaler`` is
    created only for fp16 on a CUDA device (GPU-only branch): fp16 on CPU autocasts without loss
    scaling, and bf16 needs no scaling because it has fp32's exponent range.

    Args:
        precision: ``None``/``"fp32"`` (no autocast), ``"bf16"``/``"bfloat16"``,
            ``"fp16"``/``"float16"``/``"half"`` or ``"fp8"``/``"float8"`` (bf16 autocast around the
            float8 linears that `materialize_model` converts).
        device: The device the model runs on; selects the autocast device type.

    Raises:
        ValueError: an unknown precision name.

    Examples:
        >>> policy = Precision("bf16", "cpu")
        >>> with policy.autocast():
        ...     out = torch.nn.Linear(4, 2)(torch.randn(3, 4))
        >>> out.dtype, policy.scaler is None
        (torch.bfloat16, True)
        >>> Precision("fp8").dtype  # the float8 linears run inside bf16 autocast
        torch.bfloat16
        >>> Precision("int4")
        Traceback (most recent call last):
        ValueError: unknown precision 'int4'; accepted: ...
    """

    def __init__(self, precision: str | None = None, device: torch.device | str = "cpu") -> None:
        key = precision.lower() if isinstance(precision, str) else precision
        if key not in _PRECISIONS:
            accepted = sorted(k for k in _PRECISIONS if k is not None)
            raise ValueError(f"unknown precision {precision!r}; accepted: None, {accepted}")
        self.name: str = _PRECISIONS[key]
        self.dtype: torch.dtype | None = _DTYPES[self.name]
        self.device_type: str = torch.device(device).type
        self.scaler: torch.amp.GradScaler | None = None
        if self.name == "fp16" and self.device_type == "cuda":  # GPU-only: fp16 gradients need loss scaling
            self.scaler = torch.amp.GradScaler("cuda")

    def __repr__(self) -> str:
        return f"Precision({self.name!r}, device_type={self.device_type!r}, scaler={self.scaler is not None})"

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context for forward passes: ``torch.autocast`` for bf16/fp16, a no-op for fp32."""
        if self.dtype is None:
            return _NO_AUTOCAST
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiply `loss` by the scaler's factor before ``backward`` (identity without a scaler)."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (empty without a scaler)."""
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the scaler's state; an empty mapping is accepted and ignored."""
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(dict(state_dict))
