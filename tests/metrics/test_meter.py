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
