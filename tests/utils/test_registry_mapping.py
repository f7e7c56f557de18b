import pytest

from danling import Registry


def make(a, b=0, *, c=1):
    return a, b, c


def test_build_accepts_a_config_mapping_as_last_positional():
    registry = Registry("thing")
    registry.register(make, "make")
    assert registry.build(1, {"type": "MAKE", "b": 2, "c": 3}) == (1, 2, 3)
    # explicit keywords win over the mapping
    assert registry.build(1, {"type": "make", "c": 3}, c=4) == (1, 0, 4)
    with pytest.raises(ValueError, match="registered: make"):
        registry.build(1, {"type": "nope"})
