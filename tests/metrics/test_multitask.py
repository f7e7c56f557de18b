import pytest
import torch

from danling.metrics import AverageMeters, MultiTaskMetrics, StreamMetrics, binary_metrics
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
