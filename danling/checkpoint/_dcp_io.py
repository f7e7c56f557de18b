"""DCP's reader and load planner with every pickle read by the restricted unpickler.

DCP unpickles its `.metadata` index with plain `pickle` and the non-tensor entries of a
checkpoint with `torch.load(weights_only=False)`: either can run code planted in the files.
These subclasses route both through [`danling.checkpoint.unpickling`][] unless `trusted`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .unpickling import UnsafePickleError, read_dcp_metadata, torch_load

__all__ = ["SafeReader", "SafePlanner", "CheckpointException"]


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, with its `.metadata` pickle read by the restricted unpickler."""

    def __init__(self, path: str, *, trusted: bool = False) -> None:
        super().__init__(path)
        self.trusted = trusted

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.trusted:
            return super().read_metadata(*args, **kwargs)
        metadata = read_dcp_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, unpickling plain (non-tensor) entries weights-only unless trusted."""

    def __init__(self, trusted: bool, directory: Path) -> None:
        super().__init__()
        self.trusted, self.directory = trusted, directory
        self.refused: UnsafePickleError | None = None

    def load_bytes(self, read_item: Any, value: Any) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch_load(value, map_location="cpu", origin=f"{self.directory} (entry {fqn})", trusted=self.trusted)
        except UnsafePickleError as err:
            self.refused = err
            raise
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
