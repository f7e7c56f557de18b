import math

import pytest
import torch

from danling.metrics import AverageMeter, AverageMeters
from danling.utils import RoundDict


def test_scalar_meter_weighted_average_and_reset():
    meter = AverageMeter()
    assert math.isnan(meter.val) and math.isnan(meter.avg) and meter.count == 0
    meter.update(2.0, n=3)
    meter.update(4)
    assert meter.val == 4 and meter.bat == 4
    assert meter.sum == 10.0 and meter.count == 4 and meter.avg == 2.5
    assert isinstance(meter.avg, float)
    assert meter.reset() is meter
    assert math.isnan(meter.avg) and meter.sum == 0 and meter.count == 0


def test_tensor_values_accumulate_on_device_and_read_as_numbers():
    meter = AverageMeter()
    meter.update(torch.tensor(0.5), n=2)
    meter.update(torch.tensor(1.0, requires_grad=True) * 1, n=2)
    assert isinstance(meter._sum, torch.Tensor) and not meter._sum.requires_grad
    assert meter.avg == 0.75 and isinstance(meter.avg, float) and isinstance(meter.val, float)
    vector = AverageMeter()
    vector.update(torch.tensor([1.0, 3.0]))
    vector.update(torch.tensor([3.0, 5.0]), n=3)
    assert torch.equal(vector.avg, torch.tensor([2.5, 4.5]))
    assert vector.avg.dtype == torch.float32
    with pytest.raises(ValueError, match=r"shape \(3,\).*\(2,\)"):
        vector.update(torch.ones(3))


@pytest.mark.parametrize(("value", "n", "error"), [("1", 1, TypeError), (1.0, -1, ValueError), (1.0, "2", TypeError)])
def test_bad_updates(value, n, error):
    with pytest.raises(error):
        AverageMeter().update(value, n)


def test_format_and_repr():
    meter = AverageMeter()
    meter.update(0.25)
    meter.update(0.75)
    assert f"{meter:.2f}" == "0.75 (0.50)"
    assert repr(meter) == "AverageMeter(val=0.75, avg=0.5)"


def test_average_meters_create_on_update_and_expose_round_dicts():
    meters = AverageMeters()
    meters.update({"loss": 1.0}, time=0.5)
    meters.update(loss=3.0)
    assert isinstance(meters.avg, RoundDict)
    assert meters.avg.dict() == {"loss": 2.0, "time": 0.5}
    assert meters.val.dict() == {"loss": 3.0, "time": 0.5}
    assert meters.bat.dict() == meters.val.dict()
    assert meters.count.dict() == {"loss": 2, "time": 1}
    assert meters.loss is meters["loss"] and "time" in meters and len(meters) == 2
    assert f"{meters:.1f}" == "loss: 3.0 (2.0)\ttime: 0.5 (0.5)"
    values, counts = meters.read("avg")
    assert values.dict() == {"loss": 2.0, "time": 0.5} and counts == {"loss": 2, "time": 1}
    meters.extra = AverageMeter()
    assert "extra" in meters
    with pytest.raises(AttributeError):
        meters.missing  # noqa: B018
    with pytest.raises(TypeError, match="mappings"):
        meters.update([("loss", 1.0)])


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (torch.tensor([1.0, 2.0]), 3.0),  # a number after vectors
        (torch.tensor([1.0, 2.0]), torch.tensor(3.0)),  # a 0-d tensor after vectors
        (1.0, torch.tensor([1.0, 2.0])),  # a vector after numbers
        (torch.tensor(1.0), torch.tensor([1.0, 2.0])),  # a vector after 0-d tensors
    ],
)
def test_an_update_of_another_shape_is_rejected_not_broadcast(first, second):
    meter = AverageMeter()
    meter.update(first)
    with pytest.raises(ValueError, match=r"shape") as error:
        meter.update(second)
    shapes = {tuple(torch.as_tensor(v).shape) for v in (first, second)}
    assert all(str(shape) in str(error.value) for shape in shapes)
    assert meter.count == 1  # the rejected value was not counted
    meter.reset()
    meter.update(second)  # a reset meter takes any shape
    assert meter.count == 1


