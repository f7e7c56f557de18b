"""The row-table and bucketize confusion counts against a direct mask-and-count reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from danling.metrics import multiclass_metrics, multilabel_metrics
from danling.metrics.functional._common import NARROW_POSITIONS, confusion_from_labels, label_counter


def reference(pred, target, num_classes, ignore_index, groups=1):
    """One (C, C) matrix per group and the count of invalid targets, by explicit masks."""
    pred, target = pred.reshape(-1, groups), target.reshape(-1, groups)
    matrix = torch.zeros(groups, num_classes, num_classes, dtype=torch.long)
    invalid = 0
    for row_p, row_t in zip(pred.tolist(), target.tolist()):
        for group, (p, t) in enumerate(zip(row_p, row_t)):
            if ignore_index is not None and t == ignore_index:
                continue
            if 0 <= t < num_classes:
                matrix[group, t, p] += 1
            else:
                invalid += 1
    return (matrix if groups > 1 else matrix[0]), invalid


@settings(max_examples=50, deadline=None)
@given(
    num_classes=st.integers(1, 5),
    groups=st.integers(1, 3),
    ignore_index=st.one_of(st.none(), st.integers(-3, 7), st.just(-100), st.just(-100.0), st.just(0.5)),
    data=st.data(),
)
def test_counts_match_the_masked_reference(num_classes, groups, ignore_index, data):
    n = data.draw(st.integers(0, 12))
    shape = (n, groups) if groups > 1 else (n,)
    pred = torch.tensor(data.draw(st.lists(st.integers(0, num_classes - 1), min_size=n * groups, max_size=n * groups)))
    target = torch.tensor(data.draw(st.lists(st.integers(-120, 9), min_size=n * groups, max_size=n * groups)))
    pred, target = pred.long().reshape(shape), target.long().reshape(shape)
    confusion = confusion_from_labels(pred, target, num_classes, ignore_index, groups=groups)
    matrix, invalid = reference(pred, target, num_classes, ignore_index, groups)
    assert torch.equal(confusion.matrix, matrix)
    assert int(confusion.invalid) == invalid


def test_counts_of_batches_add_up_to_the_counts_of_all_data():
    counter = label_counter(3, -100)
    pred, target = torch.tensor([0, 1, 2, 2, 1]), torch.tensor([0, -100, 2, 7, 1])
    total = counter.count(pred[:2], target[:2]) + counter.count(pred[2:], target[2:])
    assert torch.equal(counter.confusion(total).matrix, counter.confusion(counter.count(pred, target)).matrix)
    assert int(counter.confusion(total).invalid) == 1
    running = counter.empty()
    counter.accumulate(running, pred[:2], target[:2])
    counter.accumulate(running, pred[2:], target[2:])
    assert torch.equal(running, total)


def test_global_metrics_confusion_is_not_changed_by_later_updates():
    metrics = multiclass_metrics(3, metrics=["acc", "confmat"])
    metrics.update(torch.eye(3), torch.tensor([0, 1, 2]))
    first = metrics.avg["confmat"].clone() if isinstance(metrics.avg["confmat"], torch.Tensor) else None
    (store,) = metrics._stores.values()
    held = store.confusion
    metrics.update(torch.eye(3), torch.tensor([1, 1, 1]))
    assert torch.equal(held.matrix, torch.eye(3, dtype=torch.long))
    assert metrics.avg["acc"] == 4 / 6
    if first is not None:
        assert torch.equal(first, torch.eye(3, dtype=torch.long))


def test_invalid_targets_still_make_accuracy_nan_and_ignored_ones_are_skipped():
    metrics = multiclass_metrics(3, metrics=["acc"])
    metrics.update(torch.eye(3), torch.tensor([0, 1, -100]))
    assert metrics.avg["acc"] == 1.0
    metrics.update(torch.eye(3), torch.tensor([0, 1, 5]))
    assert metrics.avg["acc"] != metrics.avg["acc"]  # nan
    labels = multilabel_metrics(2, metrics=["acc"])
    labels.update(torch.tensor([[0.9, 0.1], [0.2, 0.8]]), torch.tensor([[1, -100], [0, 1]]))
    assert labels.avg["acc"] == 1.0


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
@pytest.mark.parametrize("ignore_index", [None, -100, 2, 10**12])
@pytest.mark.parametrize("n", [50, 5000])  # below and above NARROW_POSITIONS: int64 and int32 rows
def test_rows_from_the_table_or_bucketize_match_the_reference_at_any_target(dtype, ignore_index, n):
    """Targets reach their rows through a table of the boundaries' span, or `bucketize` beyond it.

    Values far outside the table (either end of the dtype) clamp to rows that count them invalid;
    a dtype that cannot hold the table's ends (or an `ignore_index` spanning more than
    `ROW_TABLE_SPAN` values) takes `bucketize`, with the same counts.
    """
    num_classes = 3
    g = torch.Generator().manual_seed(n)
    info = torch.iinfo(dtype)
    values = [v for v in (info.min, -101, -100, -99, -1, 0, 1, 2, 3, 4, 99, info.max) if info.min <= v <= info.max]
    target = torch.tensor(values, dtype=dtype)[torch.randint(0, len(values), (n,), generator=g)]
    pred = torch.randint(0, num_classes, (n,), generator=g)
    counter = label_counter(num_classes, ignore_index)
    uses_table = (
        counter.row_table is not None
        and dtype in (torch.int32, torch.int64)
        and info.min <= counter.low
        and counter.high <= info.max
    )
    assert uses_table == (ignore_index != 10**12 and dtype in (torch.int32, torch.int64))
    confusion = counter.confusion(counter.count(pred, target))
    matrix, invalid = reference(pred, target.long(), num_classes, ignore_index)
    assert torch.equal(confusion.matrix, matrix)
    assert int(confusion.invalid) == invalid
    assert counter._row_tables[(target.device, dtype, n >= NARROW_POSITIONS)] is not None or not uses_table


def test_host_view_reads_the_live_table_as_int64_items():
    counter = label_counter(3, -100)
    counts = counter.empty("cpu")
    view = counter.host_view(counts)
    assert isinstance(view, memoryview) and view.format == "q" and len(view) == counter.size
    counter.accumulate(counts, torch.tensor([0, 2, 2, 1]), torch.tensor([0, 2, 1, -100]))
    counter.accumulate(counts, torch.tensor([1]), torch.tensor([7]))  # an invalid target
    assert list(view) == counts.tolist()  # in-place adds show through the view
    through_view, through_tolist = counter.host_table(counts, view), counter.host_table(counts)
    assert list(through_view[0]) == list(through_tolist[0]) and through_view[1:] == through_tolist[1:]
    assert through_view[2] == 1
    # Tables the host does not read get no view: int32, strided, or larger than the host reads.
    assert counter.host_view(counts.int()) is None
    assert counter.host_view(torch.zeros(2 * counter.size, dtype=torch.long)[::2]) is None
    large = label_counter(64, None)
    assert large.host_view(large.empty("cpu")) is None
