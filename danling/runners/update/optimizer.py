"""One optimizer update: gradient rescaling, the non-finite check, clipping, the step and the scheduler."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from danling.distributed import all_reduce_any, is_distributed

from .precision import Precision

__all__ = ["OptimizerContainer", "clip_gradients", "has_nonfinite_gradients", "scale_gradients"]


def _grads(parameters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Existing gradients, as local tensors: a sharded (DTensor) gradient gives its shard.

    Element-wise work (scaling, clamping, the finite check) is the same on the shards, and torch's
    multi-tensor kernels refuse lists that mix DTensors with plain tensors.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    return [g.to_local() if _is_dtensor(g) else g for g in grads]


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "to_local")


def scale_gradients(parameters: Iterable[torch.Tensor], factor: float | torch.Tensor) -> None:
    """Multiply every existing ``.grad`` of `parameters` by `factor` (a number or a 0-d tensor) in place.

    A tensor factor is applied as is, without reading it on the host.
    """
    grads = _grads(parameters)
    if not grads or (not isinstance(factor, torch.Tensor) and factor == 1):
        return
    if isinstance(factor, torch.Tensor):
        factor = factor.to(grads[0].device)
    torch._foreach_mul_(grads, factor)


def clip_gradients(
    parameters: Iterable[torch.Tensor],
    max_grad_norm: float | None = None,
    max_grad_value: float | None = None,
    *,
    norm_group: Any = None,
) -> torch.Tensor | None:
    """Clip gradients in place: first each element to ``±max_grad_value``, then the global norm to ``max_grad_norm``.

    Gradients must already be unscaled when a ``GradScaler`` is in use. No host synchronisation.
    Sharded (DTensor) gradients count with their full tensors, whatever mesh each lives on; with
    `norm_group`, the squared norms of the ranks in that group are summed too (pipeline stages
    hold disjoint parameters, so the global norm spans them all).

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
        local = _grads(parameters)
        if local:
            torch._foreach_clamp_min_(local, -max_grad_value)
            torch._foreach_clamp_max_(local, max_grad_value)
    if max_grad_norm is None:
        return None
    if max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm!r}")
    if not parameters:
        return torch.zeros(())
    sharded = any(_is_dtensor(p.grad) for p in parameters)
    reduce = norm_group is not None and is_distributed(norm_group)
    if not sharded and not reduce:
        return torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm)
    total = _global_norm([p.grad for p in parameters], norm_group if reduce else None)
    coefficient = torch.clamp(max_grad_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(_grads(parameters), coefficient.to(parameters[0].grad.device))
    return total


def _global_norm(grads: list[torch.Tensor], norm_group: Any) -> torch.Tensor:
    """2-norm over `grads`: DTensors grouped by mesh and reduced to full norms, plus the ranks of `norm_group`."""
    by_mesh: dict[int, list[torch.Tensor]] = {}
    plain = []
    for grad in grads:
        if _is_dtensor(grad):
            by_mesh.setdefault(id(grad.device_mesh), []).append(grad)
        else:
            plain.append(grad)
    norms = [torch.nn.utils.get_total_norm(plain)] if plain else []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group)
        norms.append(norm.full_tensor() if _is_dtensor(norm) else norm)
    squared = torch.stack([n.float() for n in norms]).square().sum() if norms else torch.zeros(())
    if norm_group is not None:
        dist.all_reduce(squared, group=norm_group)
    return squared.sqrt()


def has_nonfinite_gradients(parameters: Iterable[torch.Tensor], *, distributed: bool = True, group: Any = None) -> bool:
    """Whether any gradient holds ``inf``/``nan``, agreed across ranks.

    With `distributed` (the default) and an active multi-rank `group` (``None``: the default
    group) the local flag is all-reduced, so every rank gets the same answer and takes the same
    branch; the call is then collective and every rank must make it. The answer is read on the
    host: one synchronisation per call.

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
        flag = all_reduce_any(flag, group=group)
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
        precision: The [`Precision`][danling.runners.update.precision.Precision] whose scaler (if
            any) unscales gradients and steps the optimizer.
        max_grad_norm: Clip the global gradient norm to this value.
        max_grad_value: Clip each gradient element to ``±max_grad_value``.
        skip_nonfinite_grad: Skip updates whose gradients contain ``inf``/``nan``.
        scheduler_interval: ``"step"`` to advance the scheduler here; any other value leaves it to
            the caller (e.g. once per epoch).
        skip_group: Process group whose ranks agree on a non-finite skip (``None``: every rank).
        norm_group: Process group of ranks holding disjoint parameters (pipeline stages) whose
            gradients share one global norm for clipping (``None``: the local parameters only).

    Examples:
        >>> model = torch.nn.Linear(2, 1)
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
        skip_group: Any = None,
        norm_group: Any = None,
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
        self.skip_group = skip_group  # ranks that agree on skipping (None: all of them)
        self.norm_group = norm_group  # ranks whose disjoint parameters share one gradient norm
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
                value of [`GradientAccumulator.finish`][danling.runners.update.accumulation.GradientAccumulator.finish].
        """
        precision = self.precision
        scaler = None if precision is None else precision.scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        if grad_multiplier is not None:
            scale_gradients(self.parameters(), grad_multiplier)
        skip_check = self.skip_nonfinite_grad or scaler is not None
        if skip_check and has_nonfinite_gradients(self.parameters(), group=self.skip_group):
            self.skipped_steps += 1
            if scaler is not None:
                scaler.update()  # unscale_ recorded the overflow: back off the scale
            self.optimizer.zero_grad(set_to_none=True)
            return False
        if self.max_grad_norm is None and self.max_grad_value is None:
            self.last_grad_norm = None  # clipping off: skip collecting the gradients
        else:
            self.last_grad_norm = clip_gradients(
                self.parameters(), self.max_grad_norm, self.max_grad_value, norm_group=self.norm_group
            )
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
