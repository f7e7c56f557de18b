"""Queued updates give exactly what applying every update at once gives.

`GlobalMetrics` queues the batches its confusion counts need and counts them in groups;
`AverageMeter` queues 0-d tensor values and sums them in groups. The reference for both is the
same container with a queue of one (every update applied immediately, as before queuing).
"""

from __future__ import annotations

import copy
import math
import pickle
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from danling.metrics import (
    AverageMeter,
    GlobalMetrics,
    MetricFunc,
    MetricState,
    MetricTask,
    binary_metrics,
    multiclass_metrics,
    multilabel_metrics,
)
from danling.metrics import functional as F
from danling.metrics import global_metrics as global_metrics_module
from danling.metrics import meter as meter_module
from danling.metrics.functional import _common
from danling.metrics.meter import sync_meters
from tests.dist import run_distributed
from tests.metrics._compare import same
from tests.metrics.test_no_host_sync import ForbidHostSync

NAMES = {
    "multiclass": ["acc", "balanced_acc", "precision", "recall", "f1", "mcc", "confmat"],
    "binary": ["acc", "precision", "recall", "f1", "mcc", "confmat"],
    "multilabel": ["acc", "balanced_acc", "f1", "mcc", "confmat"],
}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def same_values(a, b) -> bool:
    return list(a) == list(b) and all(same(a[key], b[key]) for key in a)


def build(kind: str, size: int, ignore_index, with_data: bool = False) -> GlobalMetrics:
    names = NAMES[kind] + (["auroc"] if with_data else [])
    if kind == "multiclass":
        return multiclass_metrics(size, names, ignore_index=ignore_index)
    if kind == "multilabel":
        return multilabel_metrics(size, names, ignore_index=ignore_index)
    return binary_metrics(names, ignore_index=ignore_index)


def queue(batches: int, nbytes: int):
    """Patch the queue bounds of GlobalMetrics (`batches=1` applies every update at once)."""
    return mock.patch.multiple(global_metrics_module, PENDING_BATCHES=batches, PENDING_BYTES=nbytes)


def store_of(metrics: GlobalMetrics):
    (store,) = metrics._stores.values()
    return store


@st.composite
def batch_sequences(draw):
    """A task, its size, and batches with ignored and invalid targets, mixed dtypes and sizes."""
    kind = draw(st.sampled_from(["multiclass", "binary", "multilabel"]))
    size = 2 if kind == "binary" else draw(st.integers(1, 4))
    ignore_index = draw(st.sampled_from([-100, None, 0]))
    batches = []
    for _ in range(draw(st.integers(1, 9))):
        n = draw(st.integers(0, 5))
        dtype = draw(st.sampled_from(DTYPES))
        scale = draw(st.sampled_from([1.0, 4.0]))  # probabilities or logits, decided per batch
        width = 1 if kind == "binary" else size
        values = draw(st.lists(st.floats(0, 1, width=16), min_size=n * width, max_size=n * width))
        scores = (torch.tensor(values, dtype=torch.float32) * scale - float(scale > 1)).to(dtype)
        labels = list(range(2 if kind != "multiclass" else size)) + [-100, -1, size + 1]
        target_shape = (n, size) if kind == "multilabel" else (n,)
        flat = draw(
            st.lists(st.sampled_from(labels), min_size=math.prod(target_shape), max_size=math.prod(target_shape))
        )
        target = torch.tensor(flat, dtype=torch.long).reshape(target_shape)
        if kind == "multiclass":
            input = scores.reshape(n, size)
            if draw(st.booleans()):  # the general path: predicted labels become one-hot scores
                input = input.argmax(-1) if n else torch.zeros(0, dtype=torch.long)
        else:
            input = scores.reshape(n, width) if kind == "multilabel" else scores
        reads = draw(st.sampled_from([(), ("avg",), ("val", "avg"), ("bat",)]))
        batches.append((input, target, reads))
    return kind, size, ignore_index, batches


def replay(metrics: GlobalMetrics, batches) -> list:
    """Update with every batch, reading where the batch asks for it; returns what was read."""
    seen = []
    for input, target, reads in batches:
        metrics.update(input, target)
        seen += [(kind, metrics.read(kind)) for kind in reads]
    seen += [(kind, metrics.read(kind)) for kind in ("val", "avg")]
    return seen


