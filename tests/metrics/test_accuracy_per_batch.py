"""The per-batch accuracy of a training loop takes short paths that give the general paths' values.

`accuracy(scores, target)` with no options, on float `(N, C)` scores and int64 labels, skips the
task dispatch; micro accuracy of int64 targets with nothing ignored compares up to
`HOST_COUNT_SIZE` labels as Python lists on CPU, checks larger batches with one host read (or one
device-side check off the host); and a meter fed values of one batch size queues them like the
per-step loss. Each is compared with the general path, on every branch.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from danling.metrics import AverageMeter, StreamMetrics
from danling.metrics.functional import _common, accuracy, binary_accuracy
from danling.metrics.functional.multiclass import _confusion, accuracy_from_confusion, multiclass_accuracy
from tests.metrics._compare import CountOps, same
from tests.metrics.test_no_host_sync import ForbidHostSync


def general(input, target):
    """Micro accuracy through the confusion matrix: the path the short ones must agree with."""
    return accuracy_from_confusion(_confusion(input, target, None, None), "micro")


# How each branch is forced: (devices whose values are read on the host, largest list-compared batch).
BRANCHES = {
    "python lists": (("cpu",), 10**9),
    "host read": (("cpu",), 0),
    "device check": ((), 10**9),
}


@pytest.fixture(params=list(BRANCHES))
def branch(request, monkeypatch):
    host, size = BRANCHES[request.param]
    monkeypatch.setattr(_common, "HOST_READ_DEVICES", host)
    monkeypatch.setattr(_common, "HOST_COUNT_SIZE", size)
    return request.param


g = torch.Generator().manual_seed(0)
SCORES = torch.randn(32, 10, generator=g)
TARGET = torch.randint(0, 10, (32,), generator=g)
CASES = {
    "plain": (SCORES, TARGET),
    "target above the classes": (SCORES, torch.cat([TARGET[:-1], torch.tensor([10])])),
    "negative target": (SCORES, torch.cat([torch.tensor([-1]), TARGET[1:]])),
    "-100 without ignore_index": (SCORES, torch.full((32,), -100)),
    "largest int64 target": (SCORES, torch.cat([TARGET[:-1], torch.tensor([2**63 - 1])])),
    "smallest int64 target": (SCORES, torch.cat([TARGET[:-1], torch.tensor([-(2**63)])])),
    "one sample": (SCORES[:1], TARGET[:1]),
    "empty batch": (torch.randn(0, 10), torch.zeros(0, dtype=torch.long)),
    "nan scores": (torch.where(SCORES > 1, math.nan, SCORES), TARGET),
    "ties": (torch.zeros(32, 10), TARGET),
    "float64 scores": (SCORES.double(), TARGET),
    "scores needing grad": (SCORES.clone().requires_grad_(), TARGET),
    "non-contiguous scores": (torch.randn(10, 32, generator=g).T, TARGET),
    "many classes": (torch.randn(32, 1000, generator=g), torch.randint(0, 1000, (32,), generator=g)),
    "probabilities": (SCORES.softmax(-1), TARGET),
    "large batch": (torch.randn(300_007, 3, generator=g), torch.randint(0, 3, (300_007,), generator=g)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_accuracy_without_options_equals_the_general_path(case, branch):
    input, target = CASES[case]
    expected = general(input, target)
    assert same(accuracy(input, target), expected)
    assert same(multiclass_accuracy(input, target), expected)
    assert same(multiclass_accuracy(input, target, average="weighted"), expected)


def test_inputs_outside_the_short_path_keep_their_task():
    binary, labels = torch.rand(32, 1, generator=g), torch.randint(0, 2, (32, 1), generator=g)
    assert same(accuracy(binary, labels), binary_accuracy(binary, labels))
    one_column = torch.rand(32, 1, generator=g)
    assert same(accuracy(one_column, labels.squeeze(-1)), binary_accuracy(one_column, labels.squeeze(-1)))
    int32 = TARGET.int()
    assert same(accuracy(SCORES, int32), general(SCORES, int32))
    assert same(
        accuracy(SCORES, TARGET, average="macro"),
        accuracy_from_confusion(_confusion(SCORES, TARGET, 10, None), "macro"),
    )
    assert same(
        accuracy(SCORES, TARGET, ignore_index=3), accuracy_from_confusion(_confusion(SCORES, TARGET, 10, 3), "micro")
    )
    with pytest.raises(ValueError, match="task must be one of"):
        accuracy(SCORES, TARGET, task="multi")


@settings(max_examples=60, deadline=None)
@given(
    num_classes=st.integers(1, 5),
    data=st.data(),
)
def test_random_batches_equal_the_general_path(num_classes, data):
    n = data.draw(st.integers(0, 8))
    rows = data.draw(
        st.lists(
            st.lists(st.floats(-3, 3, width=32), min_size=num_classes, max_size=num_classes), min_size=n, max_size=n
        )
    )
    labels = data.draw(st.lists(st.sampled_from([*range(num_classes), -100, -1, num_classes]), min_size=n, max_size=n))
    input = torch.tensor(rows, dtype=torch.float32).reshape(n, num_classes)
    target = torch.tensor(labels, dtype=torch.long)
    expected = general(input, target)
    saved = _common.HOST_READ_DEVICES, _common.HOST_COUNT_SIZE
    for host, size in BRANCHES.values():
        _common.HOST_READ_DEVICES, _common.HOST_COUNT_SIZE = host, size
        try:
            assert same(multiclass_accuracy(input, target), expected)
            if num_classes > 1:
                assert same(accuracy(input, target), expected)
        finally:
            _common.HOST_READ_DEVICES, _common.HOST_COUNT_SIZE = saved


def test_stream_metrics_of_accuracy_equal_the_general_path(branch):
    fast, slow = StreamMetrics(acc=accuracy), StreamMetrics(acc=general)
    sizes = [32, 32, 32, 7, 32, 32, 1, 1, 32, 64, 65, 300, 32]
    for i, size in enumerate(sizes):
        input, target = torch.randn(size, 10, generator=g), torch.randint(0, 10, (size,), generator=g)
        if i == 4:
            target[0] = 11  # an invalid batch: nan, weighted like any other
        fast.update(input, target)
        slow.update(input, target)
        assert same(fast["acc"].val, slow["acc"].val)
    for name in ("val", "avg", "sum", "count"):
        assert same(getattr(fast, name)["acc"], getattr(slow, name)["acc"]), name


def test_host_read_is_taken_on_cpu_and_device_check_reads_nothing(monkeypatch):
    with pytest.raises(AssertionError, match="host synchronisation"), ForbidHostSync():
        accuracy(SCORES, TARGET)
    monkeypatch.setattr(_common, "HOST_READ_DEVICES", ())
    metrics = StreamMetrics(acc=accuracy)
    with ForbidHostSync():
        accuracy(SCORES, TARGET)
        multiclass_accuracy(SCORES, TARGET)
        metrics.update(SCORES, TARGET)
        metrics.update(SCORES, TARGET)


@pytest.mark.parametrize("weights", [[32] * 5, [32, 32, 7, 32, 32], [1, 32, 32, 1, 1], [32, 0, 32, 32, 3]])
def test_meter_queues_values_of_one_batch_size_like_the_general_path(weights):
    values = [torch.tensor(v, dtype=torch.float64) for v in (0.25, 0.5, 0.1, 0.125, 1.0)]
    meter = AverageMeter()
    total, count = torch.zeros((), dtype=torch.float64), 0
    for value, n in zip(values, weights):
        meter.update(value, n)
        assert same(meter.val, value.item()) and meter.count == (count := count + n)
        if n:
            total = total + value * n
    assert same(meter.sum, total.item()) and meter.count == sum(weights)
    assert same(meter.avg, (total / count).item())


def test_stream_accuracy_of_small_cpu_batches_dispatches_one_argmax_per_64_batches():
    # In a training step every dispatched op costs several microseconds (its code has left the
    # caches): the per-batch accuracy of a small CPU batch is kept and counted with the next 63,
    # with one `cat` per side and one `argmax`, where the hand-written
    # `correct += (logits.argmax(-1) == target).sum()` issues four ops per batch. Its values wait
    # in the meter as floats; the meter's queue adds a few ops per 64 updates.
    metrics = StreamMetrics(acc=accuracy)
    metrics.update(SCORES, TARGET)
    with CountOps() as counted:
        metrics.update(SCORES, TARGET)
    assert counted.ops == []
    with CountOps() as counted:
        for _ in range(62):
            metrics.update(SCORES, TARGET)
    # The 64th batch: the kept ones are counted, and their 64 values fill the meter's queue.
    assert counted.ops[:3] == ["cat.default", "argmax.default", "cat.default"] and len(counted.ops) <= 3 + 4
    assert same(metrics.avg["acc"], general(SCORES, TARGET).item())
