"""Budgets, cadences and split selection: the rules the runner's budget properties apply.

The runner's properties (`epochs`, `steps`, `log_interval`, `train_splits`, ...) read the typed
config and the bound dataloaders and hand them to these functions, which hold the rules: how
long a run trains, how often it logs, and on which splits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["checked_count", "default_interval", "length_of", "selected_splits", "step_budget"]

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


def checked_count(name: str, value: Any, *, minimum: int = 0, accepted: str = "an int >= 0 or None") -> Any:
    """`value` when it is `None` or an int (not a bool) of at least `minimum`; else a one-line `ValueError`."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise ValueError(f"{name} must be {accepted}, got {value!r}")
    return value


def step_budget(steps: int | None, epochs: int | None, loaders: Iterable[Any], accum_steps: int) -> int | None:
    """`steps` when set; else `epochs` times the optimizer steps of one epoch over `loaders`
    (when every loader has a length); else `None`."""
    if steps is not None or epochs is None:
        return steps
    per_epoch = 0
    for loader in loaders:
        length = length_of(loader)
        if length is None:
            return None
        per_epoch += math.ceil(length / accum_steps)
    return epochs * per_epoch if per_epoch else None


def default_interval(length: int | None, steps: int | None, *, fallback: int) -> int:
    """A tenth of `length` (a loader's batches), else a tenth of `steps`, at least 1; `fallback` without either."""
    if length:
        return max(length // 10, 1)
    return max(steps // 10, 1) if steps else fallback


def selected_splits(configured: str | Sequence[str] | None, default: Sequence[str]) -> list[str]:
    """The configured splits (a name or a list; `[]` is a choice), else `default`, without duplicates."""
    if configured is None:
        return list(default)
    return [configured] if isinstance(configured, str) else list(dict.fromkeys(configured))


def evaluation_default(known: Sequence[str], train: Sequence[str]) -> list[str]:
    """Every known split that is not trained and not named for inference (`infer*`, `predict*`)."""
    trained = set(train)
    return [split for split in known if split not in trained and not split.startswith(_INFER_PREFIXES)]
