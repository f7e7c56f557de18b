"""Per-replica dataloader checkpoints (`checkpoint.enable_ft_dataloader_checkpoints`): each group's own data position.

A replica group reads its own share of every pass. When it restarts and recovers from a peer,
the peer's loader position counts the peer's batches; with these checkpoints the group instead
continues from the position it saved itself before each update (the batches of its share it had
trained on when it died), so no batch of its share is skipped or read twice.

What a group saves (per rank, through
[`TorchFTCheckpointManager.save_dataloaders`][danling.checkpoint.ft.TorchFTCheckpointManager.save_dataloaders]):
the state of each training loader, the fingerprint of the batch it yields next (checked when the
position is loaded, as for any resume) and the loop's split and batch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from ..checkpointing.elastic import data_positions
from ..checkpointing.resume import loader_fingerprint
from ..config_sections import CheckpointConfig, FaultToleranceConfig

__all__ = [
    "FT_REPLICA_ID_ENV",
    "ReplicaPositions",
    "data_position",
    "ft_checkpoint_options",
    "with_own_position",
]

FT_REPLICA_ID_ENV = "FT_REPLICA_ID"  # names the group's dataloader checkpoints when checkpoint.ft_replica_id is unset


@runtime_checkable
class ReplicaPositions(Protocol):
    """Where a replica group keeps its own data position (a `TorchFTCheckpointManager`)."""

    def save_dataloaders(self, state: Mapping[str, Any], step: int) -> Any: ...
    def load_dataloaders(self, map_location: Any = "cpu") -> Mapping[str, Any] | None: ...


def ft_checkpoint_options(
    checkpoint: CheckpointConfig, ft: FaultToleranceConfig, backend: str
) -> dict[str, str] | None:
    """`TorchFTCheckpointManager`'s own arguments, or `None` when `checkpoint.enable_ft_dataloader_checkpoints` is off.

    The replica id is `checkpoint.ft_replica_id`, else `$FT_REPLICA_ID`, else `ft.replica_id`.

    Raises:
        ValueError: `ft.enabled` is off (only a recovering replica group reads these checkpoints),
            or the checkpoint backend (`backend`, resolved) is not DCP.
    """
    if not checkpoint.enable_ft_dataloader_checkpoints:
        return None
    if not ft.enabled:
        raise ValueError(
            "checkpoint.enable_ft_dataloader_checkpoints=True needs ft.enabled=True: a replica group reads its "
            "dataloader checkpoint only when it recovers from a TorchFT peer"
        )
    if backend != "dcp":
        raise ValueError(
            f"checkpoint.enable_ft_dataloader_checkpoints=True writes DCP checkpoints, but checkpoint.backend="
            f"{backend!r}; use 'auto' or 'dcp'"
        )
    replica_id = checkpoint.ft_replica_id
    if replica_id is None:
        replica_id = os.environ.get(FT_REPLICA_ID_ENV) or ft.replica_id
    return {"replica_id": str(replica_id), "prefix": checkpoint.ft_dataloader_checkpoint_prefix}


def data_position(
    dataloaders: Mapping[str, Any], train_splits: list[str], split: str | None, batch: int, step: int
) -> dict[str, Any]:
    """What `save_dataloaders` writes for this rank: training loader states, their fingerprints, the loop position."""
    keep = {*train_splits, split}
    states = {
        name: loader.state_dict()
        for name, loader in dataloaders.items()
        if name in keep and callable(getattr(loader, "state_dict", None))
    }
    fingerprints = {name: loader_fingerprint(dataloaders[name], state) for name, state in states.items()}
    return {
        "dataloaders": states,
        "fingerprints": fingerprints,
        "position": {"split": split, "batch": int(batch), "step": int(step)},
    }


def with_own_position(
    payload: Mapping[str, Any], own: Mapping[str, Any], dataloaders: Mapping[str, Any]
) -> dict[str, Any]:
    """A peer's payload with this group's saved data position in place of the peer's.

    The loader states and fingerprints are the group's own; the loop keeps the peer's counters,
    update state and round, and takes the group's split and batch (the pass it was in).
    """
    payload = dict(payload)
    states = dict(own.get("dataloaders") or {})
    position = own.get("position") or {}
    payload["dataloaders"] = states
    payload["fingerprints"] = dict(own.get("fingerprints") or {})
    loop = dict(payload.get("loop") or {})
    loop["split"], loop["batch"] = position.get("split"), int(position.get("batch") or 0)
    loop["data"] = data_positions(dataloaders, states)
    payload["loop"] = loop
    return payload
