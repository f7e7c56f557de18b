"""How [`TorchRunner`][danling.runners.TorchRunner] turns datasets into loaders, and what they add up to.

[`build_sampler`][danling.runners.torch_data.build_sampler] makes the resumable, sharded index
sampler of one split; [`epoch_budget`][danling.runners.torch_data.epoch_budget] estimates the
optimizer steps of an epoch-mode run from the datasets before any loader exists, and
[`why_no_steps`][danling.runners.torch_data.why_no_steps] says why there are none. The runner's
`build_dataloaders` and `build_datasampler` hooks call them with explicit arguments.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence, Sized
from typing import Any

import torch
from torch.utils.data import IterableDataset

from danling.data import ResumableSampler, resolve_loader_options

__all__ = ["build_sampler", "epoch_budget", "why_no_steps"]

# The number of indices a split's sampler yields on this rank: `len(runner.build_datasampler(...))`.
SamplerLength = Callable[[Any, str], int]


def build_sampler(
    dataset: Any,
    *,
    loader_config: Mapping[str, Any],
    split: str,
    is_train: bool,
    shuffle: bool,
    seed: int,
    num_replicas: int,
    rank: int,
) -> ResumableSampler:
    """The [`ResumableSampler`][danling.data.ResumableSampler] of one split: its order depends only
    on `(seed, epoch)`, it shards over `num_replicas` ranks, and `drop_last` comes from the split's
    loader options."""
    options = resolve_loader_options(dict(loader_config), split, is_train=is_train)
    generator = torch.Generator()
    generator.manual_seed(seed)
    return ResumableSampler(
        dataset,
        num_replicas=num_replicas,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=bool(options["drop_last"]),
        generator=generator,
    )


def _sized(dataset: Any) -> bool:
    return isinstance(dataset, Sized) and not isinstance(dataset, IterableDataset)


def _batches(loader_config: Mapping[str, Any], split: str, samples: int) -> tuple[int, int, bool]:
    options = resolve_loader_options(dict(loader_config), split, is_train=True)
    size = options.get("batch_size", 1)
    drop_last = bool(options["drop_last"])
    return (samples // size if drop_last else math.ceil(samples / size)), size, drop_last


def epoch_budget(
    *,
    epochs: int | None,
    steps: int | None,
    accum_steps: int,
    train_splits: Sequence[str],
    datasets: Mapping[str, Any],
    loader_config: Mapping[str, Any],
    sampler_length: SamplerLength,
) -> int | None:
    """The optimizer-step budget: `steps` when set, else `epochs` times the updates of one epoch
    over the train splits (None when a train split has no length, or no update happens)."""
    if steps is not None or epochs is None:
        return steps
    per_epoch = 0
    for split in train_splits:
        dataset = datasets.get(split)
        if not _sized(dataset):
            return None
        batches, _, _ = _batches(loader_config, split, sampler_length(dataset, split))
        per_epoch += math.ceil(batches / accum_steps)
    return epochs * per_epoch or None


def why_no_steps(
    *,
    epochs: int | None,
    steps: int | None,
    train_splits: Sequence[str],
    datasets: Mapping[str, Any],
    loader_config: Mapping[str, Any],
    sampler_length: SamplerLength,
) -> str | None:
    """Why `epoch_budget` found no step (no budget, no train split, or one that yields no batch),
    in words; None when that is not the reason."""
    if epochs is None:
        return None if steps is not None else "this run has no length: set epochs (with sized train datasets) or steps"
    if not train_splits:
        return f"no training split among the datasets {list(datasets)}: name one 'train' or set train_splits"
    for split in train_splits:
        dataset = datasets.get(split)
        if not _sized(dataset):
            continue
        samples = sampler_length(dataset, split)
        _, size, drop_last = _batches(loader_config, split, samples)
        if samples == 0 or (drop_last and samples < size):
            return (
                f"training split {split!r} yields no batch: {samples} sample(s) on this rank with batch_size "
                f"{size}{' and drop_last' if drop_last else ''}; lower dataloader.batch_size or add data"
            )
    return None
