import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from danling.data import (
    DataResumeError,
    ResumableBatchSampler,
    ResumableSampler,
    batch_fingerprint,
    build_dataloader,
    check_batch_fingerprint,
    indices_fingerprint,
    resolve_loader_options,
    set_epoch,
)


class Indices(Dataset):
    """Each sample is its own index, so batches show exactly which indices were drawn."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(5))


def _batches(loader, passes: int = 1) -> list[list[int]]:
    return [batch.tolist() for _ in range(passes) for batch in loader]


def test_split_section_wins_and_none_means_unset():
    config = {
        "batch_size": 8,
        "drop_last": None,
        "val": {"batch_size": 2, "shuffle": True},
        "train": {"num_workers": 0},
    }
    assert resolve_loader_options(config, "val", is_train=False) == {
        "batch_size": 2,
        "shuffle": True,
        "drop_last": False,
    }
    assert resolve_loader_options(config, "train", is_train=True) == {
        "batch_size": 8,
        "num_workers": 0,
        "shuffle": True,
        "drop_last": True,
    }
    assert resolve_loader_options(None, "test", is_train=False) == {"shuffle": False, "drop_last": False}


def test_unknown_option_is_named():
    with pytest.raises(ValueError, match=r"\['batchsize'\] for split 'val'; accepted: .*batch_size"):
        build_dataloader(Indices(4), split="val", config={"val": {"batchsize": 2}})


def test_train_shuffles_and_drops_last_eval_keeps_order():
    train = build_dataloader(Indices(10), split="train", config={"batch_size": 4}, seed=0)
    batches = _batches(train)
    assert [len(b) for b in batches] == [4, 4]
    flat = sum(batches, [])
    assert flat != sorted(flat)  # shuffled (seed 0 gives a non-identity permutation)
    val = build_dataloader(Indices(10), split="val", config={"batch_size": 4})
    assert _batches(val) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # is_train overrides the split name
    assert [
        len(b) for b in _batches(build_dataloader(Indices(10), split="x", config={"batch_size": 4}, is_train=True))
    ] == [4, 4]


def test_order_depends_on_seed_and_epoch_only():
    def order(seed):
        return _batches(build_dataloader(Indices(32), split="train", config={"batch_size": 8}, seed=seed), passes=2)

    torch.manual_seed(1)
    first = order(5)
    torch.manual_seed(2)  # the global RNG does not matter
    assert order(5) == first
    assert order(6) != first
    assert first[:4] != first[4:]  # each pass (epoch) is a new permutation
    loader = build_dataloader(Indices(32), split="train", config={"batch_size": 8}, seed=5)
    set_epoch(loader, 1)
    assert _batches(loader) == first[4:]


def test_loader_never_consumes_the_global_rng():
    loader = build_dataloader(Indices(16), split="train", config={"batch_size": 4}, seed=0)
    before = torch.get_rng_state()
    _batches(loader, passes=2)
    loader.load_state_dict(loader.state_dict())
    _batches(loader)
    assert torch.equal(before, torch.get_rng_state())


def test_distributed_shards_are_disjoint_and_cover():
    shards = [
        _batches(
            build_dataloader(
                Indices(20), split="train", config={"batch_size": 5}, distributed=True, rank=r, world_size=2, seed=3
            )
        )
        for r in range(2)
    ]
    flat = [sum(s, []) for s in shards]
    assert not set(flat[0]) & set(flat[1])
    assert sorted(flat[0] + flat[1]) == list(range(20))
    assert all(
        isinstance(loader.sampler, torch.utils.data.DistributedSampler)
        for loader in [build_dataloader(Indices(4), split="val", distributed=True, rank=1, world_size=2)]
    )
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        build_dataloader(Indices(4), split="val", distributed=True, rank=2, world_size=2)


def test_iterable_dataset_has_no_sampler():
    loader = build_dataloader(Stream(), split="train", config={"batch_size": 2})
    assert _batches(loader) == [[0, 1], [2, 3]]
    assert batch_fingerprint(loader, loader.state_dict()) is None
    with pytest.raises(ValueError, match="shuffle=True is not possible"):
        build_dataloader(Stream(), split="train", config={"shuffle": True})


def _sharded(size, config, world_size, rank, *, seed):
    """The runner's train loader over `Indices(size)` for one rank of `world_size`."""
    distributed = world_size > 1
    kwargs = {"distributed": distributed, "rank": rank, "world_size": world_size}
    return build_dataloader(Indices(size), split="train", config=config, seed=seed, **kwargs)


