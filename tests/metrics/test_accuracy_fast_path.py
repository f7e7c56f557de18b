"""Micro (and weighted) multiclass accuracy skips the confusion matrix: same values, same dtype."""

from __future__ import annotations

import math

import pytest
import torch

from danling.metrics.functional import accuracy
from danling.metrics.functional.multiclass import _confusion, accuracy_from_confusion, multiclass_accuracy


def _slow(input, target, num_classes=None, ignore_index=None, average="micro"):
    return accuracy_from_confusion(_confusion(input, target, num_classes, ignore_index), average)


def _same(fast: torch.Tensor, slow: torch.Tensor) -> None:
    assert fast.dtype == slow.dtype and fast.shape == slow.shape
    assert torch.equal(fast, slow) or (math.isnan(fast.item()) and math.isnan(slow.item()))


generator = torch.Generator().manual_seed(0)
SCORES = torch.randn(64, 5, generator=generator)
TARGET = torch.randint(0, 5, (64,), generator=generator)
CASES = {
    "plain": (SCORES, TARGET, {}),
    "ignore a class": (SCORES, TARGET, {"ignore_index": 2}),
    "ignore -100": (SCORES, torch.where(TARGET == 1, -100, TARGET), {"ignore_index": -100}),
    "ignore as float": (SCORES, torch.where(TARGET == 1, -100, TARGET), {"ignore_index": -100.0}),
    "fractional ignore never matches": (SCORES, TARGET, {"ignore_index": 1.5}),
    "ignore a class, one invalid target": (SCORES, torch.cat([TARGET[:-1], torch.tensor([9])]), {"ignore_index": 2}),
    "ignore a class, all targets ignored": (SCORES, torch.full((64,), 2), {"ignore_index": 2}),
    "invalid target": (SCORES, torch.cat([TARGET[:-1], torch.tensor([7])]), {}),
    "negative target not ignored": (SCORES, torch.cat([TARGET[:-1], torch.tensor([-1])]), {"ignore_index": -100}),
    "everything ignored": (SCORES, torch.full((64,), -100), {"ignore_index": -100}),
    "empty batch": (torch.randn(0, 5), torch.zeros(0, dtype=torch.long), {}),
    "class dimension second": (torch.randn(4, 5, 6, generator=generator), torch.randint(0, 5, (4, 6)), {}),
    "tokens, class last": (torch.randn(4, 6, 5, generator=generator), torch.randint(0, 5, (4, 6)), {}),
    "predicted labels": (torch.tensor([0, 2, 9, -1, 4]), torch.tensor([0, 2, 3, 0, 1]), {"num_classes": 5}),
    "nan scores": (torch.where(SCORES > 1, math.nan, SCORES), TARGET, {}),
    "ties": (torch.zeros(64, 5), TARGET, {}),
    "uint8 targets, more classes than uint8 holds": (
        torch.randn(8, 300, generator=generator),
        torch.randint(0, 255, (8,), generator=generator).to(torch.uint8),
        {},
    ),
    "int32 targets": (SCORES, TARGET.int(), {"ignore_index": 3}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("average", ["micro", "weighted"])
def test_fast_accuracy_equals_the_confusion_matrix_path(case, average):
    input, target, options = CASES[case]
    _same(
        multiclass_accuracy(input, target, average=average, **options), _slow(input, target, average=average, **options)
    )


def test_the_generic_entry_point_takes_the_fast_path_with_the_same_result():
    _same(accuracy(SCORES, TARGET, num_classes=5), _slow(SCORES, TARGET))
    _same(accuracy(SCORES, TARGET, ignore_index=0), _slow(SCORES, TARGET, ignore_index=0))


def test_macro_accuracy_still_averages_per_class_recall():
    _same(multiclass_accuracy(SCORES, TARGET, average="macro"), _slow(SCORES, TARGET, average="macro"))
    assert not torch.equal(multiclass_accuracy(SCORES, TARGET, average="macro"), multiclass_accuracy(SCORES, TARGET))


def test_micro_accuracy_builds_no_confusion_matrix(monkeypatch):
    from danling.metrics.functional import multiclass

    def refuse(*args, **kwargs):
        raise AssertionError("micro accuracy built a confusion matrix")

    monkeypatch.setattr(multiclass, "confusion_from_labels", refuse)
    assert multiclass_accuracy(SCORES, TARGET).item() == (SCORES.argmax(-1) == TARGET).double().mean().item()
    with pytest.raises(AssertionError, match="built a confusion matrix"):
        multiclass_accuracy(SCORES, TARGET, average="macro")
