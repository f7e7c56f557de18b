"""Argument and state checks of the DCP checkpoint manager."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _check_keys(obj: Any, path: str = "") -> None:
    """DCP turns mapping keys into strings; refuse other keys instead of silently renaming them."""
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            if not isinstance(key, str):
                where = f"{path}.{key!r}" if path else repr(key)
                raise TypeError(
                    f"DCP checkpoints need string keys, but the state has key {where} ({type(key).__name__}); "
                    "it would come back as a string. Use danling.checkpoint.OptimizerState for "
                    "optimizer state, or convert the keys"
                )
            _check_keys(value, f"{path}.{key}" if path else key)


def _check_index(value: Any, label: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{label} must be an integer >= {minimum}, got {value!r}")
    return value


def _key_names(value: Any, label: str) -> tuple[str, ...]:
    keys = (value,) if isinstance(value, str) else tuple(value)
    for key in keys:
        if not isinstance(key, str) or not key:
            raise ValueError(f"{label} must be top-level checkpoint keys (non-empty strings), got {key!r}")
    return keys


def _data_domain(data_rank: int | None, data_size: int | None, rank: int, world_size: int) -> tuple[int, int]:
    """Validate the data-parallel coordinates, defaulting to the process group's own."""
    if data_size is None and data_rank is None:
        return rank, world_size
    size = world_size if data_size is None else _check_index(data_size, "data_size", 1)
    if data_rank is None:
        raise ValueError(f"data_rank must be given with data_size={data_size!r} (this rank's data-parallel index)")
    index = _check_index(data_rank, "data_rank")
    if index >= size:
        raise ValueError(f"data_rank must be below data_size={size}, got {index}")
    return index, size
