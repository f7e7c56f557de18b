"""Gathering kept data across two real gloo ranks: held once, pieces sent as they are, same values."""

import pytest
import torch

from danling.metrics import multiclass_metrics
from danling.metrics.distributed import gather_across_ranks
from tests.dist import run_distributed

pytestmark = pytest.mark.distributed

N = 70_000  # above RANKING_MIN_SCORES: AUROC and AUPRC take the host ranking (sorted per-column copies)


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


def _described(tensor):
    return tensor.dtype, tuple(tensor.shape), tensor.double().flatten().tolist()


def _worker(rank, world_size):
    out = {}
    # Uneven lengths, pieces of different integer widths: widened to the widest, in rank order.
    pieces = [torch.arange(3, dtype=torch.int8)] if rank == 0 else [torch.arange(5, dtype=torch.int16) + 10] * 2
    gathered = gather_across_ranks(pieces)
    out["pieces"] = (gathered.dtype, gathered.tolist())
    # Held once: every shard is received straight into its slice of the result, unpadded.
    rows = torch.full((4 if rank == 0 else 7, 3), float(rank))
    gathered = gather_across_ranks(rows)
    out["rows"] = gathered.tolist()
    out["storage"] = (gathered.untyped_storage().nbytes(), (4 + 7) * 3 * 4)
    out["nothing"] = gather_across_ranks(None if rank == 0 else torch.ones(2, 2)).tolist()
    # Every dtype comes back as it went, including those that travel in a wider one; a shard
    # of zero rows (not None) contributes nothing.
    out["dtypes"] = {}
    for dtype in (torch.bool, torch.uint8, torch.int16, torch.int64, torch.float16, torch.bfloat16, torch.float64):
        local = (torch.arange(rank * 10, rank * 10 + (3 if rank == 0 else 5)) % 7).to(dtype).reshape(-1, 1)
        out["dtypes"][str(dtype)] = _described(gather_across_ranks(local))
        out["dtypes"][f"{dtype} empty"] = _described(gather_across_ranks(local[: 0 if rank == 1 else 2]))

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
        for dtype in (torch.bool, torch.uint8, torch.int16, torch.int64, torch.float16, torch.bfloat16, torch.float64):
            shards = [(torch.arange(r * 10, r * 10 + (3 if r == 0 else 5)) % 7).to(dtype) for r in range(2)]
            whole = torch.cat(shards).reshape(-1, 1)
            assert out["dtypes"][str(dtype)] == _described(whole)
            assert out["dtypes"][f"{dtype} empty"] == _described(shards[0][:2].reshape(-1, 1))
        assert out["avg"] == pytest.approx(expected, abs=1e-12)
