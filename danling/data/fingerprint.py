"""Fingerprints of "the next batch" of a loader state, to check that a resumed run continues the data stream."""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader.stateful import Stateful
from torchdata.stateful_dataloader.stateful_dataloader import (
    _INDEX_SAMPLER_STATE,
    _ITERATOR_FINISHED,
    _SAMPLER_ITER_STATE,
    _SAMPLER_ITER_YIELDED,
    _StatefulMultiProcessingDataLoaderIter,
)

__all__ = ["DataResumeError", "batch_fingerprint", "check_batch_fingerprint", "indices_fingerprint"]

_MP = _StatefulMultiProcessingDataLoaderIter


class DataResumeError(RuntimeError):
    """A restored loader would not continue the data stream where the checkpoint left it."""


def indices_fingerprint(indices: Iterable[int]) -> str:
    """Hash a sequence of sample indices into a short hex string.

    Examples:
        >>> indices_fingerprint([3, 1, 2]) == indices_fingerprint((3, 1, 2))
        True
        >>> indices_fingerprint([1, 2, 3]) == indices_fingerprint([3, 2, 1])
        False
    """
    payload = json.dumps([int(i) for i in indices]).encode()
    return hashlib.sha256(payload).hexdigest()[:16]


def batch_fingerprint(loader: Any, state: Mapping[str, Any]) -> str | None:
    """Fingerprint the indices of the batch `loader` would yield next if it were restored from `state`.

    The loader itself is not touched: its index sampler is copied (the dataset is shared, not
    copied), the copy is restored from `state` the way torchdata restores it, and one batch of
    indices is drawn. The result depends on the sampler configuration as well as on `state`
    (seed, shuffle, batch size, dataset length, rank and world size), so computing it when a
    checkpoint is saved and again on the rebuilt loader when it is loaded detects a resumed run
    whose data stream would not continue where the saved one stopped. Both single-process and
    multi-worker loader states are understood.

    Args:
        loader: A `StatefulDataLoader` (or anything with ``dataset`` and ``batch_sampler``/``sampler``).
        state: A state returned by ``loader.state_dict()`` (possibly of another process's loader).

    Returns:
        A 16-character hex digest, or ``None`` for iterable-style datasets, which have no indices.

    Examples:
        >>> from danling.data import build_dataloader
        >>> loader = build_dataloader(list(range(8)), split="val", config={"batch_size": 2})
        >>> it = iter(loader); first = next(it)
        >>> batch_fingerprint(loader, loader.state_dict()) == indices_fingerprint(next(it).tolist())
        True
    """
    if isinstance(getattr(loader, "dataset", None), IterableDataset):
        return None
    batch = _next_indices(loader, state)
    return indices_fingerprint([] if batch is None else batch if isinstance(batch, list) else [batch])


def check_batch_fingerprint(loader: Any, state: Mapping[str, Any], expected: str | None) -> None:
    """Raise [`DataResumeError`][danling.data.DataResumeError] unless `loader` restored from `state` matches `expected`.

    `expected` is what [`batch_fingerprint`][danling.data.batch_fingerprint] returned when the
    checkpoint was written; ``None`` (no fingerprint recorded) skips the check.

    Examples:
        >>> from danling.data import build_dataloader
        >>> loader = build_dataloader(list(range(8)), split="train", config={"batch_size": 2}, seed=1)
        >>> state = loader.state_dict(); saved = batch_fingerprint(loader, state)
        >>> check_batch_fingerprint(loader, state, saved)
        >>> other = build_dataloader(list(range(8)), split="train", config={"batch_size": 2}, seed=2)
        >>> check_batch_fingerprint(other, state, saved)
        Traceback (most recent call last):
        danling.data.fingerprint.DataResumeError: ...
    """
    if expected is None:
        return
    actual = batch_fingerprint(loader, state)
    if actual != expected:
        raise DataResumeError(
            f"the restored dataloader would not continue the saved data stream: next-batch fingerprint {actual!r} "
            f"!= {expected!r} recorded in the checkpoint; check that the dataset, batch size, shuffle, seed and "
            "world size match the run that wrote it"
        )


def _next_indices(loader: Any, state: Mapping[str, Any]) -> Any:
    """Draw the next index batch of a copy of `loader`'s sampler restored from `state`."""
    index_sampler = loader.batch_sampler if getattr(loader, "batch_sampler", None) is not None else loader.sampler
    try:  # share the dataset instead of copying it: only the sampler's own state matters
        probe = copy.deepcopy(index_sampler, memo={id(loader.dataset): loader.dataset})
    except Exception as error:
        raise TypeError(f"cannot fingerprint: the index sampler {index_sampler!r} cannot be copied") from error
    if _MP._SNAPSHOT in state:  # multi-worker layout: a main-process snapshot plus batches yielded since
        main, skip = state[_MP._SNAPSHOT][_MP._MAIN_SNAPSHOT], state[_MP._STEPS_SINCE_SNAPSHOT]
    else:
        main, skip = state, 0
    iterator = _restore(probe, main) if main else iter(probe)
    for _ in range(skip):
        next(iterator, None)
    batch = None if state.get(_ITERATOR_FINISHED) else next(iterator, None)
    # A pass that has ended (or has nothing left) is followed by a fresh one, as in the real loader.
    return next(iter(probe), None) if batch is None else batch


def _restore(probe: Any, main: Mapping[str, Any]) -> Iterator:
    """Mirror torchdata's restore of the main-process sampler state onto `probe`."""
    iterator = iter(probe)
    if isinstance(probe, Stateful) or isinstance(iterator, Stateful):
        if isinstance(probe, Stateful) and main.get(_INDEX_SAMPLER_STATE) is not None:
            probe.load_state_dict(main[_INDEX_SAMPLER_STATE])
        iterator = iter(probe)
        if main.get(_SAMPLER_ITER_STATE) is not None and isinstance(iterator, Stateful):
            iterator.load_state_dict(main[_SAMPLER_ITER_STATE])
        return iterator
    return itertools.islice(probe, main.get(_SAMPLER_ITER_YIELDED, 0), None)
