"""`StreamMetrics.update` takes a short path for plain tensors and plain metric functions.

It skips `base_preprocess` for plain tensors and calls plain functions without the meter's call
layers. Every case here is compared exactly with the general path: each `MetricMeter` fed the
preprocessed batch through `update_preprocessed`, sharing one state dict per batch.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from danling.metrics import MetricMeter, MetricTask, StreamMetrics
from danling.metrics import functional as F
from danling.metrics.factories import metric_funcs
from danling.metrics.preprocess import base_preprocess
from tests.metrics._compare import same


def multiclass_specs(num_classes: int) -> dict:
    task = MetricTask("multiclass", num_classes=num_classes, ignore_index=-100)
    return {
        "acc": F.accuracy,
        "acc_ignore": lambda x, y: F.accuracy(x, y, ignore_index=-100),
        "acc_macro": lambda x, y: F.accuracy(x, y, num_classes=num_classes, average="macro"),
        "f1": lambda x, y: F.multiclass_f1_score(x, y, num_classes=num_classes, ignore_index=-100),
        **metric_funcs(task, ["acc", "f1", "mcc"]),  # share one state per batch
    }


SPECS = {
    "binary": lambda size: {"acc": F.accuracy, "acc_ignore": lambda x, y: F.accuracy(x, y, ignore_index=-100)},
    "multiclass": multiclass_specs,
    "multilabel": lambda size: {
        "acc": lambda x, y: F.accuracy(x, y, task="multilabel"),
        **metric_funcs(MetricTask("multilabel", num_labels=size), ["acc", "f1"]),
    },
}


def batch(kind: str, size: int, rows: int, data) -> tuple[torch.Tensor, torch.Tensor]:
    """Random NaN-free scores and labels of `kind`, with ignored and (multiclass) invalid labels."""
    seed = data.draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    if kind == "binary":
        scores, labels = torch.randn(rows, generator=g), torch.randint(0, 2, (rows,), generator=g)
    elif kind == "multiclass":
        scores, labels = torch.randn(rows, size, generator=g), torch.randint(0, size, (rows,), generator=g)
    else:
        scores, labels = torch.randn(rows, size, generator=g), torch.randint(0, 2, (rows, size), generator=g)
    special = data.draw(st.sampled_from([None, -100, -1, size]))
    if special is not None and rows and (kind == "multiclass" or special == -100):
        labels.view(-1)[data.draw(st.integers(0, labels.numel() - 1))] = special
    if data.draw(st.booleans()):
        scores = scores.double()
    return scores, labels


def general(specs: dict, batches: list, preprocess=base_preprocess) -> dict[str, MetricMeter]:
    meters = {name: MetricMeter(metric) for name, metric in specs.items()}
    for input, target, n in batches:
        if preprocess is not None:
            input, target = preprocess(input, target)
        states: dict = {}
        for meter in meters.values():
            meter.update_preprocessed(input, target, n=n, states=states)
    return meters


def assert_same(metrics: StreamMetrics, meters: dict[str, MetricMeter]) -> None:
    for name, meter in meters.items():
        for kind in ("val", "avg", "sum", "count"):
            assert same(getattr(metrics[name], kind), getattr(meter, kind)), (name, kind)


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(list(SPECS)), size=st.integers(2, 5), data=st.data())
def test_plain_tensors_give_the_values_of_the_general_path(kind, size, data):
    specs = SPECS[kind](size)
    batches = []
    for _ in range(data.draw(st.integers(1, 4))):
        scores, labels = batch(kind, size, data.draw(st.sampled_from([1, 3, 32, 64, 65, 130])), data)
        if data.draw(st.booleans()):
            scores = scores.requires_grad_()  # the short path detaches as base_preprocess does
        batches.append((scores, labels, data.draw(st.sampled_from([None, None, 5]))))
    metrics = StreamMetrics(**specs)
    for input, target, n in batches:
        metrics.update(input, target, n=n)
    assert_same(metrics, general(specs, batches))
    assert not any(isinstance(metrics[name]._val, torch.Tensor) and metrics[name]._val.requires_grad for name in specs)


def test_other_inputs_and_preprocessing_take_the_general_path():
    specs = multiclass_specs(3)
    lists = ([[0.2, 0.5, 0.3], [0.9, 0.05, 0.05]], [1, 2], None)
    tensors = (torch.tensor([[0.1, 0.2, 3.0], [2.0, 0.0, 1.0], [0.0, 1.0, 0.5]]), torch.tensor([2, 1, -100]), None)
    metrics = StreamMetrics(**specs)
    for input, target, n in (lists, tensors):
        metrics.update(input, target, n=n)
    assert_same(metrics, general(specs, [lists, tensors]))

    def flip(input, target):  # a user preprocess still runs on plain tensors
        input, target = base_preprocess(input, target)
        return -input, target

    flipped = StreamMetrics(acc=F.accuracy, preprocess=flip)
    flipped.update(*tensors[:2])
    assert_same(flipped, general({"acc": F.accuracy}, [tensors], preprocess=flip))
    assert flipped.val["acc"] != metrics.val["acc"]


def test_meters_that_are_not_metric_meters_are_refused():
    metrics = StreamMetrics(acc=F.accuracy)
    metrics._meters["plain"] = object()
    with pytest.raises(TypeError, match="can only update MetricMeters, found object"):
        metrics.update(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))
