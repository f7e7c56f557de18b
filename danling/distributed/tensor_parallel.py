"""Tensor parallelism from a plan in the config, and activation checkpointing of a model's blocks."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

__all__ = ["TENSOR_PARALLEL_STYLES", "apply_tensor_plan", "checkpoint_blocks", "parallelize"]

TENSOR_PARALLEL_STYLES = ("colwise", "rowwise", "sequence")
"""Styles a `parallel.tensor_plan` entry may name: torch's ColwiseParallel, RowwiseParallel, SequenceParallel."""


def _style(name: str) -> Any:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence": SequenceParallel}[name]()


def _matches(name: str, pattern: str) -> bool:
    """`*` stands for one name level, as in torch's `parallelize_module` plans."""
    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(fnmatchcase(part, atom) for part, atom in zip(parts, atoms))


def apply_tensor_plan(model: nn.Module, mesh: Any, plan: Mapping[str, str]) -> nn.Module:
    """Split the modules named by `plan` over the tensor-parallel `mesh`.

    Args:
        model: The model (on its device, not yet sharded by FSDP).
        mesh: The 1-D device mesh of the tensor axis.
        plan: Module-name pattern to style (see `TENSOR_PARALLEL_STYLES`).

    Raises:
        ValueError: A style is unknown, or a pattern matches no module (a plan that would leave
            the model unsplit while the tensor axis duplicates its work).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(f"parallel.tensor_plan must map module-name patterns to styles, got {plan!r}")
    plan = _flatten(plan)
    names = [name for name, _ in model.named_modules() if name]
    styles = {}
    for pattern, style in plan.items():
        if style not in TENSOR_PARALLEL_STYLES:
            raise ValueError(
                f"parallel.tensor_plan[{pattern!r}]={style!r} is not a style; "
                f"accepted: {', '.join(TENSOR_PARALLEL_STYLES)}"
            )
        if not any(_matches(name, pattern) for name in names):
            raise ValueError(f"parallel.tensor_plan pattern {pattern!r} matches no module; names include: {names[:8]}")
        styles[pattern] = _style(style)
    return parallelize_module(model, mesh, styles)


def parallelize(model: nn.Module, parallel: Any, plan: Mapping[str, str] | None, *, distributed: bool) -> nn.Module:
    """Tensor parallelism for one local part: the model's own `parallelize(parallel)` hook, else `plan`.

    `parallel` is the run's [`ParallelContext`][danling.distributed.topology.ParallelContext]. The
    hook may change the model in place and return None, or return the new module. Without a hook,
    `plan` (`parallel.tensor_plan`) is applied over the tensor axis's mesh; without either, a
    tensor axis above 1 is an error, since it would only duplicate work.

    Raises:
        TypeError: `model.parallelize` returned something other than a module or None.
        NotImplementedError: `tensor > 1` with neither a `parallelize` method nor a plan.
    """
    hook = getattr(model, "parallelize", None)
    if callable(hook):
        result = hook(parallel)
        if result is not None and not isinstance(result, nn.Module):
            raise TypeError(f"{type(model).__name__}.parallelize() must return a module or None, got {result!r}")
        return model if result is None else result
    degree = parallel.topology.degrees["tensor"]
    if degree == 1 or not distributed:
        return model
    if not plan:
        raise NotImplementedError(
            f"parallel.axes.tensor={degree} but {type(model).__name__} has no parallelize(parallel) method and "
            "parallel.tensor_plan is empty: give one of them"
        )
    return apply_tensor_plan(model, parallel.mesh["tensor"], dict(plan))


def _flatten(plan: Mapping, prefix: str = "") -> dict[str, Any]:
    """Dotted patterns back from a config that nested them (`{"layers": {"*": {"up": ...}}}`)."""
    flat: dict[str, Any] = {}
    for key, value in plan.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def checkpoint_blocks(blocks: Sequence[nn.Module], mode: str) -> None:
    """Recompute the activations of each block in backward instead of keeping them.

    `block` keeps only each block's input; `selective` keeps the results of matrix products and
    attention (costly to recompute) and recomputes the rest. Each block's class is swapped for a
    subclass whose forward runs under `torch.utils.checkpoint`, so parameter names (and with them
    checkpoints) do not change and copies of the block (an EMA) stay checkpointed.

    Raises:
        ValueError: `mode` is not `block` or `selective`.
    """
    if mode not in ("block", "selective"):
        raise ValueError(f"activation checkpointing mode must be 'block' or 'selective', got {mode!r}")
    for block in blocks:
        if not getattr(block, "_danling_checkpoint_mode", None):
            block.__class__ = _checkpointed_class(type(block), mode)


@functools.cache
def _checkpointed_class(cls: type, mode: str) -> type:
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    options: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        aten = torch.ops.aten
        kept = [aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default]
        for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention"):
            op = getattr(aten, name, None)
            if op is not None:
                kept.append(op.default)
        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, kept)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(super(checkpointed, self).forward, *args, **options, **kwargs)

    checkpointed = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward, "_danling_checkpoint_mode": mode})
    return checkpointed
