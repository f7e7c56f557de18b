"""Optimizer and scheduler registries and the builders that turn configuration into objects."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

import torch
from chanfig import Variable
from torch import nn
from torch.optim import Optimizer, swa_utils
from torch.optim import lr_scheduler as torch_schedulers

from ..utils.registry import Registry, normalize
from .lr_scheduler import LR_METHODS, LRScheduler, phase_steps
from .param_groups import build_param_groups
from .phases import PhaseScheduler

__all__ = ["OPTIMIZERS", "SCHEDULERS", "build_optimizer", "build_scheduler", "is_metric_scheduler"]

# Keys of a scheduler section that configure the runner's dispatch, not the scheduler itself.
RUNNER_SCHEDULER_KEYS = ("interval", "monitor")

# torch schedulers that call the run length something other than `total_steps`.
_TOTAL_STEPS_ALIASES = {"cosineannealinglr": "T_max", "polynomiallr": "total_iters"}


class _SchedulerRegistry(Registry):
    """Scheduler registry that also resolves every name in `LR_METHODS` to an `LRScheduler` with that method."""

    def lookup(self, name: str) -> Callable[..., Any] | None:
        entry = super().lookup(name)
        if entry is None and LR_METHODS.lookup(name) is not None:
            return partial(LRScheduler, method=name)
        return entry

    def names(self) -> list[str]:
        return sorted({*super().names(), *LR_METHODS.names()})


OPTIMIZERS = Registry("optimizer")
"""Optimizers by name: every `torch.optim` optimizer under its lower-cased class name (`"adamw"`, `"sgd"`, ...)."""

SCHEDULERS = _SchedulerRegistry("scheduler")
"""Learning-rate schedulers by name.

Holds [`LRScheduler`][danling.optim.LRScheduler] (`"lrscheduler"`), each of its methods as a shortcut
(`"cosine"` builds `LRScheduler(method="cosine")`), [`PhaseScheduler`][danling.optim.PhaseScheduler]
(`"phases"`), and every `torch.optim.lr_scheduler` class under its lower-cased name
(`"steplr"`, `"onecyclelr"`, `"reducelronplateau"`, ...).
"""


def _register_torch() -> None:
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if isinstance(obj, type) and issubclass(obj, Optimizer) and obj is not Optimizer:
            OPTIMIZERS.register(obj)
    bases = (torch_schedulers.LRScheduler, torch_schedulers._LRScheduler)
    for name in dir(torch_schedulers):
        obj = getattr(torch_schedulers, name)
        if not isinstance(obj, type) or obj in bases:
            continue
        if issubclass(obj, (torch_schedulers.LRScheduler, torch_schedulers.ReduceLROnPlateau)):
            SCHEDULERS.register(obj)
    SCHEDULERS.register(swa_utils.SWALR)
    SCHEDULERS.register(LRScheduler)
    SCHEDULERS.register(PhaseScheduler)
    SCHEDULERS.register(PhaseScheduler, "phases")
    SCHEDULERS.register(PhaseScheduler, "piecewise")


_register_torch()


def to_plain(value: Any) -> Any:
    """Recursively turn mappings (chanfig `Config`, `NestedDict`, ...) into dicts and unwrap chanfig variables."""
    if isinstance(value, Variable):
        return to_plain(value.value)
    if isinstance(value, Mapping):
        return {key: to_plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_plain(item) for item in value)
    return value


def _options(config: Mapping[str, Any] | None, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Merge a config section with overrides; keys set to `None` count as unset (typed configs default to `None`)."""
    options = to_plain(dict(config or {}))
    options.update(overrides)
    return {key: value for key, value in options.items() if value is not None}


