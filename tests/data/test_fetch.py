"""Whole-batch fetching of tensor datasets: the same batches as the per-example path, or that path."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Sampler, Subset, TensorDataset, default_collate, random_split

from danling.data import build_dataloader
from danling.data.fetch import _TensorBatchFetcher, tensor_batch_fetcher


def per_example(batch):
    """default_collate behind another function: build_dataloader then fetches example by example."""
    return default_collate(batch)


def dataset(size: int = 23, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(size, 3, 2, generator=generator),
        torch.randint(0, 5, (size,), generator=generator),
        torch.arange(size, dtype=torch.float64),
    )


def fetcher_of(loader):
    return iter(loader)._dataset_fetcher


def assert_same_batches(fast, slow) -> None:
    batches, expected = list(fast), list(slow)
    assert len(batches) == len(expected)
    for batch, reference in zip(batches, expected):
        assert type(batch) is type(reference) is list
        for tensor, other in zip(batch, reference, strict=True):
            assert tensor.dtype == other.dtype and tensor.shape == other.shape
            assert tensor.is_contiguous()
            assert torch.equal(tensor, other)


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(1, 40),
    batch=st.integers(1, 9),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    world_size=st.integers(1, 3),
    subset=st.booleans(),
    data=st.data(),
)
def test_whole_batch_fetch_gives_the_per_example_batches(size, batch, shuffle, drop_last, world_size, subset, data):
    source = dataset(size)
    if subset:  # a random subset in a random order, behind a second subset
        inner = data.draw(st.permutations(range(size)))[: data.draw(st.integers(1, size))]
        outer = data.draw(st.lists(st.integers(0, len(inner) - 1), min_size=1, max_size=len(inner)))
        source = Subset(Subset(source, inner), outer)
    rank = data.draw(st.integers(0, world_size - 1))
    config = {"batch_size": batch, "shuffle": shuffle, "drop_last": drop_last}
    options = dict(split="train", config=config, distributed=world_size > 1, rank=rank, world_size=world_size, seed=3)
    fast = build_dataloader(source, **options)
    slow = build_dataloader(source, collate_fn=per_example, **options)
    assert isinstance(fetcher_of(fast), _TensorBatchFetcher)
    assert not isinstance(fetcher_of(slow), _TensorBatchFetcher)
    for epoch in range(2):
        fast.sampler.set_epoch(epoch)
        slow.sampler.set_epoch(epoch)
        assert_same_batches(fast, slow)


def test_random_split_and_a_single_tensor_are_fetched_whole():
    train, _ = random_split(dataset(30), [20, 10], generator=torch.Generator().manual_seed(0))
    loader = build_dataloader(train, split="val", config={"batch_size": 6})
    assert isinstance(fetcher_of(loader), _TensorBatchFetcher)
    assert_same_batches(loader, build_dataloader(train, split="val", config={"batch_size": 6}, collate_fn=per_example))
    single = TensorDataset(torch.arange(7))
    assert [batch[0].tolist() for batch in build_dataloader(single, split="val", config={"batch_size": 4})] == [
        [0, 1, 2, 3],
        [4, 5, 6],
    ]


def test_restored_loader_continues_with_whole_batches():
    source = dataset(37)
    config = {"batch_size": 4}
    loader = build_dataloader(source, split="train", config=config, seed=5)
    stream = iter(loader)
    for _ in range(3):
        next(stream)
    state = loader.state_dict()
    rest = list(stream)
    restored = build_dataloader(source, split="train", config=config, seed=5)
    restored.load_state_dict(state)
    resumed = iter(restored)
    assert isinstance(resumed._dataset_fetcher, _TensorBatchFetcher)
    assert_same_batches(resumed, rest)


class Doubled(TensorDataset):
    def __getitem__(self, index):
        return tuple(2 * tensor[index] for tensor in self.tensors)


class Batched(TensorDataset):
    def __getitems__(self, indices):
        return [(self.tensors[0][i] + 100,) for i in indices]


def test_datasets_and_loaders_that_fetch_differently_keep_their_own_path():
    plain = TensorDataset(torch.arange(6))
    assert tensor_batch_fetcher(fetcher_of(build_dataloader(plain, split="val", collate_fn=per_example))) is None
    # The item or batch access is the user's own: it must be called.
    doubled = build_dataloader(Doubled(torch.arange(4)), split="val", config={"batch_size": 2})
    assert [b[0].tolist() for b in doubled] == [[0, 2], [4, 6]]
    assert [b[0].tolist() for b in build_dataloader(Batched(torch.arange(2)), split="val")] == [[100], [101]]
    instance = TensorDataset(torch.arange(2))
    instance.__getitems__ = lambda indices: [(torch.tensor(-1),) for _ in indices]
    assert [b[0].tolist() for b in build_dataloader(instance, split="val")] == [[-1], [-1]]
    # Sparse tensors and float subset indices are left to the per-example path.
    sparse = TensorDataset(torch.eye(3).to_sparse())
    assert tensor_batch_fetcher(fetcher_of(build_dataloader(sparse, split="val"))) is None
    assert tensor_batch_fetcher(fetcher_of(build_dataloader(Subset(plain, [0.0, 1.0]), split="val"))) is None
    # Worker processes fetch as usual, with the same batches.
    workers = build_dataloader(plain, split="val", config={"batch_size": 4, "num_workers": 1})
    assert [batch[0].tolist() for batch in workers] == [[0, 1, 2, 3], [4, 5]]


class Fixed(Sampler):
    def __init__(self, indices):
        self.indices = indices

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


@pytest.mark.parametrize("indices", [[-1, 0], [1.0, 2.0], [0, 99]])
def test_unusual_indices_behave_as_per_example(indices):
    source = TensorDataset(torch.arange(5))
    options = dict(split="val", sampler=Fixed(indices), config={"batch_size": 2})
    fast = build_dataloader(source, **options)
    slow = build_dataloader(source, collate_fn=per_example, **options)
    try:
        expected = list(slow)
    except Exception as error:  # the per-example error type is the contract
        with pytest.raises(type(error)):
            list(fast)
    else:
        assert_same_batches(fast, expected)
