"""Where the loops stand inside a round, as one checkpointable object."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from danling.utils import RoundDict

__all__ = ["LoopState"]


class LoopState:
    """The loops' position: which train split is under way, how far, and what the round has produced.

    A checkpoint written mid-round carries it, so a resumed run continues the interrupted split
    (and accumulation window) instead of restarting the round, and its result row ends up
    identical to the uninterrupted one.

    Attributes:
        split: Train split whose pass is under way (`None` between passes, or once a pass ran to its end).
        batch: Batches consumed by that pass so far.
        trained: Whether the round's training is over (it was evaluating).
        round: Results of the splits the round has finished.
        accumulator: The accumulation window position, kept by the update strategy
            ([`GradientAccumulator`][danling.runners.update.accumulation.GradientAccumulator]).

    Examples:
        >>> state = LoopState()
        >>> state.split, state.batch = "train", 3
        >>> restored = LoopState()
        >>> restored.load_state_dict(state.state_dict())
        >>> restored.split, restored.batch, restored.trained
        ('train', 3, False)
    """

    def __init__(self, accumulator: Any = None) -> None:
        self.accumulator = accumulator
        self.split: str | None = None
        self.batch = 0
        self.trained = False
        self.round: RoundDict | None = None

    def begin_round(self) -> RoundDict:
        """The current round's result: the restored partial one of a resumed round, else a new one."""
        if self.round is None:
            self.round = RoundDict()
        return self.round

    def end_round(self) -> None:
        """The round's row is stored: the next round starts with training and an empty result."""
        self.round = None
        self.trained = False

    def splits_from_cursor(self, splits: list[str]) -> list[str]:
        """`splits` starting at the one whose pass was interrupted, if any."""
        return splits[splits.index(self.split) :] if self.split in splits else splits

    def state_dict(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "batch": self.batch,
            "trained": self.trained,
            "round": None if not self.round else self.round.dict(),
            "accumulator": None if self.accumulator is None else self.accumulator.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.split = state.get("split")
        self.batch = int(state.get("batch") or 0)
        self.trained = bool(state.get("trained", False))
        round_result = state.get("round")
        self.round = RoundDict(round_result) if round_result else None
        if self.accumulator is not None and state.get("accumulator"):
            self.accumulator.load_state_dict(state["accumulator"])
