import pytest
import torch

from danling.data import split_batch


@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        ({"input": 1, "target": 2}, (1, 2)),
        ({"input": 1, "extra": 3}, (1, None)),
        ([1, 2, 3], (1, 2)),
        ((1,), (1, None)),
        ("text", ("text", None)),
        (b"raw", (b"raw", None)),
        (7, (7, None)),
    ],
)
def test_default_batch_contract(batch, expected):
    assert split_batch(batch) == expected


def test_tensor_batch_is_input_only():
    batch = torch.arange(4).view(2, 2)
    inputs, target = split_batch(batch)
    assert inputs is batch and target is None


def test_bad_batches_are_named():
    with pytest.raises(ValueError, match=r"'input' key .* got keys \['x', 'y'\]"):
        split_batch({"x": 1, "y": 2})
    with pytest.raises(ValueError, match="empty sequence"):
        split_batch([])
