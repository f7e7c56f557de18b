"""Building blocks of the PyTorch training step, each usable without a runner.

- [`Precision`][danling.runners.torch_components.Precision]: autocast context and (fp16 on CUDA)
  gradient scaling.
- [`GradientAccumulator`][danling.runners.torch_components.GradientAccumulator]: which
  micro-steps synchronise gradients and step the optimizer, and how each loss is normalised.
- [`clip_gradients`][danling.runners.torch_components.clip_gradients] and
  [`has_nonfinite_gradients`][danling.runners.torch_components.has_nonfinite_gradients].
- [`OptimizerContainer`][danling.runners.torch_components.OptimizerContainer]: one optimizer
  update (unscale, non-finite skip, clip, step, scheduler, zero grads).
- [`EMA`][danling.runners.torch_components.EMA]: an exponential moving average of a model's weights.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from danling.distributed import all_reduce_any, unwrap_model

__all__ = [
    "EMA",
    "GradientAccumulator",
    "OptimizerContainer",
    "Precision",
    "clip_gradients",
    "has_nonfinite_gradients",
    "scale_gradients",
]

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
}
_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


# `nullcontext` holds no state and may be entered any number of times: one instance serves every fp32 step.
_NO_AUTOCAST = contextlib.nullcontext()


class Precision:
    """Mixed-precision policy: an autocast context plus, for fp16 on CUDA, a gradient scaler.

    ``"bf16"`` and ``"fp16"`` run the forward pass under ``torch.autocast`` with that dtype;
    parameters and gradients stay in fp32. bf16 autocast works on CPU too. A ``GradScaler`` is
    created only for fp16 on a CUDA device (GPU-only branch): fp16 on CPU autocasts without loss
    scaling, and bf16 needs no scaling because it has fp32's exponent range.

    Args:
        precision: ``None``/``"fp32"`` (no autocast), ``"bf16"``/``"bfloat16"`` or
            ``"fp16"``/``"float16"``/``"half"``.
        device: The device the model runs on; selects the autocast device type.

    Raises:
        ValueError: an unknown precision name.

    Examples:
        >>> policy = Precision("bf16", "cpu")
        >>> with policy.autocast():
        ...     out = nn.Linear(4, 2)(torch.randn(3, 4))
        >>> out.dtype, policy.scaler is None
        (torch.bfloat16, True)
        >>> Precision("fp8")
        Traceback (most recent call last):
        ValueError: unknown precision 'fp8'; accepted: ...
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


