"""Resuming a checkpoint on another number of data-parallel ranks (elastic data-parallel resume).

A checkpoint records, next to the per-rank loader states, a layout-free description of the
training data position and of the global batch, both in the global `loop` entry:

- `loop.data`: for each training split, the pass's epoch and how many positions of its global
  permutation all ranks together have consumed
  ([`ResumableSampler.global_state`][danling.data.ResumableSampler.global_state]);
- `loop.micro_batches_per_update`: how many per-rank micro-batches, summed over the data-parallel
  ranks, one optimizer update covers (ranks x `accum_steps` of the run that started it).

On a resize, [`TorchCheckpointing`][danling.runners.checkpointing.torch_state.TorchCheckpointing]
continues each interrupted pass from its global position
([`ResumableSampler.load_global_state`][danling.data.ResumableSampler.load_global_state]) and
chooses `accum_steps` so that an update covers as many samples as before; see `docs/elastic.md`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from danling.data import DataResumeError, ResumableSampler, loader_global_state

__all__ = ["data_positions", "elastic_accum_steps", "restore_positions"]


def data_positions(loaders: Mapping[str, Any], states: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """`{split: {"epoch", "samples_consumed"}}` of every loader in `states` that a resize can continue."""
    positions = {}
    for split, state in states.items():
        loader = loaders.get(split)
        try:
            position = None if loader is None else loader_global_state(loader, state)
        except TypeError:  # an index sampler that cannot be copied: no elastic position for it
            position = None
        if position is not None:
            positions[split] = position
    return positions


def _sampler_of(loader: Any) -> ResumableSampler | None:
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    return sampler if isinstance(sampler, ResumableSampler) else None


def restore_positions(
    loaders: Mapping[str, Any], positions: Mapping[str, Any], cursor: str | None, seed: int | None
) -> None:
    """Continue each split's pass from its global position on the loaders' (new) layout.

    Raises:
        DataResumeError: the interrupted split `cursor` has no global position or no loader
            batched by a [`ResumableBatchSampler`][danling.data.ResumableBatchSampler] now.
    """
    for split, loader in loaders.items():
        position, sampler = positions.get(split), _sampler_of(loader)
        if position is None or sampler is None:
            if split == cursor:
                reason = (
                    "the checkpoint has no global position for it"
                    if position is None
                    else "its loader is not batched by a ResumableBatchSampler (let the runner build it)"
                )
                raise DataResumeError(
                    f"cannot continue split {split!r} mid-pass on another number of data-parallel ranks: {reason}; "
                    "add 'dataloaders' to checkpoint.exclude_from_loading to restart the pass instead"
                )
            continue
        if seed is not None:
            sampler.seed = int(seed)  # a seed adopted from the checkpoint (see set_seed)
        sampler.load_global_state(position)
        if len(loader) == 0:
            # Nothing of the pass is left for this layout (fewer samples than a batch on every rank):
            # the pass is over, as when the checkpoint was written after its last batch.
            sampler.origin = None
            sampler.load_state_dict({"epoch": int(position["epoch"]), "yielded": len(sampler)})


def elastic_accum_steps(
    reference: int, ranks: int, configured: int, batch_size: int | None, logger: logging.Logger
) -> int:
    """The `accum_steps` that keeps `reference` micro-batches per update on `ranks` data-parallel ranks.

    When `ranks` divides `reference` that is ``reference // ranks``; otherwise the configured value
    is kept and a WARNING says how the global batch changes.

    Examples:
        >>> log = logging.getLogger("doctest")
        >>> elastic_accum_steps(2, 1, 1, 4, log), elastic_accum_steps(4, 2, 1, 4, log)
        (2, 2)
        >>> elastic_accum_steps(2, 3, 1, 4, log)  # 2 micro-batches cannot be spread over 3 ranks
        1
    """
    if reference % ranks == 0:
        accum = reference // ranks
        if accum != configured:
            logger.info(
                "keeping the global batch of %d micro-batches per update on %d data-parallel ranks: "
                "accum_steps %d -> %d",
                reference,
                ranks,
                configured,
                accum,
            )
        return accum
    size = batch_size or 1
    logger.warning(
        "cannot keep the global batch on %d data-parallel ranks: the run updated every %d micro-batches "
        "(%d samples), which %d ranks cannot share equally; keeping the per-rank batch (%s) and "
        "accum_steps=%d, so the global batch changes from %d to %d samples per update",
        ranks,
        reference,
        reference * size,
        ranks,
        batch_size,
        configured,
        reference * size,
        ranks * configured * size,
    )
    return configured
