"""Two real gloo ranks must give the results a single process gets on the union of their data."""

import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from danling.metrics import (
    AverageMeter,
    AverageMeters,
    GlobalMetrics,
    MultiTaskMetrics,
    binary_metrics,
    multiclass_metrics,
    multilabel_metrics,
    regression_metrics,
    sides,
)
from danling.metrics import functional as F
from danling.metrics import global_metrics as global_metrics_module
from tests.dist import run_distributed

pytestmark = pytest.mark.distributed

# Uneven shards: rank 0 gets three batches, rank 1 two, all of different lengths.
SHARDS = {0: [0, 2, 3], 1: [1, 4]}
SIZES = [5, 9, 3, 12, 7]


def dataset():
    g = torch.Generator().manual_seed(1234)
    batches = []
    for n in SIZES:
        target = torch.randint(0, 4, (n,), generator=g)
        target[torch.rand(n, generator=g) < 0.15] = -100
        multilabel = torch.randint(0, 2, (n, 3), generator=g)
        batches.append(
            {
                "multiclass": (torch.randn(n, 4, generator=g), target),
                "binary": (torch.randn(n, generator=g), torch.randint(0, 2, (n,), generator=g)),
                "multilabel": (torch.rand(n, 3, generator=g), multilabel),
                "regression": (torch.randn(n, 2, generator=g), torch.randn(n, 2, generator=g)),
            }
        )
    return batches


def containers():
    return {
        "multiclass": multiclass_metrics(4, ["acc", "balanced_acc", "f1", "mcc", "auroc", "auprc"]),
        "multiclass_stream": multiclass_metrics(4, mode="stream"),
        "binary": binary_metrics(["acc", "f1", "mcc", "auroc", "auprc"]),
        "multilabel": multilabel_metrics(3, ["acc", "f1", "auroc", "auprc"]),
        "regression": regression_metrics(2),
        "plain": GlobalMetrics(auroc=F.binary_auroc),
        # binned AUROC / AUPRC: per-bin counts, summed across ranks by one all-reduce
        "binned_multiclass": multiclass_metrics(4, ["acc", "auroc", "auprc"], bins=16),
        "binned_multilabel": multilabel_metrics(3, ["auroc", "auprc"], bins=16),
    }


def task_of(name):
    return {"multiclass_stream": "multiclass", "plain": "binary"}.get(name, name.removeprefix("binned_"))


def feed(metrics, batches, indices):
    for name, container in metrics.items():
        for i in indices:
            container.update(*batches[i][task_of(name)])


def numbers(values):
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in values.items()}


def lonely_containers():
    return {
        "multiclass": multiclass_metrics(4),
        "regression": regression_metrics(2),
        "plain": containers()["plain"],
        "binned_binary": binary_metrics(["auroc", "auprc"], bins=16),  # rank 1 adds zero counts
        "binary": binary_metrics(["acc", "auroc", "auprc"]),  # scores by label: rank 1 gathers nothing
    }


class CountCollectives:
    """Count calls of torch.distributed collectives made inside the block."""

    NAMES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "reduce", "gather", "barrier")

    def __enter__(self):
        self.calls, self.saved = 0, {name: getattr(dist, name) for name in self.NAMES}

        def counting(original):
            def wrapper(*args, **kwargs):
                self.calls += 1
                return original(*args, **kwargs)

            return wrapper

        for name, original in self.saved.items():
            setattr(dist, name, counting(original))
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(dist, name, original)


def _worker(rank, world_size):
    batches = dataset()
    metrics = containers()
    with CountCollectives() as updates:
        feed(metrics, batches, SHARDS[rank])
    assert updates.calls == 0, "updates must not communicate"
    with CountCollectives() as reads:
        metrics["multiclass"].avg  # noqa: B018
    assert reads.calls > 0
    out = {name: {"avg": numbers(c.avg), "bat": numbers(c.bat), "text": f"{c:.4f}"} for name, c in metrics.items()}
    out["avg_again"] = numbers(metrics["multiclass"].avg)  # reads are not cached across ranks

    # A container whose data all sits on rank 0: rank 1 joins the collectives with nothing.
    lonely = lonely_containers()
    if rank == 0:
        feed(lonely, batches, range(len(SIZES)))
    out["lonely"] = {name: numbers(c.avg) for name, c in lonely.items()}

    # Binary scores kept in order, as on a device (where splitting by label would read the device
    # at every update): the read splits them, and gathers the sides as a store kept by label does.
    in_order = binary_metrics(["acc", "f1", "mcc", "auroc", "auprc"])
    with mock.patch.object(sides, "HOST_DEVICES", ()):
        feed({"binary": in_order}, batches, SHARDS[rank])
    assert in_order._stores[next(iter(in_order._stores))].sides is None
    out["binary_in_order"] = numbers(in_order.avg)
    # What a read of binary AUROC sends: each side's scores, never the targets.
    sent = []

    def recording(tensor, *args, **kwargs):
        pieces = [tensor] if isinstance(tensor, torch.Tensor) else list(tensor or [])
        sent.extend(piece.dtype for piece in pieces)
        return gather(tensor, *args, **kwargs)

    gather = global_metrics_module.gather_across_ranks
    with mock.patch.object(global_metrics_module, "gather_across_ranks", recording):
        metrics["binary"].avg  # noqa: B018
    out["binary_sent"] = sorted({str(dtype) for dtype in sent})
    # A target that is no label, on one rank only, makes every rank's AUROC and AUPRC nan.
    scores, target = batches[SHARDS[rank][0]]["binary"]
    spoilt = {"exact": binary_metrics(["auroc", "auprc"]), "binned": binary_metrics(["auroc", "auprc"], bins=16)}
    for container in spoilt.values():
        container.update(scores, target.clone().fill_(2) if rank == 1 else target)
    out["spoilt"] = {name: numbers(container.avg) for name, container in spoilt.items()}

    # Meters: weighted values, a tensor meter only rank 1 updates, and a meter nobody updates.
    meters = AverageMeters()
    meters.update(loss=float(rank + 1))
    meters["loss"].update(10.0 * (rank + 1), n=rank + 1)
    meters.vector = AverageMeter()
    meters.idle = AverageMeter()
    if rank == 1:
        meters.vector.update(torch.tensor([1.0, 3.0]), n=2)
    out["meters"] = {"bat": numbers(meters.bat), "avg": numbers(meters.avg), "text": f"{meters:.2f}"}
    out["meter_alone"] = (meters.loss.bat, meters.loss.avg, meters.loss.val)
    # An empty batch on rank 1 (NaN mean, weight 0) weighs nothing in `bat` or `avg`.
    empty = AverageMeter()
    empty.update(2.0 * (rank + 1))
    if rank == 1:
        empty.update(math.nan, n=0)
    out["weightless"] = (empty.bat, empty.avg)

    tasks = MultiTaskMetrics(aggregate="micro", a=multiclass_metrics(4, ["acc"]), b=binary_metrics(["acc"]))
    for i in SHARDS[rank]:
        tasks.update({"a": batches[i]["multiclass"]})
    tasks.update({"b": batches[SHARDS[rank][0]]["binary"]})
    out["multitask"] = numbers(tasks.avg["aggregate"])
    return out


