"""When a runner's checkpoint is due, what it is named, which aliases it gets, and what it records.

The runner's [`save_checkpoint`][danling.runners.checkpointing.hooks.CheckpointHooks.save_checkpoint]
decides through [`save_when_due`][danling.runners.checkpointing.saves.save_when_due] with explicit
facts (counters, whether the weights are the best, their score) and hands the payload to the
standalone [`CheckpointManager.save`][danling.checkpoint.CheckpointManager.save], which knows
nothing about runners. To change the policy, override the runner's `save_checkpoint`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from danling.checkpoint import CheckpointManager

__all__ = ["SaveFacts", "save_when_due"]


@dataclass(frozen=True)
class SaveFacts:
    """What the runner knows when a save is requested.

    Attributes:
        epoch: Finished epochs so far.
        global_step: Optimizer updates so far.
        step_mode: The run counts its budget in steps (the cadence counts steps then, else epochs).
        run_id: The run's id, recorded in the manifest.
        best: The weights saved now are the run's best (the newest result row is the best one and
            no training happened since it was stored).
        score: The score of the weights saved now, or `None`; `save_top_k` ranks checkpoints by it.
        lower_is_better: Whether a lower score is better (`score_mode` of the manifest).
    """

    epoch: int
    global_step: int
    step_mode: bool
    run_id: str
    best: bool
    score: float | None
    lower_is_better: bool


def save_when_due(
    manager: CheckpointManager,
    facts: SaveFacts,
    payload: Callable[[], Mapping[str, Any]],
    *,
    name: str = "latest",
    epochs: int | None = None,
    save_best: bool = True,
    last_step: bool = False,
    force: bool = False,
) -> Path | None:
    """Save `payload()` through `manager` if a save is due, and point its aliases at it.

    The checkpoint is named `epoch-<epochs>` when `epochs` is given (the index of the epoch just
    finished) and `step-<global_step>` otherwise; `manager.should_save` decides from the number of
    finished epochs, or steps in step mode, unless `force` or `last_step` is set. The aliases are
    `name` and `latest`, plus `best` when `save_best` is set and `facts.best` holds. `payload` is
    called only when the save is due.

    Returns:
        The checkpoint directory, or `None` when nothing was written by this process.
    """
    if epochs is not None:
        index, checkpoint_name = epochs + 1, f"epoch-{epochs:06d}"
    else:
        index = facts.global_step if facts.step_mode else facts.epoch
        checkpoint_name = f"step-{facts.global_step:06d}"
    if not manager.should_save(index, last=last_step, force=force):
        return None
    aliases = [name, "latest"]
    if save_best and facts.best:
        aliases.append("best")
    metadata: dict[str, Any] = {"epoch": facts.epoch, "global_step": facts.global_step, "run_id": facts.run_id}
    if facts.score is not None:  # what `save_top_k` retention ranks by
        metadata.update(score=facts.score, score_mode="min" if facts.lower_is_better else "max")
    return manager.save(payload(), checkpoint_name, aliases=tuple(dict.fromkeys(aliases)), metadata=metadata)