def _resume(
    size, batch, cut, *, num_workers=0, world_size=1, rank=0, shuffle=None, drop_last=None, passes=3, context=None
):
    """Stop after `cut` batches, restore a fresh loader from the state, compare with an uninterrupted run."""
    config = {"batch_size": batch, "num_workers": num_workers, "shuffle": shuffle, "drop_last": drop_last}
    if context is not None:
        config["multiprocessing_context"] = context

    def make():
        return _sharded(size, config, world_size, rank, seed=11)

    reference = _batches(make(), passes=passes)
    cut = min(cut, len(reference))
    interrupted, seen, state = make(), [], None
    while state is None:
        for batch in interrupted:
            seen.append(batch.tolist())
            if len(seen) == cut:
                state = interrupted.state_dict()
                fingerprint = batch_fingerprint(interrupted, state)
                break
    restored = make()
    restored.load_state_dict(state)
    rest = []
    while len(seen) + len(rest) < len(reference):
        rest.extend(_batches(restored))
    assert seen + rest == reference
    if rest:
        assert fingerprint == indices_fingerprint(rest[0])
    check_batch_fingerprint(restored, state, fingerprint)


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(3, 30),
    batch=st.integers(1, 7),
    cut=st.integers(1, 40),
    world_size=st.integers(1, 3),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    data=st.data(),
)
def test_restored_loader_continues_the_stream(size, batch, cut, world_size, shuffle, drop_last, data):
    rank = data.draw(st.integers(0, world_size - 1))
    if drop_last and size // world_size < batch:
        batch = max(1, size // world_size)
    _resume(size, batch, cut, world_size=world_size, rank=rank, shuffle=shuffle, drop_last=drop_last)


@pytest.mark.parametrize("cut", [2, 4, 7])  # mid-epoch, at the epoch boundary, in the second epoch
def test_restored_multiworker_loader_continues_the_stream(cut):
    _resume(18, 4, cut, num_workers=2)


def test_restored_loader_continues_the_stream_with_forkserver_workers():
    # Python 3.14 starts workers with forkserver by default on Linux: the sampler, the dataset and
    # the loader's state then cross a pickle instead of a fork, and resuming must not notice.
    _resume(18, 4, 6, num_workers=2, context="forkserver", passes=2)


def test_fingerprint_detects_a_changed_configuration():
    config = {"batch_size": 4}
    loader = build_dataloader(Indices(16), split="train", config=config, seed=1)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    saved = batch_fingerprint(loader, state)
    assert batch_fingerprint(loader, state) == saved  # probing does not move the loader
    assert next(iterator).tolist() and loader.state_dict() != state
    changed = [
        build_dataloader(Indices(16), split="train", config=config, seed=2),
        build_dataloader(Indices(16), split="train", config={"batch_size": 2}, seed=1),
        build_dataloader(Indices(17), split="train", config=config, seed=1),
        build_dataloader(Indices(16), split="train", config=config, seed=1, distributed=True, rank=0, world_size=2),
    ]
    for other in changed:
        with pytest.raises(DataResumeError, match="would not continue the saved data stream"):
            check_batch_fingerprint(other, state, saved)
    check_batch_fingerprint(changed[0], state, None)  # no fingerprint recorded: nothing to check


def test_sampler_rejects_bad_states():
    sampler = ResumableSampler(range(4), shuffle=False)
    with pytest.raises(ValueError, match=r"missing \['yielded'\]"):
        sampler.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="negative"):
        sampler.load_state_dict({"epoch": 0, "yielded": -1})
    sampler.load_state_dict({"epoch": 0, "yielded": 9})
    with pytest.raises(ValueError, match="resume at index 9"):
        iter(sampler)


