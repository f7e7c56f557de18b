"""Metric values counted on the host reach their meters as Python floats, to the same bits.

`value_on_host(accuracy)` gives the per-batch accuracy of CPU labels as the float the metric's
0-d float64 tensor would hold; `AverageMeter.update_float64` adds such a float as that tensor
would be added (same pending groups, same float64 reduction). `MetricMeter` and `StreamMetrics`
use both for `accuracy`, so their values must equal, bit for bit, those of the same metric
wrapped in a function the meters do not know (which takes the tensor path).
"""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from danling.metrics import AverageMeter, MetricMeter, StreamMetrics
from danling.metrics.functional import _common, accuracy, value_on_host
from tests.metrics._compare import same


def tensor_path(input, target):
    """`accuracy` behind a function no meter recognises: its value arrives as a 0-d tensor."""
    return accuracy(input, target)


def assert_same_meter(fast: AverageMeter, slow: AverageMeter) -> None:
    assert same(fast._sum, slow._sum)  # bit for bit, pending groups included
    for kind in ("val", "avg", "sum", "count"):
        assert same(getattr(fast, kind), getattr(slow, kind)), kind
    assert same(fast.state_dict()["pending"], slow.state_dict()["pending"])


# ---------------------------------------------------------------- the meter


@st.composite
def float_updates(draw):
    """(value, weight, how) triples: `how` adds the value as a float or as a float64/float32 tensor."""
    size = draw(st.integers(1, 150))
    values = draw(st.lists(st.floats(-1e3, 1e3, width=64) | st.just(math.nan), min_size=size, max_size=size))
    weights = draw(st.lists(st.sampled_from([32, 32, 32, 7, 1, 0]), min_size=size, max_size=size))
    kinds = st.sampled_from(["float", "float", "float", "float64", "float32"])
    hows = draw(st.lists(kinds, min_size=size, max_size=size))
    return list(zip(values, weights, hows))


@settings(max_examples=60, deadline=None)
@given(updates=float_updates(), cut=st.integers(0, 150))
def test_float_updates_equal_float64_tensor_updates_to_the_bit(updates, cut):
    fast, slow = AverageMeter(), AverageMeter()
    for index, (value, n, how) in enumerate(updates):
        if index == cut:  # a checkpoint in the middle of a group: the copy continues the same groups
            restored = AverageMeter()
            restored.load_state_dict(fast.state_dict())
            fast = restored
        if how == "float32":
            tensor = torch.tensor(value, dtype=torch.float32)
            fast.update(tensor, n)
            slow.update(tensor, n)
            continue
        tensor = torch.tensor(value, dtype=torch.float64)
        if how == "float":
            fast.update_float64(value, n)
        else:
            fast.update(tensor, n)
        slow.update(tensor, n)
        assert same(fast.val, slow.val)
    assert_same_meter(fast, slow)
    assert_same_meter(pickle.loads(pickle.dumps(fast)), slow)
    assert_same_meter(copy.deepcopy(fast), slow)


def test_float_updates_are_refused_where_a_0d_tensor_is():
    shaped = AverageMeter()
    shaped.update(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"shape \(\).*\(2,\)"):
        shaped.update_float64(0.5, 32)
    with pytest.raises(ValueError, match="non-negative"):
        AverageMeter().update_float64(0.5, -1)
    weighted = AverageMeter()
    weighted.update_float64(0.5, 2.5)  # a non-int weight takes the general path
    weighted.update_float64(0.25, 32)
    assert weighted.count == 34.5 and weighted.sum == pytest.approx(0.5 * 2.5 + 0.25 * 32)


# ---------------------------------------------------------------- the accuracy's host value


def labels_and_scores(rows: int, classes: int, seed: int, bad: int | None):
    g = torch.Generator().manual_seed(seed)
    scores, labels = torch.randn(rows, classes, generator=g), torch.randint(0, classes, (rows,), generator=g)
    if bad is not None:
        labels[seed % rows] = bad
    return scores, labels


