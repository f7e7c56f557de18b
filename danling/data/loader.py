"""Build a resumable torchdata `StatefulDataLoader` from a `dataloader` config section."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from .fetch import tensor_batch_fetcher
from .fingerprint import _MP, _restore
from .sampler import ResumableBatchSampler, ResumableSampler

__all__ = ["LOADER_OPTIONS", "build_dataloader", "loader_global_state", "resolve_loader_options", "set_epoch"]

# Keys a `dataloader` config section may hold (besides per-split sub-sections).
LOADER_OPTIONS = frozenset(
    {
        "batch_size",
        "shuffle",
        "drop_last",
        "num_workers",
        "persistent_workers",
        "prefetch_factor",
        "pin_memory",
        "pin_memory_device",
        "in_order",
        "snapshot_every_n_steps",
        "timeout",
        "multiprocessing_context",
    }
)


class _Loader(StatefulDataLoader):
    """`StatefulDataLoader` whose single-process passes fetch in-memory tensor batches whole.

    Each pass's iterator gets a [`tensor_batch_fetcher`][danling.data.fetch.tensor_batch_fetcher]
    when one applies (same batches, a fraction of the per-example fetch and collate cost); worker
    processes and every other dataset fetch as usual. Iterator state, and so resuming, is unchanged.
    """

    def _get_iterator(self) -> Any:
        iterator = super()._get_iterator()
        if self.num_workers == 0:
            fetcher = tensor_batch_fetcher(getattr(iterator, "_dataset_fetcher", None))
            if fetcher is not None:
                iterator._dataset_fetcher = fetcher
        return iterator


def resolve_loader_options(config: Mapping[str, Any] | None, split: str, *, is_train: bool) -> dict[str, Any]:
    """Merge a ``dataloader`` config section into the keyword arguments for one split.

    Plain keys of `config` apply to every split. A key whose value is a mapping is a per-split
    section; only the one named `split` is used, and its keys win over the plain ones. Keys set to
    ``None`` count as unset. ``shuffle`` and ``drop_last`` default to `is_train`.

    Args:
        config: The ``dataloader`` section of a runner config (or ``None``).
        split: The split being built, e.g. ``"train"``.
        is_train: Whether the split is used for training.

    Returns:
        Keyword arguments ready for `StatefulDataLoader` (without sampler, generator and collate).

    Raises:
        ValueError: a key is not a DataLoader option; the message lists the accepted ones.

    Examples:
        >>> config = {"batch_size": 32, "num_workers": 0, "val": {"batch_size": 128}, "train": {"shuffle": None}}
        >>> resolve_loader_options(config, "train", is_train=True)
        {'batch_size': 32, 'num_workers': 0, 'shuffle': True, 'drop_last': True}
        >>> resolve_loader_options(config, "val", is_train=False)
        {'batch_size': 128, 'num_workers': 0, 'shuffle': False, 'drop_last': False}
    """
    options = _merged_options(config, split)
    options.setdefault("shuffle", is_train)
    options.setdefault("drop_last", is_train)
    return options


def build_dataloader(
    dataset: Any,
    *,
    split: str,
    config: Mapping[str, Any] | None = None,
    distributed: bool = False,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    is_train: bool | None = None,
    collate_fn: Callable | None = None,
    worker_init_fn: Callable | None = None,
    sampler: Any = None,
) -> StatefulDataLoader:
    """Wrap one dataset split in a resumable `StatefulDataLoader`.

    Map-style datasets get a [`ResumableSampler`][danling.data.ResumableSampler]: shuffled by
    ``(seed, epoch)`` when ``shuffle`` is on, sharded over ``world_size`` ranks when `distributed`,
    and checkpointed together with the loader so a restored loader continues mid-epoch. The loader
    also gets its own ``torch.Generator`` so that building and iterating it never consumes the global
    torch RNG (which would shift every later random draw of a resumed run).

    Iterable datasets are passed through without a sampler; they must shard themselves under
    data parallelism and cannot be shuffled by the loader.

    With ``num_workers=0`` and no `collate_fn`, a `TensorDataset` (also behind `Subset`s, as
    `random_split` returns it) is fetched a whole batch at a time: each tensor is indexed once
    with the batch's indices instead of once per example and stacked again. The batches are
    the same; for small models this removes most of the loading time.

    Args:
        dataset: The dataset of the split.
        split: Split name; selects the per-split section of `config`.
        config: The ``dataloader`` config section (see
            [`resolve_loader_options`][danling.data.resolve_loader_options]).
        distributed: Shard the data over ``world_size`` ranks.
        rank: This process's data-parallel rank (only used when `distributed`).
        world_size: Number of data-parallel ranks (only used when `distributed`).
        seed: Base seed of the shuffle order; must be identical on every rank.
        is_train: Whether this is a training split; defaults to ``split == "train"``. It decides
            the default of ``shuffle`` and ``drop_last``.
        collate_fn: Optional batch collation function.
        worker_init_fn: Optional function run in each worker process.
        sampler: An index sampler to use instead of the default `ResumableSampler` (map-style
            datasets only). A ``generator`` attribute on it, when set, becomes the loader's
            generator too, so the sampler can reseed the worker seeds it draws.

    Returns:
        The configured `StatefulDataLoader`.

    Raises:
        ValueError: an unknown option, an invalid rank/world size, or ``shuffle=True`` for an
            iterable dataset.

    Examples:
        >>> loader = build_dataloader(list(range(10)), split="train", config={"batch_size": 4})
        >>> [len(batch) for batch in loader]  # shuffled, incomplete last batch dropped
        [4, 4]
        >>> loader = build_dataloader(list(range(10)), split="val", config={"batch_size": 4})
        >>> [batch.tolist() for batch in loader]
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    """
    if is_train is None:
        is_train = split == "train"
    options = resolve_loader_options(config, split, is_train=is_train)
    if distributed and (world_size < 1 or not 0 <= rank < world_size):
        raise ValueError(f"invalid data-parallel placement rank={rank}, world_size={world_size}")
    if not distributed:
        rank, world_size = 0, 1
    shuffle = options.pop("shuffle")
    generator = getattr(sampler, "generator", None)
    if generator is None:
        generator = torch.Generator()
        generator.manual_seed(seed)
    if isinstance(dataset, IterableDataset):
        if _merged_options(config, split).get("shuffle"):
            raise ValueError(f"split {split!r}: shuffle=True is not possible for an iterable dataset")
        if sampler is not None:
            raise ValueError(f"split {split!r}: an iterable dataset cannot take a sampler, got {sampler!r}")
    elif sampler is None:
        sampler = ResumableSampler(
            dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=bool(shuffle),
            seed=seed,
            drop_last=bool(options["drop_last"]),
            generator=generator,
        )
    with warnings.catch_warnings():
        # torchdata calls a deprecated torch hook on every construction; the warning is not actionable.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
        loader = _Loader(
            dataset,
            sampler=sampler,
            generator=generator,
            collate_fn=collate_fn,
            worker_init_fn=worker_init_fn,
            **options,
        )
    if isinstance(sampler, ResumableSampler) and loader.batch_size is not None:
        # Same batches and states as torchdata's batch sampler, cut by slices rather than drawn one
        # index at a time. Swapped in after construction so that `sampler`, `batch_size` and
        # `drop_last` keep describing the loader (passing `batch_sampler=` would reset them).
        object.__setattr__(loader, "batch_sampler", ResumableBatchSampler(sampler, loader.batch_size, loader.drop_last))
    return loader


def _merged_options(config: Mapping[str, Any] | None, split: str) -> dict[str, Any]:
    """The options explicitly set (not ``None``) for `split`, the split section winning."""
    config = config or {}
    options = {k: v for k, v in config.items() if not isinstance(v, Mapping)}
    override = config.get(split)
    if isinstance(override, Mapping):
        options.update(override)
    unknown = sorted(set(options) - LOADER_OPTIONS)
    if unknown:
        raise ValueError(
            f"unknown dataloader option(s) {unknown} for split {split!r}; accepted: {sorted(LOADER_OPTIONS)}"
        )
    return {k: v for k, v in options.items() if v is not None}


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell a loader's sampler which epoch starts, if the sampler cares (e.g. ``DistributedSampler``).

    Works for a `StatefulDataLoader`, a plain ``DataLoader`` or a bare sampler; does nothing for
    loaders whose sampler has no ``set_epoch``.

    Examples:
        >>> loader = build_dataloader(list(range(4)), split="train", config={"batch_size": 2})
        >>> set_epoch(loader, 3); loader.sampler.epoch
        3
    """
    batch_sampler = getattr(loader, "batch_sampler", None)
    for obj in (loader, getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if hasattr(obj, "set_epoch"):
            obj.set_epoch(epoch)
            return


def loader_global_state(loader: Any, state: Mapping[str, Any] | None = None) -> dict[str, int] | None:
    """Where a loader's pass stands globally: its sampler's ``{"epoch", "samples_consumed"}``.

    The position is the one a loader restored from `state` (default: ``loader.state_dict()``)
    would continue from, so with worker processes it counts the batches training received, not
    the ones prefetched. It is the same on every data-parallel rank and can be continued on any
    number of them with [`ResumableSampler.load_global_state`][danling.data.ResumableSampler.load_global_state].

    Returns:
        The global state, or ``None`` when the loader is not batched by a
        [`ResumableBatchSampler`][danling.data.ResumableBatchSampler].

    Examples:
        >>> loader = build_dataloader(list(range(10)), split="train", config={"batch_size": 2})
        >>> it = iter(loader); _ = next(it); _ = next(it)
        >>> loader_global_state(loader)
        {'epoch': 0, 'samples_consumed': 4}
    """
    batch_sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(batch_sampler, ResumableBatchSampler):
        return None
    state = loader.state_dict() if state is None else state
    # A copy restored from the state, as torchdata restores the real one (the dataset is shared).
    probe = copy.deepcopy(batch_sampler, memo={id(loader.dataset): loader.dataset})
    if _MP._SNAPSHOT in state:  # worker processes: a main-process snapshot plus the batches yielded since
        main, skip = state[_MP._SNAPSHOT][_MP._MAIN_SNAPSHOT], state[_MP._STEPS_SINCE_SNAPSHOT]
    else:
        main, skip = state, 0
    iterator = _restore(probe, main) if main else iter(probe)
    for _ in range(skip):
        next(iterator, None)
    return probe.sampler.global_state()
