"""Fault tolerance without stopping the job: TorchFT replica groups (`ft.*`).

See [`FaultTolerance`][danling.runners.ft.runtime.FaultTolerance] and docs/fault-tolerance.md.
"""

from .runtime import LIGHTHOUSE_ENV, FaultTolerance, ReplicaHost, check_fault_tolerance

__all__ = ["LIGHTHOUSE_ENV", "FaultTolerance", "ReplicaHost", "check_fault_tolerance"]