def build_optimizer(
    params: nn.Module | Iterable[Any], config: Mapping[str, Any] | None = None, **overrides: Any
) -> Optimizer:
    """Build an optimizer from a configuration mapping such as `RunnerConfig.optim`.

    `type` names the optimizer in [`OPTIMIZERS`][danling.optim.OPTIMIZERS]; `param_groups` (optional)
    is a list of regex groups handled by [`build_param_groups`][danling.optim.build_param_groups], with
    `lr`, `weight_decay` and `betas` of the section (or the optimizer's defaults) as the bases of
    `lr_multiplier`, `weight_decay_multiplier`, `beta1` and `beta2`. Every other key is passed to the
    optimizer. A YAML list for `betas` becomes a tuple; keys set to `None` are treated as unset.

    Args:
        params: A module (its trainable parameters are used, by name), `(name, parameter)` pairs,
            plain parameters, or ready-made parameter-group dicts (the last two without `param_groups`).
        config: The optimizer section; a dict or chanfig `Config`.
        **overrides: Keys that take precedence over `config`.

    Returns:
        The optimizer.

    Raises:
        ValueError: On a missing or unknown `type` (listing the registered names), a negative `lr`,
            options the optimizer does not accept, or invalid `param_groups`.

    Examples:
        >>> import torch
        >>> from danling.optim import build_optimizer
        >>> model = torch.nn.Linear(4, 2)
        >>> config = {"type": "AdamW", "lr": 1e-3, "weight_decay": 0.05,
        ...           "param_groups": [{"pattern": "bias$", "weight_decay_multiplier": 0.0, "beta2": 0.95}]}
        >>> optimizer = build_optimizer(model, config)
        >>> type(optimizer).__name__, len(optimizer.param_groups)
        ('AdamW', 2)
        >>> optimizer.param_groups[1]["weight_decay"], optimizer.param_groups[1]["betas"]
        (0.0, (0.9, 0.95))
    """
    options = _options(config, overrides)
    name = options.pop("type", None)
    if name is None:
        raise ValueError(f"optimizer config needs a 'type'; registered: {', '.join(OPTIMIZERS.names())}")
    optimizer_cls = OPTIMIZERS.get(name)
    specs = options.pop("param_groups", None)
    if isinstance(options.get("betas"), list):
        options["betas"] = tuple(options["betas"])
    if options.get("lr") is not None and options["lr"] < 0:
        raise ValueError(f"optimizer lr must be non-negative, got {options['lr']}")
    groups = _parameter_groups(params, specs, optimizer_cls, options)
    return OPTIMIZERS.build(groups, type=name, **options)


def _parameter_groups(params: Any, specs: Any, optimizer_cls: type, options: Mapping[str, Any]) -> list[Any]:
    if isinstance(params, nn.Module):
        named = [(name, param) for name, param in params.named_parameters() if param.requires_grad]
    else:
        items = list(params)
        if all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) for item in items):
            named = items
        elif specs:
            raise ValueError("optim.param_groups needs named parameters: pass a module or (name, parameter) pairs")
        else:
            return items
    if not specs:
        return [param for _, param in named]
    defaults = {
        key: parameter.default
        for key, parameter in inspect.signature(optimizer_cls).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }
    return build_param_groups(
        named,
        specs,
        lr=options.get("lr", defaults.get("lr")),
        weight_decay=options.get("weight_decay", defaults.get("weight_decay")),
        betas=options.get("betas", defaults.get("betas")),
    )


