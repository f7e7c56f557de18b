"""A resumable, epoch-seeded sampler shared by single-process and data-parallel runs."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import DistributedSampler

__all__ = ["ResumableSampler", "derive_seed"]


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
        self._skip: int | None = None

    def __iter__(self) -> Iterator[int]:
        # Everything that must happen when the pass starts runs now, not at the first next():
        # torchdata creates (and may discard) iterators before pulling from them.
        start, self._skip = self._skip or 0, None
        if self.generator is not None:
            self.generator.manual_seed(derive_seed(self.seed, self.epoch, self.rank))
        indices = list(super().__iter__())
        if start > len(indices):
            raise ValueError(f"cannot resume at index {start}: this pass only has {len(indices)} indices")
        self.yielded = start
        return self._iterate(indices, start)

    def _iterate(self, indices: list[int], start: int) -> Iterator[int]:
        for position in range(start, len(indices)):
            self.yielded = position + 1
            yield indices[position]
        # The pass is over: a state saved from now on must describe the start of the next one,
        # not "epoch + 1 with this pass's count already handed out" (which skipped indices).
        self.epoch += 1
        self.yielded = 0

    def state_dict(self) -> dict[str, int]:
        """Return the epoch and the number of indices handed out in the current pass."""
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state from `state_dict`; the next pass resumes after the recorded position."""
        missing = {"epoch", "yielded"} - set(state_dict)
        if missing:
            raise ValueError(f"sampler state is missing {sorted(missing)}; got keys {sorted(state_dict)}")
        yielded = int(state_dict["yielded"])
        if yielded < 0:
            raise ValueError(f"sampler state has a negative position: yielded={yielded}")
        self.epoch = int(state_dict["epoch"])
        self.yielded = yielded
        self._skip = yielded