@settings(max_examples=50, deadline=None)
@given(case=batch_sequences(), bounds=st.sampled_from([(2, 1 << 20), (3, 150), (64, 100), (5, 1 << 20)]))
def test_queued_counts_are_the_counts_of_every_update_applied_at_once(case, bounds):
    kind, size, ignore_index, batches = case
    with queue(*bounds):
        queued = build(kind, size, ignore_index, with_data=bounds[0] == 3)
        queued_reads = replay(queued, batches)
    with queue(1, 1 << 20):
        direct = build(kind, size, ignore_index, with_data=bounds[0] == 3)
        direct_reads = replay(direct, batches)
    assert torch.equal(store_of(queued).counts, store_of(direct).counts)
    for (kind_q, (values_q, count_q)), (kind_d, (values_d, count_d)) in zip(queued_reads, direct_reads):
        assert kind_q == kind_d and count_q == count_d
        assert same_values(values_q, values_d), kind_q
    # And both are the sum of each batch's own confusion counts.
    task = store_of(direct).task
    total = task.empty_confusion()
    for input, target, _ in batches:
        total = total + task.confusion(*task.format(input, target))
    assert torch.equal(store_of(queued).confusion.matrix, total.matrix)
    assert int(store_of(queued).confusion.invalid) == int(total.invalid)


def test_the_queue_is_bounded_and_counted_every_64_batches():
    metrics = multiclass_metrics(10, ["acc"])
    store = store_of(metrics)
    target = torch.randint(0, 10, (32,))
    for step in range(1, 150):
        metrics.update(torch.randn(32, 10), target)
        assert len(store.pending) == step % global_metrics_module.PENDING_BATCHES
        assert store.pending_bytes < global_metrics_module.PENDING_BYTES
    assert (store._counts is not None) and int(store._counts.sum()) == 128 * 32
    assert int(store.counts.sum()) == 149 * 32 and store.pending == []  # a read counts the rest


def test_big_batches_and_views_of_big_tensors_are_counted_at_once():
    metrics = multiclass_metrics(4, ["acc"])
    store = store_of(metrics)
    big = torch.randn(70_000, 4)  # 1.1 MB of scores: above the queue's byte bound (128 KiB)
    metrics.update(torch.randn(3, 4), torch.tensor([0, 1, 2]))
    metrics.update(big, torch.zeros(70_000, dtype=torch.long))
    assert store.pending == [] and int(store._counts.sum()) == 70_003  # the queued batch went first
    metrics.update(big[:8], torch.zeros(8, dtype=torch.long))  # small view, but it pins all of `big`
    assert store.pending == [] and int(store._counts.sum()) == 70_011
    # 96 kB each with targets, below `COUNT_ALONE` targets: the second crosses the byte bound.
    half = [torch.randn(4_000, 4) for _ in range(2)]
    metrics.update(half[0], torch.zeros(4_000, dtype=torch.long))
    assert len(store.pending) == 1
    metrics.update(half[1], torch.zeros(4_000, dtype=torch.long))
    assert store.pending == [] and int(store._counts.sum()) == 78_011


@pytest.mark.parametrize("kind", ["multiclass", "binary", "multilabel"])
def test_big_batches_are_counted_in_pieces_with_the_counts_of_one_count(kind):
    """Above `COUNT_ELEMENTS` targets a batch is counted in pieces of rows: the same integers."""
    generator = torch.Generator().manual_seed(2)
    size = 2 if kind == "binary" else 5
    shape = (1000, size) if kind == "multilabel" else (1000,)
    target = torch.randint(0, 2 if kind == "multilabel" else size, shape, generator=generator)
    target.view(-1)[::17] = -100
    target.view(-1)[::29] = 7  # invalid
    scores = torch.randn(1000, size, generator=generator)
    scores = scores[:, 0] if kind == "binary" else scores
    counts = {}
    for elements in (1 << 40, 64, 7):  # whole, pieces of rows, and a row per piece (64 // 5 rows, 7 // 5 -> 1)
        with mock.patch.object(global_metrics_module, "COUNT_ELEMENTS", elements):
            metrics = build(kind, size, -100)
            metrics.update(scores, target)
            counts[elements] = store_of(metrics).counts.clone()
    assert torch.equal(counts[64], counts[1 << 40]) and torch.equal(counts[7], counts[1 << 40])
    assert int(counts[64].sum()) == target.numel()


