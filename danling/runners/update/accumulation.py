"""Accumulation windows: which micro-steps synchronise gradients and step the optimizer."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .gradient_sync import gradient_sync_for

__all__ = ["GradientAccumulator"]


class GradientAccumulator:
    """State machine of gradient accumulation over a pass of micro-batches.

    Micro-steps are grouped into windows of ``accum_steps``; the optimizer steps after the last
    micro-step of each window. When the pass length is known (``start(total)``), the last window
    of the pass may be shorter, and its losses are divided by its real size, so every update sees
    the mean gradient of the micro-batches it covers. Under DDP, ``no_sync`` skips the gradient
    all-reduce for every micro-step except the one that closes its window.

    When the pass length is unknown (``start(None)``), losses are divided by ``accum_steps``; if
    the pass ends inside a window, `finish` returns the factor that rescales those gradients to the
    mean over the micro-steps actually taken (they also were never synchronised, see
    [`all_reduce_gradients`][danling.distributed.all_reduce_gradients]).

    ``state_dict()`` records the pass position (not gradients, so save at window boundaries).
    After ``load_state_dict`` the next ``start`` continues the interrupted pass instead of opening
    a new one, matching a dataloader restored mid-epoch.

    Examples:
        >>> acc = GradientAccumulator(accum_steps=4)
        >>> acc.start(total=10)
        >>> plan = []
        >>> for _ in range(10):
        ...     size = acc.window_size
        ...     plan.append((size, acc.advance()))
        >>> [size for size, _ in plan]
        [4, 4, 4, 4, 4, 4, 4, 4, 2, 2]
        >>> [i for i, (_, step) in enumerate(plan) if step]
        [3, 7, 9]
    """

    def __init__(self, accum_steps: int = 1) -> None:
        if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
            raise ValueError(f"accum_steps must be a positive integer, got {accum_steps!r}")
        self.accum_steps = accum_steps
        self.total: int | None = None
        self.position = 0
        self._pending = 0  # micro-steps since the last closed window
        self._resumed = False

    def set_accum_steps(self, accum_steps: int) -> None:
        """Change the window size between windows; the pass position is kept.

        Raises:
            ValueError: `accum_steps` is not a positive integer, or a window is open.
        """
        if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
            raise ValueError(f"accum_steps must be a positive integer, got {accum_steps!r}")
        if self._pending:
            raise ValueError(f"cannot change accum_steps to {accum_steps} with {self._pending} micro-step(s) pending")
        self.accum_steps = accum_steps

    def start(self, total: int | None = None) -> None:
        """Open a pass of `total` micro-batches (``None`` when unknown), or continue a restored one.

        Raises:
            ValueError: a negative `total`, or a restored pass whose length differs from `total`.
        """
        if total is not None and total < 0:
            raise ValueError(f"total must be a non-negative number of micro-batches or None, got {total!r}")
        if self._resumed:
            self._resumed = False
            if self.position and (self.total is None or self.position < self.total):
                if total != self.total:
                    raise ValueError(
                        f"the restored pass had {self.total} micro-batches but the loader now has {total}; "
                        "the data changed since the checkpoint"
                    )
                return
        self.total, self.position, self._pending = total, 0, 0

    @property
    def pending(self) -> int:
        """Micro-steps taken in the window that is still open (0 at a window boundary)."""
        return self._pending

    @property
    def window_size(self) -> int:
        """Number of micro-steps in the window the next micro-step belongs to."""
        if self.total is None or self.accum_steps == 1:
            return self.accum_steps
        window_start = self.position - self.position % self.accum_steps
        return max(1, min(self.accum_steps, self.total - window_start))

    @property
    def is_boundary(self) -> bool:
        """Whether the next micro-step closes its window (synchronise gradients, then step)."""
        if self.accum_steps == 1:
            return True
        return self.position % self.accum_steps + 1 >= self.window_size

    def normalize(self, loss: torch.Tensor) -> torch.Tensor:
        """Divide a micro-step loss by the size of its window."""
        if self.accum_steps == 1:
            return loss
        size = self.window_size
        return loss if size == 1 else loss / size

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """The context that keeps the next micro-step's gradients local unless it closes its window.

        Enter it around the forward pass (and the backward, which may follow the block). The
        model's [`GradientSync`][danling.runners.update.gradient_sync.GradientSync] decides how
        (DDP's `no_sync`, FSDP2's sync flag, ...); a model with no reducer gets a no-op.
        """
        return gradient_sync_for(model).context(self.is_boundary)

    def advance(self) -> bool:
        """Record one finished micro-step; return whether the optimizer should step now."""
        if self.accum_steps == 1:  # every micro-step is its own window
            self.position += 1
            return True
        boundary = self.is_boundary
        self.position += 1
        self._pending = 0 if boundary else self._pending + 1
        return boundary

    def finish(self) -> float | None:
        """End a pass. Return ``None`` if no window is open, else the gradient rescale factor for it.

        The factor (``accum_steps / micro-steps taken``) turns the open window's gradients into
        their mean; multiply the gradients by it (after averaging them over ranks under DDP) and
        step the optimizer. The open window is closed either way.
        """
        pending, self._pending = self._pending, 0
        if pending == 0:
            return None
        return self.accum_steps / pending

    def state_dict(self) -> dict[str, Any]:
        """Position in the current pass."""
        return {"accum_steps": self.accum_steps, "total": self.total, "position": self.position}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a position; the next `start` continues that pass if it was unfinished."""
        self.total = state_dict.get("total")
        self.position = int(state_dict.get("position", 0))
        self._pending = self.position % self.accum_steps if self.total is None else 0
        self._resumed = True
