"""The per-batch and per-read shortcuts give exactly what the general code paths give."""

from __future__ import annotations

import math
import pickle
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from danling.metrics import AverageMeter, AverageMeters, MetricTask, multiclass_metrics
from danling.metrics import global_metrics as global_metrics_module
from danling.metrics import meter as meter_module
from danling.metrics.functional._common import label_counter
from danling.metrics.meter import sync_meters
from danling.utils import RoundDict, rounding
from danling.utils.rounding import row_builder
from tests.metrics._compare import same

CLASSIFICATION = ["acc", "balanced_acc", "precision", "recall", "f1", "mcc", "confmat"]


def batches_strategy(num_classes: int):
    """Batches of float32 scores and int64 targets: classes plus values that are ignored or invalid."""
    target = st.sampled_from([*range(num_classes), -100, -1, num_classes, 0])
    row = st.lists(st.floats(-3, 3, width=32), min_size=num_classes, max_size=num_classes)
    batch = st.integers(0, 6).flatmap(
        lambda n: st.tuples(st.lists(row, min_size=n, max_size=n), st.lists(target, min_size=n, max_size=n))
    )
    return st.lists(batch, min_size=1, max_size=4)


@settings(max_examples=50, deadline=None)
@given(
    num_classes=st.integers(1, 4),
    ignore_index=st.sampled_from([-100, None, 0, 7]),
    data=st.data(),
)
def test_plain_multiclass_batches_count_like_the_general_path(num_classes, ignore_index, data):
    # Per batch: the dtype (a change counts the queue first) and whether the scores carry autograd.
    dtypes = data.draw(st.lists(st.sampled_from([torch.float32, torch.float64]), min_size=4, max_size=4))
    grads = data.draw(st.lists(st.booleans(), min_size=4, max_size=4))
    batches = [
        (torch.tensor(x, dtype=dtype).reshape(-1, num_classes).requires_grad_(grad), torch.tensor(y, dtype=torch.long))
        for (x, y), dtype, grad in zip(data.draw(batches_strategy(num_classes)), dtypes, grads)
    ]
    fast = multiclass_metrics(num_classes, CLASSIFICATION, ignore_index=ignore_index)
    general = multiclass_metrics(num_classes, CLASSIFICATION, ignore_index=ignore_index)
    assert fast._plain_store is not None  # the short path of GlobalMetrics.update applies
    for input, target in batches:
        fast.update(input, target)
    pending = fast._plain_store.pending
    assert not any(source.requires_grad for source, _ in pending)
    assert len({source.dtype for source, _ in pending}) <= 1 and pending[-1][0].dtype is batches[-1][0].dtype
    # Every batch through MetricTask.format and MetricTask.predicted_labels instead.
    general._plain_store = None
    with mock.patch.object(global_metrics_module, "_plain_multiclass", lambda *args: False):
        for input, target in batches:
            general.update(input, target)
    (fast_store,), (general_store,) = fast._stores.values(), general._stores.values()
    assert torch.equal(fast_store.counts, general_store.counts)
    for kind in ("val", "avg"):
        fast_values, general_values = fast.read(kind), general.read(kind)
        assert fast_values[1] == general_values[1]
        assert all(same(fast_values[0][k], general_values[0][k]) for k in CLASSIFICATION), kind
    # Both agree with the confusion counts of all data at once.
    task = MetricTask("multiclass", num_classes=num_classes, ignore_index=ignore_index)
    reference = task.confusion(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
    assert torch.equal(fast_store.confusion.matrix, reference.matrix)
    assert int(fast_store.confusion.invalid) == int(reference.invalid)


@pytest.mark.parametrize(
    ("kind", "size", "input", "target"),
    [
        ("binary", None, torch.tensor([0.2, 0.7, -1.5, 3.0]), torch.tensor([0, 1, 1, -100])),
        ("multiclass", 3, torch.tensor([[0.2, 0.7, 0.1], [2.0, -1.0, 0.5]]), torch.tensor([1, 4])),
        ("multilabel", 2, torch.tensor([[0.2, 0.7], [0.9, 0.6]]), torch.tensor([[0, 1], [1, -100]])),
    ],
)
def test_task_label_counter_is_what_confusion_counter_returns(kind, size, input, target):
    sizes = {"multiclass": "num_classes", "multilabel": "num_labels"}
    task = MetricTask(kind, ignore_index=-100, **({sizes[kind]: size} if size else {}))
    input, target = task.format(input, target)
    counter, pred = task.confusion_counter(input)
    assert task.label_counter() is counter
    assert torch.equal(task.predicted_labels(input), pred)
    with pytest.raises(ValueError, match="regression"):
        MetricTask("regression", num_outputs=1).label_counter()
    with pytest.raises(ValueError, match="size"):
        MetricTask("multiclass").label_counter()


def test_copied_confusion_does_not_follow_the_counts_and_counts_invalid_rows():
    counter = label_counter(3, -100)
    counts = counter.count(torch.tensor([0, 1, 2, 2]), torch.tensor([0, -100, 9, -5]))
    view, copy = counter.confusion(counts), counter.confusion(counts, copy=True)
    assert torch.equal(view.matrix, copy.matrix) and int(copy.invalid) == 2
    counts += 1
    assert not torch.equal(view.matrix, copy.matrix)  # the view sees the change, the copy does not
    assert int(copy.invalid) == 2


@pytest.mark.parametrize(
    "values",
    [
        {"loss": 0.25, "acc": 1, "flag": True, "none": None},
        {"f1": torch.tensor([0.5, 0.25]), "nan": math.nan},
        {},
    ],
)
def test_round_dict_of_flat_results_is_the_round_dict_constructor(values):
    fast, general = RoundDict.from_flat(values), RoundDict(values)
    assert type(fast) is RoundDict and list(fast) == list(general)
    assert all(same(fast[key], general[key]) for key in values)
    assert vars(fast).keys() == vars(general).keys()
    assert repr(fast) == repr(general) and f"{fast:.2f}" == f"{general:.2f}"
    assert repr(round(fast, 1)) == repr(round(general, 1))
    assert repr(pickle.loads(pickle.dumps(fast))) == repr(general)
    for key in values:
        assert same(getattr(fast, key), getattr(general, key))
    fast["extra"] = 1.0  # still an ordinary, mutable RoundDict
    assert fast.extra == 1.0 and fast.dict()["extra"] == 1.0


@pytest.mark.parametrize(
    "values",
    [
        {"val.acc": 0.5},
        {"items": 0.5},
        {"seq": [0.1, 0.2]},
        {1: 0.5},
        {"deep": {"er": {"acc": 0.5}}},
        {"empty": {}},
        {"val": {"a.b": 0.5}},
        {"val": {"items": 0.5}},
    ],
)
def test_round_dict_falls_back_to_the_constructor_for_anything_else(values):
    assert RoundDict.from_flat(values).dict() == RoundDict(values).dict()


@pytest.mark.parametrize(
    ("keys", "checked"),
    [(["acc", "f1"], True), (["acc", "items"], False), (["acc", "val.f1"], False), ([1], False)],
)
def test_a_row_builder_checks_its_keys_once_and_builds_what_from_flat_builds(keys, checked):
    # Keys that pass are checked here, not at each build; any other key keeps `from_flat`.
    build = row_builder(keys)
    assert (build is rounding._build) is checked
    for values in ({key: 0.5 for key in keys}, {key: torch.tensor([0.25, 1.0]) for key in keys}):
        built = build(values)
        assert type(built) is RoundDict and repr(built) == repr(RoundDict.from_flat(values))
        assert vars(built).keys() == vars(RoundDict.from_flat(values)).keys()


@pytest.mark.parametrize(
    "row",
    [
        {"train": {"loss": 0.25, "acc": torch.tensor(0.5)}, "val": {"loss": math.nan}},
        {"val": {"acc": 1}, "epoch": 3, "note": None},
    ],
)
def test_round_dict_of_a_result_row_is_the_round_dict_constructor(row):
    # A row of split -> metrics (what the loops store every epoch) takes the shortcut too.
    fast, general = RoundDict.from_flat(row), RoundDict(row)
    assert repr(fast) == repr(general) and f"{fast:.2f}" == f"{general:.2f}"
    assert repr(pickle.loads(pickle.dumps(fast))) == repr(general)
    for key, value in row.items():
        if isinstance(value, dict):
            assert type(fast[key]) is RoundDict and vars(fast[key]).keys() >= vars(general[key]).keys()
            assert getattr(fast, key) is fast[key]
            for name in value:
                assert same(fast[key][name], general[key][name]) and same(fast[f"{key}.{name}"], general[key][name])
    # A copy: later changes to the source mappings do not reach the row.
    for value in row.values():
        if isinstance(value, dict):
            value["added"] = 1.0
    assert all("added" not in value for value in fast.values() if isinstance(value, dict))


def test_meters_average_read_matches_the_synchronised_path():
    meters = AverageMeters()
    meters.update(loss=torch.tensor(0.1), time=0.5)
    meters.update(loss=torch.tensor(0.3, requires_grad=True) * 1)
    meters["vector"] = AverageMeter()
    meters.vector.update(torch.tensor([1.0, 3.0]), n=2)
    meters["unused"] = AverageMeter()
    values, counts = meters.read("avg")
    synced = sync_meters(list(meters.values()))
    assert list(values) == list(meters)
    for name, expected in zip(meters, synced):
        assert same(values[name], expected.avg), name
        assert counts[name] == expected.count
    assert same(meters.avg["unused"], math.nan) and meters.avg["loss"] == pytest.approx(0.2)


@settings(max_examples=30, deadline=None)
@given(
    values=st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=8),
    weights=st.lists(st.integers(0, 3), min_size=8, max_size=8),
)
def test_meter_tensor_sums_are_float64_sums_of_every_update(values, weights):
    # Queued 0-d values are summed in groups: the same float64 accumulation as one fused add per
    # update, up to the order of the roundings.
    meter = AverageMeter()
    expected = None
    for value, n in zip(values, weights):
        value = torch.tensor(value)
        if n == 1:
            meter.update(value)
        else:
            meter.update(value, n=n)
        step = value.to(torch.float64) * n
        expected = step if expected is None else torch.add(expected, value, alpha=n)
    scale = sum(abs(v) * n for v, n in zip(values, weights))
    assert meter._sum.dtype == torch.float64
    # At most two roundings per value: into its group, and the group into the sum.
    assert meter._sum.item() == pytest.approx(expected.item(), rel=0, abs=4e-15 * scale)
    assert meter.count == sum(weights[: len(values)])