def test_binary_and_multilabel_decisions_wait_as_booleans():
    metrics = binary_metrics(["acc"])
    metrics.update(torch.rand(8), torch.randint(0, 2, (8,)))
    ((decisions, _),) = store_of(metrics).pending
    assert decisions.dtype is torch.bool  # 1 byte a sample, not int64's 8
    metrics = multilabel_metrics(3, ["acc"])
    metrics.update(torch.rand(8, 3), torch.randint(0, 2, (8, 3)))
    ((decisions, _),) = store_of(metrics).pending
    assert decisions.dtype is torch.bool


@pytest.mark.parametrize("kind", ["binary", "multiclass", "multilabel"])
def test_big_cpu_batches_are_counted_with_int32_positions_and_the_same_counts(kind):
    """From `NARROW_POSITIONS` targets the count's positions are int32, written over its rows.

    Half of int64's bytes per target for the temporaries of one count; small batches keep int64
    (fewer casts per call). The counts are the same either way.
    """
    generator = torch.Generator().manual_seed(4)
    size = 3 if kind != "binary" else 2
    shape = (5000, size) if kind == "multilabel" else (5000,)
    scores = torch.rand((5000, size) if kind != "binary" else shape, generator=generator)
    target = torch.randint(-1, size + 1, shape, generator=generator)
    target.view(-1)[::11] = -100
    metrics = build(kind, size, -100)
    counter = store_of(metrics).counter
    pred = scores.argmax(-1) if kind == "multiclass" else scores > 0.5
    assert target.numel() >= _common.NARROW_POSITIONS
    assert counter.index(pred, target).dtype is torch.int32
    assert counter.index(pred[:100], target[:100]).dtype is torch.int64
    small = [counter.count(pred[i : i + 100], target[i : i + 100]) for i in range(0, 5000, 100)]
    expected = torch.stack(small).sum(0)
    assert torch.equal(counter.count(pred, target), expected)
    metrics.update(scores, target)  # counted at update (5000 targets), with int32 positions
    assert torch.equal(store_of(metrics).counts, expected)


def big_batch(kind: str, rows: int, seed: int = 6):
    generator = torch.Generator().manual_seed(seed)
    if kind == "multilabel":
        return torch.rand(rows, 3, generator=generator), torch.randint(-1, 2, (rows, 3), generator=generator)
    if kind == "binary":
        return torch.rand(rows, generator=generator), torch.randint(-1, 2, (rows,), generator=generator)
    return torch.randn(rows, 4, generator=generator), torch.randint(-1, 4, (rows,), generator=generator)


@pytest.mark.parametrize("kind", ["multiclass", "binary", "multilabel"])
def test_a_store_of_counts_alone_holds_no_big_batch_and_reads_its_counts(kind):
    """From `COUNT_ALONE` targets a batch is counted at update: `val` reads its own counts."""
    rows = global_metrics_module.COUNT_ALONE  # multilabel: 3 targets a row, so a third would do
    size = 2 if kind == "binary" else 3 if kind == "multilabel" else 4
    metrics = build(kind, size, -1)
    store = store_of(metrics)
    small, big = big_batch(kind, 7, seed=1), big_batch(kind, rows)
    metrics.update(*small)
    assert store.last is not None and len(store.pending) == 1  # a training-size batch waits
    metrics.update(*big)
    assert store.pending == [] and store.last is None and store.last_counts is not None
    # The metrics of the batch itself, computed from its data, not from the container's counts.
    own = {store.task: MetricState.from_batch(store.task, *big)}
    direct = {name: global_metrics_module._evaluate(metric, own) for name, metric in metrics.metrics.items()}
    assert same_values(metrics.val, direct) and same_values(metrics.bat, direct)
    both = build(kind, size, -1)
    for batch in (small, big):
        both.update(*batch)
    assert same_values(metrics.avg, both.avg)
    restored = build(kind, size, -1)  # a checkpoint keeps the latest batch's counts
    restored.load_state_dict(metrics.state_dict())
    assert same_values(restored.val, direct) and same_values(restored.avg, metrics.avg)
    assert store_of(restored).last_counts is not None and store_of(restored).last is None
    state = metrics.state_dict()
    state["tasks"]["0"]["last_counts"] = [1, 2, 3]  # a damaged checkpoint: refused, naming the key
    with pytest.raises(ValueError, match="'last_counts' must be a tensor or None, got list"):
        build(kind, size, -1).load_state_dict(state)


