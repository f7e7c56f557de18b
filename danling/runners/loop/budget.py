"""Budgets, cadences and split selection derived from the config and the bound dataloaders.

[`ProgressMixin`][danling.runners.loop.budget.ProgressMixin] answers "how long do we train, how
often do we log and checkpoint, and on which splits" for `BaseRunner`; every answer is read
from `config` first and inferred from `dataloaders` otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import RunnerConfig

__all__ = ["ProgressMixin"]

_INFER_PREFIXES = ("infer", "predict")


def length_of(loader: Any) -> int | None:
    """`len(loader)`, or `None` for iterables without a length."""
    try:
        return len(loader)
    except TypeError:
        return None


def _why_empty(loader: Any) -> str:
    """Why a loader of length 0 is empty, from its dataset size, batch size and `drop_last`."""
    dataset, batch_size = getattr(loader, "dataset", None), getattr(loader, "batch_size", None)
    size = length_of(dataset) if dataset is not None else None
    if size == 0 or size is None:
        return "its dataset is empty" if size == 0 else "it is empty"
    return (
        f"its dataset has {size} samples and batch_size={batch_size} with drop_last=True drops them all; "
        f"use a batch_size <= {size} or drop_last=False"
    )


class ProgressMixin:
    """Budget, cadence and split properties; mixed into `BaseRunner`."""

    config: RunnerConfig

    # ------------------------------------------------------------------ budgets and cadence
    @property
    def epochs(self) -> int | None:
        """Number of epochs to train (`config.epochs`); `None` selects step mode."""
        return self.config.get("epochs")

    @epochs.setter
    def epochs(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"epochs must be a non-negative int or None, got {value!r}")
        self.config.epochs = value

    @property
    def steps(self) -> int | None:
        """Optimizer-step budget.

        `config.steps` when set; otherwise `epochs` times the optimizer steps per epoch, when
        every train dataloader has a length; otherwise `None`.
        """
        steps = self.config.get("steps")
        if steps is not None or self.epochs is None:
            return steps
        per_epoch = 0
        for split in self.train_splits:
            length = length_of(self.dataloaders.get(split))
            if length is None:
                return None
            per_epoch += math.ceil(length / self.accum_steps)
        return self.epochs * per_epoch if per_epoch else None

    @steps.setter
    def steps(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"steps must be a non-negative int or None, got {value!r}")
        self.config.steps = value

    @property
    def is_step_mode(self) -> bool:
        """Whether training counts optimizer steps (no `epochs` configured) instead of epochs."""
        return self.epochs is None

    @cached_property
    def accum_steps(self) -> int:
        """Micro-batches per optimizer step (`config.accum_steps`, default 1)."""
        value = self.config.get("accum_steps") or 1
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"accum_steps must be a positive int, got {value!r}")
        return value

    @cached_property
    def precision(self) -> str | None:
        """Autocast precision requested by the config (`"fp32"`, `"fp16"`, `"bf16"`), or `None`."""
        precision = self.config.get("precision")
        if isinstance(precision, str):
            return self.config.PRECISIONS.get(precision.lower(), precision)
        return precision

    @cached_property
    def max_grad_value(self) -> float | None:
        """Gradient value clipping threshold (`config.max_grad_value`), or `None`."""
        return self.config.get("max_grad_value")

    @cached_property
    def max_grad_norm(self) -> float | None:
        """Gradient norm clipping threshold (`config.max_grad_norm`), or `None`."""
        return self.config.get("max_grad_norm")

    @cached_property
    def skip_nonfinite_grad(self) -> bool:
        """Whether updates with NaN/inf gradients are skipped (`config.skip_nonfinite_grad`)."""
        return bool(self.config.get("skip_nonfinite_grad"))

    @property
    def progress(self) -> float:
        """Fraction of the training budget done, in `[0, 1]` (by steps when known, else epochs)."""
        steps = self.steps
        if steps:
            value = self.train_state.global_step / steps
        elif self.epochs:
            value = self.train_state.epoch / self.epochs
        else:
            return 0.0
        return min(max(value, 0.0), 1.0)

    @property
    def batch_size(self) -> int:
        """Batch size from `dataloader.batch_size`, else from the first dataloader that has one."""
        size = self.config.get("dataloader.batch_size")
        if size:
            return size
        for loader in self.dataloaders.values():
            size = getattr(loader, "batch_size", None)
            if size:
                return size
        raise ValueError("cannot infer the batch size: set dataloader.batch_size or bind a dataloader with batch_size")

    @property
    def log_interval(self) -> int:
        """Iterations between step logs: `config.log_interval`, else a tenth of the first train loader.

        `0` (configured) turns step logs off; results of each round are still logged.
        """
        loader = next((self.dataloaders[s] for s in self.train_splits if s in self.dataloaders), None)
        return self._log_interval_for(length_of(loader))

    def _log_interval_for(self, length: int | None) -> int:
        configured = self.config.get("log_interval")
        if configured is not None:
            if isinstance(configured, bool) or not isinstance(configured, int) or configured < 0:
                raise ValueError(f"log_interval must be an int >= 0 (0: no step logs) or None, got {configured!r}")
            return configured
        if length:
            return max(length // 10, 1)
        return max(self.steps // 10, 1) if self.steps else 100

    @property
    def evaluate_interval(self) -> int:
        """Optimizer steps between evaluations in step mode.

        `config.evaluate_interval` when set (`0`: only the evaluation after the last step);
        otherwise a tenth of the step budget, at least 1, which is also the default checkpoint
        cadence, so every default checkpoint holds evaluated weights. Epoch mode evaluates after
        every epoch and does not read it.
        """
        configured = self.config.get("evaluate_interval")
        if configured is not None:
            if isinstance(configured, bool) or not isinstance(configured, int) or configured < 0:
                raise ValueError(f"evaluate_interval must be an int >= 0 (0: after the last step), got {configured!r}")
            return configured
        steps = self.steps
        return max(steps // 10, 1) if steps else 0

    @property
    def evaluate_batches(self) -> int | None:
        """Batches of each evaluation split in an evaluation run while training (`None`: the whole split).

        `config.evaluate_batches`; a dry run (`config.dry_run`) caps it at its batch count.
        """
        limits = [self.config.get("evaluate_batches"), self.config.get("dry_run")]
        for value in limits:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"evaluate_batches and dry_run must be positive ints or None, got {value!r}")
        given = [value for value in limits if value is not None]
        return min(given) if given else None

    @property
    def checkpoint_interval(self) -> int:
        """Checkpoint cadence: `checkpoint.interval`, else every epoch (epoch mode) or a tenth of `steps`."""
        configured = self.config.get("checkpoint.interval")
        if configured:
            return configured
        if not self.is_step_mode:
            return 1
        steps = self.config.get("steps")
        return max(steps // 10, 1) if steps else 1

    # ------------------------------------------------------------------ splits
    def _known_splits(self) -> list[str]:
        return list(dict.fromkeys([*self.datasets.keys(), *self.dataloaders.keys()]))

    @property
    def train_splits(self) -> list[str]:
        """Splits trained on: `config.train_splits`, else every split whose name starts with `train`."""
        configured = self.config.get("train_splits")
        if configured is not None:  # `[]` is a choice, not "unset"
            return [configured] if isinstance(configured, str) else list(dict.fromkeys(configured))
        return [split for split in self._known_splits() if split.startswith("train")]

    @property
    def evaluate_splits(self) -> list[str]:
        """Splits evaluated: `config.evaluate_splits` (`[]`: none), else every split not trained or inferred."""
        configured = self.config.get("evaluate_splits")
        if configured is not None:  # `[]`: evaluate nothing
            return [configured] if isinstance(configured, str) else list(dict.fromkeys(configured))
        train = set(self.train_splits)
        return [s for s in self._known_splits() if s not in train and not s.startswith(_INFER_PREFIXES)]

    def _resolve_splits(self, requested: str | Sequence[str] | None, default: list[str], kind: str) -> list[str]:
        if requested is None:
            splits = default
        else:
            splits = [requested] if isinstance(requested, str) else list(dict.fromkeys(requested))
        missing = [split for split in splits if split not in self.dataloaders]
        if missing:
            raise ValueError(f"{kind} split(s) {missing} have no dataloader; available: {list(self.dataloaders)}")
        return splits
