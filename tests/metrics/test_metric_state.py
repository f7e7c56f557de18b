"""`state_dict` / `load_state_dict` of meters and metric containers: a restored container continues exactly."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch

from danling.metrics import (
    AverageMeter,
    AverageMeters,
    GlobalMetrics,
    MultiTaskMetrics,
    StreamMetrics,
    binary_metrics,
    multiclass_metrics,
    multilabel_metrics,
    regression_metrics,
)
from danling.metrics.functional import accuracy


def _through_file(state: Any) -> Any:
    """`state` saved and read back as a checkpoint is: torch.save, then the weights-only reader."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _batches(count: int, seed: int, regression: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    if regression:
        return [(torch.randn(4, generator=generator), torch.randn(4, generator=generator)) for _ in range(count)]
    return [
        (torch.randn(4, 3, generator=generator), torch.randint(0, 3, (4,), generator=generator)) for _ in range(count)
    ]


def _continued(make: Callable[[], Any], batches: list, cut: int) -> tuple[Any, Any]:
    """A container fed every batch, and one restored from the first's state after `cut` batches and fed the rest."""
    whole, restored = make(), make()
    for pred, target in batches[:cut]:
        whole.update(pred, target)
    restored.load_state_dict(_through_file(whole.state_dict()))
    for pred, target in batches[cut:]:
        whole.update(pred, target)
        restored.update(pred, target)
    return whole, restored


def test_average_meter_continues_bit_for_bit_across_pending_groups():
    values = torch.randn(200, dtype=torch.float32, generator=torch.Generator().manual_seed(0)) * 1e3
    whole, restored = AverageMeter(), AverageMeter()
    for value in values[:100]:  # 64 summed, 36 still pending when the state is taken
        whole.update(value)
    state = _through_file(whole.state_dict())
    assert state["pending"].shape == (36,) and state["count"] == 100
    restored.load_state_dict(state)
    assert restored.avg == whole.avg and restored.val == whole.val
    for value in values[100:]:
        whole.update(value)
        restored.update(value)
    assert restored.sum == whole.sum and restored.avg == whole.avg and restored.count == whole.count == 200


def test_average_meter_of_numbers_and_vectors():
    numbers, vectors = AverageMeter(), AverageMeter()
    numbers.update(0.5, n=3)
    vectors.update(torch.tensor([1.0, 2.0]), n=2)
    for meter, more in ((numbers, 0.25), (vectors, torch.tensor([4.0, 8.0]))):
        restored = AverageMeter()
        restored.load_state_dict(_through_file(meter.state_dict()))
        meter.update(more)
        restored.update(more)
        assert torch.equal(torch.as_tensor(restored.avg), torch.as_tensor(meter.avg))
        assert restored.count == meter.count


def test_average_meter_refuses_another_state():
    with pytest.raises(ValueError, match="not the state of a meter"):
        AverageMeter().load_state_dict({"loss": 1.0})


def test_average_meters_create_the_named_meters_and_reset_the_others():
    meters = AverageMeters()
    for step in range(70):
        meters.update(loss=torch.tensor(step / 7), time=0.1 * step)
    restored = AverageMeters()
    restored.update(extra=1.0)
    restored.load_state_dict(_through_file(meters.state_dict()))
    assert set(restored) == {"extra", "loss", "time"} and restored["extra"].count == 0
    del restored["extra"]
    assert restored.avg == meters.avg and restored.sum == meters.sum and restored.count == meters.count


def test_stream_metrics_continue_exactly_and_refuse_other_metrics():
    batches = _batches(40, seed=1)
    whole, restored = _continued(lambda: multiclass_metrics(num_classes=3, mode="stream"), batches, cut=25)
    assert isinstance(whole, StreamMetrics) and restored.avg == whole.avg
    with pytest.raises(ValueError, match=r"no meters \['acc', 'f1', 'mcc'\]"):
        StreamMetrics(other=accuracy).load_state_dict(whole.state_dict())


@pytest.mark.parametrize("regression", [False, True], ids=["confusion-and-scores", "moments-and-data"])
def test_global_metrics_continue_exactly(regression):
    if regression:
        make = lambda: regression_metrics(metrics=["mae", "r2", "spearman"])  # noqa: E731
    else:
        make = lambda: multiclass_metrics(num_classes=3)  # noqa: E731  (acc/f1/mcc count; auroc keeps scores)
    whole, restored = _continued(make, _batches(90, seed=2, regression=regression), cut=70)
    assert isinstance(whole, GlobalMetrics)
    assert restored.avg == whole.avg and restored.val == whole.val and restored.count == whole.count


def test_global_metrics_refuse_a_state_of_other_metrics():
    state = multiclass_metrics(num_classes=3).state_dict()
    with pytest.raises(ValueError, match="this GlobalMetrics has"):
        regression_metrics(metrics=["mae"]).load_state_dict(state)


_SCORES = torch.tensor([[2.0, 0.1, -1.0], [0.3, 1.5, 0.2], [0.1, 0.2, 3.0], [1.0, 0.9, 0.1]])
_CLASSES, _BINARY = torch.tensor([0, 1, 2, 1]), torch.tensor([0, 1, 1, 0])


@pytest.mark.parametrize(
    ("write", "read", "batch", "key"),
    [
        (lambda: multiclass_metrics(3), lambda: multiclass_metrics(4), (_SCORES, _CLASSES), "counts"),
        (
            lambda: multiclass_metrics(3),
            lambda: multiclass_metrics(3, ignore_index=None),
            (_SCORES, _CLASSES),
            "counts",
        ),
        (
            lambda: multiclass_metrics(3, ["auroc"]),
            lambda: multiclass_metrics(4, ["auroc"]),
            (_SCORES, _CLASSES),
            "inputs",
        ),
        (
            lambda: multilabel_metrics(3),
            lambda: multilabel_metrics(2),
            (_SCORES.sigmoid(), _SCORES.gt(0.5).long()),
            "counts",
        ),
        (lambda: binary_metrics(bins=10), lambda: binary_metrics(bins=100), (_SCORES[:, 0].sigmoid(), _BINARY), "bins"),
        (
            lambda: regression_metrics(1, ["mae"]),
            lambda: regression_metrics(3, ["mae"]),
            (_SCORES[:, 0], _SCORES[:, 1]),
            "moments",
        ),
    ],
)
def test_global_metrics_refuse_a_state_of_another_task_size(write, read, batch, key):
    # The same metric names over another number of classes (or ignore_index, or bins): the counts
    # or scores of the old task would be read as the new one's, giving NaN or wrong values.
    written = write()
    written.update(*batch)
    container = read()
    with pytest.raises(ValueError, match=rf"state {key!r} has shape .* this container's .* task expects"):
        container.load_state_dict(_through_file(written.state_dict()))
    assert container.count == 0  # nothing was loaded


def test_multitask_metrics_continue_every_task():
    def make() -> MultiTaskMetrics:
        return MultiTaskMetrics(
            first=multiclass_metrics(num_classes=3), second=multiclass_metrics(num_classes=3, mode="stream")
        )

    whole, restored = make(), make()
    batches = _batches(30, seed=3)
    for pred, target in batches[:20]:
        whole.update({"first": (pred, target), "second": (pred, target)})
    restored.load_state_dict(_through_file(whole.state_dict()))
    for pred, target in batches[20:]:
        for metrics in (whole, restored):
            metrics.update({"first": (pred, target), "second": (pred, target)})
    assert restored.avg == whole.avg
    with pytest.raises(ValueError, match="holds tasks"):
        MultiTaskMetrics(first=multiclass_metrics(num_classes=3)).load_state_dict(whole.state_dict())