def test_stores_that_keep_data_still_hold_the_latest_batch_for_val():
    metrics = multiclass_metrics(4, ["acc", "auroc"], ignore_index=-1)
    batch = big_batch("multiclass", global_metrics_module.COUNT_ALONE)
    metrics.update(*batch)
    store = store_of(metrics)
    assert store.last_counts is None and store.latest()[0] is batch[0]  # the tail of the kept data
    assert store.pending == []  # counted at once: a queued evaluation batch would hold its targets
    assert int(store.counts.sum()) == batch[1].numel()
    # The count's `ones` for this batch size are one element seen N times, not N int64s.
    assert all(ones.untyped_storage().nbytes() == 8 for ones in store.counter._ones.values())


def test_a_dtype_change_counts_the_queue_first_and_a_device_mix_still_fails_at_update():
    metrics = multiclass_metrics(3, ["acc"])
    store = store_of(metrics)
    metrics.update(torch.eye(3), torch.tensor([0, 1, 2]))
    metrics.update(torch.eye(3, dtype=torch.float64), torch.tensor([0, 1, 1]))
    assert [s.dtype for s, _ in store.pending] == [torch.float64] and int(store._counts.sum()) == 3
    assert metrics.avg["acc"] == 5 / 6
    with pytest.raises(RuntimeError):  # counts live on the CPU; a batch elsewhere cannot be added
        metrics.update(torch.eye(3, device="meta"), torch.tensor([0, 1, 2], device="meta"))
    with pytest.raises(RuntimeError):  # scores and targets on different devices
        metrics.update(torch.eye(3, device="meta"), torch.tensor([0, 1, 2]))


def test_reset_drops_the_queue():
    metrics, fresh = multiclass_metrics(3, ["acc", "f1"]), multiclass_metrics(3, ["acc", "f1"])
    metrics.update(torch.eye(3), torch.tensor([0, 1, 2]))
    metrics.reset()
    assert store_of(metrics).pending == [] and store_of(metrics).counts is None
    for m in (metrics, fresh):
        m.update(torch.eye(3), torch.tensor([2, 1, 0]))
    assert same_values(metrics.avg, fresh.avg) and metrics.avg["acc"] == 1 / 3


def test_updates_never_synchronise_even_when_the_queue_is_counted(monkeypatch):
    monkeypatch.setattr(_common, "HOST_BINCOUNT_DEVICES", ())
    metrics, meter = multiclass_metrics(5, ["acc", "f1"]), AverageMeter()
    binary = binary_metrics(["acc", "f1"])
    with ForbidHostSync():
        for _ in range(130):  # crosses both queues' bounds twice
            metrics.update(torch.randn(4, 5), torch.randint(0, 5, (4,)))
            binary.update(torch.randn(4), torch.randint(0, 2, (4,)))
            meter.update(torch.rand(()))
        store_of(metrics).flush()
    assert int(store_of(metrics).counts.sum()) == 520 and meter.count == 130


# ---------------------------------------------------------------- inference mode


def _batches(seed: int = 0, count: int = 6):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 4, generator=g), torch.randint(-1, 4, (5,), generator=g)) for _ in range(count)]


def _reference_values(batches):
    with queue(1, 1 << 20):
        reference = multiclass_metrics(4, NAMES["multiclass"], ignore_index=-1)
        for batch in batches:
            reference.update(*batch)
        return reference.avg


