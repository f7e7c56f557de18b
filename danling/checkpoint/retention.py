"""Which history checkpoints retention may delete: `keep_latest_k`, `save_top_k` and the aliases.

A checkpoint saved at a scored state carries `score` and `score_mode` (`"min"` or `"max"`) in its
manifest metadata. The top k of those are ranked by the same rule as the runner's best row: the
better score first and, among equal scores, the latest checkpoint (highest epoch, then step).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["prunable", "top_k"]


def _rank(metadata: Mapping[str, Any]) -> tuple[float, int, int] | None:
    score, mode = metadata.get("score"), metadata.get("score_mode")
    if isinstance(score, bool) or not isinstance(score, (int, float)) or mode not in ("min", "max"):
        return None
    if math.isnan(score):
        return None
    signed = float(score) if mode == "min" else -float(score)
    return signed, -int(metadata.get("epoch") or 0), -int(metadata.get("global_step") or 0)


def top_k(history: Iterable[tuple[Path, Mapping[str, Any]]], k: int) -> list[Path]:
    """The `k` best scored checkpoints of `history` (pairs of path and manifest), best first.

    Examples:
        >>> history = [
        ...     (Path("epoch-000003"), {"metadata": {"score": 0.5, "score_mode": "min", "epoch": 3}}),
        ...     (Path("epoch-000002"), {"metadata": {"score": 0.2, "score_mode": "min", "epoch": 2}}),
        ...     (Path("epoch-000001"), {"metadata": {"score": 0.5, "score_mode": "min", "epoch": 1}}),
        ...     (Path("epoch-000000"), {"metadata": {}}),
        ... ]
        >>> [path.name for path in top_k(history, 2)]
        ['epoch-000002', 'epoch-000003']
    """
    ranked = []
    for path, manifest in history:
        rank = _rank(manifest.get("metadata") or {})
        if rank is not None:
            ranked.append((rank, path))
    ranked.sort(key=lambda item: item[0])
    return [path for _, path in ranked[:k]]


def prunable(
    history: list[tuple[Path, Mapping[str, Any]]],
    *,
    keep_latest_k: int | None,
    save_top_k: int | None,
    protected: set[Path],
) -> list[Path]:
    """History checkpoints (newest first in `history`) that retention deletes.

    Kept: the newest `keep_latest_k`, the `save_top_k` best scored ones, and every alias target
    (`protected`). With neither count set nothing is deleted; with only `save_top_k` set, the
    newest ones are not kept for being new (the `latest` alias still protects the newest).
    """
    if not keep_latest_k and not save_top_k:
        return []
    keep = set(protected)
    keep.update(path for path, _ in history[: keep_latest_k or 0])
    if save_top_k:
        keep.update(top_k(history, save_top_k))
    return [path for path, _ in history if path not in keep]
