"""Gathering kept data across two real gloo ranks: held once, pieces sent as they are, same values."""

import pytest
import torch

from danling.metrics import multiclass_metrics
from danling.metrics.distributed import gather_across_ranks
from tests.dist import run_distributed

pytestmark = pytest.mark.distributed

N = 70_000  # above RANKING_MIN_SCORES: AUROC and AUPRC take the bucketed ranking


def data():
    g = torch.Generator().manual_seed(7)
    labels = torch.randint(0, 4, (N,), generator=g)
    labels[::9] = -100
    logits = (torch.randn(N, 4, generator=g) * 2).round(decimals=1) + torch.nn.functional.one_hot(labels % 4, 4)
    return logits, labels


def shard(rank):
    # Uneven shards: 40% on rank 0, 60% on rank 1.
    cut = N * 2 // 5
    return slice(0, cut) if rank == 0 else slice(cut, N)


def _worker(rank, world_size):
    out = {}
    # Uneven lengths, pieces of different integer widths: widened to the widest, in rank order.
    pieces = [torch.arange(3, dtype=torch.int8)] if rank == 0 else [torch.arange(5, dtype=torch.int16) + 10] * 2
    gathered = gather_across_ranks(pieces)
    out["pieces"] = (gathered.dtype, gathered.tolist())
    # Held once: the result is a view of the one buffer every rank's shard was received into.
    rows = torch.full((4 if rank == 0 else 7, 3), float(rank))
    gathered = gather_across_ranks(rows)
    out["rows"] = gathered.tolist()
    out["storage"] = (gathered.untyped_storage().nbytes(), 2 * 7 * 3 * 4)
    out["nothing"] = gather_across_ranks(None if rank == 0 else torch.ones(2, 2)).tolist()

    logits, labels = data()
    metrics = multiclass_metrics(4)
    part = shard(rank)
    for start in range(part.start, part.stop, 5000):
        stop = min(start + 5000, part.stop)
        metrics.update(logits[start:stop], labels[start:stop])
    out["avg"] = dict(metrics.avg)
    return out


def test_gather_holds_data_once_and_matches_one_process():
    results = run_distributed(_worker, world_size=2)
    logits, labels = data()
    union = multiclass_metrics(4)
    for start in range(0, N, 5000):
        union.update(logits[start : start + 5000], labels[start : start + 5000])
    expected = dict(union.avg)
    for out in results:
        assert out["pieces"] == (torch.int16, [0, 1, 2, *range(10, 15), *range(10, 15)])
        assert out["rows"] == [[0.0] * 3] * 4 + [[1.0] * 3] * 7
        assert out["storage"][0] == out["storage"][1]  # world x longest shard, no second copy
        assert out["nothing"] == [[1.0, 1.0], [1.0, 1.0]]
        assert out["avg"] == pytest.approx(expected, abs=1e-12)
