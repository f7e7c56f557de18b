"""Scheduler steps that happen once per round (epoch-interval and metric-driven schedulers)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from danling.optim import is_metric_scheduler

__all__ = ["advance_round_scheduler", "monitored_value"]

_PREFERRED_MONITOR_SPLITS = ("val", "validate", "validation")


def advance_round_scheduler(
    scheduler: Any,
    interval: str,
    result: Mapping[str, Any],
    *,
    monitor: str | None,
    score_name: str,
    splits: Sequence[str] = (),
) -> None:
    """Step a scheduler whose interval is not `"step"` once, with the monitored value for metric schedulers."""
    if scheduler is None or interval == "step":
        return
    if is_metric_scheduler(scheduler):
        scheduler.step(monitored_value(result, monitor=monitor, score_name=score_name, splits=splits))
    else:
        scheduler.step()


def monitored_value(
    result: Mapping[str, Any], *, monitor: str | None, score_name: str, splits: Sequence[str] = ()
) -> float:
    """The value a metric scheduler watches in a round's row.

    `monitor` is a dotted path (`"val.loss"`); without it, `score_name` is read from the first of
    `splits` (or `val`/`validate`/`validation` and then any split) that has it.

    Examples:
        >>> monitored_value({"train": {"loss": 1.0}, "val": {"loss": 0.5}}, monitor=None, score_name="loss")
        0.5
    """
    if monitor:
        node: Any = result
        for part in monitor.split("."):
            if not isinstance(node, Mapping) or part not in node:
                raise ValueError(f"scheduler.monitor={monitor!r} is not in the epoch result {_keys(result)}")
            node = node[part]
        return float(node)
    having = [key for key, value in result.items() if isinstance(value, Mapping) and score_name in value]
    preferred = list(splits) if splits else list(_PREFERRED_MONITOR_SPLITS)
    for split in [*preferred, *having]:
        if split in having:
            return float(result[split][score_name])
    if score_name in result:
        return float(result[score_name])
    raise ValueError(
        f"cannot find {score_name!r} for the metric scheduler in the epoch result {_keys(result)}; "
        "set scheduler.monitor"
    )


def _keys(result: Mapping[str, Any]) -> list[str]:
    keys = []
    for key, value in result.items():
        if isinstance(value, Mapping):
            keys.extend(f"{key}.{sub}" for sub in value)
        else:
            keys.append(key)
    return keys
