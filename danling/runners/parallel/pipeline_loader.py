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

    Its position within a pass is saved by `state_dict()`: after `load_state_dict()`, the next
    pass yields only the batches that were left, exactly as a restored `StatefulDataLoader`
    does, so a resumed run keeps every rank on the same step. The passes after that are full
    again.

    It deliberately exposes no `sampler`/`batch_sampler`: those belong to the real loader, whose
    position this stand-in does not track.

    Args:
        loader: The loader the data-reading ranks use; only its length is read.

    Raises:
        TypeError: `loader` has no length (a data-free rank cannot know when the pass ends).

    Examples:
        >>> proxy = StepProxyLoader(range(3))
        >>> list(proxy), len(proxy)
        ([None, None, None], 3)
        >>> it = iter(proxy); _ = next(it); state = proxy.state_dict()
        >>> resumed = StepProxyLoader(range(3)); resumed.load_state_dict(state)
        >>> list(resumed), list(resumed)
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

    def state_dict(self) -> dict[str, Any]:
        """Batches yielded so far in the pass under way (0 between passes)."""
        return {"position": self.position, "length": len(self)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue the saved pass at its position on the next `iter()`.

        Accepts this class's own state and the state of the real loader it stands in for (a
        torchdata `StatefulDataLoader`, single- or multi-process): pipeline peers share one copy
        of their data rank's checkpoint entries, so a data-free rank may get the real loader's.

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
