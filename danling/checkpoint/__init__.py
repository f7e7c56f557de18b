"""Atomic, verifiable checkpoints with aliases, retention and optional background writes.

- [`CheckpointManager`][danling.checkpoint.CheckpointManager]: backend-neutral policy (layout,
  `latest`/`best`/named aliases, `keep_latest_k` retention, cadence, async saves, fallback to
  the newest checkpoint that verifies).
- [`FileCheckpointManager`][danling.checkpoint.FileCheckpointManager]: one `torch.save` file per
  checkpoint, written by the main process.
- [`TorchDistributedCheckpointManager`][danling.checkpoint.dcp.TorchDistributedCheckpointManager]:
  torch.distributed.checkpoint backend for multi-process runs (imported on first use).
- [`read_checkpoint`][danling.checkpoint.read_checkpoint]: verify and load without a manager.
- [`CheckpointError`][danling.checkpoint.CheckpointError]: raised for torn, corrupt or missing
  checkpoints, naming the offending file.
"""

from .base import CheckpointManager
from .file import FileCheckpointManager, read_checkpoint
from .manifest import CheckpointError, CheckpointNotFoundError

__all__ = [
    "CheckpointManager",
    "FileCheckpointManager",
    "CheckpointError",
    "CheckpointNotFoundError",
    "read_checkpoint",
]

# The DCP backend imports torch.distributed.checkpoint (about 1.7 s), so it loads on first use
# and stays out of `__all__` (a star import would otherwise trigger it on `import danling`).
_LAZY_DCP = ("TorchDistributedCheckpointManager", "get_training_state", "set_training_state", "read_dcp_checkpoint")


def __getattr__(name: str):
    if name in _LAZY_DCP:
        from . import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
