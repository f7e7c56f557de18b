import dataclasses
from collections import OrderedDict, defaultdict, namedtuple

import numpy as np
import pytest
import torch
from chanfig import NestedDict

from danling.utils import RoundDict, to_device

Batch = namedtuple("Batch", ["inputs", "labels"])
META = torch.device("meta")


class TensorLike:
    """Mimics NestedTensor: a `to` method plus `__torch_function__`."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.calls = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return NotImplemented

    def to(self, device, **kwargs):
        self.calls.append((device, kwargs))
        return TensorLike(device)


class ToOnly:
    """Has `to` but is not tensor-like (like an nn.Module), so it must be left alone."""

    def to(self, device):
        raise AssertionError("should not be moved")


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    meta: dict
    steps: int = dataclasses.field(default=0, init=False)

    def __post_init__(self):
        self.post_init_calls = getattr(self, "post_init_calls", 0) + 1


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor


class AttrDict(dict):
    def __init__(self, *args, note="", **kwargs):
        super().__init__(*args, **kwargs)
        self.note = note


class Strict(OrderedDict):
    def __setitem__(self, key, value):
        if hasattr(self, "_frozen"):
            raise TypeError("read-only")
        super().__setitem__(key, value)


def test_tensor_and_leaves():
    moved = to_device(torch.ones(2), META)
    assert moved.device == META and moved.shape == (2,)
    array = np.ones(2)
    for leaf in ("text", b"bytes", 3, 2.5, None, array):
        assert to_device(leaf, "meta") is leaf
    module = ToOnly()
    assert to_device(module, "meta") is module
    assert to_device(torch.Tensor, "meta") is torch.Tensor


def test_nested_structures_keep_types():
    data = {
        "batch": Batch(torch.zeros(2), [torch.ones(1), (torch.ones(1), "label")]),
        "ordered": OrderedDict(b=torch.ones(1), a=2),
    }
    moved = to_device(data, "meta")
    assert type(moved) is dict
    assert isinstance(moved["batch"], Batch)
    assert moved["batch"].inputs.device == META
    assert isinstance(moved["batch"].labels, list)
    assert moved["batch"].labels[0].device == META
    assert isinstance(moved["batch"].labels[1], tuple) and moved["batch"].labels[1][1] == "label"
    assert isinstance(moved["ordered"], OrderedDict) and list(moved["ordered"]) == ["b", "a"]
    # The input is untouched.
    assert data["batch"].inputs.device == torch.device("cpu")
    assert data["ordered"]["b"].device == torch.device("cpu")


def test_mapping_subclasses():
    factory = defaultdict(list, x=torch.ones(1))
    moved = to_device(factory, "meta")
    assert isinstance(moved, defaultdict) and moved.default_factory is list and moved["x"].device == META

    attr = AttrDict(x=torch.ones(1), note="kept")
    moved = to_device(attr, "meta")
    assert isinstance(moved, AttrDict) and moved.note == "kept" and moved["x"].device == META
    assert attr["x"].device == torch.device("cpu")

    nested = NestedDict({"a": {"b": torch.ones(1)}})
    moved = to_device(nested, "meta")
    assert isinstance(moved, NestedDict) and moved["a"]["b"].device == META

    result = to_device(RoundDict(loss=torch.tensor(0.5)), "meta")
    assert isinstance(result, RoundDict) and result["loss"].device == META


def test_mapping_that_rejects_item_assignment_falls_back_to_constructor():
    strict = Strict(x=torch.ones(1))
    strict._frozen = True
    moved = to_device(strict, "meta")
    assert isinstance(moved, Strict) and moved["x"].device == META


def test_dataclasses():
    sample = Sample(torch.ones(2), {"y": torch.zeros(1)})
    sample.steps = 5
    moved = to_device(sample, "meta")
    assert isinstance(moved, Sample) and moved is not sample
    assert moved.x.device == META and moved.meta["y"].device == META
    assert moved.steps == 5 and moved.post_init_calls == 1  # __init__/__post_init__ not re-run
    assert sample.x.device == torch.device("cpu")
    frozen = to_device(Frozen(torch.ones(1)), "meta")
    assert isinstance(frozen, Frozen) and frozen.x.device == META
    assert to_device(Sample, "meta") is Sample  # the class itself is not an instance


def test_tensor_likes_and_non_blocking():
    like = TensorLike()
    moved = to_device({"nt": like}, "meta")["nt"]
    assert isinstance(moved, TensorLike) and moved.device == META
    assert like.calls == [(META, {})]
    to_device(like, "meta", non_blocking=True)
    assert like.calls[-1] == (META, {"non_blocking": True})
    assert to_device(torch.ones(1), "cpu", non_blocking=True).device == torch.device("cpu")


def test_same_device_is_a_no_op():
    tensor = torch.ones(1)
    assert to_device(tensor, "cpu") is tensor


def test_list_subclass_and_empty_containers():
    class Tagged(list):
        pass

    moved = to_device(Tagged([torch.ones(1)]), "meta")
    assert isinstance(moved, Tagged) and moved[0].device == META
    assert to_device([], "meta") == [] and to_device((), "meta") == () and to_device({}, "meta") == {}


@pytest.mark.parametrize("device", ["gpu", "cuda:x", 1.5, None])
def test_bad_device(device):
    with pytest.raises(ValueError, match="invalid device"):
        to_device(torch.ones(1), device)
