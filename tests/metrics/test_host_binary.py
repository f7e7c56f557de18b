"""Binary metrics of small CPU batches are counted from Python lists, with the general path's values.

The scores are thresholded in Python as `positive_predictions` does on the tensor (logits when
any score lies outside `[0, 1]`, the threshold rounded to float32 for float32 scores); each case
is compared exactly with the same call with the host path off (`HOST_CONFUSION_SIZE = 0`).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from danling.metrics import binary_metrics
from danling.metrics import functional as F
from tests.metrics._compare import CountOps, same
from tests.metrics.test_host_class_scores import both_paths

FUNCTIONS = {
    "accuracy": F.binary_accuracy,
    "balanced_accuracy": F.binary_balanced_accuracy,
    "precision": F.binary_precision,
    "recall": F.binary_recall,
    "f1": F.binary_f1_score,
    "mcc": F.binary_mcc,
}


def assert_same_on_both_paths(input, target, **options):
    for name, function in FUNCTIONS.items():
        fast, general = both_paths(lambda function=function: function(input, target, **options))
        assert same(fast, general), (name, options, fast, general)
    fast, general = both_paths(lambda: F.accuracy(input, target, **options))  # the generic entry point
    assert same(fast, general)


@settings(max_examples=150, deadline=None)
@given(
    rows=st.integers(1, 256),
    logits=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    threshold=st.one_of(st.sampled_from([0.0, 0.1, 0.3, 0.5, 0.7, 1.0]), st.floats(0, 1)),
    ignore_index=st.sampled_from([None, -100, 0, 1]),
    data=st.data(),
)
def test_random_small_batches_equal_the_general_path(rows, logits, dtype, threshold, ignore_index, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    scores = torch.randn(rows, generator=g, dtype=dtype) if logits else torch.rand(rows, generator=g, dtype=dtype)
    if data.draw(st.booleans()):  # scores on the threshold, or next to it, in float32 or float64
        scores[0] = threshold
        scores[-1] = torch.tensor(threshold, dtype=torch.float32).item()
    target = torch.randint(0, 2, (rows,), generator=g)
    for _ in range(data.draw(st.integers(0, 2))):
        target[data.draw(st.integers(0, rows - 1))] = data.draw(st.sampled_from([-100, -1, 2, 0, 1]))
    assert_same_on_both_paths(scores, target, threshold=threshold, ignore_index=ignore_index)


g = torch.Generator().manual_seed(2)
SCORES = torch.rand(32, generator=g)
TARGET = torch.randint(0, 2, (32,), generator=g)
CASES = {
    "probabilities": (SCORES, TARGET, {}),
    "logits": (torch.randn(32, generator=g), TARGET, {}),
    "float32 next to the threshold": (torch.full((32,), 0.1), TARGET, {"threshold": 0.1}),
    "float64 next to the threshold": (torch.full((32,), 0.1, dtype=torch.float64), TARGET, {"threshold": 0.1}),
    "logits, threshold 0.3": (torch.randn(32, generator=g), TARGET, {"threshold": 0.3}),
    "threshold beyond float32": (SCORES * 4, TARGET, {"threshold": 1e39}),
    "nan scores": (torch.where(SCORES > 0.8, math.nan, SCORES), TARGET, {}),
    "one class only": (SCORES, torch.ones(32, dtype=torch.long), {}),
    "nothing predicted positive": (torch.zeros(32), TARGET, {}),
    "invalid target": (SCORES, torch.cat([TARGET[:-1], torch.tensor([2])]), {}),
    "everything ignored": (SCORES, torch.full((32,), -100), {"ignore_index": -100}),
    "ignore_index as float": (SCORES, torch.where(TARGET == 1, -100, TARGET), {"ignore_index": -100.0}),
    "bool target": (SCORES, TARGET.bool(), {}),
    "float target": (SCORES, TARGET.float(), {}),
    "(N, 1) scores": (SCORES.unsqueeze(-1), TARGET, {}),
    "above the size limit": (torch.rand(257, generator=g), torch.randint(0, 2, (257,), generator=g), {}),
    # Counts [[44, 7], [34, 3]]: MCC needs sqrt(5887440), which torch's CPU kernel rounds up by one
    # bit against the correctly rounded `math.sqrt`; the host path must take torch's.
    "a square root torch rounds differently": (
        torch.tensor([0.1] * 44 + [0.9] * 7 + [0.1] * 34 + [0.9] * 3),
        torch.tensor([0] * 51 + [1] * 37),
        {},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_edge_cases_equal_the_general_path(case):
    input, target, options = CASES[case]
    assert_same_on_both_paths(input, target, **options)


def test_a_small_batch_takes_one_tensor_op_per_metric():
    with CountOps() as counted:
        F.binary_accuracy(SCORES, TARGET)
    assert counted.ops == ["scalar_tensor.default"]


@settings(max_examples=30, deadline=None)
@given(ignore_index=st.sampled_from([None, -100, 1]), threshold=st.sampled_from([0.3, 0.5]), data=st.data())
def test_stream_binary_metrics_equal_the_general_path(ignore_index, threshold, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    batches = []
    for _ in range(data.draw(st.integers(1, 4))):
        rows = data.draw(st.sampled_from([1, 7, 32, 256, 257]))
        target = torch.randint(0, 2, (rows,), generator=g)
        if data.draw(st.booleans()):
            target[0] = data.draw(st.sampled_from([-100, 2]))
        batches.append((torch.randn(rows, generator=g), target))
    names = ["acc", "balanced_acc", "precision", "recall", "f1", "mcc"]

    def run():
        metrics = binary_metrics(names, mode="stream", threshold=threshold, ignore_index=ignore_index)
        for input, target in batches:
            metrics.update(input, target)
        return metrics

    fast, general = both_paths(run)
    for name in names:
        for kind in ("val", "avg", "sum", "count"):
            assert same(getattr(fast[name], kind), getattr(general[name], kind)), (name, kind)
