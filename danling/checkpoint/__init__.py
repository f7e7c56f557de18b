"""Atomic, verifiable checkpoints with aliases, retention, background writes and in-place restores.

- [`CheckpointManager`][danling.checkpoint.CheckpointManager]: backend-neutral policy (layout,
  `latest`/`best`/named aliases, `keep_latest_k` retention, cadence, async saves, fallback to
  the newest checkpoint that verifies), `load` and `load_into` (restore live objects in place).
- [`FileCheckpointManager`][danling.checkpoint.FileCheckpointManager]: one `torch.save` file per
  checkpoint, written by the main process.
- [`TorchDistributedCheckpointManager`][danling.checkpoint.dcp.TorchDistributedCheckpointManager]:
  torch.distributed.checkpoint backend for multi-process runs, with global and per-rank entries
  (imported on first use, like the rest of [`danling.checkpoint.dcp`][]);
  [`TorchFTCheckpointManager`][danling.checkpoint.ft.TorchFTCheckpointManager] adds a TorchFT replica
  group's own dataloader checkpoints beside it (`danling.checkpoint.ft`, also imported on first use).
- [`Stateful`][danling.checkpoint.Stateful]: what a live object needs to be saved and restored;
  [`ModelState`][danling.checkpoint.training.ModelState],
  [`OptimizerState`][danling.checkpoint.training.OptimizerState] and
  [`TrainingState`][danling.checkpoint.training.TrainingState] wrap models and optimizers.
- [`register_format`][danling.checkpoint.register_format],
  [`detect_format`][danling.checkpoint.detect_format],
  [`open_checkpoint_reader`][danling.checkpoint.open_checkpoint_reader],
  [`read_checkpoint`][danling.checkpoint.read_checkpoint]: one registry of on-disk formats; read
  any checkpoint without a manager.
- [`CheckpointError`][danling.checkpoint.CheckpointError]: raised for torn, corrupt or missing
  checkpoints, naming the offending file;
  [`CheckpointResizeError`][danling.checkpoint.CheckpointResizeError] when per-rank state does not
  fit the number of data-parallel ranks;
  [`CheckpointSaveError`][danling.checkpoint.failures.CheckpointSaveError] when a save fails (a
  full disk), and [`UnsafePickleError`][danling.checkpoint.unpickling.UnsafePickleError] when a
  file needs more than the restricted unpickler admits (see [`danling.checkpoint.unpickling`][]).
"""

from .base import CheckpointManager
from .failures import CheckpointSaveError
from .file import FileCheckpointManager
from .formats import (
    CheckpointFormat,
    checkpoint_formats,
    detect_format,
    open_checkpoint_reader,
    read_checkpoint,
    register_format,
    unregister_format,
)
from .manifest import CheckpointError, CheckpointNotFoundError, CheckpointResizeError
from .payload import Stateful
from .unpickling import UnsafePickleError

__all__ = [
    "CheckpointManager",
    "FileCheckpointManager",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointResizeError",
    "CheckpointSaveError",
    "UnsafePickleError",
    "Stateful",
    "CheckpointFormat",
    "register_format",
    "unregister_format",
    "checkpoint_formats",
    "detect_format",
    "open_checkpoint_reader",
    "read_checkpoint",
]

# The DCP backend and the training-state wrappers import torch.distributed.checkpoint (about
# 1.7 s), so they load on first use and stay out of `__all__` (a star import would otherwise
# trigger it on `import danling`). `TorchFTCheckpointManager` (danling.checkpoint.ft) is built on it.
_LAZY_DCP = (
    "TorchDistributedCheckpointManager",
    "ModelState",
    "OptimizerState",
    "TrainingState",
    "get_training_state",
    "set_training_state",
    "read_dcp_checkpoint",
)


def __getattr__(name: str):
    if name == "TorchFTCheckpointManager":
        from .ft import TorchFTCheckpointManager

        return TorchFTCheckpointManager
    if name in _LAZY_DCP:
        from . import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
