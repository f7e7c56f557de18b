import math
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from danling.utils import RoundDict

Pair = namedtuple("Pair", ["low", "high"])


def test_round_builtin_and_method_return_new_rounddict():
    d = RoundDict(loss=0.123456, nested={"acc": 0.987654})
    for r in (round(d, 3), d.round(3)):
        assert isinstance(r, RoundDict)
        assert r["loss"] == 0.123
        assert r["nested"]["acc"] == 0.988
        assert isinstance(r["nested"], RoundDict)
    assert d["loss"] == 0.123456  # untouched


def test_round_without_digits_keeps_float_type():
    r = round(RoundDict(a=2.6, b=3))
    assert r["a"] == 3.0 and isinstance(r["a"], float)
    assert r["b"] == 3 and isinstance(r["b"], int)


def test_round_tensors_keep_dtype_and_skip_integers():
    d = RoundDict(f=torch.tensor([0.12345, 1.98765], dtype=torch.float64), i=torch.tensor([1, 2]), b=torch.tensor(True))
    r = round(d, 2)
    assert r["f"].dtype == torch.float64
    assert torch.equal(r["f"], torch.tensor([0.12, 1.99], dtype=torch.float64))
    assert r["i"] is d["i"] and r["b"] is d["b"]


def test_round_containers_and_special_values():
    d = RoundDict(
        seq=[0.1111, (0.2222, "x")],
        arr=np.array([0.6666]),
        npf=np.float32(0.7777),
        nan=float("nan"),
        inf=float("-inf"),
        flag=True,
        text="keep",
        none=None,
    )
    # Item assignment keeps the container classes (chanfig's constructor would convert them).
    d["pair"] = Pair(0.3333, 0.4444)
    d["od"] = OrderedDict(z=0.5555)
    r = round(d, 1)
    assert r["seq"] == [0.1, (0.2, "x")]
    assert isinstance(r["pair"], Pair) and r["pair"] == Pair(0.3, 0.4)
    assert isinstance(r["od"], OrderedDict) and r["od"]["z"] == 0.6
    np.testing.assert_allclose(r["arr"], [0.7])
    assert isinstance(r["npf"], np.float32) and math.isclose(float(r["npf"]), 0.8, rel_tol=1e-6)
    assert math.isnan(r["nan"]) and r["inf"] == float("-inf")
    assert r["flag"] is True and r["text"] == "keep" and r["none"] is None


def test_round_keeps_dotted_keys_and_instance_attributes():
    d = RoundDict()
    dict.__setitem__(d, "lr.group0", 0.123)
    assert list(round(d, 1).keys()) == ["lr.group0"]


@pytest.mark.parametrize("ndigits", [1.5, "2", True])
def test_round_rejects_bad_ndigits(ndigits):
    with pytest.raises(TypeError, match="ndigits"):
        RoundDict(a=1.0).round(ndigits)


def test_format():
    d = RoundDict(loss=0.5, val={"acc": torch.tensor(0.25), "per_class": torch.tensor([0.1, 0.2])}, n=3, name="r")
    assert f"{d:.2f}" == "loss: 0.50\tval.acc: 0.25\tval.per_class: [0.10, 0.20]\tn: 3.00\tname: r"
    assert format(RoundDict(flag=True, nothing=None), ".1f") == "flag: True\tnothing: None"
    assert f"{d}" == str(d)
    assert format(RoundDict(), ".3f") == ""
    with pytest.raises(ValueError):
        format(RoundDict(a=0.5), "not-a-spec")


def test_chanfig_behaviour_preserved():
    d = RoundDict({"val": {"acc": 0.5}})
    assert d.val.acc == 0.5
    assert d["val.acc"] == 0.5
    assert d.dict() == {"val": {"acc": 0.5}}


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.text(min_size=1, alphabet="abc"), st.floats(allow_nan=False, allow_infinity=False)))
def test_round_matches_python_round(values):
    r = round(RoundDict(values), 3)
    assert r.dict() == {key: round(value, 3) for key, value in values.items()}
