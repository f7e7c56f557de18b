import math

import pytest
import torch

from danling.metrics import (
    AverageMeter,
    AverageMeters,
    MetricMeter,
    MultiTaskMetrics,
    StreamMetrics,
    binary_metrics,
    multiclass_metrics,
)
from danling.metrics import functional as F


def build(aggregate, **kwargs):
    metrics = MultiTaskMetrics(aggregate=aggregate, **kwargs)
    metrics.small = StreamMetrics(acc=F.binary_accuracy)
    metrics.large = binary_metrics(["acc", "auroc"])
    metrics.update({"small": ([0.9, 0.1], [1, 1]), "large": {"input": [0.9, 0.8, 0.1, 0.2], "target": [1, 1, 0, 1]}})
    return metrics


def test_macro_micro_weighted_aggregates():
    small, large = 0.5, 0.75
    assert build("macro").avg["aggregate"]["acc"] == pytest.approx((small + large) / 2)
    assert build("micro").avg["aggregate"]["acc"] == pytest.approx((small * 2 + large * 4) / 6)
    weighted = build("weighted", aggregate_weights={"small": 3, "large": 1})
    assert weighted.avg["aggregate"]["acc"] == pytest.approx((small * 3 + large) / 4)
    # A metric found in one task only is aggregated over that task.
    assert weighted.avg["aggregate"]["auroc"] == pytest.approx(weighted.avg["large"]["auroc"])
    assert "aggregate" not in build(None).avg
    assert set(build("macro").val) == {"small", "large", "aggregate"}


@pytest.mark.parametrize("mode", ["stream", "global"])
def test_a_task_of_weight_zero_leaves_the_aggregate_alone(mode):
    # A task with no samples yet reads NaN; with weight 0 (its count under "micro", a weight of 0
    # under "weighted") it must add nothing, not turn the aggregate of the other tasks into NaN.
    for aggregate, weights in (("micro", None), ("weighted", {"seen": 2.0, "unseen": 0.0})):
        metrics = MultiTaskMetrics(aggregate=aggregate, aggregate_weights=weights)
        metrics.seen = binary_metrics(["acc"], mode=mode)
        metrics.unseen = binary_metrics(["acc"], mode=mode)
        metrics.update({"seen": ([0.9, 0.1], [1, 1])})
        assert metrics.avg["aggregate"]["acc"] == 0.5
    weightless = MultiTaskMetrics(aggregate="weighted", aggregate_weights={"a": 0, "b": 0})
    weightless.a, weightless.b = AverageMeters(), AverageMeters()
    weightless.update({"a": {"x": 1.0}, "b": {"x": 2.0}})
    assert math.isnan(weightless.avg["aggregate"]["x"])  # no weight at all: undefined


def test_an_aggregate_of_values_of_different_shapes_names_the_metric_and_tasks():
    # Per-class F1 of a 3-class and a 5-class task cannot be combined; the read failed with
    # torch's "stack expects each tensor to be equal size".
    metrics = MultiTaskMetrics(aggregate="macro")
    metrics.small = multiclass_metrics(3, ["f1"], average=None)
    metrics.large = multiclass_metrics(5, ["f1"], average=None)
    metrics.update({"small": ([[0.8, 0.1, 0.1]], [0]), "large": ([[0.1, 0.6, 0.1, 0.1, 0.1]], [1])})
    message = r"cannot aggregate 'f1' over tasks of different shapes: small \(3,\), large \(5,\)"
    with pytest.raises(ValueError, match=message):
        _ = metrics.avg


def test_format_lists_tasks_one_per_line_and_reset():
    metrics = build("macro")
    assert f"{metrics:.2f}" == ("small: acc: 0.50 (0.50)\nlarge: acc: 0.75 (0.75)\tauroc: 1.00 (1.00)")
    assert metrics.reset() is metrics
    assert metrics.small.count["acc"] == 0 and metrics.large.count == 0


