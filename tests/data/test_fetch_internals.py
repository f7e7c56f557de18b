"""Pins the private torch / torchdata internals the whole-batch fetch relies on.

`danling.data.fetch` swaps the `_dataset_fetcher` of a single-process loader iterator for a
subclass of torch's `_MapDatasetFetcher`. Neither is public API, so a torch or torchdata upgrade
that changes them must fail here, loudly, instead of silently changing how batches are built.
"""

from __future__ import annotations

import inspect

import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate
from torch.utils.data._utils.fetch import _BaseDatasetFetcher, _MapDatasetFetcher
from torchdata.stateful_dataloader import StatefulDataLoader

from danling.data.fetch import tensor_batch_fetcher


def _dataset() -> TensorDataset:
    return TensorDataset(torch.arange(20).view(10, 2), torch.arange(10))


def test_map_dataset_fetcher_keeps_its_constructor_attributes_and_fetch():
    assert issubclass(_MapDatasetFetcher, _BaseDatasetFetcher)
    parameters = list(inspect.signature(_MapDatasetFetcher.__init__).parameters)
    assert parameters == ["self", "dataset", "auto_collation", "collate_fn", "drop_last"]
    assert list(inspect.signature(_MapDatasetFetcher.fetch).parameters) == ["self", "possibly_batched_index"]
    dataset = _dataset()
    fetcher = _MapDatasetFetcher(dataset, True, default_collate, False)
    assert fetcher.dataset is dataset and fetcher.collate_fn is default_collate
    assert fetcher.auto_collation is True and fetcher.drop_last is False
    # the per-example path the whole-batch fetch must reproduce: __getitem__ per index, then collate
    assert [t.tolist() for t in fetcher.fetch([3, 1])] == [[[6, 7], [2, 3]], [3, 1]]


def test_single_process_iterators_expose_a_replaceable_dataset_fetcher():
    for loader in (DataLoader(_dataset(), batch_size=4), StatefulDataLoader(_dataset(), batch_size=4)):
        iterator = loader._get_iterator()
        assert type(iterator._dataset_fetcher) is _MapDatasetFetcher
        fast = tensor_batch_fetcher(iterator._dataset_fetcher)
        assert fast is not None
        iterator._dataset_fetcher = fast  # what danling's loaders do, once per pass
        assert [t.tolist() for t in next(iterator)] == [[[0, 1], [2, 3], [4, 5], [6, 7]], [0, 1, 2, 3]]


def test_stateful_loader_builds_its_iterator_through_get_iterator():
    assert callable(getattr(StatefulDataLoader, "_get_iterator", None))
    assert "_get_iterator" in StatefulDataLoader.__dict__ or "_get_iterator" in DataLoader.__dict__