@pytest.mark.parametrize("pattern", ["inside then read outside", "outside then read inside", "mixed"])
def test_updates_and_reads_in_and_out_of_inference_mode(pattern):
    batches = _batches()
    metrics = multiclass_metrics(4, NAMES["multiclass"], ignore_index=-1)
    for index, batch in enumerate(batches):
        inside = pattern == "inside then read outside" or (pattern == "mixed" and index % 2 == 0)
        with torch.inference_mode(inside):
            metrics.update(*batch)
        if pattern == "mixed" and index == 2:
            with torch.inference_mode():  # a read inside, then updates outside again
                assert metrics.avg["acc"] == _reference_values(batches[:3])["acc"]
    with torch.inference_mode(pattern == "outside then read inside"):
        values = metrics.avg
    assert same_values(values, _reference_values(batches))
    confusion = store_of(metrics).confusion
    confusion.matrix += 1  # readers get ordinary tensors they may change in place
    copied = copy.deepcopy(metrics)
    metrics.update(*batches[0])  # counting continues outside inference mode
    assert same_values(copied.avg, values)
    assert same_values(metrics.avg, _reference_values([*batches, batches[0]]))
    # The label counter (and its cached tables, built under inference mode) is shared with the
    # functional metrics, which run outside it, also on tensors that require grad.
    scores = batches[1][0].clone().requires_grad_()
    expected = F.multiclass_accuracy(batches[1][0], batches[1][1], ignore_index=-1)
    assert torch.equal(F.multiclass_accuracy(scores, batches[1][1], ignore_index=-1), expected)


def test_meter_updates_in_and_out_of_inference_mode():
    meter, reference = AverageMeter(), AverageMeter()
    values = [torch.tensor(v) for v in (0.5, 0.25, 1.0, 2.0)]
    with torch.inference_mode():
        for value in values[:2]:
            meter.update(value.clone())
    assert meter.avg == 0.375
    for value in values[2:]:
        meter.update(value)
    with torch.inference_mode():
        assert meter.avg == 0.9375
    with mock.patch.object(meter_module, "PENDING_VALUES", 1):
        for value in values:
            reference.update(value)
    assert meter.sum == reference.sum == 3.75


# ---------------------------------------------------------------- copies


def _acc(state):
    return _common.cm_accuracy(state.confusion)


ACC = MetricFunc("acc", _acc, MetricTask("multiclass", num_classes=4, ignore_index=-1), "confusion")


def test_copies_and_pickles_count_the_queue_first():
    metrics = GlobalMetrics(ACC)
    batches = _batches(1)
    for batch in batches[:3]:
        metrics.update(*batch)
    assert len(store_of(metrics).pending) == 3
    copied, unpickled = copy.deepcopy(metrics), pickle.loads(pickle.dumps(metrics))
    assert store_of(copied).pending == [] and store_of(unpickled).pending == []
    expected = _reference_values(batches[:3])["acc"]
    for batch in batches[3:]:
        metrics.update(*batch)
    assert copied.avg["acc"] == unpickled.avg["acc"] == expected
    assert metrics.avg["acc"] == _reference_values(batches)["acc"]


# ---------------------------------------------------------------- AverageMeter


@st.composite
def meter_updates(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.int64]))
    width = {torch.float32: 32, torch.float64: 64}.get(dtype, 16)
    values = draw(st.lists(st.floats(-1e4, 1e4, width=width), min_size=1, max_size=150))
    weights = draw(st.lists(st.sampled_from([1, 1, 1, 1, 2, 0, 32]), min_size=len(values), max_size=len(values)))
    return [(torch.tensor(v, dtype=torch.float64).to(dtype), n) for v, n in zip(values, weights)]


