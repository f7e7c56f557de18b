"""Key paths of checkpoint payloads: flattening for config diffs, and dropping excluded keys."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["flatten", "without"]


def flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level of dotted keys."""
    flat = {}
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def without(payload: Mapping[str, Any], keys: Sequence[str]) -> Mapping[str, Any]:
    """`payload` without `keys` (dots read as nesting), copying only the mappings on their paths."""
    for key in keys:
        trimmed = _drop(payload, key)
        if trimmed is not None:
            payload = trimmed
    return payload


def _drop(mapping: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    """A copy of `mapping` without `key`, or None when it has no such key (a literal key wins)."""
    if key in mapping:
        return {name: value for name, value in mapping.items() if name != key}
    parts = key.split(".")
    for cut in range(1, len(parts)):
        head = ".".join(parts[:cut])
        child = mapping.get(head)
        trimmed = _drop(child, ".".join(parts[cut:])) if isinstance(child, Mapping) else None
        if trimmed is not None:
            return {**mapping, head: trimmed}
    return None
