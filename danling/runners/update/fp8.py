"""Float8 training (`precision: fp8`): which linears torchao's float8 training converts, and who may run it.

[`Fp8Policy`][danling.runners.update.fp8.Fp8Policy] is built from the `fp8.*` section
([`Fp8Config`][danling.runners.config_sections.Fp8Config]) once a run asks for fp8;
[`fp8_refusal`][danling.runners.update.fp8.fp8_refusal] says, before any training, why a device
cannot run it; [`convert_to_fp8`][danling.runners.update.fp8.convert_to_fp8] swaps the eligible
`nn.Linear` layers for torchao's `Float8Linear` and reports every decision. The rest of the model
runs under bf16 autocast (the runner's `Precision("fp8")`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["Fp8Conversion", "Fp8Mixin", "Fp8Policy", "convert_to_fp8", "fp8_refusal"]

# Float8 matrix products (torch._scaled_mm) need Ada (8.9) or Hopper (9.0) and later.
MIN_CAPABILITY = (8, 9)
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@runtime_checkable
class Fp8Mixin(Protocol):
    """The fp8 surface of a runner (`fp8_enabled`, `setup_fp8`), named as the reference names it.

    A protocol rather than a base class: `TorchRunner` implements these names itself (the work is
    in this module's functions), so `isinstance(runner, Fp8Mixin)` holds without another class in
    its MRO.
    """

    @property
    def fp8_enabled(self) -> bool: ...

    def setup_fp8(self) -> None: ...


def fp8_refusal(device: torch.device, *, emulate: bool = False) -> str | None:
    """Why `precision: fp8` cannot train on `device` (one line), or None when it can.

    Examples:
        >>> fp8_refusal(torch.device("cpu"))
        'precision: fp8 needs a CUDA device of compute capability >= 8.9 (Ada, Hopper or later); this run is on cpu'
    """
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        return f"precision: fp8 needs torchao (pip install 'danling[fp8]'): {err}"
    if emulate:
        return None
    if device.type != "cuda":
        needs = "precision: fp8 needs a CUDA device of compute capability >= 8.9 (Ada, Hopper or later)"
        return f"{needs}; this run is on {device}"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (
            f"precision: fp8 needs a CUDA device of compute capability >= 8.9; {device} is {name} "
            f"of compute capability {capability[0]}.{capability[1]}"
        )
    return None


@dataclass
class Fp8Conversion:
    """What `convert_to_fp8` did: the converted linears' names and each skipped linear's reason."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def convert_to_fp8(
    model: nn.Module,
    *,
    recipe: str = "tensorwise",
    filter_fqns: list[str] | tuple[str, ...] = (),
    fsdp_all_gather: bool = False,
    emulate: bool = False,
) -> Fp8Conversion:
    """Swap the eligible `nn.Linear` layers of `model` (in place) for torchao's `Float8Linear`.

    A linear stays in high precision when its qualified name contains one of `filter_fqns`, or when
    its input or output size is not divisible by 16 (what float8 matrix products require).

    Args:
        model: The model, before compilation and wrapping (FSDP2 shards it after).
        recipe: `"tensorwise"`, `"rowwise"` or `"rowwise_with_gw_hp"` (torchao's recipe names).
        filter_fqns: Substrings of qualified module names to keep in high precision.
        fsdp_all_gather: All-gather FSDP2-sharded weights in float8 (tensorwise only).
        emulate: Emulate the float8 matrix products (any device).

    Raises:
        ValueError: an unknown `recipe`, or `fsdp_all_gather` with a recipe other than tensorwise.
        ImportError: torchao is not installed.
    """
    if recipe not in RECIPES:
        raise ValueError(f"fp8.recipe={recipe!r} is not a float8 recipe; accepted: {list(RECIPES)}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_all_gather or emulate:
        if fsdp_all_gather and recipe != "tensorwise":
            raise ValueError(f"fp8.fsdp_all_gather needs fp8.recipe='tensorwise', got {recipe!r}")
        config = _replace(config, enable_fsdp_float8_all_gather=fsdp_all_gather, emulate=emulate)
    report = Fp8Conversion()

    def eligible(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        reason = _skip_reason(module, name, filter_fqns)
        if reason is None:
            report.converted.append(name)
        else:
            report.skipped[name] = reason
        return reason is None

    convert_to_float8_training(model, module_filter_fn=eligible, config=config)
    return report


def _skip_reason(linear: nn.Linear, name: str, filter_fqns: Any) -> str | None:
    matched = next((fqn for fqn in filter_fqns if fqn in name), None)
    if matched is not None:
        return f"name matches fp8.filter_fqns entry {matched!r}"
    if linear.in_features % 16 or linear.out_features % 16:
        return f"{linear.in_features}x{linear.out_features} is not divisible by 16"
    return None


def _replace(config: Any, **changes: Any) -> Any:
    from dataclasses import replace

    return replace(config, **changes)


class Fp8Policy:
    """The fp8 settings of a run (`fp8.*`), applied to each model (part) by `materialize_model`.

    Args:
        recipe: torchao's float8 recipe name.
        filter_fqns: Substrings of module names kept in high precision.
        fsdp_all_gather: All-gather in float8 where the layout is FSDP2.
        emulate: Emulate the float8 matrix products (tests; any device).
    """

    def __init__(
        self, recipe: str = "tensorwise", filter_fqns: Any = (), fsdp_all_gather: bool = True, emulate: bool = False
    ) -> None:
        if recipe not in RECIPES:
            raise ValueError(f"fp8.recipe={recipe!r} is not a float8 recipe; accepted: {list(RECIPES)}")
        self.recipe, self.filter_fqns = recipe, tuple(filter_fqns or ())
        self.fsdp_all_gather, self.emulate = fsdp_all_gather, emulate
        self.conversions: list[Fp8Conversion] = []

    def __repr__(self) -> str:
        return f"Fp8Policy(recipe={self.recipe!r}, filter_fqns={list(self.filter_fqns)}, emulate={self.emulate})"

    def apply(self, model: nn.Module, *, fsdp: bool = False) -> Fp8Conversion:
        """Convert `model` in place; `fsdp` says the layout is FSDP2 (float8 all-gather when tensorwise)."""
        conversion = convert_to_fp8(
            model,
            recipe=self.recipe,
            filter_fqns=self.filter_fqns,
            fsdp_all_gather=fsdp and self.fsdp_all_gather and self.recipe == "tensorwise",
            emulate=self.emulate,
        )
        self.conversions.append(conversion)
        return conversion
