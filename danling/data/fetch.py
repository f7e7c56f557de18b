"""Whole-batch fetching for in-memory tensor datasets.

A `DataLoader` over a `TensorDataset` builds every batch one example at a time: a
`__getitem__` call per example (one index op per tensor) and then `default_collate`, which
stacks the rows again. For a batch of 32 rows of a small model that is over a hundred
microseconds, often more than the forward pass. Indexing each tensor once with the batch's
indices gives the same tensors (same values, dtype and shape, contiguous) for a few
microseconds.

[`tensor_batch_fetcher`][danling.data.fetch.tensor_batch_fetcher] returns such a fetcher when a
loader's fetch is exactly "per-example `__getitem__` of a `TensorDataset` (possibly behind
`Subset`s), then `default_collate`", and None otherwise; loaders built by
[`build_dataloader`][danling.data.build_dataloader] use it in single-process loading.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Subset, TensorDataset, default_collate
from torch.utils.data._utils.fetch import _MapDatasetFetcher

__all__ = ["tensor_batch_fetcher"]


class _TensorBatchFetcher(_MapDatasetFetcher):
    """`_MapDatasetFetcher` of a `TensorDataset` that indexes each tensor once per batch.

    `positions` maps the loader's indices to rows of `source` when the loader's dataset is a
    chain of `Subset`s over it. Batches whose indices are not plain integers go the per-example
    way, so they fail (or not) exactly as they would there.
    """

    def __init__(self, fetcher: _MapDatasetFetcher, source: TensorDataset, positions: torch.Tensor | None) -> None:
        super().__init__(fetcher.dataset, fetcher.auto_collation, fetcher.collate_fn, fetcher.drop_last)
        self.source = source
        self.positions = positions

    def fetch(self, possibly_batched_index: Any) -> Any:
        index = np.asarray(possibly_batched_index)
        if index.dtype.kind != "i" or index.ndim != 1:
            return super().fetch(possibly_batched_index)
        rows = torch.from_numpy(index.astype(np.int64, copy=False))
        if self.positions is not None:
            rows = self.positions[rows]
        # A list, as default_collate makes of the tuples TensorDataset returns.
        return [tensor[rows] for tensor in self.source.tensors]


def tensor_batch_fetcher(fetcher: Any) -> _TensorBatchFetcher | None:
    """A whole-batch replacement for a loader iterator's `fetcher`, or None where it would differ.

    Only a batched map-style fetch with `default_collate` over a `TensorDataset` whose
    `__getitem__` is the stock one, directly or through `Subset`s that are stock too, qualifies;
    its tensors must be dense (strided, not nested). `Subset` indices are read when the fetcher
    is made, i.e. once per pass of the loader.

    Examples:
        >>> from torch.utils.data import DataLoader
        >>> dataset = TensorDataset(torch.arange(10).view(5, 2), torch.arange(5))
        >>> loader = DataLoader(dataset, batch_size=2)
        >>> fetcher = tensor_batch_fetcher(iter(loader)._dataset_fetcher)
        >>> fetcher.fetch([4, 0])
        [tensor([[8, 9],
                [0, 1]]), tensor([4, 0])]
    """
    if type(fetcher) is not _MapDatasetFetcher or not fetcher.auto_collation:
        return None
    if fetcher.collate_fn is not default_collate:
        return None
    node, positions = fetcher.dataset, None
    while _is_stock(node, Subset):
        try:
            indices = torch.as_tensor(node.indices)
        except (TypeError, ValueError, RuntimeError):  # not a sequence of numbers: per example
            return None
        dtype = indices.dtype
        if indices.ndim != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            return None
        indices = indices.to("cpu", torch.int64)  # uint8 would index as a mask; batch indices are on the CPU
        positions = indices if positions is None else indices[positions]
        node = node.dataset
    if not _is_stock(node, TensorDataset):
        return None
    if not all(t.layout is torch.strided and not t.is_nested for t in node.tensors):
        return None
    return _TensorBatchFetcher(fetcher, node, positions)


def _is_stock(dataset: Any, cls: type) -> bool:
    """`dataset` is a `cls` whose item access (and batched access, if any) is `cls`'s own."""
    kind = type(dataset)
    if not isinstance(dataset, cls) or kind.__getitem__ is not cls.__getitem__:
        return False
    if getattr(kind, "__getitems__", None) is not getattr(cls, "__getitems__", None):
        return False
    return "__getitems__" not in getattr(dataset, "__dict__", {})
