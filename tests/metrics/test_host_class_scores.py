"""Confusion metrics of small multiclass CPU batches are counted from Python lists, with the same values.

Covered: precision, recall and F1 (every average), balanced accuracy and MCC.

Each case runs the same call twice: with the host path (batches up to `HOST_CONFUSION_SIZE`
labels) and with it switched off (`HOST_CONFUSION_SIZE = 0`, the confusion-matrix path; accuracy's
`HOST_COUNT_SIZE = 0` too), and compares the
results exactly: dtype, shape, every bit, `nan` where the general path gives `nan`.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from danling.metrics import StreamMetrics, multiclass_metrics
from danling.metrics import functional as F
from danling.metrics.functional import _common
from tests.metrics._compare import CountOps, same

FUNCTIONS = {
    "precision": (F.precision, F.multiclass_precision),
    "recall": (F.recall, F.multiclass_recall),
    "f1": (F.f1_score, F.multiclass_f1_score),
    "balanced_accuracy": (F.balanced_accuracy, F.multiclass_balanced_accuracy),
    "mcc": (F.mcc, F.multiclass_mcc),
}
UNAVERAGED = ("balanced_accuracy", "mcc")  # one definition each: no `average`
AVERAGES = ["default", "macro", "weighted", "micro", None, "none"]


def both_paths(call):
    """`call()` through the host path and through the confusion matrix."""
    fast = call()
    saved = _common.HOST_COUNT_SIZE, _common.HOST_CONFUSION_SIZE
    _common.HOST_COUNT_SIZE = _common.HOST_CONFUSION_SIZE = 0
    try:
        general = call()
    finally:
        _common.HOST_COUNT_SIZE, _common.HOST_CONFUSION_SIZE = saved
    return fast, general


def assert_same_on_both_paths(which, input, target, average, num_classes=None, ignore_index=None):
    generic, multiclass = FUNCTIONS[which]
    if which in UNAVERAGED and average != "default":
        return
    options = {} if average == "default" else {"average": average}
    calls = [
        lambda: generic(input, target, num_classes=num_classes, ignore_index=ignore_index, **options),
        lambda: multiclass(input, target, num_classes, ignore_index=ignore_index, **options),
    ]
    for call in calls:
        fast, general = both_paths(call)
        assert same(fast, general), (which, average, fast, general)


@settings(max_examples=150, deadline=None)
@given(
    which=st.sampled_from(list(FUNCTIONS)),
    average=st.sampled_from(AVERAGES),
    classes=st.integers(2, 40),
    rows=st.integers(1, 256),
    ignore_index=st.sampled_from([None, -100, 0, 1, 99]),
    data=st.data(),
)
def test_random_small_batches_equal_the_confusion_matrix_path(which, average, classes, rows, ignore_index, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    input = torch.randn(rows, classes, generator=g, dtype=data.draw(st.sampled_from([torch.float32, torch.float64])))
    # Few distinct labels make absent and never-predicted classes common (the 0/0 cases).
    target = torch.randint(0, data.draw(st.integers(1, classes)), (rows,), generator=g)
    for _ in range(data.draw(st.integers(0, 3))):
        target[data.draw(st.integers(0, rows - 1))] = data.draw(st.sampled_from([-100, -1, classes, 0, 1]))
    assert_same_on_both_paths(which, input, target, average, ignore_index=ignore_index)
    assert_same_on_both_paths(which, input, target, average, num_classes=classes, ignore_index=ignore_index)


g = torch.Generator().manual_seed(1)
SCORES = torch.randn(32, 10, generator=g)
TARGET = torch.randint(0, 10, (32,), generator=g)
CASES = {
    "plain": (SCORES, TARGET, {}),
    "one sample": (SCORES[:1], TARGET[:1], {}),
    "every target ignored": (SCORES, torch.full((32,), -100), {"ignore_index": -100}),
    "invalid target": (SCORES, torch.cat([TARGET[:-1], torch.tensor([10])]), {}),
    "largest int64 target": (SCORES, torch.cat([TARGET[:-1], torch.tensor([2**63 - 1])]), {}),
    "ignored class": (SCORES, TARGET, {"ignore_index": int(TARGET[0])}),
    "ignore_index as float": (SCORES, torch.where(TARGET == 1, -100, TARGET), {"ignore_index": -100.0}),
    "ties": (torch.zeros(32, 10), TARGET, {}),
    "nan scores": (torch.where(SCORES > 1, math.nan, SCORES), TARGET, {}),
    "scores needing grad": (SCORES.clone().requires_grad_(), TARGET, {}),
    "non-contiguous scores": (torch.randn(10, 32, generator=g).T, TARGET, {}),
    "at the size limit": (torch.randn(256, 5, generator=g), torch.randint(0, 5, (256,), generator=g), {}),
    "above the size limit": (torch.randn(257, 5, generator=g), torch.randint(0, 5, (257,), generator=g), {}),
    "num_classes given": (SCORES, TARGET, {"num_classes": 10}),
    "one class predicted": (torch.zeros(32, 10).index_fill_(1, torch.tensor([3]), 1.0), TARGET, {}),
    "one class in the target": (SCORES, torch.full((32,), 4), {}),
    "perfect": (torch.nn.functional.one_hot(TARGET, 10).float(), TARGET, {}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("which", list(FUNCTIONS))
@pytest.mark.parametrize("average", AVERAGES)
def test_edge_cases_equal_the_confusion_matrix_path(case, which, average):
    input, target, options = CASES[case]
    assert_same_on_both_paths(which, input, target, average, **options)


def test_bad_options_still_raise():
    with pytest.raises(ValueError, match="average must be one of"):
        F.f1_score(SCORES, TARGET, average="mean")
    with pytest.raises(ValueError, match="num_classes=5 does not match"):
        F.multiclass_precision(SCORES, TARGET, 5)


def test_a_small_batch_takes_a_handful_of_tensor_ops():
    metrics = StreamMetrics(f1=F.f1_score, precision=F.precision, recall=F.recall, balanced=F.balanced_accuracy)
    with CountOps() as counted:
        metrics.update(SCORES, TARGET)
    # Per metric: argmax, the per-class values, their average and the 0-d result (the
    # confusion-matrix path dispatches about thirty).
    assert len(counted.ops) <= 4 * 5, counted.ops
    with CountOps() as counted:
        F.mcc(SCORES, TARGET)
    assert counted.ops == [
        "argmax.default",
        "scalar_tensor.default",
        "sqrt.default",
        "_local_scalar_dense.default",
        "scalar_tensor.default",
    ]


STREAM_METRICS = ["acc", "balanced_acc", "precision", "recall", "f1", "mcc"]


@settings(max_examples=40, deadline=None)
@given(
    classes=st.integers(2, 12),
    ignore_index=st.sampled_from([None, -100, 0, 1.5]),
    average=st.sampled_from(["macro", "weighted", "micro", None]),
    data=st.data(),
)
def test_stream_multiclass_metrics_equal_the_confusion_matrix_path(classes, ignore_index, average, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    batches = []
    for _ in range(data.draw(st.integers(1, 4))):
        rows = data.draw(st.sampled_from([1, 5, 32, 64, 65, 256, 257]))
        target = torch.randint(0, classes, (rows,), generator=g)
        if data.draw(st.booleans()):
            target[data.draw(st.integers(0, rows - 1))] = data.draw(st.sampled_from([-100, -1, classes]))
        batches.append((torch.randn(rows, classes, generator=g), target))

    def run():
        container = multiclass_metrics(
            classes, STREAM_METRICS, mode="stream", average=average, ignore_index=ignore_index
        )
        for input, target in batches:
            container.update(input, target)
        return container

    fast, general = both_paths(run)
    for name in STREAM_METRICS:
        for kind in ("val", "avg", "sum", "count"):
            assert same(getattr(fast[name], kind), getattr(general[name], kind)), (name, kind)