def test_tensor_values_are_aggregated_elementwise():
    metrics = MultiTaskMetrics(aggregate="macro", a=AverageMeters(), b=AverageMeters())
    metrics.update({"a": {"x": torch.tensor([1.0, 2.0])}, "b": {"x": torch.tensor([3.0, 6.0])}})
    assert torch.equal(metrics.avg["aggregate"]["x"], torch.tensor([2.0, 4.0], dtype=torch.float64))


def test_errors():
    metrics = build("macro")
    with pytest.raises(ValueError, match="Task missing not found in"):
        metrics.update({"small": ([0.1], [0]), "missing": ([0.1], [0])})
    assert metrics.small.count["acc"] == 2  # nothing was updated
    with pytest.raises(ValueError, match="aggregate must be"):
        MultiTaskMetrics(aggregate="mean")
    with pytest.raises(ValueError, match="aggregate_weights"):
        MultiTaskMetrics(aggregate="weighted")
    partial = build("weighted", aggregate_weights={"small": 1})
    with pytest.raises(ValueError, match="large"):
        partial.avg  # noqa: B018
    with pytest.raises(TypeError, match="StreamMetrics"):
        metrics["bad"] = object()
    with pytest.raises(ValueError, match="reserved"):
        metrics["aggregate"] = AverageMeters()


def _batch(scores, labels):
    return {"input": torch.tensor(scores), "target": torch.tensor(labels)}


@pytest.mark.parametrize("by", ["attribute", "item"])
def test_a_callable_assigned_as_a_task_is_registered_and_updated(by):
    metrics = MultiTaskMetrics()
    if by == "attribute":
        metrics.acc_task = F.binary_accuracy
    else:
        metrics["acc_task"] = F.binary_accuracy
    assert "acc_task" in metrics and list(metrics) == ["acc_task"]
    metrics.update({"acc_task": _batch([0.9, 0.2, 0.8, 0.1], [1, 1, 1, 0])})
    assert metrics.avg["acc_task"] == pytest.approx(0.75)
    assert metrics.acc_task.count == 4


@pytest.mark.parametrize("by", ["attribute", "item"])
def test_a_metric_meter_assigned_as_a_task_is_registered_and_updated(by):
    meter = MetricMeter(F.binary_accuracy)
    metrics = MultiTaskMetrics()
    if by == "attribute":
        metrics.acc_task = meter
    else:
        metrics["acc_task"] = meter
    assert metrics.acc_task is meter
    metrics.update({"acc_task": ([0.9, 0.2], [1, 1])})
    metrics.update({"acc_task": _batch([0.9, 0.8], [1, 1])})
    assert meter.count == 4 and metrics.avg["acc_task"] == pytest.approx(0.75)
    assert metrics.val["acc_task"] == pytest.approx(1.0)
    assert f"{metrics:.2f}" == "acc_task: 1.00 (0.75)"


@pytest.mark.parametrize("by", ["attribute", "item"])
def test_a_nested_multitask_assigned_as_a_task_is_registered_and_updated(by):
    inner = MultiTaskMetrics(aggregate="macro")
    inner.a = StreamMetrics(acc=F.binary_accuracy)
    inner.b = StreamMetrics(acc=F.binary_accuracy)
    outer = MultiTaskMetrics(aggregate="macro")
    outer.flat = StreamMetrics(acc=F.binary_accuracy)
    if by == "attribute":
        outer.nested = inner
    else:
        outer["nested"] = inner
    assert outer.nested is inner
    outer.update({"flat": ([0.9, 0.1], [1, 0]), "nested": {"a": ([0.9, 0.9], [1, 0]), "b": ([0.1, 0.1], [1, 1])}})
    avg = outer.avg
    assert avg["flat"]["acc"] == 1.0
    assert avg["nested"]["a"]["acc"] == 0.5 and avg["nested"]["b"]["acc"] == 0.0
    assert avg["nested"]["aggregate"]["acc"] == 0.25
    # The outer aggregate matches metrics by their path below each task: "acc" only in `flat`.
    assert avg["aggregate"]["acc"] == 1.0
    outer.reset()
    assert inner.a.count["acc"] == 0


