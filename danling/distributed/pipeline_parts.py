"""Pipeline stage modules cut out of a model by module names, and the placement of stages on ranks.

A pipeline stage built from `parallel.module_fqns_per_model_part` is a
[`PipelineModelPart`][danling.distributed.pipeline_parts.PipelineModelPart]: it holds the
named submodules of the original model at their original dotted paths, so its `state_dict()`
keys are exactly the keys those parameters have in the whole model. Checkpoints written by one
pipeline layout therefore load into another layout (or into the unsplit model) key for key.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["PipelineModelPart", "stage_placement", "validate_module_fqns"]

# Schedules whose stages are placed in a V: rank r owns stage r and stage 2 * pp - 1 - r.
V_SCHEDULES = frozenset({"zbvzerobubble", "dualpipev"})


class PipelineModelPart(nn.Module):
    """A slice of a model: some of its submodules, kept at their original paths and run in order.

    Each module named in `fqns` is taken from `model` (the object itself, not a copy) and
    registered under the same dotted path inside this part: `"layers.3"` becomes
    `part.layers[3]`-like nesting, so `part.state_dict()` has the key `"layers.3.weight"`
    exactly as `model.state_dict()` does. The forward pass feeds the input through the modules
    in the order of `fqns`, each module's output being the next one's input.

    The modules are shared with `model`, never copied: a rank that keeps only its own parts
    (and drops `model`) holds no parameters of other stages.

    Args:
        model: The whole model.
        fqns: Dotted names of the submodules of this part, in execution order.

    Raises:
        ValueError: `fqns` is empty, names a module `model` does not have, names one twice, or
            names a module inside another one of the list.

    Examples:
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> part = PipelineModelPart(model, ["1", "2"])
        >>> list(part.state_dict())
        ['2.weight', '2.bias']
    """

    def __init__(self, model: nn.Module, fqns: Sequence[str]) -> None:
        super().__init__()
        if isinstance(fqns, str) or not fqns:
            raise ValueError(f"a pipeline model part needs a non-empty list of module names, got {fqns!r}")
        self.fqns: tuple[str, ...] = tuple(fqns)
        for fqn in self.fqns:
            self._attach(fqn, _get_submodule(model, fqn))

    def _attach(self, fqn: str, module: nn.Module) -> None:
        *parents, name = fqn.split(".")
        node: nn.Module = self
        for depth, parent in enumerate(parents):
            child = node._modules.get(parent)
            if child is None:
                child = _Namespace()
                node.add_module(parent, child)
            elif not isinstance(child, _Namespace):
                inner = ".".join(parents[: depth + 1])
                raise ValueError(f"module {fqn!r} lies inside {inner!r}, which the same part already holds")
            node = child
        if name in node._modules:
            raise ValueError(f"module {fqn!r} is listed twice, or contains another module of the same part")
        node.add_module(name, module)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output = input
        for fqn in self.fqns:
            output = self.get_submodule(fqn)(output)
        return output

    def extra_repr(self) -> str:
        return f"fqns={list(self.fqns)}"


class _Namespace(nn.Module):
    """An intermediate path node of a `PipelineModelPart`: holds children, is never called."""

    def forward(self, *args, **kwargs):  # pragma: no cover - never part of the execution order
        raise RuntimeError("a pipeline part's path container is not callable")


def _get_submodule(model: nn.Module, fqn: str) -> nn.Module:
    if not isinstance(fqn, str) or not fqn:
        raise ValueError(f"module names must be non-empty strings, got {fqn!r}")
    try:
        return model.get_submodule(fqn)
    except AttributeError:
        raise ValueError(f"{type(model).__name__} has no submodule {fqn!r}") from None


def validate_module_fqns(fqns_per_part: Sequence[Sequence[str]], pipeline_degree: int) -> list[list[str]]:
    """Check `parallel.module_fqns_per_model_part` against the pipeline degree.

    Args:
        fqns_per_part: One list of module names per pipeline stage, stage 0 first.
        pipeline_degree: Number of pipeline ranks.

    Returns:
        The names as lists of strings.

    Raises:
        ValueError: the outer list is empty, its length is not a multiple of the pipeline
            degree, a stage has no modules, or a module is listed for two stages.
    """
    if isinstance(fqns_per_part, str) or not isinstance(fqns_per_part, Sequence) or not fqns_per_part:
        raise ValueError(
            f"parallel.module_fqns_per_model_part must be a non-empty list of module-name lists, got {fqns_per_part!r}"
        )
    parts = [[fqns] if isinstance(fqns, str) else list(fqns) for fqns in fqns_per_part]
    if len(parts) % pipeline_degree:
        raise ValueError(
            f"parallel.module_fqns_per_model_part has {len(parts)} stages, which is not a multiple of the "
            f"pipeline degree {pipeline_degree}; give pipeline x stages-per-rank lists"
        )
    seen: dict[str, int] = {}
    for stage, fqns in enumerate(parts):
        if not fqns:
            raise ValueError(f"parallel.module_fqns_per_model_part[{stage}] is empty; every stage needs a module")
        for fqn in fqns:
            if fqn in seen:
                raise ValueError(f"module {fqn!r} is listed for pipeline stages {seen[fqn]} and {stage}")
            seen[fqn] = stage
    return parts


def stage_placement(num_stages: int, pipeline_degree: int, style: str = "loop") -> dict[int, int]:
    """Pipeline rank that owns each stage.

    `"loop"` places stage `s` on rank `s % pp` (rank r owns r, r + pp, r + 2pp, ...); `"v"`
    runs down the ranks and back up (rank r owns r and 2pp - 1 - r, ...), as the zero-bubble
    V schedules require.

    Raises:
        ValueError: `num_stages` is not a positive multiple of `pipeline_degree`, or an unknown style.

    Examples:
        >>> stage_placement(4, 2)
        {0: 0, 1: 1, 2: 0, 3: 1}
        >>> stage_placement(4, 2, "v")
        {0: 0, 1: 1, 2: 1, 3: 0}
    """
    if num_stages < 1 or num_stages % pipeline_degree:
        raise ValueError(
            f"{num_stages} pipeline stages cannot be spread evenly over pipeline degree {pipeline_degree}; "
            "the stage count must be a positive multiple of it"
        )
    if style == "loop":
        return {stage: stage % pipeline_degree for stage in range(num_stages)}
    if style == "v":
        placement = {}
        for stage in range(num_stages):
            lap, offset = divmod(stage, pipeline_degree)
            placement[stage] = offset if lap % 2 == 0 else pipeline_degree - 1 - offset
        return placement
    raise ValueError(f"unknown stage placement style {style!r}; accepted: 'loop', 'v'")