@pytest.mark.parametrize("empty", [math.nan, torch.tensor(math.nan), torch.tensor([math.nan, math.inf])])
def test_zero_weight_update_keeps_the_average(empty):
    # An empty batch: its mean loss is NaN, its weight 0; the running average must not change.
    meter = AverageMeter()
    full = torch.tensor([1.0, 3.0]) if isinstance(empty, torch.Tensor) and empty.ndim else 2.0
    meter.update(full, n=2)
    meter.update(empty, n=0)
    expected = meter.avg
    assert meter.count == 2
    assert torch.equal(torch.as_tensor(meter.avg), torch.as_tensor(full))
    assert torch.equal(torch.as_tensor(meter.sum), torch.as_tensor(full, dtype=torch.float64) * 2)
    meter.update(full, n=2)
    assert torch.equal(torch.as_tensor(meter.avg), torch.as_tensor(expected))


@pytest.mark.parametrize(
    ("value", "kind"), [(3, int), (torch.tensor(3), int), (torch.tensor([1, 2]), torch.Tensor), (2.5, float)]
)
def test_zero_weight_update_keeps_the_value_type(value, kind):
    meter = AverageMeter()
    meter.update(value, n=0)
    assert type(meter.val) is kind or isinstance(meter.val, kind)
    assert torch.equal(torch.as_tensor(meter.val), torch.as_tensor(value))
    assert meter.count == 0 and meter._n == 0
    # Nothing weighs yet: the average is NaN, shaped like the values.
    if isinstance(value, torch.Tensor) and value.ndim:
        assert isinstance(meter.avg, torch.Tensor) and meter.avg.shape == value.shape and meter.avg.isnan().all()
    else:
        assert math.isnan(meter.avg)


@pytest.mark.parametrize("n", [math.nan, math.inf, -1, -0.5])
@pytest.mark.parametrize("value", [2.0, torch.tensor(2.0), torch.tensor([1.0, 2.0])])
def test_a_weight_that_is_no_finite_non_negative_number_is_refused(n, value):
    # A NaN or infinite weight would make `count` and `avg` NaN for good; it is refused like a
    # negative one, naming the weight, and nothing is counted.
    meter = AverageMeter()
    meter.update(value, n=2)
    with pytest.raises(ValueError, match=f"n must be a finite non-negative number, got {n!r}"):
        meter.update(value, n=n)
    if isinstance(value, float):
        with pytest.raises(ValueError, match="n must be a finite non-negative number"):
            meter.update_float64(value, n=n)
    assert meter.count == 2 and torch.equal(torch.as_tensor(meter.avg), torch.as_tensor(value))


def test_average_meters_refuse_a_keyword_n_that_would_become_a_meter():
    # `update(loss=x, n=32)` made a meter named `n` and weighed `loss` 1, silently.
    meters = AverageMeters()
    with pytest.raises(TypeError, match=r"n=32.*meters\[name\]\.update\(value, n=\.\.\.\)"):
        meters.update(loss=0.5, n=32)
    assert "n" not in meters and "loss" not in meters  # nothing was added
    meters.update({"n": 3.0}, loss=0.5)  # a meter named n, asked for by a mapping
    assert meters["n"].avg == 3.0 and meters["loss"].count == 1


def test_a_nonfinite_sum_set_apart_keeps_sum_and_avg_and_checkpoints_but_frees_later_sums():
    meter = AverageMeter()
    meter.update(torch.tensor(1.0))
    assert not meter.isolate_nonfinite() and meter._aside is None  # a finite sum stays where it is
    meter.update(torch.tensor(float("nan")))
    meter.update(torch.tensor(2.0))
    assert meter.isolate_nonfinite()
    assert meter._running_sum() == 0 and math.isnan(meter.sum) and math.isnan(meter.avg)
    meter.update(torch.tensor(4.0))
    assert meter._running_sum() == 4.0 and meter.count == 4 and math.isnan(meter.avg)
    state = meter.state_dict()
    assert math.isnan(float(state["total"]))  # the part set apart is folded back into a checkpoint
    again = AverageMeter()
    again.load_state_dict(state)
    assert math.isnan(again.avg) and again.count == 4
    floats = AverageMeter()
    floats.update(float("inf"))
    floats.update(3.0)
    assert floats.isolate_nonfinite() and floats.sum == float("inf") and floats._running_sum() == 0.0
