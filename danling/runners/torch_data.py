"""Dataloaders and samplers of [`TorchRunner`][danling.runners.TorchRunner].

[`TorchDataMixin`][danling.runners.torch_data.TorchDataMixin] wraps every dataset in a resumable
loader, shards it over the data domain of the runner's topology, and estimates the optimizer-step
budget of an epoch-mode run from the datasets before the loaders exist.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sized
from typing import Any

import torch
from torch.utils.data import IterableDataset

from danling.data import ResumableSampler, build_dataloader, resolve_loader_options

__all__ = ["TorchDataMixin"]


class TorchDataMixin:
    """Loader building and sharding; mixed into `TorchRunner` ahead of `BaseRunner`."""

    collate_fn: Callable | None = None

    def _total_steps(self) -> int | None:
        """The optimizer-step budget, estimated from the datasets when the loaders are not built yet."""
        steps = self.steps
        if steps is not None or self.epochs is None:
            return steps
        per_epoch = 0
        for split in self.train_splits:
            dataset = self.datasets.get(split)
            if not isinstance(dataset, Sized) or isinstance(dataset, IterableDataset):
                return None
            options = resolve_loader_options(self._loader_config(), split, is_train=True)
            samples = len(self.build_datasampler(dataset, split=split, shuffle=False))
            size = options.get("batch_size", 1)
            batches = samples // size if options["drop_last"] else math.ceil(samples / size)
            per_epoch += math.ceil(batches / self.accum_steps)
        return self.epochs * per_epoch or None

    def _why_no_steps(self) -> str | None:
        """Why `_total_steps` found no step in epoch mode (no train split, or one that yields no
        batch, or no budget at all), in words; None when that is not the reason."""
        if self.epochs is None:
            return (
                None
                if self.steps is not None
                else "this run has no length: set epochs (with sized train datasets) or steps"
            )
        splits = self.train_splits
        if not splits:
            return f"no training split among the datasets {list(self.datasets)}: name one 'train' or set train_splits"
        for split in splits:
            dataset = self.datasets.get(split)
            if not isinstance(dataset, Sized) or isinstance(dataset, IterableDataset):
                continue
            options = resolve_loader_options(self._loader_config(), split, is_train=True)
            samples = len(self.build_datasampler(dataset, split=split, shuffle=False))
            size = options.get("batch_size", 1)
            if samples == 0 or (options["drop_last"] and samples < size):
                return (
                    f"training split {split!r} yields no batch: {samples} sample(s) on this rank with batch_size "
                    f"{size}{' and drop_last' if options['drop_last'] else ''}; lower dataloader.batch_size or add data"
                )
        return None

    def _loader_config(self) -> dict[str, Any]:
        return self.config.dataloader.dict()

    @property
    def _data_seed(self) -> int:
        return int(self.config.get("seed") or 0)

    def build_dataloaders(self) -> None:
        """Wrap every dataset in `self.datasets` without a dataloader yet in a resumable `StatefulDataLoader`.

        Called by `__post_init__` when datasets are bound. Options come from `config.dataloader`
        with `config.dataloader.<split>` overrides; train splits shuffle and drop the last partial
        batch unless configured otherwise. Samplers come from `build_datasampler` and batches are
        collated with `self.collate_fn`. Loaders already in `self.dataloaders` are left alone.
        """
        config = self._loader_config()
        train_splits = set(self.train_splits)
        for split, dataset in self.datasets.items():
            if split in self.dataloaders:
                continue
            is_train = split in train_splits
            sampler = None
            if not isinstance(dataset, IterableDataset):
                shuffle = resolve_loader_options(config, split, is_train=is_train)["shuffle"]
                sampler = self.build_datasampler(dataset, split=split, shuffle=shuffle)
            self.dataloaders[split] = build_dataloader(
                dataset,
                split=split,
                config=config,
                distributed=self.topology.size("data") > 1,
                rank=self.topology.rank("data"),
                world_size=self.topology.size("data"),
                seed=self._data_seed,
                is_train=is_train,
                collate_fn=self.collate_fn,
                sampler=sampler,
            )

    def build_datasampler(self, dataset: Any, *, split: str, shuffle: bool) -> Any:
        """The index sampler of one split: a [`ResumableSampler`][danling.data.ResumableSampler].

        It is a `DistributedSampler` sharding over all ranks when distributed, and a local
        random or sequential sampler otherwise; its order depends only on `(seed, epoch)` and its
        position is saved with the loader, so a resumed run continues mid-epoch.
        """
        is_train = split in self.train_splits
        options = resolve_loader_options(self._loader_config(), split, is_train=is_train)
        generator = torch.Generator()
        generator.manual_seed(self._data_seed)
        topology = self.topology  # the data domain: ranks that read the same batch share a shard
        return ResumableSampler(
            dataset,
            num_replicas=topology.size("data"),
            rank=topology.rank("data"),
            shuffle=shuffle,
            seed=self._data_seed,
            drop_last=bool(options["drop_last"]),
            generator=generator,
        )
