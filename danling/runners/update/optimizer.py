"""One optimizer update: gradient rescaling, the non-finite check, clipping, the step and the scheduler."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from danling.distributed import all_reduce_any, is_distributed

from .precision import Precision
from .spikes import TrainingDivergedError

__all__ = ["OptimizerContainer", "clip_gradients", "has_nonfinite_gradients", "outside_parameters", "scale_gradients"]


def outside_parameters(
    model: torch.nn.Module | None, optimizer: torch.optim.Optimizer, holders: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """The parameters `optimizer` updates that are not in `model`, named by where they are held.

    `holders` maps attribute names to what the runner holds under them (the criterion, other
    modules, bare parameters); a parameter of the criterion is named `criterion.<name>`, a bare
    one by its attribute. A checkpoint stores their optimizer state under these names, so the
    names must not depend on the order the optimizer lists them in.

    Raises:
        ValueError: a parameter is held nowhere in `holders` (it could not be named, so its state
            could not be restored to it).

    Examples:
        >>> from torch import nn
        >>> model, criterion = nn.Linear(2, 1), nn.Module()
        >>> criterion.scale = nn.Parameter(torch.ones(()))
        >>> optimizer = torch.optim.SGD([*model.parameters(), criterion.scale], lr=0.1)
        >>> list(outside_parameters(model, optimizer, {"criterion": criterion}))
        ['criterion.scale']
    """
    inside = {id(param) for param in model.parameters()} if model is not None else set()
    outside = [param for group in optimizer.param_groups for param in group["params"] if id(param) not in inside]
    if not outside:
        return {}
    names: dict[int, str] = {}
    for holder, value in holders.items():
        if isinstance(value, torch.nn.Module):
            for name, param in value.named_parameters():
                names.setdefault(id(param), f"{holder}.{name}")
        elif isinstance(value, torch.Tensor):
            names.setdefault(id(value), holder)
    found = {}
    for param in outside:
        if id(param) not in names:
            raise ValueError(
                f"the {type(optimizer).__name__} updates a parameter of shape {tuple(param.shape)} that is not in the "
                "model and not held by the runner; assign it to the runner (self.<name> = it) or to a module the "
                "runner holds (e.g. the criterion), so that checkpoints can name it"
            )
        found[names[id(param)]] = param
    return found


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
    (gradients zeroed, scheduler not advanced, ``False`` returned, `skipped_steps` incremented, a
    warning logged) when the gradients are non-finite and ``skip_nonfinite_grad``,
    ``check_nonfinite`` or a ``GradScaler`` is in use (the scaler would skip the step anyway; it
    then lowers its scale). The non-finite decision is all-reduced, so every rank skips together;
    it costs one host synchronisation per update and is only made when one of those options applies.

    After ``max_nonfinite_updates`` non-finite updates in a row, `step` raises
    [`TrainingDivergedError`][danling.runners.update.spikes.TrainingDivergedError] instead: by
    default the first one when only ``check_nonfinite`` asked for the check (NaN never reaches the
    weights, and the run does not go on silently), no limit when skipping was asked for.

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
        check_nonfinite: Check for (and drop) non-finite updates even without ``skip_nonfinite_grad``.
        max_nonfinite_updates: Non-finite updates in a row that stop the run (``None``: 1 when only
            ``check_nonfinite`` is on, no limit with ``skip_nonfinite_grad`` or a scaler).
        logger: Where skipped updates are reported (default: ``danling.runners``).

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
        check_nonfinite: bool = False,
        max_nonfinite_updates: int | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        for name, value in (("max_grad_norm", max_grad_norm), ("max_grad_value", max_grad_value)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive or None, got {value!r}")
        limit = max_nonfinite_updates
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"nonfinite.max_consecutive must be a positive integer or None, got {limit!r}")
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.precision = precision
        self.max_grad_norm = max_grad_norm
        self.max_grad_value = max_grad_value
        self.skip_nonfinite_grad = skip_nonfinite_grad
        self.scheduler_interval = scheduler_interval
        self.skip_group = skip_group  # ranks that agree on skipping (None: all of them)
        self.norm_group = norm_group  # ranks whose disjoint parameters share one gradient norm
        self.check_nonfinite = check_nonfinite
        self.max_nonfinite_updates = max_nonfinite_updates
        self.logger = logger or logging.getLogger("danling.runners")
        self.skipped_steps = 0
        self.consecutive_nonfinite = 0
        self.lr_scale = 1.0  # a spike cooldown lowers the learning rates of the updates it covers
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
        skip_check = self.skip_nonfinite_grad or self.check_nonfinite or scaler is not None
        if skip_check and has_nonfinite_gradients(self.parameters(), group=self.skip_group):
            if scaler is not None:
                scaler.update()  # unscale_ recorded the overflow: back off the scale
            self.optimizer.zero_grad(set_to_none=True)
            self._nonfinite_skipped()
            return False
        if scaler is None and self.max_grad_norm is None and self.max_grad_value is None and self.lr_scale == 1.0:
            self.step_plain()
            return True
        self.consecutive_nonfinite = 0
        if self.max_grad_norm is None and self.max_grad_value is None:
            self.last_grad_norm = None  # clipping off: skip collecting the gradients
        else:
            self.last_grad_norm = clip_gradients(
                self.parameters(), self.max_grad_norm, self.max_grad_value, norm_group=self.norm_group
            )
        lowered = self._lower_lr() if self.lr_scale != 1.0 else None
        if scaler is not None:
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        if lowered is not None:  # the scheduler carries on from the rates it set
            for group, lr in zip(self.optimizer.param_groups, lowered):
                group["lr"] = lr
        if self.scheduler is not None and self.scheduler_interval == "step":
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def step_plain(self) -> None:
        """The update of `step` with nothing to unscale, check, clip or lower: optimizer, step-interval
        scheduler, gradients freed. The runner's fused training pass calls it directly."""
        self.consecutive_nonfinite, self.last_grad_norm = 0, None
        self.optimizer.step()
        if self.scheduler is not None and self.scheduler_interval == "step":
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def drop(self) -> None:
        """Drop the window's gradients without an update (a skipped loss spike)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1

    def _lower_lr(self) -> list[Any]:
        """Multiply every group's learning rate by `lr_scale`; return the rates to put back."""
        saved = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * self.lr_scale
        return saved

    def _nonfinite_skipped(self) -> None:
        """Count a dropped non-finite update, report it, and stop once too many came in a row."""
        self.skipped_steps += 1
        self.consecutive_nonfinite += 1
        limit = self.max_nonfinite_updates
        if limit is None and not (self.skip_nonfinite_grad or self.scaler is not None):
            limit = 1
        if limit is not None and self.consecutive_nonfinite >= limit:
            # Suggest skip_nonfinite_grad only where it is off: with it on, the limit is the only knob.
            hint = "raise nonfinite.max_consecutive"
            if not self.skip_nonfinite_grad:
                hint = f"set skip_nonfinite_grad=True to skip such updates, or {hint}"
            raise TrainingDivergedError(
                f"{self.consecutive_nonfinite} update(s) in a row had non-finite (NaN/inf) gradients; stopping "
                f"(nonfinite.max_consecutive={limit}). The weights were not updated with them: {hint}"
            )
        if self.scaler is None:  # a scaler's overflow skips are routine while it settles its scale
            self.logger.warning(
                "skipped an update with non-finite (NaN/inf) gradients (%d skipped so far, %d in a row)",
                self.skipped_steps,
                self.consecutive_nonfinite,
            )

    def state_dict(self) -> dict[str, Any]:
        """Skip counter and scaler state (optimizer and scheduler are checkpointed on their own)."""
        return {
            "skipped_steps": self.skipped_steps,
            "consecutive_nonfinite": self.consecutive_nonfinite,
            "scaler": {} if self.precision is None else self.precision.state_dict(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.consecutive_nonfinite = int(state_dict.get("consecutive_nonfinite", 0))
        if self.precision is not None:
            self.precision.load_state_dict(state_dict.get("scaler") or {})
