"""Process-group lifecycle and rank queries that also work in a plain single-process run."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .slurm import apply_slurm_launch

if TYPE_CHECKING:  # only for annotations: builds without distributed support lack the class
    from torch.distributed import ProcessGroup

__all__ = [
    "barrier",
    "default_backend",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_process_group_from_env",
    "is_distributed",
    "is_main_process",
]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


_AVAILABLE = dist.is_available()  # fixed by the torch build: asked once, not at every query


def _world_holder() -> object | None:
    """torch's holder of the default group (`_world`, whose `_default_pg` is the group), where this
    torch keeps it so; `None` otherwise, and `_initialized` asks `dist.is_initialized()`.

    `is_initialized()` reaches the same attribute through two properties (a metaclass's and the
    holder's). A metric container asks at every read of `avg`, typically once an epoch with that
    code out of the caches, where the two calls cost about 10 us of a 90 us read.
    """
    if not _AVAILABLE:
        return None
    from torch.distributed import distributed_c10d

    holder = getattr(distributed_c10d, "_world", None)
    # Only a holder whose public property stands for the attribute read here: any other layout
    # in a later torch turns the shortcut off rather than reading the wrong thing.
    if not isinstance(getattr(type(holder), "default_pg", None), property) or "_default_pg" not in vars(holder):
        return None
    return holder if (holder._default_pg is None) is (not dist.is_initialized()) else None


_WORLD = _world_holder()


def _initialized() -> bool:
    if _WORLD is not None:
        return _WORLD._default_pg is not None  # type: ignore[attr-defined]
    return _AVAILABLE and dist.is_initialized()


def is_distributed(group: ProcessGroup | None = None) -> bool:
    """Whether `group` (the default group when `None`) is active and has more than one rank.

    A collective over a one-rank group is the identity, so callers skip it when this is false.

    Examples:
        >>> is_distributed()
        False
    """
    if _WORLD is not None:  # `_initialized()`, inlined: metric containers ask at every read
        return _WORLD._default_pg is not None and dist.get_world_size(group) > 1  # type: ignore[attr-defined]
    return _initialized() and dist.get_world_size(group) > 1


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in `group`; for the default group, ``$RANK`` or 0 without a process group.

    Examples:
        >>> get_rank()
        0
    """
    if _initialized():
        return dist.get_rank(group)
    if group is not None:
        raise RuntimeError("a process group was given but torch.distributed is not initialised")
    return _env_int("RANK", 0)


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in `group`; for the default group, ``$WORLD_SIZE`` or 1 without a process group.

    Examples:
        >>> get_world_size()
        1
    """
    if _initialized():
        return dist.get_world_size(group)
    if group is not None:
        raise RuntimeError("a process group was given but torch.distributed is not initialised")
    return _env_int("WORLD_SIZE", 1)


def get_local_rank() -> int:
    """Rank within this node, from ``$LOCAL_RANK`` (set by torchrun), else 0.

    Examples:
        >>> get_local_rank()
        0
    """
    return _env_int("LOCAL_RANK", 0)


def is_main_process() -> bool:
    """Whether this is global rank 0 (always true in a single-process run).

    Examples:
        >>> is_main_process()
        True
    """
    return get_rank() == 0


def barrier(group: ProcessGroup | None = None) -> None:
    """Wait for every rank of `group` (default: all); does nothing unless it has more than one rank."""
    if is_distributed(group):
        dist.barrier(group=group)


def default_backend() -> str:
    """``"nccl"`` when CUDA is usable, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init_process_group_from_env(
    backend: str | None = None,
    *,
    init_method: str = "env://",
    timeout: float | None = None,
    allow_existing: bool = False,
) -> bool:
    """Start the default process group from torchrun's (or `srun`'s) environment variables.

    Reads ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` (and, for the default ``env://``
    rendezvous, ``MASTER_ADDR``/``MASTER_PORT``); inside an `srun` step that no torchrun placed,
    they are first derived from ``SLURM_*``
    ([`apply_slurm_launch`][danling.distributed.slurm.apply_slurm_launch]). A run with
    ``WORLD_SIZE`` unset or 1 is left single-process. On CUDA machines the current device is set
    to ``LOCAL_RANK`` before the group starts (GPU-only branch).

    Args:
        backend: Communication backend; ``None`` picks ``"nccl"`` on CUDA and ``"gloo"`` otherwise.
        init_method: Rendezvous URL, e.g. ``"env://"`` or ``"file:///tmp/store"``.
        timeout: Optional collective timeout in seconds.
        allow_existing: Accept a default group that is already running (e.g. started by a test
            launcher) instead of raising, provided its world size matches ``WORLD_SIZE``.

    Returns:
        ``True`` when this call started the group (so the caller owns it and should destroy it),
        ``False`` when nothing was started.

    Raises:
        RuntimeError: a default group is already running and `allow_existing` is false, or its
            world size disagrees with ``WORLD_SIZE``.
        ValueError: a non-positive `timeout`, ``RANK`` missing or out of range, or a partial
            launch environment inside a Slurm job.

    Examples:
        >>> init_process_group_from_env()  # WORLD_SIZE unset: single process, nothing to start
        False
    """
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    apply_slurm_launch()
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size <= 1:
        return False
    if dist.is_initialized():
        if not allow_existing:
            raise RuntimeError("the default process group is already initialised; the caller owns its lifecycle")
        if dist.get_world_size() != world_size:
            raise RuntimeError(
                f"the running process group has {dist.get_world_size()} ranks but WORLD_SIZE={world_size}"
            )
        return False
    rank = _env_int("RANK", -1)
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK must be set to a value in [0, {world_size}) when WORLD_SIZE={world_size}; got {rank}")
    backend = backend or default_backend()
    if backend == "nccl" and torch.cuda.is_available():  # GPU-only: bind this process to its device
        torch.cuda.set_device(get_local_rank())
    kwargs = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, **kwargs)
    return True