@settings(max_examples=40, deadline=None)
@given(updates=meter_updates(), numbers=st.booleans())
def test_meter_groups_depend_only_on_the_updates_and_match_immediate_adds(updates, numbers):
    reading, quiet = AverageMeter(), AverageMeter()
    exact, scale = [], 0.0
    for index, (value, n) in enumerate(updates):
        if numbers and index % 7 == 3:  # Python numbers in between
            value = value.item()
        reading.update(value, n)
        quiet.update(value, n)
        number = value if isinstance(value, (int, float)) else value.item()
        exact.append(number * n)
        scale += abs(number * n)
        assert same(reading.val, number)
        # float64 accumulation: at most two roundings per value (into its group, the group into the sum)
        bound = 2.5e-16 * len(exact) * scale
        assert reading.sum == pytest.approx(math.fsum(exact), rel=0, abs=bound)
        reading.avg  # reading never changes where later groups are cut  # noqa: B018
    assert same(reading._sum, quiet._sum)  # bit for bit
    assert reading.count == quiet.count == sum(n for _, n in updates)
    with mock.patch.object(meter_module, "PENDING_VALUES", 1):
        immediate = AverageMeter()
        for value, n in updates:
            immediate.update(value, n)
    assert reading.sum == pytest.approx(immediate.sum, rel=0, abs=5e-16 * len(exact) * scale)
    assert len(quiet._pending) < meter_module.PENDING_VALUES


def test_meter_reads_do_not_move_the_group_boundaries():
    # Random float64 values: grouping changes the last bits, so equal sums mean equal groups.
    values = torch.randn(200, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 1000
    reading, quiet = AverageMeter(), AverageMeter()
    for value in values:
        reading.update(value)
        quiet.update(value)
        reading.avg  # noqa: B018
    assert torch.equal(reading._sum, quiet._sum)
    groups = [values[i : i + 64].sum() for i in range(0, 200, 64)]
    expected = torch.zeros((), dtype=torch.float64)
    for group in groups[:-1]:
        expected = expected + group
    assert torch.equal(reading._sum, expected + groups[-1])


def test_meter_queue_keeps_val_immediate_and_shapes_checked():
    meter = AverageMeter()
    for step in range(1, 70):
        meter.update(torch.tensor(float(step)))
        assert meter.val == step and meter.count == step
    assert len(meter._pending) == 69 - 64 and meter.avg == 35.0
    vector = AverageMeter()
    vector.update(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"shape \(\).*\(2,\)"):
        vector.update(torch.tensor(1.0))
    restored = pickle.loads(pickle.dumps(meter))
    assert restored.avg == copy.deepcopy(meter).avg == 35.0 and restored.sum == 69 * 70 / 2


# ---------------------------------------------------------------- two ranks


def _two_rank_reads(rank: int, world_size: int) -> dict:
    # `bat` of a store of counts alone sums the ranks' latest-batch counts, whether a rank's batch
    # was counted alone (rank 0: COUNT_ALONE targets) or waits in its queue (rank 1: 5).
    latest = multiclass_metrics(4, NAMES["multiclass"], ignore_index=-1)
    latest.update(*(big_batch("multiclass", global_metrics_module.COUNT_ALONE) if rank == 0 else _batches(3, 1)[0]))
    bat = latest.bat.dict()
    batches = _batches(2, count=7)
    metrics = multiclass_metrics(4, NAMES["multiclass"], ignore_index=-1)
    meter = AverageMeter()
    with torch.inference_mode():
        for batch in batches[rank::world_size]:
            metrics.update(*batch)
            meter.update(batch[0].sum(), n=batch[0].shape[0])
    pending = len(store_of(metrics).pending), len(meter._pending)
    (synced,) = sync_meters([meter])
    return {
        "values": metrics.avg.dict(),
        "count": metrics.read("avg")[1],
        "pending": pending,
        "meter": synced.avg,
        "bat": bat,
    }


@pytest.mark.distributed
def test_two_ranks_read_queued_updates_like_one_process_reads_all_of_them():
    results = run_distributed(_two_rank_reads, world_size=2)
    batches = _batches(2, count=7)
    expected = _reference_values(batches)
    total = sum(float(x.sum()) * x.shape[0] for x, _ in batches) / sum(x.shape[0] for x, _ in batches)
    assert [r["pending"] for r in results] == [(4, 4), (3, 3)]  # both ranks read with queued batches
    union = _reference_values([big_batch("multiclass", global_metrics_module.COUNT_ALONE), _batches(3, 1)[0]])
    for result in results:
        assert same_values(result["bat"], union.dict())
        assert same_values(result["values"], expected.dict())
        assert set(result["count"].values()) == {35}
        assert result["meter"] == pytest.approx(total, rel=1e-6)
