"""A stand-in loader for pipeline ranks that take part in every step but read no data."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["StepProxyLoader"]


class StepProxyLoader:
    """Yields `None` once per batch of `loader`, without reading it: a step clock for data-free ranks.

    A pipeline rank whose local stages are neither the first (which needs the input) nor the last
    (which needs the target) still runs every schedule step, so its loop must take as many steps
    as the loops of the ranks that read data. This loader has the same length as `loader` and
    yields `None` that many times per pass; the underlying loader is never iterated, so no
    batch is loaded or collated.

    Resuming: the checkpoint of a run stores one copy of each data rank's loader position, and
    pipeline peers share a data rank, so this stand-in saves nothing of its own (it has no
    `state_dict`) and the copy is the real loader's, written by the ranks that read data.
    `load_state_dict` takes that state (or `{"position": n}`), and the next pass yields only the
    batches that were left, as the restored real loader does; the passes after that are full.
    `dataset`, `sampler` and `batch_sampler` are the real loader's, so the next-batch
    fingerprint of a resumed run is checked against the real position too.

    Args:
        loader: The loader the data-reading ranks use; it is never iterated.

    Raises:
        TypeError: `loader` has no length (a data-free rank cannot know when the pass ends).

    Examples:
        >>> proxy = StepProxyLoader(range(3))
        >>> list(proxy), len(proxy)
        ([None, None, None], 3)
        >>> proxy.load_state_dict({"position": 1})
        >>> list(proxy), list(proxy)
        ([None, None], [None, None, None])
    """

    def __init__(self, loader: Any) -> None:
        try:
            len(loader)
        except TypeError:
            raise TypeError(
                f"a pipeline rank without data must know how many steps a pass has, but the loader "
                f"{type(loader).__name__} has no len(); use a sized dataset or set an explicit step count"
            ) from None
        self.loader = loader
        self.position = 0  # batches yielded in the pass under way
        self._resume_from: int | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[None]:
        total = len(self)
        start, self._resume_from = self._resume_from or 0, None
        self.position = start
        while self.position < total:
            self.position += 1
            yield None
        self.position = 0  # a finished pass: the next one is full, as after a real loader's epoch

    @property
    def dataset(self) -> Any:
        """The real loader's dataset."""
        return getattr(self.loader, "dataset", None)

    @property
    def sampler(self) -> Any:
        """The real loader's sampler (read for next-batch fingerprints, never advanced here)."""
        return getattr(self.loader, "sampler", None)

    @property
    def batch_sampler(self) -> Any:
        """The real loader's batch sampler (read for next-batch fingerprints, never advanced here)."""
        return getattr(self.loader, "batch_sampler", None)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue the saved pass at its position on the next `iter()`.

        Accepts the state of the real loader it stands in for (a torchdata `StatefulDataLoader`,
        single- or multi-process) or `{"position": n}`.

        Raises:
            ValueError: the position is negative or beyond the length of the loader.
        """
        position = _position_of(state_dict)
        if not 0 <= position <= len(self):
            raise ValueError(f"saved pipeline proxy position {position} is outside a pass of {len(self)} batches")
        self.position = position
        self._resume_from = position


def _position_of(state: Mapping[str, Any]) -> int:
    """Batches yielded in the saved pass (0 for a finished one) from either kind of loader state."""
    if "position" in state:
        return int(state["position"])
    if state.get("_iterator_finished"):
        return 0  # the saved pass ended: the next one is a full pass
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, Mapping):  # multi-process layout: a snapshot plus the batches since
        return int(snapshot.get("_snapshot_step", 0)) + int(state.get("_steps_since_snapshot", 0))
    return int(state.get("_num_yielded", 0))