@settings(max_examples=60, deadline=None)
@given(
    rows=st.sampled_from([1, 3, 32, 64, 65, 200]),
    classes=st.integers(2, 12),
    seed=st.integers(0, 2**16),
    bad=st.sampled_from([None, None, -1, 12]),
    double=st.booleans(),
)
def test_the_host_value_of_accuracy_is_the_float_its_tensor_holds(rows, classes, seed, bad, double):
    scores, labels = labels_and_scores(rows, classes, seed, bad)
    if double:
        scores = scores.double()
    on_host = value_on_host(accuracy)
    expected = accuracy(scores, labels)
    assert expected.dtype == torch.float64
    assert same(on_host.one(scores, labels), expected.item())  # every size: list compare and host read
    kind = on_host.kind(scores, labels)
    assert (kind is not None) == (rows <= 64)  # small batches may be counted together
    if kind is not None:  # alone, and among others of the same kind
        assert same(on_host.many([scores], [labels], kind)[0], expected.item())
        others = labels_and_scores(7, classes, seed + 1, None)
        values = on_host.many([others[0].to(scores.dtype), scores], [others[1], labels], kind)
        assert same(values[1], expected.item()) and same(values[0], accuracy(*others).item())


def test_only_the_plain_per_batch_case_is_counted_on_the_host(monkeypatch):
    on_host = value_on_host(accuracy)
    scores, labels = labels_and_scores(8, 3, 0, None)
    for input, target in [
        (scores[:, 0], labels.clamp(0, 1)),  # binary scores
        (scores.tolist(), labels),  # not tensors
        (scores, labels.int()),  # int32 labels
        (scores[:0], labels[:0]),  # empty
        (scores[:, :1], labels * 0),  # one class
        (scores.half(), labels),  # half-precision scores
    ]:
        assert on_host.one(input, target) is None and on_host.kind(input, target) is None
    wide = labels_and_scores(8, 600, 0, None)  # 4800 scores: too many to keep
    assert on_host.one(*wide) is not None and on_host.kind(*wide) is None
    monkeypatch.setattr(_common, "HOST_READ_DEVICES", ())  # an accelerator: the value stays on the device
    assert on_host.one(scores, labels) is None and on_host.kind(scores, labels) is None
    assert value_on_host(tensor_path) is None

    class ByValue:  # unhashable: compares by value
        __hash__ = None

        def __eq__(self, other):
            return True

        def __call__(self, input, target):
            return accuracy(input, target)

    assert value_on_host(ByValue()) is None


# ---------------------------------------------------------------- meters and containers


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([32, 32, 32, 17, 1, 65]), min_size=1, max_size=140),
    seed=st.integers(0, 2**16),
    cut=st.integers(0, 140),
)
def test_accuracy_meters_equal_the_tensor_path_to_the_bit(sizes, seed, cut):
    fast_meter, slow_meter = MetricMeter(accuracy), MetricMeter(tensor_path)
    fast, slow = StreamMetrics(acc=accuracy, wrapped=tensor_path), StreamMetrics(acc=tensor_path, wrapped=tensor_path)
    for index, rows in enumerate(sizes):
        scores, labels = labels_and_scores(rows, 5, seed + index, -1 if index % 37 == 5 else None)
        if index == cut:  # resumed mid-pass from a checkpoint
            fast.load_state_dict(fast.state_dict())
            restored = MetricMeter(accuracy)
            restored.load_state_dict(fast_meter.state_dict())
            fast_meter = restored
        fast.update(scores.requires_grad_(), labels)
        slow.update(scores, labels)
        fast_meter.update(scores, labels)
        slow_meter.update(scores, labels)
    assert type(fast["acc"]._val) is float and type(fast_meter._val) is float  # the host path was taken
    assert_same_meter(fast["acc"], slow["acc"])
    assert_same_meter(fast_meter, slow_meter)
    assert_same_meter(fast_meter, slow["acc"])
    assert fast.avg.dict() == pytest.approx(slow.avg.dict(), nan_ok=True)


def test_reassigning_the_metric_changes_the_path():
    meter = MetricMeter(accuracy)
    meter.metric = tensor_path
    meter.update(*labels_and_scores(4, 3, 0, None))
    assert isinstance(meter._val, torch.Tensor)
    with pytest.raises(TypeError, match="metric must be callable"):
        meter.metric = 3


