"""Global and per-rank checkpoint entries, and what loading does when the number of data ranks changes.

A distributed checkpoint holds two kinds of top-level entries:

- **global** entries, one copy for the whole run (config, counters, results, model and
  optimizer, whose sharded tensors DCP splits between the ranks by itself);
- **per-rank** entries, one copy per *data-parallel* rank (RNG streams, dataloader positions,
  next-batch fingerprints), stored as ``<key>.rank<data_rank>``. Ranks that see the same data
  (tensor- or pipeline-parallel peers) share a data rank and so a copy.

The checkpoint's manifest records the data-parallel size it was written with and which keys are
per-rank ([`layout_record`][danling.checkpoint.ranks.layout_record]). Loading with the same size
gives each rank its own copy. Loading with another size cannot give every rank a copy that means
anything, so [`plan_rank_entries`][danling.checkpoint.ranks.plan_rank_entries] either drops the
per-rank keys the caller declared optional (with a warning) or raises
[`CheckpointResizeError`][danling.checkpoint.CheckpointResizeError]. The decision reads only the
checkpoint's metadata, so every rank reaches the same one without communicating: no rank is left
waiting in a collective for a rank that failed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .manifest import CheckpointError, CheckpointResizeError

__all__ = ["RANK_LAYOUT_KEY", "RankLayout", "rank_entry", "layout_record", "read_layout", "plan_rank_entries"]

RANK_LAYOUT_KEY = "rank_layout"  # manifest metadata entry written by per-rank-aware backends
_RANK = re.compile(r"^rank(\d+)$")


def rank_entry(data_rank: int) -> str:
    """The sub-key a per-rank entry of data rank `data_rank` is stored under.

    Examples:
        >>> rank_entry(3)
        'rank3'
    """
    return f"rank{data_rank}"


@dataclass(frozen=True)
class RankLayout:
    """How a checkpoint stores its entries.

    Attributes:
        data_size: Data-parallel size the checkpoint was written with (`None` when unknown: an
            older checkpoint with no per-rank entries).
        keys: Every top-level key that was saved (DCP stores no empty mappings, so a key whose
            value was `{}` is known only from here).
        rank_local_keys: The keys stored per data rank.
    """

    data_size: int | None
    keys: tuple[str, ...]
    rank_local_keys: tuple[str, ...]


def layout_record(keys: Iterable[str], rank_local_keys: Iterable[str], data_size: int) -> dict[str, Any]:
    """The JSON-serializable manifest entry describing a checkpoint's layout.

    Examples:
        >>> layout_record(["model", "rng"], ["rng"], 2)
        {'data_size': 2, 'keys': ['model', 'rng'], 'rank_local_keys': ['rng']}
    """
    return {"data_size": int(data_size), "keys": sorted(keys), "rank_local_keys": sorted(rank_local_keys)}


def read_layout(
    manifest: Mapping[str, Any], paths: Iterable[Sequence[Any]], default_rank_local: Sequence[str]
) -> RankLayout:
    """Read a checkpoint's layout from its manifest, or infer it from its entries for older checkpoints.

    Args:
        manifest: The checkpoint's parsed manifest.
        paths: The nested key path of every stored leaf (DCP's planner data), e.g.
            ``("rng", "rank1", "torch")``.
        default_rank_local: Per-rank keys assumed for a checkpoint written before layouts were
            recorded; their data size is inferred from the ``rank<i>`` copies present.

    Returns:
        A [`RankLayout`][danling.checkpoint.ranks.RankLayout].

    Examples:
        >>> read_layout({"metadata": {}}, [("model", "w"), ("rng", "rank0"), ("rng", "rank1")], ["rng", "state"])
        RankLayout(data_size=2, keys=('model', 'rng'), rank_local_keys=('rng',))
    """
    record = (manifest.get("metadata") or {}).get(RANK_LAYOUT_KEY)
    if isinstance(record, Mapping):
        size = record.get("data_size")
        if not isinstance(size, int) or size < 1:
            raise CheckpointError(f"checkpoint manifest has a malformed {RANK_LAYOUT_KEY!r} entry: {dict(record)!r}")
        return RankLayout(size, tuple(record.get("keys", ())), tuple(record.get("rank_local_keys", ())))
    keys: set[str] = set()
    ranks: set[int] = set()
    local = set()
    for path in paths:
        keys.add(str(path[0]))
        match = _RANK.match(str(path[1])) if len(path) > 1 else None
        if path[0] in default_rank_local and match:
            local.add(str(path[0]))
            ranks.add(int(match.group(1)))
    return RankLayout(max(ranks) + 1 if ranks else None, tuple(sorted(keys)), tuple(sorted(local)))


def plan_rank_entries(
    layout: RankLayout,
    wanted: Iterable[str],
    *,
    data_size: int,
    optional: Sequence[str] = (),
    origin: Any = "checkpoint",
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Decide which per-rank entries this rank reads, deterministically from the checkpoint's layout.

    Args:
        layout: The checkpoint's layout.
        wanted: Top-level keys the caller loads (after `exclude_from_loading`).
        data_size: The loading run's data-parallel size.
        optional: Per-rank keys that may be dropped when the size changed (e.g. ``"rng"``).
        origin: The checkpoint, for messages.

    Returns:
        ``(per_rank, dropped)``: the wanted per-rank keys to read this rank's copy of, and the
        optional ones dropped because the size changed.

    Raises:
        CheckpointResizeError: The size changed and a wanted per-rank key is not optional.

    Examples:
        >>> layout = RankLayout(2, ("model", "rng", "dataloaders"), ("dataloaders", "rng"))
        >>> plan_rank_entries(layout, ["model", "rng"], data_size=2)
        (('rng',), ())
        >>> plan_rank_entries(layout, ["model", "rng"], data_size=3, optional=["rng"])
        ((), ('rng',))
    """
    wanted = set(wanted)
    per_rank = tuple(key for key in layout.rank_local_keys if key in wanted)
    if not per_rank or layout.data_size == data_size:
        return per_rank, ()
    dropped = tuple(key for key in per_rank if key in optional)
    blocking = [key for key in per_rank if key not in optional]
    if blocking:
        raise CheckpointResizeError(
            f"checkpoint {origin} was written by {layout.data_size} data-parallel ranks, but this run has "
            f"{data_size}. Its per-rank entries {blocking} hold one copy per data rank and cannot be "
            f"redistributed (global entries would load fine). Resume with {layout.data_size} data ranks, or "
            f"add {blocking} to exclude_from_loading to restore everything else and start those afresh"
            + (f" (the optional per-rank entries {list(dropped)} are dropped either way)" if dropped else "")
        )
    return (), dropped