def test_two_ranks_match_one_process_on_the_union():
    results = run_distributed(_worker, world_size=2)
    batches = dataset()
    everything = range(len(SIZES))
    last = [SHARDS[0][-1], SHARDS[1][-1]]
    union, last_union = containers(), containers()
    feed(union, batches, everything)
    feed(last_union, batches, last)  # global containers' `bat` covers the latest batch of both ranks
    lonely = lonely_containers()
    feed(lonely, batches, everything)
    for out in results:
        for name, container in union.items():
            assert out[name]["avg"] == pytest.approx(numbers(container.avg), nan_ok=True), name
            if "stream" not in name:
                assert out[name]["bat"] == pytest.approx(numbers(last_union[name].avg), nan_ok=True), name
        assert out["avg_again"] == out["multiclass"]["avg"]
        assert out["binary_in_order"] == pytest.approx(numbers(union["binary"].avg))
        assert out["binary_sent"] == ["torch.float32"]
        assert all(math.isnan(value) for values in out["spoilt"].values() for value in values.values())
        assert out["multiclass"]["text"] == results[0]["multiclass"]["text"]
        for name in ("multiclass", "regression", "plain", "binned_binary", "binary"):
            assert out["lonely"][name] == pytest.approx(numbers(lonely[name].avg), nan_ok=True), name
    check_stream_bat(results, batches)
    check_meters(results)
    check_multitask(results, batches)


def check_stream_bat(results, batches):
    per_rank = []
    for rank in (0, 1):
        single = multiclass_metrics(4, mode="stream")
        single.update(*batches[SHARDS[rank][-1]]["multiclass"])
        per_rank.append((single.val, SIZES[SHARDS[rank][-1]]))
    for name in ("acc", "f1", "mcc"):
        expected = sum(values[name] * n for values, n in per_rank) / sum(n for _, n in per_rank)
        assert results[0]["multiclass_stream"]["bat"][name] == pytest.approx(expected)


def check_meters(results):
    # loss: rank 0 adds 1 (n=1) then 10 (n=1); rank 1 adds 2 (n=1) then 20 (n=2).
    for out in results:
        assert out["meters"]["avg"]["loss"] == pytest.approx((1 + 10 + 2 + 40) / 5)
        assert out["meters"]["bat"]["loss"] == pytest.approx((10 + 40) / 3)
        assert out["meters"]["avg"]["vector"] == pytest.approx([1.0, 3.0])
        assert math.isnan(out["meters"]["avg"]["idle"])
        assert out["meters"]["text"] == results[0]["meters"]["text"]
        assert out["meter_alone"][:2] == (pytest.approx(50 / 3), pytest.approx(53 / 5))
    assert [out["meter_alone"][2] for out in results] == [10.0, 20.0]  # val stays local
    assert [out["weightless"] for out in results] == [(2.0, 3.0), (2.0, 3.0)]


def check_multitask(results, batches):
    union_a = multiclass_metrics(4, ["acc"])
    feed({"multiclass": union_a}, batches, range(len(SIZES)))
    union_b = binary_metrics(["acc"])
    for rank in (0, 1):
        union_b.update(*batches[SHARDS[rank][0]]["binary"])
    count_a, count_b = sum(SIZES), SIZES[SHARDS[0][0]] + SIZES[SHARDS[1][0]]
    expected = (union_a.avg["acc"] * count_a + union_b.avg["acc"] * count_b) / (count_a + count_b)
    for out in results:
        assert out["multitask"]["acc"] == pytest.approx(expected)
