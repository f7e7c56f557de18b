"""Checkpointing of [`ParallelRunner`][danling.runners.parallel_runner.ParallelRunner]: DCP over all local model parts.

[`ParallelCheckpointing`][danling.runners.parallel.checkpoint.ParallelCheckpointing] is the torch
component with two differences: a distributed run writes DCP checkpoints only (every rank its own
shards, resharded on load), and the module a checkpoint holds is all of this rank's model parts as
one (see [`merge_parts`][danling.distributed.parts.merge_parts]), so a checkpoint of one pipeline
layout loads on another.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn

from danling.distributed.parts import merge_parts

from ..checkpointing.host import TorchCheckpointHost
from ..checkpointing.torch_state import TorchCheckpointing

__all__ = ["ParallelCheckpointHost", "ParallelCheckpointing"]


class ParallelCheckpointHost(TorchCheckpointHost, Protocol):
    """The parallel runner as its checkpointing sees it: the torch host plus its local model parts."""

    model_parts: list[nn.Module] | None


class ParallelCheckpointing(TorchCheckpointing):
    """DCP checkpoints of the local model parts of a parallel layout; `ParallelRunner.checkpointing`."""

    host: ParallelCheckpointHost

    @property
    def backend(self) -> str:
        """`"dcp"` for distributed runs (the only format that reshards); the file backend is refused there.

        Raises:
            ValueError: `checkpoint.backend` names another backend in a distributed run.
        """
        backend = self.config.checkpoint.backend or "auto"
        if not self.host.distributed:
            return super().backend
        if backend not in ("auto", "dcp"):
            raise ValueError(
                f"checkpoint.backend={backend!r} is not supported by ParallelRunner in a distributed run: its "
                "checkpoints are sharded and only 'dcp' (or 'auto') can write and reshard them"
            )
        return "dcp"

    @property
    def checkpoint_model(self) -> Any:
        """All local parts as one module (see [`merge_parts`][danling.distributed.parts.merge_parts])."""
        host = self.host
        parts = host.model_parts or [host.model]
        return merge_parts([host.unwrap(part) for part in parts]) if len(parts) > 1 else parts[0]