def build_scheduler(
    optimizer: Optimizer,
    config: Mapping[str, Any] | None = None,
    total_steps: int | None = None,
    **overrides: Any,
) -> Any:
    """Build a learning-rate scheduler from a configuration mapping such as `RunnerConfig.sched`.

    `type` names the scheduler in [`SCHEDULERS`][danling.optim.SCHEDULERS]. The runner-level keys
    `interval` and `monitor` are ignored here (they decide when the runner steps the scheduler, see
    [`is_metric_scheduler`][danling.optim.is_metric_scheduler]). `total_steps` fills in the run length
    of schedulers that take one and do not set it in `config`: `total_steps` itself (danling's
    schedulers, `OneCycleLR`), `T_max` (`CosineAnnealingLR`) or `total_iters` (`PolynomialLR`).
    Keys set to `None` are treated as unset.

    Args:
        optimizer: The optimizer to schedule.
        config: The scheduler section; a dict or chanfig `Config`. Empty or `None` means no scheduler.
        total_steps: Number of optimizer steps of the run, if known.
        **overrides: Keys that take precedence over `config`.

    Returns:
        The scheduler, or `None` when the configuration is empty.

    Raises:
        ValueError: On a missing or unknown `type` (listing the registered names) or arguments the
            scheduler does not accept or lacks (e.g. no `total_steps` for `"cosine"`).

    Examples:
        >>> import torch
        >>> from danling.optim import build_optimizer, build_scheduler
        >>> optimizer = build_optimizer(torch.nn.Linear(2, 1), {"type": "sgd", "lr": 0.1})
        >>> build_scheduler(optimizer, {"type": "cosine", "warmup_steps": 10, "interval": "step"}, total_steps=100)
        LRScheduler(method='cosine', scaling='percentile', final_lr_ratio=0.001, total_steps=100, warmup_steps=10,
                    cooldown_steps=20, min_lr=1e-09)
        >>> build_scheduler(optimizer, {}) is None
        True
    """
    options = _options(config, overrides)
    for key in RUNNER_SCHEDULER_KEYS:
        options.pop(key, None)
    if not options:
        return None
    name = options.pop("type", None)
    if name is None:
        raise ValueError(f"scheduler config needs a 'type'; registered: {', '.join(SCHEDULERS.names())}")
    scheduler_cls = SCHEDULERS.get(name)
    if total_steps is not None:
        accepted = inspect.signature(scheduler_cls).parameters
        for key in ("total_steps", _TOTAL_STEPS_ALIASES.get(normalize(name))):
            if key is not None and key in accepted:
                options.setdefault(key, total_steps)
                break
        if "warmup_steps" in accepted and "cooldown_steps" in accepted:
            _fit_phases(options, options.get("total_steps", total_steps))
    return SCHEDULERS.build(optimizer, type=name, **options)


def _fit_phases(options: dict[str, Any], total_steps: Any) -> None:
    """Shrink configured warmup + cooldown steps that exceed a short run, keeping their proportion.

    A config written for a long run (`warmup_steps: 500`) must still work for a 10-step smoke
    test; the shortening is announced with a warning that names both values.
    """
    if not isinstance(total_steps, int) or total_steps < 1:
        return
    warmup = phase_steps(options.get("warmup_steps", total_steps // 20), total_steps)
    cooldown = phase_steps(options.get("cooldown_steps", total_steps // 5), total_steps)
    if not (isinstance(warmup, int) and isinstance(cooldown, int)) or min(warmup, cooldown) < 0:
        return  # LRScheduler names the bad value
    if warmup + cooldown <= total_steps:
        return
    scale = total_steps / (warmup + cooldown)
    fitted = int(warmup * scale), int(cooldown * scale)
    warnings.warn(
        f"scheduler warmup_steps={warmup} + cooldown_steps={cooldown} exceed the run's {total_steps} optimizer "
        f"steps; shortened to {fitted[0]} + {fitted[1]} in the same proportion",
        stacklevel=3,
    )
    options["warmup_steps"], options["cooldown_steps"] = fitted


def is_metric_scheduler(scheduler: Any) -> bool:
    """Whether `scheduler` must be stepped with a monitored value, as in `scheduler.step(val_loss)`.

    True for `ReduceLROnPlateau` and any scheduler whose `step` has a required argument.

    Args:
        scheduler: A scheduler instance, a scheduler class, or a name in [`SCHEDULERS`][danling.optim.SCHEDULERS].

    Examples:
        >>> from danling.optim import is_metric_scheduler
        >>> is_metric_scheduler("ReduceLROnPlateau"), is_metric_scheduler("cosine")
        (True, False)
    """
    if isinstance(scheduler, str):
        scheduler = SCHEDULERS.get(scheduler)
    if isinstance(scheduler, partial):
        scheduler = scheduler.func
    cls = scheduler if isinstance(scheduler, type) else type(scheduler)
    if issubclass(cls, torch_schedulers.ReduceLROnPlateau):
        return True
    step = getattr(cls, "step", None)
    if step is None:
        return False
    parameters = list(inspect.signature(step).parameters.values())[1:]  # drop self
    return any(
        parameter.default is inspect.Parameter.empty
        and parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for parameter in parameters
    )