def test_setting_the_group_and_plain_attributes_is_not_a_task():
    metrics = MultiTaskMetrics(aggregate="macro")
    metrics.group = None
    assert len(metrics) == 0 and metrics.aggregate == "macro"


# ------------------------------------------------ single meters and metric functions in the aggregate
def _single_meter_tasks(aggregate, **kwargs):
    """Two tasks given as metric functions, one as a MetricMeter: each reports under `binary_accuracy`."""
    metrics = MultiTaskMetrics(aggregate=aggregate, **kwargs)
    metrics.small = F.binary_accuracy
    metrics.large = MetricMeter(F.binary_accuracy)
    metrics.update({"small": ([0.9, 0.1], [1, 1]), "large": ([0.9, 0.8, 0.1, 0.2], [1, 1, 0, 1])})
    return metrics


@pytest.mark.parametrize(
    ("aggregate", "kwargs", "expected"),
    [
        ("macro", {}, (0.5 + 0.75) / 2),
        ("micro", {}, (0.5 * 2 + 0.75 * 4) / 6),
        ("weighted", {"aggregate_weights": {"small": 3, "large": 1}}, (0.5 * 3 + 0.75) / 4),
    ],
)
def test_metric_meter_and_callable_tasks_are_aggregated_under_their_metric_name(aggregate, kwargs, expected):
    metrics = _single_meter_tasks(aggregate, **kwargs)
    for kind in ("val", "bat", "avg"):
        values = metrics.read(kind)
        assert values["small"] == 0.5 and values["large"] == 0.75  # each task still reads as one number
        assert values["aggregate"]["binary_accuracy"] == pytest.approx(expected)


def test_a_single_meter_task_matches_the_same_metric_path_in_a_container_task():
    metrics = MultiTaskMetrics(aggregate="micro")
    metrics.single = F.binary_accuracy
    metrics.container = StreamMetrics(F.binary_accuracy, auroc=F.binary_auroc)  # `binary_accuracy` by name
    metrics.update({"single": ([0.9, 0.1], [1, 1]), "container": ([0.9, 0.8, 0.1, 0.2], [1, 1, 0, 1])})
    aggregate = metrics.avg["aggregate"]
    assert aggregate["binary_accuracy"] == pytest.approx((0.5 * 2 + 0.75 * 4) / 6)
    assert aggregate["auroc"] == pytest.approx(metrics.avg["container"]["auroc"])


def test_a_single_meter_without_a_metric_name_reports_under_its_task_name():
    metrics = MultiTaskMetrics(aggregate="macro")
    metrics.mae = MetricMeter(lambda input, target: (input - target).abs().mean())
    metrics.loss = AverageMeter()
    metrics.update({"mae": (torch.tensor([1.0, 2.0]), torch.tensor([1.5, 2.5]))})
    metrics.loss.update(0.25)
    aggregate = metrics.avg["aggregate"]
    assert aggregate["mae"] == pytest.approx(0.5) and aggregate["loss"] == pytest.approx(0.25)


# ------------------------------------------------ an unknown task is named, whatever the tasks are
def test_an_update_for_an_unknown_task_names_it_even_with_a_lambda_metric():
    metrics = MultiTaskMetrics(aggregate="macro")
    metrics.mae = lambda input, target: (input - target).abs().mean()
    metrics.acc = StreamMetrics(close=lambda input, target: ((input - target).abs() < 0.5).float().mean())
    with pytest.raises(ValueError, match=r"Task loss not found in MultiTaskMetrics\(.*mae=MetricMeter\(<lambda>\)"):
        metrics.update({"loss": ([0.1], [0.0])})
    assert repr(metrics.acc) == "StreamMetrics(close=MetricMeter(<lambda>))"
