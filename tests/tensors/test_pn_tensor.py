"""PNTensor items become NestedTensor batches through the stock DataLoader collate."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

import danling
from danling.tensors import NestedTensor, PNTensor, tensor


class Sequences(Dataset):
    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, index):
        length = self.lengths[index]
        return {"input": tensor(torch.arange(length) + index), "label": index % 2}


def test_tensor_factory_matches_torch_tensor():
    t = tensor([[1, 2], [3, 4]], dtype=torch.float64, requires_grad=True)
    assert type(t) is PNTensor and t.dtype == torch.float64 and t.requires_grad and t.is_leaf
    assert danling.tensor is tensor and danling.NestedTensor is NestedTensor and danling.PNTensor is PNTensor


def test_views_of_a_single_item():
    item = PNTensor([[1, 2], [3, 4]])
    assert item.tensor is item and item.concat is item
    assert item.mask.shape == (2, 2) and bool(item.mask.all()) and item.mask.stride() == (0, 0)
    assert type(item.new_empty(3)) is PNTensor


def test_default_collate_nests_items():
    batch = default_collate([tensor([1, 2, 3]), tensor([4])])
    assert isinstance(batch, NestedTensor) and batch.tolist() == [[1, 2, 3], [4]]
    assert type(batch.concat) is torch.Tensor  # the packed storage is a plain tensor


def test_dataloader_in_worker_processes():
    loader = DataLoader(Sequences([3, 1, 4, 2, 5]), batch_size=2, num_workers=2)
    batches = list(loader)
    assert [len(b["input"]) for b in batches] == [2, 2, 1]
    first = batches[0]
    assert isinstance(first["input"], NestedTensor)
    assert first["input"].tolist() == [[0, 1, 2], [1]]
    assert first["label"].tolist() == [0, 1]


def test_batches_feed_a_model():
    loader = DataLoader(Sequences([3, 1, 4]), batch_size=3)
    batch = next(iter(loader))
    embedding = torch.nn.Embedding(10, 4)
    pooled = embedding(batch["input"]).mean(dim=1)
    assert pooled.shape == (3, 4)
    torch.testing.assert_close(pooled[1], embedding(torch.tensor([1])).mean(0))