@settings(max_examples=50, deadline=None)
@given(
    total=st.one_of(st.floats(-1e6, 1e6), st.floats(-1e40, 1e40), st.just(math.inf), st.just(math.nan)),
    count=st.one_of(st.integers(1, 10**9), st.floats(0.5, 100)),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64]),
)
def test_meter_average_of_a_scalar_sum_is_the_tensor_division(total, count, dtype):
    meter = AverageMeter()
    meter._sum, meter._count, meter._val = torch.tensor(total, dtype=torch.float64), count, torch.ones((), dtype=dtype)
    expected = meter_module._to_python(meter_module._restore_dtype(meter._sum / count, meter._val))
    assert same(meter.avg, expected)


def test_a_task_hashes_its_fields_once_and_never_pickles_the_hash():
    import copy
    import pickle
    import subprocess
    import sys

    from danling.metrics import MetricTask

    task = MetricTask("multiclass", num_classes=3, ignore_index=-100)
    assert hash(task) == hash(MetricTask("multiclass", num_classes=3, ignore_index=-100.0))  # equal tasks
    assert task.__dict__["_hash"] == hash(task)  # kept after the first hash
    assert hash(task) != hash(MetricTask("multiclass", num_classes=4, ignore_index=-100))
    for restored in (pickle.loads(pickle.dumps(task)), copy.copy(task), copy.deepcopy(task)):
        assert "_hash" not in restored.__dict__ and restored == task and {task: 1}[restored] == 1
    # Another process hashes strings differently: a pickled hash would miss its equal there.
    code = (
        "import pickle, sys; from danling.metrics import MetricTask; "
        "task = pickle.loads(sys.stdin.buffer.read()); "
        "print({MetricTask('multiclass', num_classes=3, ignore_index=-100): 1}.get(task))"
    )
    done = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(task), capture_output=True, check=True)
    assert done.stdout.decode().strip() == "1"
