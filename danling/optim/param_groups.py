"""Split named parameters into optimizer parameter groups by regular expression."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor

__all__ = ["build_param_groups"]


def build_param_groups(
    named_parameters: Iterable[tuple[str, Tensor]],
    param_groups: Sequence[Mapping[str, Any]],
    lr: float | None = None,
    weight_decay: float | None = None,
    betas: Sequence[float] | None = None,
) -> list[dict[str, Any]]:
    """Assign parameters to groups whose `pattern` matches their name (`re.search`).

    Each entry of `param_groups` needs a `pattern`; every other key is a group option passed to the
    optimizer as is (`lr`, `weight_decay`, `momentum`, ...), except four derived options that scale
    or replace the top-level values:

    - `lr_multiplier`: group `lr` = `lr * lr_multiplier`;
    - `weight_decay_multiplier`: group `weight_decay` = `weight_decay * weight_decay_multiplier`;
    - `beta1` / `beta2`: replace one element of `betas`, keeping the other.

    Parameters matched by no pattern form the first group, without options, so they keep the
    optimizer-level defaults. Groups keep the order of `param_groups`; groups that end up empty are
    dropped (with a warning naming the pattern, which is usually a typo).

    Args:
        named_parameters: `(name, parameter)` pairs, e.g. `model.named_parameters()`.
        param_groups: Group specifications as described above.
        lr: Top-level learning rate, the base of `lr_multiplier`.
        weight_decay: Top-level weight decay, the base of `weight_decay_multiplier`.
        betas: Top-level betas, the base of `beta1` / `beta2`.

    Returns:
        Parameter groups ready for a `torch.optim.Optimizer`.

    Raises:
        ValueError: If an entry has no valid `pattern`, mixes a derived option with the option it
            derives (e.g. `lr` and `lr_multiplier`), lacks the base value it needs, or if a parameter
            matches two patterns (the message names the parameter and both patterns).

    Examples:
        >>> import torch
        >>> from danling.optim import build_param_groups
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
        >>> groups = build_param_groups(
        ...     model.named_parameters(),
        ...     [{"pattern": r"bias$", "weight_decay": 0.0}, {"pattern": r"^1\\.weight$", "lr_multiplier": 0.1}],
        ...     lr=1e-3,
        ... )
        >>> [(len(g["params"]), {k: v for k, v in g.items() if k != "params"}) for g in groups]
        [(1, {}), (2, {'weight_decay': 0.0}), (1, {'lr': 0.0001})]
    """
    bases = {"lr": lr, "weight_decay": weight_decay, "betas": betas}
    specs = [_parse_spec(spec, index, bases) for index, spec in enumerate(param_groups)]
    default: list[Tensor] = []
    members: list[list[Tensor]] = [[] for _ in specs]
    for name, parameter in named_parameters:
        matched = [index for index, (regex, _) in enumerate(specs) if regex.search(name)]
        if len(matched) > 1:
            first, second = (specs[index][0].pattern for index in matched[:2])
            raise ValueError(
                f"parameter {name!r} matches more than one param_groups pattern: {first!r} and {second!r}; "
                "make the patterns disjoint (anchor them with ^ and $)"
            )
        (members[matched[0]] if matched else default).append(parameter)
    groups: list[dict[str, Any]] = [{"params": default}] if default else []
    for (regex, options), params in zip(specs, members):
        if params:
            groups.append({"params": params, **options})
        else:
            warnings.warn(f"param_groups pattern {regex.pattern!r} matched no parameter", UserWarning, stacklevel=2)
    return groups


def _parse_spec(spec: Mapping[str, Any], index: int, bases: Mapping[str, Any]) -> tuple[re.Pattern, dict[str, Any]]:
    """Compile one group specification into `(regex, optimizer options)`."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"param_groups[{index}] must be a mapping with a 'pattern', got {spec!r}")
    options = dict(spec)
    pattern = options.pop("pattern", None)
    if not isinstance(pattern, str):
        raise ValueError(f"param_groups[{index}] needs a string 'pattern', got {pattern!r}")
    try:
        regex = re.compile(pattern)
    except re.error as error:
        raise ValueError(f"param_groups[{index}] has an invalid pattern {pattern!r}: {error}") from None
    where = f"param_groups[{index}] (pattern {pattern!r})"
    for derived, option in (("lr_multiplier", "lr"), ("weight_decay_multiplier", "weight_decay")):
        if derived not in options:
            continue
        multiplier = options.pop(derived)
        if option in options:
            raise ValueError(f"{where} sets both {option} and {derived}; use one")
        if bases[option] is None:
            raise ValueError(f"{where} uses {derived} but no top-level {option} is known")
        options[option] = bases[option] * multiplier
    if "beta1" in options or "beta2" in options:
        if "betas" in options:
            raise ValueError(f"{where} sets both betas and beta1/beta2; use one")
        if bases["betas"] is None:
            raise ValueError(f"{where} uses beta1/beta2 but the optimizer has no betas")
        beta1, beta2 = bases["betas"]
        options["betas"] = (options.pop("beta1", beta1), options.pop("beta2", beta2))
    if isinstance(options.get("betas"), list):  # YAML has no tuples
        options["betas"] = tuple(options["betas"])
    if "lr" in options and options["lr"] < 0:
        raise ValueError(f"{where} has a negative learning rate: {options['lr']}")
    return regex, options
