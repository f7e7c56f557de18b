"""FSDP2 (`fully_shard`) over the data axes of a parallel run: units, policies, and the mesh it shards on."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .ddp import wrap_ddp
from .expert_parallel import expert_parameters, is_expert_parameter

__all__ = [
    "FsdpSettings",
    "apply_fsdp",
    "block_modules",
    "fsdp_mesh",
    "fsdp_mixed_precision",
    "fsdp_offload",
    "wrap_data_parallel",
]


class FsdpSettings(Protocol):
    """What [`wrap_data_parallel`][danling.distributed.fsdp.wrap_data_parallel] reads of the `fsdp` config section."""

    enabled: bool | None
    modules: list[str] | None
    reshard_after_forward: bool | int | None
    mp_policy: bool | int | None
    offload_policy: bool | int | None


def block_modules(model: nn.Module, patterns: Sequence[str] | None = None, *, strict: bool = True) -> list[nn.Module]:
    """The modules of `model` that form units of their own (for sharding or activation checkpointing).

    With `patterns`, every module whose qualified name matches one of them (`fnmatch`, e.g.
    ``"layers.*"``); without, every member of an `nn.ModuleList` (the repeated blocks of most
    models).

    With `strict=False` a pattern that matches nothing gives no units instead of an error (a
    pipeline stage may hold none of the blocks the patterns name).

    Raises:
        ValueError: A pattern matches no module (the message lists some module names), with `strict`.
    """
    named = [(name, module) for name, module in model.named_modules() if name]
    if patterns:
        units = []
        for pattern in patterns:
            matched = [module for name, module in named if fnmatchcase(name, pattern)]
            if not matched and not strict:
                return []
            if not matched:
                sample = ", ".join(name for name, _ in named[:8])
                raise ValueError(f"module pattern {pattern!r} matches no module of the model; names include: {sample}")
            units.extend(module for module in matched if all(module is not unit for unit in units))
        return units
    return [member for module in model.modules() if isinstance(module, nn.ModuleList) for member in module]


def fsdp_mixed_precision(setting: Any, precision: str | None) -> Any:
    """The `MixedPrecisionPolicy` of `fsdp.mp_policy` and `precision`, or `None` for full precision.

    `None`/`True` follow `precision` (bf16/fp16 parameters in compute, fp32 gradient reduction);
    `False` keeps fp32 throughout.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    if setting is False or setting == 0 or precision not in dtypes:
        return None
    return MixedPrecisionPolicy(param_dtype=dtypes[precision], reduce_dtype=torch.float32)


def fsdp_offload(setting: Any) -> Any:
    """`CPUOffloadPolicy` when `fsdp.offload_policy` is set; pinned memory only with a GPU to copy to."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not setting:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())  # pinning needs an accelerator


def apply_fsdp(
    model: nn.Module,
    mesh: Any,
    *,
    units: Sequence[nn.Module] = (),
    reshard_after_forward: bool | int | None = None,
    mp_policy: Any = None,
    offload_policy: Any = None,
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard each of `units`, then the root, over `mesh` (1-D: FSDP; 2-D replicate x shard: HSDP).

    Each unit gathers its parameters only for its own forward and backward, which is what bounds
    peak memory; the root takes whatever parameters no unit holds. `ignored_params` (expert
    weights, already split over their own mesh) stay as they are and get no gradient reduction.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    options: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": mp_policy if mp_policy is not None else MixedPrecisionPolicy(),
        "offload_policy": offload_policy if offload_policy is not None else OffloadPolicy(),
    }
    if ignored_params:
        options["ignored_params"] = ignored_params
    if reshard_after_forward is not None:
        options["reshard_after_forward"] = reshard_after_forward
    for unit in units:
        if unit is not model:
            fully_shard(unit, **options)
    fully_shard(model, **options)
    return model


def fsdp_mesh(topology: Any) -> Any:
    """The mesh FSDP2 shards over: `shard`, or `replicate x shard` (HSDP: replicate across, shard within).

    With experts the shard axis is two grid dimensions (`shard_rest`, `expert`): their flattened
    mesh (or the one above degree one) stands for it.
    """
    mesh = topology.mesh
    dims = tuple(dim for dim in topology.domains["shard"] if dim in topology.mesh_dim_names)
    shard = "_".join(dims)  # the name `ParallelContext.build` flattens several dimensions under
    if len(dims) > 1:
        mesh[dims]._flatten(shard)  # a shard domain spanning the world got no flattened group there
    return mesh["replicate", shard] if topology.degrees["replicate"] > 1 else mesh[shard]


def wrap_data_parallel(
    part: nn.Module,
    topology: Any,
    fsdp: FsdpSettings,
    *,
    precision: str | None,
    device: torch.device,
    distributed: bool,
    compile: Callable[..., nn.Module],
    strict: bool = True,
    ddp: Mapping[str, Any] | None = None,
) -> nn.Module:
    """One local part made data parallel over the data axes of `topology`, and compiled.

    With `fsdp.enabled` in a distributed run the part is sharded with FSDP2 (units from
    `fsdp.modules`, see [`block_modules`][danling.distributed.fsdp.block_modules]) and compiled
    after; otherwise it is compiled and, when the data domain has several ranks and the part has
    trainable parameters, wrapped in DDP over the data domain's group (which broadcasts rank 0's
    weights).

    Args:
        part: The local part, on `device`, tensor-parallel and checkpointed where configured.
        topology: The run's topology (its mesh and the data domain's group).
        fsdp: The `fsdp` config section.
        precision: The runner's precision (`bf16`/`fp16` set FSDP2's parameter dtype).
        device: The device DDP places the part on.
        distributed: Whether a process group runs.
        compile: `compile(module, distributed=...)`, the runner's compiler.
        strict: Refuse `fsdp.modules` patterns that match nothing (off for pipeline stages).
        ddp: `DistributedDataParallel` options (see [`ddp_options`][danling.distributed.ddp.ddp_options]).

    Raises:
        ValueError: `ddp` sets options while `fsdp.enabled` shards the part (FSDP2 reads none of them).
    """
    ddp = dict(ddp or {})
    if fsdp.enabled and distributed:
        if ddp:
            raise ValueError(
                f"config.ddp sets {sorted(ddp)}, which apply to DDP, but fsdp.enabled shards this model with "
                "FSDP2, which reads none of them: unset the ddp keys, or turn fsdp.enabled off"
            )
        # Experts stay split over the expert axis and replicated over `expert_data`; FSDP2 shards the
        # dense parameters only (ExpertGradients reduces the experts' gradients).
        experts = {param for _, param in expert_parameters(part)}
        apply_fsdp(
            part,
            fsdp_mesh(topology),
            units=block_modules(part, fsdp.modules, strict=strict),
            reshard_after_forward=fsdp.reshard_after_forward,
            mp_policy=fsdp_mixed_precision(fsdp.mp_policy, precision),
            offload_policy=fsdp_offload(fsdp.offload_policy),
            ignored_params=experts or None,
        )
        return compile(part, distributed=True)
    part = compile(part, distributed=distributed)
    # Expert weights hold different experts on the ranks of an expert group: DDP must not average
    # them (ExpertGradients reduces them over `expert_data` instead).
    experts = [name for name, _ in expert_parameters(part)]
    trainable = any(param.requires_grad and not is_expert_parameter(param) for param in part.parameters())
    if topology.size("data") > 1 and trainable:
        if experts:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(part, experts)
        part = wrap_ddp(part, device, process_group=topology.group("data"), **ddp)
    return part
