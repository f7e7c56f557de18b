"""`GlobalMetrics.avg` of confusion counts alone reads them straight into each metric's host form.

The general read builds a `MetricState` and calls each metric's `evaluate`, which reaches the
same host form with the same statistics. The short read must give the same values to the bit,
be taken only where it applies, and step aside whenever the container's metrics are no longer
the ones it was planned for.
"""

from __future__ import annotations

import pickle
from copy import deepcopy

import pytest
import torch

from danling.metrics import GlobalMetrics, MetricFunc, binary_metrics, multiclass_metrics, multilabel_metrics
from danling.metrics import global_metrics as gm
from danling.metrics.functional.multiclass import accuracy_from_confusion
from tests.metrics._compare import same

NAMES = ["acc", "balanced_acc", "precision", "recall", "f1", "mcc"]


def build(task: str, average, names=NAMES):
    if task == "binary":
        return binary_metrics(names)
    factory = multiclass_metrics if task == "multiclass" else multilabel_metrics
    return factory(4, metrics=names, average=average)


def feed(metrics, task: str, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    for rows in (37, 300, 5):
        if task == "binary":
            input, target = torch.rand(rows, generator=generator), torch.randint(0, 2, (rows,), generator=generator)
        else:
            input = torch.randn(rows, 4, generator=generator)
            shape = (rows,) if task == "multiclass" else (rows, 4)
            target = torch.randint(0, 3 if task == "multiclass" else 2, shape, generator=generator)
        target[0] = -100  # ignored
        metrics.update(input, target)


def general_average(metrics) -> dict:
    """`avg` through the general path: the same container with its short read switched off."""
    copy = deepcopy(metrics)
    copy._host_reads = None
    return copy.avg


class NoStates:
    """Fails the read if it builds a state: the short read builds none."""

    def __enter__(self):
        self.saved = gm._TaskStore.state
        gm._TaskStore.state = lambda *args, **kwargs: pytest.fail("the read built a MetricState")

    def __exit__(self, *exc):
        gm._TaskStore.state = self.saved


@pytest.mark.parametrize("task", ["binary", "multiclass", "multilabel"])
@pytest.mark.parametrize("average", ["macro", "weighted", "micro", None])
def test_the_short_read_gives_the_general_reads_values_without_a_state(task, average):
    metrics = build(task, average)
    feed(metrics, task)
    expected = general_average(metrics)
    with NoStates():
        values = metrics.avg
    assert list(values) == NAMES
    for name in NAMES:
        assert same(values[name], expected[name]), (name, values[name], expected[name])


@pytest.mark.parametrize("task", ["binary", "multiclass", "multilabel"])
def test_invalid_targets_give_the_general_reads_nan(task):
    metrics = build(task, "macro")
    feed(metrics, task)
    bad = torch.tensor([7]) if task != "multilabel" else torch.tensor([[7, 0, 0, 0]])
    metrics.update(torch.zeros(1) if task == "binary" else torch.zeros(1, 4), bad)
    expected = general_average(metrics)
    with NoStates():
        values = metrics.avg
    assert all(same(values[name], expected[name]) for name in NAMES), (values, expected)
    assert values["acc"] != values["acc"]  # nan, as the general read gives


def test_nothing_counted_takes_the_general_read():
    metrics = build("multiclass", "macro")
    assert metrics._host_reads is not None
    values = metrics.avg  # no counts yet: the general read's nan, not a failure of the short one
    assert all(value != value for value in values.values())


def test_it_applies_only_to_counts_alone_and_plain_catalogue_metrics():
    assert build("multiclass", "macro")._host_reads is not None
    # Metrics that need more than counts, or one without a host form, keep the general read.
    assert build("multiclass", "macro", ["acc", "auroc"])._host_reads is None
    assert build("multiclass", "macro", ["acc", "confmat"])._host_reads is None

    class Logged(MetricFunc):
        def evaluate(self, state):
            return 0.25  # an override the short read would skip

    catalogue = multiclass_metrics(4, metrics=["acc"]).metrics["acc"]
    logged = Logged("acc", catalogue.fn, catalogue.task, catalogue.requires)
    metrics = GlobalMetrics(logged)
    assert metrics._host_reads is None
    feed(metrics, "multiclass")
    assert metrics.avg["acc"] == 0.25


def test_metrics_changed_after_construction_take_the_general_read():
    metrics = build("multiclass", "macro", ["acc", "f1"])
    feed(metrics, "multiclass")
    catalogue = metrics.metrics["acc"]
    # Same task, same artifacts, another function: the short read must not answer with the old one.
    metrics.metrics["acc"] = MetricFunc(
        "acc", lambda state: accuracy_from_confusion(state.confusion) * 0 + 0.5, catalogue.task, "confusion"
    )
    assert metrics.avg["acc"] == 0.5

    metrics = build("multiclass", "macro", ["acc", "f1"])
    feed(metrics, "multiclass")
    metrics.metrics["f1"].fn = lambda state: 0.75  # `fn` replaced on the metric itself
    assert metrics.avg["f1"] == 0.75


@pytest.mark.parametrize("copy", [deepcopy, lambda metrics: pickle.loads(pickle.dumps(metrics))])
def test_copies_read_the_same_values_the_short_way(copy):
    metrics = build("multilabel", "macro")
    feed(metrics, "multilabel")
    expected = metrics.avg
    copied = copy(metrics)
    assert copied._host_reads is not None and copied._host_reads[0] is next(iter(copied._stores.values()))
    with NoStates():
        values = copied.avg
    assert all(same(values[name], expected[name]) for name in NAMES)
