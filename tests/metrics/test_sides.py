"""Binary AUROC / AUPRC stores that keep host scores by label (`danling.metrics.sides`).

The catalogue's AUROC and AUPRC read the data as an unordered set of (score, label) pairs
(`requires="ranking"`), so a binary `GlobalMetrics` of them keeps each side's scores in one growing
array, sorted in place at each read: no targets and no sorted copy. Each test compares it with a
store that keeps the same batches in order (another metric of the task reads `"data"`).
"""

import copy
import math
import pickle

import numpy as np
import pytest
import torch
from sklearn import metrics as skm

from danling.metrics import GlobalMetrics, MetricFunc, binary_metrics
from danling.metrics.sides import BinarySides, HostBuffer

NAMES = ["acc", "f1", "auroc", "auprc"]


def in_order(names=NAMES, **kwargs):
    catalogue = binary_metrics(names, **kwargs).metrics
    task = next(iter(catalogue.values())).task
    return GlobalMetrics(**catalogue, ordered=MetricFunc("ordered", lambda state: 0.0, task, "data"))


def by_label(names=NAMES, **kwargs):
    return binary_metrics(names, **kwargs)


def batches(count=12, size=1000, seed=0):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        target = torch.randint(0, 2, (size,), generator=generator)
        yield torch.randn(size, generator=generator) + target, target


def values(metrics, kind="avg"):
    read = dict(getattr(metrics, kind))
    read.pop("ordered", None)
    return read


def assert_same(ours, theirs):
    assert ours.keys() == theirs.keys()
    for name in ours:
        if math.isnan(theirs[name]):
            assert math.isnan(ours[name]), name
        else:
            assert ours[name] == pytest.approx(theirs[name], rel=1e-12, abs=1e-12), name


def test_the_store_keeps_each_sides_scores_and_no_targets():
    metrics, reference = by_label(), in_order()
    data = list(batches())
    for input, target in data:
        metrics.update(input, target)
        reference.update(input, target)
        assert_same(values(metrics, "val"), values(reference, "val"))
    (store,) = metrics._stores.values()
    assert store.sides is not None and not store.chunks and not store.inputs
    scores, target = torch.cat([i for i, _ in data]), torch.cat([t for _, t in data])
    assert store.sides.nbytes == scores.numel() * 4  # float32 scores, nothing for the labels
    result = values(metrics)
    assert_same(result, values(reference))
    assert result["auroc"] == pytest.approx(skm.roc_auc_score(target, scores), abs=1e-12)
    assert result["auprc"] == pytest.approx(skm.average_precision_score(target, scores), abs=1e-12)


def test_a_read_sorts_the_sides_in_place_and_later_batches_append_after_them():
    metrics, reference = by_label(["auroc", "auprc"]), in_order(["auroc", "auprc"])
    data = list(batches(count=20, size=512, seed=1))
    for input, target in data[:10]:
        metrics.update(input, target)
        reference.update(input, target)
    (store,) = metrics._stores.values()
    address = store.sides.positives.array().ctypes.data
    assert_same(values(metrics), values(reference))
    positives = store.sides.positives.array()
    assert positives.ctypes.data == address  # sorted where it lies: no copy
    assert np.all(positives[1:] >= positives[:-1])
    del positives
    for input, target in data[10:]:
        metrics.update(input, target)
        reference.update(input, target)
    assert_same(values(metrics), values(reference))


@pytest.mark.parametrize("spoil", ["none", "ignored", "invalid", "nan score", "nan ignored score", "one side"])
@pytest.mark.parametrize("size", [300, 12_000])  # under and over the size where copies are ranked (8,192)
def test_ignored_rows_invalid_targets_and_nan_scores_read_as_in_order(spoil, size):
    generator = torch.Generator().manual_seed(2)
    scores = torch.rand(size, generator=generator)
    target = (torch.rand(size, generator=generator) < scores).long()
    target[::9] = -100
    if spoil == "invalid":
        target[5] = 2
    if spoil == "nan score":
        scores[4] = float("nan")
    if spoil == "nan ignored score":
        scores[9] = float("nan")
    if spoil == "one side":
        target[target == 0] = 1
    metrics, reference = by_label(), in_order()
    half = size // 2
    for part in (slice(0, half), slice(half, None)):
        metrics.update(scores[part], target[part])
        reference.update(scores[part], target[part])
    for kind in ("val", "avg"):
        assert_same(values(metrics, kind), values(reference, kind))
    expect_nan = spoil in ("invalid", "nan score", "one side")
    assert math.isnan(values(metrics)["auroc"]) == expect_nan


def test_a_float64_batch_widens_the_kept_scores():
    metrics, reference = by_label(), in_order()
    for index, (input, target) in enumerate(batches(count=4, seed=3)):
        input = input.double() if index == 2 else input
        metrics.update(input + 1e-9 * index, target)
        reference.update(input + 1e-9 * index, target)
    (store,) = metrics._stores.values()
    assert store.sides.positives.dtype == np.float64
    assert_same(values(metrics), values(reference))


def test_checkpoints_pickles_and_copies_continue_with_the_same_values():
    metrics = by_label()
    data = list(batches(count=6, seed=4))
    for input, target in data[:3]:
        metrics.update(input, target)
    assert values(metrics)  # a read reorders the kept scores: what follows must not depend on it
    state = metrics.state_dict()
    restored = by_label()
    restored.load_state_dict(state)
    copies = [restored, pickle.loads(pickle.dumps(metrics)), copy.deepcopy(metrics)]
    for other in copies:
        assert_same(values(other, "val"), values(metrics, "val"))
        assert_same(values(other), values(metrics))
    for input, target in data[3:]:
        for each in [metrics, *copies]:
            each.update(input, target)
    for other in copies:
        assert_same(values(other, "val"), values(metrics, "val"))
        assert_same(values(other), values(metrics))


def test_a_view_alive_across_updates_makes_growth_copy_and_keeps_both_right():
    metrics, reference = by_label(["auroc"]), in_order(["auroc"])
    data = list(batches(count=40, size=300, seed=5))
    metrics.update(*data[0])
    reference.update(*data[0])
    (store,) = metrics._stores.values()
    held = store.sides.chunks()  # views of the maps, as a state holds them during a read
    before = [scores.clone() for scores, _ in held]
    for input, target in data[1:]:
        metrics.update(input, target)
        reference.update(input, target)
    assert all(torch.equal(scores, old) for (scores, _), old in zip(held, before))
    assert_same(values(metrics), values(reference))


def test_host_buffer_grows_without_losing_values():
    buffer = HostBuffer(np.float32)
    expected = []
    for step in range(50):
        values_ = np.arange(step * 37, dtype=np.float32)
        buffer.append(values_)
        expected.append(values_)
    assert np.array_equal(buffer.array(), np.concatenate(expected))
    assert buffer.nbytes == sum(v.size for v in expected) * 4


def test_batches_on_another_device_are_kept_in_order_and_a_mix_is_refused():
    metrics = binary_metrics(["auroc"])
    metrics.update(torch.rand(16, device="meta"), torch.randint(0, 2, (16,), device="meta"))
    (store,) = metrics._stores.values()
    assert store.sides is None and store.inputs  # split by label would read the device
    sides = BinarySides(-100)
    with pytest.raises(ValueError, match="keeps host scores, but a batch came on meta"):
        sides.add(torch.rand(4, device="meta"), torch.zeros(4, dtype=torch.long, device="meta"))
