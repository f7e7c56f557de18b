"""Data loading for the runners: resumable dataloaders, the default batch contract, device moves.

- [`build_dataloader`][danling.data.build_dataloader] turns a dataset and a ``dataloader`` config
  section into a torchdata ``StatefulDataLoader`` with a
  [`ResumableSampler`][danling.data.ResumableSampler] (batched by a
  [`ResumableBatchSampler`][danling.data.ResumableBatchSampler]), so a checkpointed loader continues mid-epoch.
- [`batch_fingerprint`][danling.data.batch_fingerprint] /
  [`check_batch_fingerprint`][danling.data.check_batch_fingerprint] verify on resume that the
  rebuilt loader continues the saved data stream.
- [`loader_global_state`][danling.data.loader_global_state] gives a loader's position as samples
  consumed over all ranks, which a [`ResumableSampler`][danling.data.ResumableSampler] continues on
  any number of ranks (elastic resume).
- [`split_batch`][danling.data.split_batch] is the ``(input, target)`` contract of the default
  runner steps (moving a batch to a device is [`danling.utils.to_device`][danling.utils.to_device]).
"""

from .batch import split_batch
from .fingerprint import DataResumeError, batch_fingerprint, check_batch_fingerprint, indices_fingerprint
from .loader import LOADER_OPTIONS, build_dataloader, loader_global_state, resolve_loader_options, set_epoch
from .sampler import ResumableBatchSampler, ResumableSampler, derive_seed

__all__ = [
    "LOADER_OPTIONS",
    "DataResumeError",
    "ResumableBatchSampler",
    "ResumableSampler",
    "batch_fingerprint",
    "build_dataloader",
    "check_batch_fingerprint",
    "derive_seed",
    "indices_fingerprint",
    "loader_global_state",
    "resolve_loader_options",
    "set_epoch",
    "split_batch",
]