# ---------------------------------------------------------------- kept batches


class Reference:
    """Meters that count every batch at once: the values kept batches must give."""

    def __init__(self) -> None:
        self.fast, self.slow = MetricMeter(accuracy), MetricMeter(tensor_path)

    def update(self, scores, labels, n=None) -> None:
        self.fast.update(scores, labels, n=n)
        self.slow.update(scores, labels, n=n)


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from([32, 32, 17, 1, 65]), st.sampled_from([5, 5, 5, 3]), st.sampled_from([None, 4])),
        min_size=1,
        max_size=150,
    ),
    reads=st.sets(st.integers(0, 150), max_size=10),
    seed=st.integers(0, 2**16),
)
def test_kept_batches_read_anywhere_give_the_values_of_counting_each_batch(steps, reads, seed):
    reference = Reference()
    meter = reference.fast
    held = StreamMetrics(acc=accuracy)
    acc = held["acc"]  # a reference taken before the updates sees them
    for index, (rows, classes, n) in enumerate(steps):
        scores, labels = labels_and_scores(rows, classes, seed + index, -1 if index % 29 == 3 else None)
        reference.update(scores, labels, n)
        held.update(scores, labels, n=n)
        if index in reads:  # a read in the middle counts what is kept, and changes nothing after it
            assert same(meter.val, reference.slow.val) and same(acc.avg, reference.slow.avg)
    assert type(meter).__name__ == "_HostMetricMeter" and repr(meter) == "MetricMeter(accuracy)"
    assert_same_meter(meter, reference.slow)
    assert_same_meter(acc, reference.slow)


def test_kept_batches_survive_copies_and_are_dropped_by_reset_and_loads():
    meter, reference = MetricMeter(accuracy), MetricMeter(tensor_path)
    for seed in range(10):
        batch = labels_and_scores(32, 4, seed, None)
        meter.update(*batch)
        reference.update(*batch)
    assert len(meter.__dict__["_deferred"]) == 10  # kept, not counted yet
    assert_same_meter(pickle.loads(pickle.dumps(meter)), reference)
    assert_same_meter(copy.deepcopy(meter), reference)
    state = reference.state_dict()
    meter.update(*labels_and_scores(32, 4, 99, None))
    meter.load_state_dict(state)  # the state replaces everything, the kept batch included
    assert_same_meter(meter, reference)
    meter.update(*labels_and_scores(32, 4, 98, None))
    meter.reset()
    assert meter.count == 0 and math.isnan(meter.avg)
    meter.update(*labels_and_scores(32, 4, 97, None))
    meter.metric = tensor_path  # the kept batch is counted with the metric it was given to
    assert type(meter) is MetricMeter and meter.count == 32 and type(meter._val) is float
    meter.metric = accuracy
    assert type(meter).__name__ == "_HostMetricMeter" and meter.count == 32


def test_a_meter_of_shaped_values_refuses_a_batch_at_its_update():
    meter = MetricMeter(accuracy)
    AverageMeter.update(meter, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"shape \(\).*\(2,\)"):
        meter.update(*labels_and_scores(32, 4, 0, None))


def test_subclasses_of_metric_meter_keep_their_class_and_count_each_batch():
    class Mine(MetricMeter):
        pass

    meter = Mine(accuracy)
    meter.update(*labels_and_scores(32, 4, 0, None))
    assert type(meter) is Mine and "_deferred" not in meter.__dict__ and type(meter._val) is float


def test_kept_batches_hold_no_graph_and_count_after_inference_mode():
    meter, reference = MetricMeter(accuracy), MetricMeter(tensor_path)
    scores, labels = labels_and_scores(32, 4, 0, None)
    leaf = scores.clone().requires_grad_()
    meter.update(leaf * 2, labels)  # MetricMeter has no preprocessing: the scores arrive with their graph
    reference.update(scores * 2, labels)
    assert not meter.__dict__["_deferred"][0][0].requires_grad
    with torch.inference_mode():  # an evaluation pass keeps inference tensors, counted outside it
        batch = labels_and_scores(32, 4, 1, None)
        meter.update(*batch)
        reference.update(*batch)
    assert_same_meter(meter, reference)
