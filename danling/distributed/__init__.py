"""Process groups, collectives and the parallel topology, safe to call in a single process.

Rank queries fall back to torchrun's environment variables and then to a single process; the
collectives become local no-ops when no multi-rank group is active, so code written for
``torchrun --nproc_per_node N`` runs unchanged in a plain ``python`` process. Every collective
takes a `group` (`None`: every rank); a [`ParallelTopology`][danling.distributed.ParallelTopology]
(also named `Topology`) says which group each purpose (data, metrics, gradients, ...) should use,
through its [`ParallelContext`][danling.distributed.ParallelContext].
"""

from .collectives import all_gather_strided, all_reduce_any, all_reduce_gradients, all_reduce_mean, broadcast_object
from .ddp import ddp_options, unwrap_model, wrap_ddp
from .process_group import (
    barrier,
    default_backend,
    get_local_rank,
    get_rank,
    get_world_size,
    init_process_group_from_env,
    is_distributed,
    is_main_process,
)
from .topology import ParallelContext, ParallelTopology, Topology

__all__ = [
    "ParallelContext",
    "ParallelTopology",
    "Topology",
    "all_gather_strided",
    "all_reduce_any",
    "all_reduce_gradients",
    "all_reduce_mean",
    "barrier",
    "broadcast_object",
    "default_backend",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_process_group_from_env",
    "is_distributed",
    "is_main_process",
    "unwrap_model",
    "wrap_ddp",
    "ddp_options",
]
