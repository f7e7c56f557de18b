"""DCP checkpoints of a TorchFT replica group, plus the group's own data position beside them.

Under TorchFT (`ft.enabled`) a replica group that restarts takes the model, optimizer and loop
counters from a live peer, but its data is its own: each group reads its own share of every
pass, so the peer's loader position does not say where this group stopped.
[`TorchFTCheckpointManager`][danling.checkpoint.ft.TorchFTCheckpointManager] writes the usual
checkpoints as [`TorchDistributedCheckpointManager`][danling.checkpoint.dcp.TorchDistributedCheckpointManager]
does, and keeps the group's data position in a directory of its own,
`<prefix>-<replica id>`, with the same DCP layout, manifest and verification.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .dcp import TorchDistributedCheckpointManager
from .layout import check_name

__all__ = ["TorchFTCheckpointManager"]

# Per rank: every rank of a group reads its own part of the group's share.
_POSITION_KEYS = ("dataloaders", "fingerprints", "position")
_KEEP = 2  # the newest position and the one before it (a torn newest falls back to it)


class TorchFTCheckpointManager(TorchDistributedCheckpointManager):
    """DCP checkpoints of one TorchFT replica group, and that group's own dataloader checkpoints.

    `save`, `load` and everything else of the usual checkpoints are those of
    [`TorchDistributedCheckpointManager`][danling.checkpoint.dcp.TorchDistributedCheckpointManager].
    [`save_dataloaders`][danling.checkpoint.ft.TorchFTCheckpointManager.save_dataloaders] writes
    the group's data position (loader states, their next-batch fingerprints, the loop position)
    as `step-<N>` under `replica_directory`;
    [`load_dataloaders`][danling.checkpoint.ft.TorchFTCheckpointManager.load_dataloaders] returns
    the newest one that verifies. Both are collective over the group's ranks, like `save`.

    Args:
        directory: Where the usual checkpoints live.
        replica_id: The replica group's id; part of the directory name, so groups that share a
            run directory keep their positions apart.
        prefix: Name prefix of the per-replica directory.
        replica_directory: Where the group's positions live; defaults to `<prefix>-<replica_id>`
            beside `directory` (outside it: the usual checkpoints' listing never sees them).
        **kwargs: The options of `TorchDistributedCheckpointManager`.

    Raises:
        ValueError: `replica_id` or `prefix` is empty or not usable as a directory name.

    Examples:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> manager = TorchFTCheckpointManager(root / "checkpoints", replica_id="1")
        >>> manager.replica_directory.name
        'ft-replica-1'
        >>> manager.load_dataloaders() is None
        True
        >>> _ = manager.save_dataloaders({"dataloaders": {"train": {"yielded": 8}}, "position": {"batch": 2}}, 2)
        >>> manager.load_dataloaders()["dataloaders"]
        {'train': {'yielded': 8}}
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        replica_id: str,
        prefix: str = "ft-replica",
        replica_directory: str | os.PathLike | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(directory, **kwargs)
        self.replica_id = str(replica_id)
        self.prefix = str(prefix)
        check_name(f"{self.prefix}-{self.replica_id}", "TorchFT dataloader checkpoint directory")
        if replica_directory is None:
            replica_directory = self.directory.parent / f"{self.prefix}-{self.replica_id}"
        positions = {key: value for key, value in kwargs.items() if key in _SHARED_OPTIONS}
        # Small and written once per update: synchronous, and only the newest two are kept.
        self.positions = TorchDistributedCheckpointManager(
            replica_directory,
            process_group=self.process_group,
            rank_local_keys=_POSITION_KEYS,
            data_rank=self.data_rank,
            data_size=self.data_size,
            keep_latest_k=_KEEP,
            load_only=self.load_only,
            logger=self.logger,
            **positions,
        )

    @property
    def replica_directory(self) -> Path:
        """Where this group's dataloader checkpoints live (`<prefix>-<replica id>`)."""
        return self.positions.directory

    def save_dataloaders(self, state: Mapping[str, Any], step: int) -> Path | None:
        """Write the group's data position at optimizer step `step` as `step-<step>` (collective over the group).

        Args:
            state: Plain mappings under `dataloaders` (loader states by split), `fingerprints`
                and `position` (the loop's split and batch); every rank passes its own.
            step: The optimizer step the position belongs to (no update of it applied yet).

        Returns:
            The checkpoint directory, or `None` when the manager is load-only.
        """
        unknown = set(state) - set(_POSITION_KEYS)
        if unknown:
            raise ValueError(f"a dataloader checkpoint holds {list(_POSITION_KEYS)}, got also {sorted(unknown)}")
        return self.positions.save(state, f"step-{int(step):06d}", metadata={"global_step": int(step)})

    def load_dataloaders(self, map_location: Any = "cpu") -> dict[str, Any] | None:
        """The group's newest data position that verifies, or `None` when it has none (a first start)."""
        path = self.positions.latest_valid()
        return None if path is None else self.positions.load(path, map_location=map_location)

    def close(self, timeout: float | None = None) -> bool:
        """Close the usual checkpoints (see `CheckpointManager.close`) and the positions' writer."""
        drained = super().close(timeout)
        return self.positions.close(timeout) and drained


# Options of the usual checkpoints the positions' manager shares (cadence, retention and async do not apply).
_SHARED_OPTIONS = ("checksum", "timeout", "trusted")