def test_accepts_the_runner_config_section():
    from danling.runners.config import RunnerConfig

    config = RunnerConfig(**{"dataloader.batch_size": 4, "dataloader.val.batch_size": 8}).dataloader
    assert [len(b) for b in _batches(build_dataloader(Indices(10), split="train", config=config))] == [4, 4]
    assert [len(b) for b in _batches(build_dataloader(Indices(10), split="val", config=config))] == [8, 2]


def test_state_saved_after_a_short_final_batch_resumes_the_next_epoch():
    # Regression (found by hypothesis): with a shard shorter than the batch, the sampler finishes
    # its pass before the batch is yielded; the saved state must point at the next epoch's start.
    sampler = ResumableSampler(range(3), num_replicas=3, rank=0, shuffle=True, seed=0)
    first = list(sampler)
    assert sampler.state_dict() == {"epoch": 1, "yielded": 0}
    restored = ResumableSampler(range(3), num_replicas=3, rank=0, shuffle=True, seed=0)
    restored.load_state_dict(sampler.state_dict())
    sampler_next = list(sampler)
    assert list(restored) == sampler_next and len(first) == 1


def _torchdata_batched(size, batch, *, shuffle, drop_last, world_size, rank):
    """The same sampler batched by torchdata's own (per-index) batch sampler: the reference."""
    generator = torch.Generator().manual_seed(5)
    sampler = ResumableSampler(
        Indices(size),
        num_replicas=world_size,
        rank=rank,
        shuffle=shuffle,
        seed=5,
        drop_last=drop_last,
        generator=generator,
    )
    return StatefulDataLoader(
        Indices(size), sampler=sampler, batch_size=batch, drop_last=drop_last, generator=generator
    )


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(1, 25),
    batch=st.integers(1, 6),
    world_size=st.integers(1, 3),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    cut=st.integers(0, 12),
    data=st.data(),
)
def test_slice_batching_matches_torchdata_batches_and_states(size, batch, world_size, shuffle, drop_last, cut, data):
    rank = data.draw(st.integers(0, world_size - 1))
    config = {"batch_size": batch, "shuffle": shuffle, "drop_last": drop_last}
    ours = _sharded(size, config, world_size, rank, seed=5)
    assert isinstance(ours.batch_sampler, ResumableBatchSampler)
    assert ours.sampler is ours.batch_sampler.sampler and (ours.batch_size, ours.drop_last) == (batch, drop_last)
    reference = _torchdata_batched(size, batch, shuffle=shuffle, drop_last=drop_last, world_size=world_size, rank=rank)
    # Same batches and the same checkpoint state after every batch, over three passes.
    steps = []
    for _ in range(3):
        mine, theirs = iter(ours), iter(reference)
        for expected in theirs:
            assert next(mine).tolist() == expected.tolist()
            assert ours.state_dict() == reference.state_dict()
            steps.append(reference.state_dict())
        assert next(mine, None) is None
        assert ours.state_dict() == reference.state_dict() and ours.sampler.epoch == reference.sampler.epoch
    # A state written by either continues identically in the other.
    if steps:
        state = steps[min(cut, len(steps) - 1)]
        continued = []
        for loader in (
            ours,
            _torchdata_batched(size, batch, shuffle=shuffle, drop_last=drop_last, world_size=world_size, rank=rank),
        ):
            loader.load_state_dict(state)
            continued.append([b.tolist() for _ in range(2) for b in loader])
        assert continued[0] == continued[1]


def test_batch_sampler_needs_a_resumable_sampler():
    with pytest.raises(TypeError, match="needs a ResumableSampler, got list"):
        ResumableBatchSampler([0, 1], batch_size=1, drop_last=False)
