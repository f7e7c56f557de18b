"""Fault tolerance without stopping the job: TorchFT replica groups (`ft.*`).

See [`FaultTolerance`][danling.runners.ft.runtime.FaultTolerance], the per-replica dataloader
checkpoints of [`danling.runners.ft.data`][] and docs/fault-tolerance.md.
"""

from .data import FT_REPLICA_ID_ENV, ReplicaPositions, ft_checkpoint_options
from .runtime import LIGHTHOUSE_ENV, FaultTolerance, ReplicaHost, check_fault_tolerance

__all__ = [
    "FT_REPLICA_ID_ENV",
    "LIGHTHOUSE_ENV",
    "FaultTolerance",
    "ReplicaHost",
    "ReplicaPositions",
    "check_fault_tolerance",
    "ft_checkpoint_options",
]
