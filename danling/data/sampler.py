"""A resumable, epoch-seeded sampler shared by single-process and data-parallel runs."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler

__all__ = ["ResumableBatchSampler", "ResumableSampler", "derive_seed"]


def derive_seed(*parts: int) -> int:
    """Hash integers into a non-negative 63-bit seed (stable across processes and Python versions).

    Examples:
        >>> derive_seed(0, 1) == derive_seed(0, 1)
        True
        >>> derive_seed(0, 1) != derive_seed(1, 0)
        True
    """
    digest = hashlib.blake2b(":".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class ResumableSampler(DistributedSampler):
    """Index sampler whose order is a pure function of ``(seed, epoch)`` and whose position can be checkpointed.

    It is a `torch.utils.data.DistributedSampler` (so the usual ``num_replicas``/``rank``/
    ``drop_last`` sharding rules apply) with three additions:

    - ``state_dict()`` records the epoch and how many indices of the current pass were handed out;
      ``load_state_dict()`` makes the next pass skip exactly those, which is what torchdata's
      `StatefulDataLoader` needs to continue mid-epoch. The skip is consumed when the pass
      *starts*, so a pass that had already ended when the state was saved is followed by a full
      fresh pass.
    - When a pass runs to its end the epoch advances by itself, so loops that never call
      `set_epoch` (step mode cycling over a loader) still see a new order each pass. Calling
      `set_epoch` explicitly always wins.
    - ``generator``, when given, is reseeded from ``(seed, epoch, rank)`` each time a pass starts.
      Hand the same generator to the DataLoader: it draws its worker base seed from it right
      after starting the sampler, so worker seeds also depend only on ``(seed, epoch, rank)`` and a
      resumed run seeds its workers as the original did.

    With ``num_replicas=1`` and ``rank=0`` this is an ordinary local random (``shuffle=True``) or
    sequential (``shuffle=False``) sampler. ``seed`` must be the same on every rank, otherwise the
    ranks shard different permutations and overlap.

    Elastic resume (another number of ranks): the order of a pass is one global permutation of the
    dataset that depends on ``(seed, epoch)`` only, and rank ``r`` of ``N`` takes its positions
    ``r, r + N, ...``. After every rank has handed out ``k`` indices, the first ``N * k`` positions of
    that permutation are used up whatever ``N`` is: `global_state` reports them as
    ``samples_consumed``. `load_global_state` continues the pass on this sampler's layout: the
    positions from ``samples_consumed`` on are dealt round-robin over the ``M`` ranks of the new
    layout, after cutting the fewer than ``M`` left over at the end (so every rank gets as many and
    the ranks stay in lockstep); no position is repeated and none of the used-up ones comes back.

    Examples:
        >>> sampler = ResumableSampler(range(6), num_replicas=1, rank=0, shuffle=False)
        >>> it = iter(sampler); [next(it), next(it)]
        [0, 1]
        >>> state = sampler.state_dict(); state
        {'epoch': 0, 'yielded': 2}
        >>> fresh = ResumableSampler(range(6), num_replicas=1, rank=0, shuffle=False)
        >>> fresh.load_state_dict(state); list(fresh)
        [2, 3, 4, 5]
        >>> fresh.epoch  # the pass ran to its end
        1
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)  # type: ignore[arg-type]
        self.generator = generator
        self.yielded = 0
        # Global position the current pass was dealt from, for a pass continued on another layout
        # (`load_global_state`); `None` for an ordinary full pass.
        self.origin: int | None = None
        self._skip: int | None = None

    def __len__(self) -> int:
        if self.origin is None:
            return super().__len__()
        return max(0, len(self.dataset) - self.origin) // self.num_replicas  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        indices, start = self._start_pass()
        return self._iterate(indices, start)

    def _start_pass(self) -> tuple[list[int], int]:
        """Begin a pass: the pass's indices and the position it starts at (after a restored skip)."""
        # Everything that must happen when the pass starts runs now, not at the first next():
        # torchdata creates (and may discard) iterators before pulling from them.
        start, self._skip = self._skip or 0, None
        if self.generator is not None:
            self.generator.manual_seed(derive_seed(self.seed, self.epoch, self.rank))
        indices = list(super().__iter__()) if self.origin is None else self._dealt(self.origin)
        if start > len(indices):
            raise ValueError(f"cannot resume at index {start}: this pass only has {len(indices)} indices")
        self.yielded = start
        return indices, start

    def _end_pass(self) -> None:
        # The pass is over: a state saved from now on must describe the start of the next one,
        # not "epoch + 1 with this pass's count already handed out" (which skipped indices).
        self.epoch += 1
        self.yielded = 0
        self.origin = None

    def _global_order(self) -> list[int]:
        """The pass's permutation of the whole dataset: the same as `DistributedSampler` draws, for any world size."""
        size = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(size))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(size, generator=generator).tolist()

    def _dealt(self, origin: int) -> list[int]:
        """This rank's share of the global order from `origin` on: round-robin, an equal count per rank."""
        rest = self._global_order()[origin:]
        usable = len(rest) - len(rest) % self.num_replicas
        return rest[self.rank : usable : self.num_replicas]

    def _iterate(self, indices: list[int], start: int) -> Iterator[int]:
        for position in range(start, len(indices)):
            self.yielded = position + 1
            yield indices[position]
        self._end_pass()

    def state_dict(self) -> dict[str, int]:
        """Return the epoch and the number of indices handed out in the current pass.

        A pass continued on another layout also records the global position it was dealt from
        (``origin``), so that it resumes on this layout as the same pass.
        """
        state = {"epoch": self.epoch, "yielded": self.yielded}
        if self.origin is not None:
            state["origin"] = self.origin
        return state

    @property
    def samples_consumed(self) -> int:
        """Positions of the pass's global order used up so far, over all ranks."""
        if self.origin is None:  # an ordinary pass: rank r took positions r, r + N, ...
            return min(self.num_replicas * self.yielded, len(self.dataset))  # type: ignore[arg-type]
        return self.origin + self.num_replicas * self.yielded

    def global_state(self) -> dict[str, int]:
        """The position of the pass independent of the layout: ``{"epoch", "samples_consumed"}``.

        It is the same on every rank; [`load_global_state`][danling.data.ResumableSampler.load_global_state]
        continues it on any number of ranks.

        Examples:
            >>> two = [ResumableSampler(range(10), num_replicas=2, rank=r, seed=3) for r in (0, 1)]
            >>> seen = [next(it) for it in map(iter, two) for _ in range(2)]
            >>> state = two[0].global_state(); state
            {'epoch': 0, 'samples_consumed': 4}
            >>> three = [ResumableSampler(range(10), num_replicas=3, rank=r, seed=3) for r in range(3)]
            >>> for sampler in three:
            ...     sampler.load_global_state(state)
            >>> rest = [i for sampler in three for i in sampler]
            >>> len(rest), sorted(seen + rest) == list(range(10))  # 6 left: 2 each, nothing seen twice
            (6, True)
        """
        return {"epoch": self.epoch, "samples_consumed": self.samples_consumed}

    def load_global_state(self, state: Mapping[str, Any]) -> None:
        """Continue the pass `state` describes on this sampler's layout (see the class docstring).

        The next pass deals the positions from ``samples_consumed`` on over ``num_replicas`` ranks;
        its length (``len(self)``) is this rank's share. The pass after it is an ordinary one.

        Raises:
            ValueError: `state` lacks a key, or holds a negative or too large position.
        """
        missing = {"epoch", "samples_consumed"} - set(state)
        if missing:
            raise ValueError(f"global sampler state is missing {sorted(missing)}; got keys {sorted(state)}")
        consumed, size = int(state["samples_consumed"]), len(self.dataset)  # type: ignore[arg-type]
        if not 0 <= consumed <= size:
            raise ValueError(f"samples_consumed must be between 0 and the dataset size {size}, got {consumed}")
        self.epoch = int(state["epoch"])
        self.origin = consumed if consumed else None
        self.yielded = 0
        self._skip = 0

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state from `state_dict`; the next pass resumes after the recorded position."""
        missing = {"epoch", "yielded"} - set(state_dict)
        if missing:
            raise ValueError(f"sampler state is missing {sorted(missing)}; got keys {sorted(state_dict)}")
        yielded = int(state_dict["yielded"])
        if yielded < 0:
            raise ValueError(f"sampler state has a negative position: yielded={yielded}")
        origin = state_dict.get("origin")
        if origin is not None and not 0 <= int(origin) <= len(self.dataset):  # type: ignore[arg-type]
            raise ValueError(f"sampler state has an origin outside the dataset: origin={origin}")
        self.epoch = int(state_dict["epoch"])
        self.origin = None if origin is None else int(origin)
        self.yielded = yielded
        self._skip = yielded


class ResumableBatchSampler(BatchSampler):
    """Batches of a [`ResumableSampler`][danling.data.ResumableSampler]'s indices, one list slice per batch.

    It yields exactly the batches torchdata's own batch sampler builds from the same sampler, and
    leaves the sampler (and the checkpointed state) exactly as that one does after every batch,
    but it cuts each batch from the pass's index list instead of drawing the indices one at a
    time through two Python iterators; at small batch sizes that per-index walk cost as much as
    the rest of the runner's per-batch bookkeeping. The state format is torchdata's
    (``samples_yielded`` and the sampler's own state), so checkpoints move freely between the two.

    Examples:
        >>> sampler = ResumableSampler(range(5), num_replicas=1, rank=0, shuffle=False)
        >>> batches = ResumableBatchSampler(sampler, batch_size=2, drop_last=False)
        >>> it = iter(batches); next(it)
        [0, 1]
        >>> state = it.state_dict(); state
        {'samples_yielded': 2, 'sampler_state': {'epoch': 0, 'yielded': 2}}
        >>> fresh = ResumableBatchSampler(ResumableSampler(range(5), num_replicas=1, rank=0, shuffle=False), 2, False)
        >>> it = iter(fresh); it.load_state_dict(state); list(it)
        [[2, 3], [4]]
    """

    sampler: ResumableSampler

    def __init__(self, sampler: ResumableSampler, batch_size: int, drop_last: bool) -> None:
        if not isinstance(sampler, ResumableSampler):
            raise TypeError(f"ResumableBatchSampler needs a ResumableSampler, got {type(sampler).__name__}")
        super().__init__(sampler, batch_size, drop_last)

    def __iter__(self) -> _ResumableBatchIterator:
        return _ResumableBatchIterator(self.sampler, self.batch_size, self.drop_last)


class _ResumableBatchIterator:
    """One pass of a `ResumableBatchSampler`; Stateful in torchdata's sense (state_dict/load_state_dict)."""

    def __init__(self, sampler: ResumableSampler, batch_size: int, drop_last: bool) -> None:
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last
        self.samples_yielded = 0
        self._begin()

    def _begin(self) -> None:
        self._indices, self._position = self.sampler._start_pass()
        self._finished = False

    def __iter__(self) -> _ResumableBatchIterator:
        return self

    def __next__(self) -> list[int]:
        start, size = self._position, self.batch_size
        batch = self._indices[start : start + size]
        if len(batch) == size:  # the usual batch: the pass goes on, the sampler counts it
            self._position = self.sampler.yielded = start + size
            self.samples_yielded += size
            return batch
        if self._finished:
            raise StopIteration
        # Fewer indices than a batch left: asking for them ends the sampler's pass, as it does
        # when torchdata's batch sampler exhausts the per-index iterator.
        self._finished = True
        self._position += len(batch)
        self.samples_yielded += len(batch)
        self.sampler._end_pass()
        if not batch or self.drop_last:
            raise StopIteration
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"samples_yielded": self.samples_yielded, "sampler_state": self.sampler.state_dict()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.samples_yielded = state_dict["samples_yielded"]
        if "sampler_state" in state_dict:
            self.sampler.load_state_dict(state_dict["sampler_state"])
        self._begin()
