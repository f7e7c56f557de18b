"""The runner-facing save of [`CheckpointManager`][danling.checkpoint.CheckpointManager].

[`BaseRunner.save_checkpoint`][danling.runners.checkpointing.api.CheckpointMixin.save_checkpoint]
hands the whole decision to the manager's `save_checkpoint(runner, ...)`: cadence, the
checkpoint's name, which aliases it gets, and what payload is written. A custom manager
overrides this one method to change any of that, and keeps the storage machinery of its base.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["RunnerSaves"]


class RunnerSaves:
    """Mixed into `CheckpointManager`: save a runner's checkpoint when its cadence says so."""

    def save_checkpoint(
        self,
        runner: Any,
        name: str = "latest",
        epochs: int | None = None,
        save_best: bool = True,
        last_step: bool = False,
        force: bool = False,
    ) -> Path | None:
        """Save `runner`'s checkpoint if one is due, and point its aliases at it.

        The checkpoint is named `epoch-<epochs>` when `epochs` is given (the index of the epoch
        just finished) and `step-<global_step>` otherwise; `should_save` decides from the number of
        finished epochs, or steps in step mode, unless `force` or `last_step` is set. The aliases
        are `name` and `latest`, plus `best` when `save_best` is set and the runner says the
        weights being saved are its best
        ([`publishes_best`][danling.runners.checkpointing.api.CheckpointMixin.publishes_best]).
        The payload is `runner.checkpoint_payload(last_step=last_step)`.

        Args:
            runner: The runner whose state is saved.
            name: Alias to publish besides `latest`.
            epochs: Index of the finished epoch, for naming and cadence.
            save_best: Also publish `best` when the runner's newest result is its best.
            last_step: The run's final save; always written.
            force: Write regardless of the cadence.

        Returns:
            The checkpoint directory, or `None` when nothing was written by this process.
        """
        state = runner.train_state
        if epochs is not None:
            index, checkpoint_name = epochs + 1, f"epoch-{epochs:06d}"
        else:
            index = state.global_step if runner.is_step_mode else state.epoch
            checkpoint_name = f"step-{state.global_step:06d}"
        if not self.should_save(index, last=last_step, force=force):  # type: ignore[attr-defined]
            return None
        aliases = [name, "latest"]
        if save_best and runner.publishes_best():
            aliases.append("best")
        metadata = {"epoch": state.epoch, "global_step": state.global_step, "run_id": runner.id}
        score = runner.checkpoint_score()
        if score is not None:  # what `save_top_k` retention ranks by
            metadata.update(score=score, score_mode="min" if runner.bookkeeping.lower_is_better else "max")
        payload = runner.checkpoint_payload(last_step=last_step)
        return self.save(  # type: ignore[attr-defined]
            payload, checkpoint_name, aliases=tuple(dict.fromkeys(aliases)), metadata=metadata
        )