class GradientAccumulator:
    """State machine of gradient accumulation over a pass of micro-batches.

    Micro-steps are grouped into windows of ``accum_steps``; the optimizer steps after the last
    micro-step of each window. When the pass length is known (``start(total)``), the last window
    of the pass may be shorter, and its losses are divided by its real size, so every update sees
    the mean gradient of the micro-batches it covers. Under DDP, ``no_sync`` skips the gradient
    all-reduce for every micro-step except the one that closes its window.

    When the pass length is unknown (``start(None)``), losses are divided by ``accum_steps``; if
    the pass ends inside a window, `finish` returns the factor that rescales those gradients to the
    mean over the micro-steps actually taken (they also were never synchronised, see
    [`all_reduce_gradients`][danling.distributed.all_reduce_gradients]).

    ``state_dict()`` records the pass position (not gradients, so save at window boundaries).
    After ``load_state_dict`` the next ``start`` continues the interrupted pass instead of opening
    a new one, matching a dataloader restored mid-epoch.

    Examples:
        >>> acc = GradientAccumulator(accum_steps=4)
        >>> acc.start(total=10)
        >>> plan = []
        >>> for _ in range(10):
        ...     size = acc.window_size
        ...     plan.append((size, acc.advance()))
        >>> [size for size, _ in plan]
        [4, 4, 4, 4, 4, 4, 4, 4, 2, 2]
        >>> [i for i, (_, step) in enumerate(plan) if step]
        [3, 7, 9]
    """

    def __init__(self, accum_steps: int = 1) -> None:
        if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
            raise ValueError(f"accum_steps must be a positive integer, got {accum_steps!r}")
        self.accum_steps = accum_steps
        self.total: int | None = None
        self.position = 0
        self._pending = 0  # micro-steps since the last closed window
        self._resumed = False

    def start(self, total: int | None = None) -> None:
        """Open a pass of `total` micro-batches (``None`` when unknown), or continue a restored one.

        Raises:
            ValueError: a negative `total`, or a restored pass whose length differs from `total`.
        """
        if total is not None and total < 0:
            raise ValueError(f"total must be a non-negative number of micro-batches or None, got {total!r}")
        if self._resumed:
            self._resumed = False
            if self.position and (self.total is None or self.position < self.total):
                if total != self.total:
                    raise ValueError(
                        f"the restored pass had {self.total} micro-batches but the loader now has {total}; "
                        "the data changed since the checkpoint"
                    )
                return
        self.total, self.position, self._pending = total, 0, 0

    @property
    def window_size(self) -> int:
        """Number of micro-steps in the window the next micro-step belongs to."""
        if self.total is None or self.accum_steps == 1:
            return self.accum_steps
        window_start = self.position - self.position % self.accum_steps
        return max(1, min(self.accum_steps, self.total - window_start))

    @property
    def is_boundary(self) -> bool:
        """Whether the next micro-step closes its window (synchronise gradients, then step)."""
        if self.accum_steps == 1:
            return True
        return self.position % self.accum_steps + 1 >= self.window_size

    def normalize(self, loss: torch.Tensor) -> torch.Tensor:
        """Divide a micro-step loss by the size of its window."""
        if self.accum_steps == 1:
            return loss
        size = self.window_size
        return loss if size == 1 else loss / size

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """``model.no_sync()`` for micro-steps that do not close their window, else a no-op context.

        Run forward and backward inside it. Models without ``no_sync`` (not DDP) get a no-op.
        """
        if self.is_boundary or not hasattr(model, "no_sync"):
            return contextlib.nullcontext()
        return model.no_sync()

    def advance(self) -> bool:
        """Record one finished micro-step; return whether the optimizer should step now."""
        if self.accum_steps == 1:  # every micro-step is its own window
            self.position += 1
            return True
        boundary = self.is_boundary
        self.position += 1
        self._pending = 0 if boundary else self._pending + 1
        return boundary

    def finish(self) -> float | None:
        """End a pass. Return ``None`` if no window is open, else the gradient rescale factor for it.

        The factor (``accum_steps / micro-steps taken``) turns the open window's gradients into
        their mean; multiply the gradients by it (after averaging them over ranks under DDP) and
        step the optimizer. The open window is closed either way.
        """
        pending, self._pending = self._pending, 0
        if pending == 0:
            return None
        return self.accum_steps / pending

    def state_dict(self) -> dict[str, Any]:
        """Position in the current pass."""
        return {"accum_steps": self.accum_steps, "total": self.total, "position": self.position}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a position; the next `start` continues that pass if it was unfinished."""
        self.total = state_dict.get("total")
        self.position = int(state_dict.get("position", 0))
        self._pending = self.position % self.accum_steps if self.total is None else 0
        self._resumed = True


def _grads(parameters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in parameters if p.grad is not None]


def scale_gradients(parameters: Iterable[torch.Tensor], factor: float) -> None:
    """Multiply every existing ``.grad`` of `parameters` by `factor` in place."""
    grads = _grads(parameters)
    if grads and factor != 1:
        torch._foreach_mul_(grads, factor)


def clip_gradients(
    parameters: Iterable[torch.Tensor], max_grad_norm: float | None = None, max_grad_value: float | None = None
) -> torch.Tensor | None:
    """Clip gradients in place: first each element to ``±max_grad_value``, then the global norm to ``max_grad_norm``.

    Gradients must already be unscaled when a ``GradScaler`` is in use. No host synchronisation.

    Returns:
        The total gradient norm before norm clipping (a tensor), or ``None`` when norm clipping is off.

    Examples:
        >>> w = torch.zeros(2, requires_grad=True); w.grad = torch.tensor([3.0, 4.0])
        >>> clip_gradients([w], max_grad_norm=1.0)
        tensor(5.)
        >>> w.grad
        tensor([0.6000, 0.8000])
    """
    parameters = [p for p in parameters if p.grad is not None]
    if max_grad_value is not None:
        if max_grad_value <= 0:
            raise ValueError(f"max_grad_value must be positive, got {max_grad_value!r}")
        torch.nn.utils.clip_grad_value_(parameters, max_grad_value)
    if max_grad_norm is None:
        return None
    if max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm!r}")
    if not parameters:
        return torch.zeros(())
    return torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm)


def has_nonfinite_gradients(parameters: Iterable[torch.Tensor], *, distributed: bool = True) -> bool:
    """Whether any gradient holds ``inf``/``nan``, agreed across ranks.

    With `distributed` (the default) and an active multi-rank group the local flag is all-reduced,
    so every rank gets the same answer and takes the same branch; the call is then collective and
    every rank must make it. The answer is read on the host: one synchronisation per call.

    Examples:
        >>> w = torch.zeros(2, requires_grad=True); w.grad = torch.tensor([1.0, float("nan")])
        >>> has_nonfinite_gradients([w])
        True
    """
    grads = _grads(parameters)
    flag = torch.zeros((), dtype=torch.bool)
    if grads:
        # The max-norm of a tensor is non-finite exactly when an element is; unlike the 2-norm it cannot overflow.
        norms = torch._foreach_norm(grads, float("inf"))
        flag = ~torch.stack([n.to(grads[0].device, torch.float32) for n in norms]).isfinite().all()
    if distributed:
        flag = all_reduce_any(flag)
    return bool(flag)


class OptimizerContainer:
    """One optimizer update: unscale, non-finite check, clipping, step, scheduler, zeroing.

    `step` is what a runner calls at the end of an accumulation window. An update is skipped
    (gradients zeroed, scheduler not advanced, ``False`` returned, `skipped_steps` incremented)
    when the gradients are non-finite and either ``skip_nonfinite_grad`` is on or a
    ``GradScaler`` is in use (the scaler would skip the step anyway; it then lowers its scale). The
    non-finite decision is all-reduced, so every rank skips together; it costs one host
    synchronisation per update and is only made when one of those two options applies.

    Args:
        optimizer: The optimizer to step.
        scheduler: Optional LR scheduler, stepped after each applied update when
            ``scheduler_interval == "step"``.
        precision: The [`Precision`][danling.runners.torch_components.Precision] whose scaler (if
            any) unscales gradients and steps the optimizer.
        max_grad_norm: Clip the global gradient norm to this value.
        max_grad_value: Clip each gradient element to ``±max_grad_value``.
        skip_nonfinite_grad: Skip updates whose gradients contain ``inf``/``nan``.
        scheduler_interval: ``"step"`` to advance the scheduler here; any other value leaves it to
            the caller (e.g. once per epoch).

    Examples:
        >>> model = nn.Linear(2, 1)
        >>> container = OptimizerContainer(torch.optim.SGD(model.parameters(), lr=0.1), skip_nonfinite_grad=True)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> container.step()
        True
        >>> (model(torch.ones(1, 2)) * float("nan")).sum().backward()
        >>> container.step(), container.skipped_steps, model.weight.grad
        (False, 1, None)
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None = None,
        *,
        precision: Precision | None = None,
        max_grad_norm: float | None = None,
        max_grad_value: float | None = None,
        skip_nonfinite_grad: bool = False,
        scheduler_interval: str = "step",
    ) -> None:
        for name, value in (("max_grad_norm", max_grad_norm), ("max_grad_value", max_grad_value)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive or None, got {value!r}")
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.precision = precision
        self.max_grad_norm = max_grad_norm
        self.max_grad_value = max_grad_value
        self.skip_nonfinite_grad = skip_nonfinite_grad
        self.scheduler_interval = scheduler_interval
        self.skipped_steps = 0
        self.last_grad_norm: torch.Tensor | None = None

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return None if self.precision is None else self.precision.scaler

    def parameters(self) -> Iterator[torch.Tensor]:
        """Every parameter the optimizer updates."""
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def step(self, grad_multiplier: float | None = None) -> bool:
        """Apply one update from the accumulated gradients; return whether it was applied.

        Args:
            grad_multiplier: Optional factor applied to the (unscaled) gradients first, e.g. the
                value of [`GradientAccumulator.finish`][danling.runners.torch_components.GradientAccumulator.finish].
        """
        precision = self.precision
        scaler = None if precision is None else precision.scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        if grad_multiplier is not None:
            scale_gradients(self.parameters(), grad_multiplier)
        if (self.skip_nonfinite_grad or scaler is not None) and has_nonfinite_gradients(self.parameters()):
            self.skipped_steps += 1
            if scaler is not None:
                scaler.update()  # unscale_ recorded the overflow: back off the scale
            self.optimizer.zero_grad(set_to_none=True)
            return False
        if self.max_grad_norm is None and self.max_grad_value is None:
            self.last_grad_norm = None  # clipping off: skip collecting the gradients
        else:
            self.last_grad_norm = clip_gradients(self.parameters(), self.max_grad_norm, self.max_grad_value)
        if scaler is not None:
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None and self.scheduler_interval == "step":
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def state_dict(self) -> dict[str, Any]:
        """Skip counter and scaler state (optimizer and scheduler are checkpointed on their own)."""
        return {
            "skipped_steps": self.skipped_steps,
            "scaler": {} if self.precision is None else self.precision.state_dict(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        if self.precision is not None:
            self.precision.load_state_dict(state_dict.get("scaler") or {})


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
