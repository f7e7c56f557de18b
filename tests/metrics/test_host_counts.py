"""Accumulated CPU confusion counts are read on the host at `compute`, with the same values.

`GlobalMetrics` keeps confusion counts as a flat tensor; reading a small table with one `tolist`
and doing the arithmetic in Python replaces shaping the counts and a dozen tensor ops per
metric. Each case computes the same data twice, with the host read and with it switched off
(`HOST_TABLE_SIZE = 0`: the confusion-matrix path), and compares every value exactly: dtype,
shape, every bit, `nan` where the tensor path gives `nan`.
"""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from danling.metrics import (
    GlobalMetrics,
    MetricFunc,
    MetricTask,
    binary_metrics,
    multiclass_metrics,
    multilabel_metrics,
)
from danling.metrics.functional import _common, _host
from tests.metrics._compare import CountOps, same

NAMES = ["acc", "balanced_acc", "precision", "recall", "f1", "mcc"]
AVERAGES = ["macro", "weighted", "micro", None]


def build(task: str, size: int, average, ignore_index):
    if task == "binary":
        return binary_metrics(NAMES, ignore_index=ignore_index)
    factory = multiclass_metrics if task == "multiclass" else multilabel_metrics
    return factory(size, metrics=NAMES, average=average, ignore_index=ignore_index)


def values(task, size, average, ignore_index, batches, *, host: bool):
    metrics = build(task, size, average, ignore_index)
    for input, target in batches:
        metrics.update(input, target)
    saved = _common.HOST_TABLE_SIZE
    if not host:
        _common.HOST_TABLE_SIZE = 0
    try:
        return dict(metrics.avg)
    finally:
        _common.HOST_TABLE_SIZE = saved


def assert_same_on_both_paths(task, size, average, ignore_index, batches):
    fast = values(task, size, average, ignore_index, batches, host=True)
    general = values(task, size, average, ignore_index, batches, host=False)
    assert fast.keys() == general.keys()
    for name in fast:
        assert same(fast[name], general[name]), (task, average, name, fast[name], general[name])


def make_batch(task, size, rows, generator, spread):
    if task == "binary":
        target = torch.randint(0, spread, (rows,), generator=generator)
        return torch.rand(rows, generator=generator), target
    if task == "multiclass":
        target = torch.randint(0, spread, (rows,), generator=generator)
        return torch.randn(rows, size, generator=generator), target
    # Few positives or few negatives make labels never positive / never predicted (the 0/0 cases).
    target = (torch.rand(rows, size, generator=generator) < spread / 4).long()
    return torch.rand(rows, size, generator=generator) ** spread, target


@settings(max_examples=120, deadline=None)
@given(
    task=st.sampled_from(["binary", "multiclass", "multilabel"]),
    average=st.sampled_from(AVERAGES),
    size=st.integers(1, 12),
    rows=st.lists(st.integers(0, 300), min_size=0, max_size=4),
    ignore_index=st.sampled_from([None, -100, 0, 1]),
    data=st.data(),
)
def test_random_counts_equal_the_confusion_matrix_path(task, average, size, rows, ignore_index, data):
    size = 2 if task == "binary" else size
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    spread = data.draw(st.integers(1, 2 if task == "binary" else max(size, 4) if task == "multiclass" else 4))
    batches = []
    for count in rows:
        input, target = make_batch(task, size, count, generator, min(spread, size) if task == "multiclass" else spread)
        for _ in range(data.draw(st.integers(0, 2)) if count else 0):  # ignored and invalid targets
            index = data.draw(st.integers(0, count - 1))
            target.view(count, -1)[index, 0] = data.draw(st.sampled_from([-100, -1, size, 0]))
        batches.append((input, target))
    assert_same_on_both_paths(task, size, average, ignore_index, batches)


g = torch.Generator().manual_seed(5)
FLAGS = torch.randint(0, 2, (64, 4), generator=g)
LABEL_CASES = {
    "plain": (torch.rand(64, 4, generator=g), FLAGS),
    "no positives anywhere, none predicted": (torch.zeros(64, 4), torch.zeros(64, 4, dtype=torch.long)),
    "every target ignored": (torch.rand(64, 4, generator=g), torch.full((64, 4), -100)),
    "an invalid target": (torch.rand(64, 4, generator=g), torch.cat([FLAGS[:-1], torch.tensor([[0, 1, 2, 0]])])),
    "one label never positive": (torch.rand(64, 4, generator=g), FLAGS * torch.tensor([1, 1, 1, 0])),
    "perfect": (FLAGS.float(), FLAGS),
}


@pytest.mark.parametrize("case", list(LABEL_CASES))
@pytest.mark.parametrize("average", AVERAGES)
def test_multilabel_edge_cases_equal_the_confusion_matrix_path(case, average):
    assert_same_on_both_paths("multilabel", 4, average, -100, [LABEL_CASES[case]])


@pytest.mark.parametrize("task", ["binary", "multiclass", "multilabel"])
def test_no_update_gives_nan_on_both_paths(task):
    assert_same_on_both_paths(task, 3 if task != "binary" else 2, "macro", -100, [])


def scaled(task: str, average, factor: int):
    """A container of every host metric whose counts are multiplied by `factor` (same proportions)."""
    generator = torch.Generator().manual_seed(5)
    metrics = build(task, 4 if task != "binary" else 2, average, -100)
    metrics.update(*make_batch(task, 4, 200, generator, 4 if task == "multiclass" else 2))
    state = metrics.state_dict()
    for entry in state["tasks"].values():
        entry["counts"].mul_(factor)
    metrics.load_state_dict(state)
    return metrics


@pytest.mark.parametrize("task", ["binary", "multiclass", "multilabel"])
@pytest.mark.parametrize("average", AVERAGES)
@pytest.mark.parametrize("factor", [(1 << 34) + 7, (1 << 19) + 3, 3**25])
def test_counts_whose_products_round_in_float64_give_the_tensor_paths_values(task, average, factor):
    """From 2**26 counted samples MCC's products of counts round in float64; the host rounds them alike.

    Every metric (MCC included) equals the tensor path's value, bit for bit, with counts scaled
    to between about 2**26 and 2**47 samples; the other metrics only add counts, exact up to 2**53.
    """
    metrics = scaled(task, average, factor)
    (store,) = metrics._stores.values()
    counts = _host.counts_of_confusion(store.counter.confusion(store.counts))
    pooled = counts.pooled if task == "multilabel" else counts
    assert pooled.total >= _host._EXACT_TOTAL  # the float64 branch of `mcc_of`
    host = dict(metrics.avg)
    saved = _common.HOST_TABLE_SIZE
    _common.HOST_TABLE_SIZE = 0
    try:
        metrics._cache.clear()
        general = dict(metrics.avg)
    finally:
        _common.HOST_TABLE_SIZE = saved
    for name in host:
        assert same(host[name], general[name]), (task, average, name, host[name], general[name])


def test_counts_beyond_exact_float64_sums_take_the_tensor_path():
    metrics = scaled("multiclass", "macro", 1 << 52)
    (store,) = metrics._stores.values()
    assert _host.counts_of_confusion(store.counter.confusion(store.counts)) is None
    small = multiclass_metrics(3, metrics=["acc"])
    small.update(torch.eye(3), torch.arange(3))
    (small_store,) = small._stores.values()
    assert _host.counts_of_confusion(small_store.counter.confusion(small_store.counts)) is not None


def test_reading_accumulated_counts_dispatches_a_third_of_the_tensor_paths_ops():
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(300, 5, generator=generator), torch.randint(0, 5, (300,), generator=generator))] * 3
    counted = {}
    for host in (True, False):
        metrics = multiclass_metrics(5, metrics=["acc", "f1", "mcc", "precision", "recall"])
        for batch in batches:
            metrics.update(*batch)
        (store,) = metrics._stores.values()
        store.flush()
        saved = _common.HOST_TABLE_SIZE
        _common.HOST_TABLE_SIZE = saved if host else 0
        try:
            with CountOps() as ops:
                metrics.compute()
        finally:
            _common.HOST_TABLE_SIZE = saved
        counted[host] = ops.ops
    # One read of the counts, then per metric its 0-d result (and the few torch reductions that
    # must round as the tensor path does); the tensor path shapes the counts and runs each formula.
    assert len(counted[True]) * 2.5 < len(counted[False]), counted
    assert not {"view.default", "index_select.default", "diagonal.default"} & set(counted[True])


@pytest.mark.parametrize("task", ["binary", "multiclass", "multilabel"])
def test_host_scores_reach_the_container_as_floats_and_callers_as_tensors(task):
    # A score computed on the host is a Python float: the container reads it without a tensor
    # made and read back (scalar_tensor + item were about a quarter of a cold acc-only compute).
    generator = torch.Generator().manual_seed(0)
    size = 5000  # counted by `update`: nothing left for `compute` to count
    if task == "binary":
        batch = torch.randn(size, generator=generator), torch.randint(0, 2, (size,), generator=generator)
    elif task == "multiclass":
        batch = torch.randn(size, 4, generator=generator), torch.randint(0, 4, (size,), generator=generator)
    else:
        batch = torch.randn(size, 4, generator=generator), torch.randint(0, 2, (size, 4), generator=generator)
    metrics = build(task, 4, "macro", None)
    metrics.update(*batch)
    metrics.compute()  # the first read fills per-process caches
    metrics.update(*batch)
    counted = build(task, 4, "macro", None)
    counted.metrics = {"acc": counted.metrics["acc"]}
    counted.update(*batch)
    counted.update(*batch)
    with CountOps() as ops:
        acc = counted.compute()["acc"]
    assert same(acc, metrics.compute()["acc"])
    assert not {"scalar_tensor.default", "_local_scalar_dense.default"} & set(ops.ops), ops.ops
    (store,) = metrics._stores.values()
    state, values = store.state("avg", None), metrics.compute()
    for name in NAMES:
        if task != "multilabel" or name in ("acc", "balanced_acc", "mcc"):  # one value, not per label
            assert type(values[name]) is float, name
        called = metrics.metrics[name](state)  # called as a function: a float64 tensor, as always
        assert type(called) is torch.Tensor and called.dtype == torch.float64 and called.ndim == 0
        assert same(called.item(), values[name])


def test_kept_tables_are_read_without_tolist_and_follow_later_updates(monkeypatch):
    # Two containers of one task share its label counter; each keeps a reader of its own table,
    # made at its first count, which later in-place adds must show through.
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(40, 4, generator=g), torch.randint(-1, 4, (40,), generator=g)) for _ in range(4)]
    expected = []
    for step in range(1, len(batches) + 1):
        first = values("multiclass", 4, "macro", -1, batches[:step], host=False)
        second = values("multiclass", 4, "macro", -1, batches[:step][::-1], host=False)
        expected.append((first, second))
    metrics, other = build("multiclass", 4, "macro", -1), build("multiclass", 4, "macro", -1)

    def refuse(self, *args, **kwargs):
        raise AssertionError("a kept table was read with tolist")

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "tolist", refuse)
        for step, (first, second) in enumerate(expected, 1):
            metrics.update(*batches[step - 1])
            other.reset()
            for batch in batches[:step][::-1]:
                other.update(*batch)
            for container, reference in ((metrics, first), (other, second)):
                got = dict(container.avg)
                assert all(same(got[name], reference[name]) for name in NAMES), (step, got, reference)
    copy = deepcopy(metrics)  # a copy reads its own table, not the original's memory
    metrics.update(*batches[0])  # added to the original's table in place
    assert all(same(copy.avg[name], expected[-1][0][name]) for name in NAMES)
    copy.update(*batches[1])  # and its own updates show
    reference = values("multiclass", 4, "macro", -1, [*batches, batches[1]], host=False)
    assert all(same(copy.avg[name], reference[name]) for name in NAMES)


@pytest.mark.parametrize("kind", ["avg", "val"])
def test_a_metric_reading_data_it_did_not_declare_is_refused_not_given_an_empty_batch(kind):
    # A store of counts keeps no data: its states hold the counts alone (`avg` always; `val` for a
    # batch of 4096 targets or more, counted alone). An empty batch there turned such a metric
    # into a silent NaN or zero.
    task = MetricTask("multiclass", num_classes=3)
    rows = MetricFunc("rows", lambda state: state.data[0].shape[0], task, "confusion")
    metrics = GlobalMetrics(rows=rows)
    size = 4096 if kind == "val" else 4
    metrics.update(torch.randn(size, 3), torch.arange(size) % 3)
    with pytest.raises(ValueError, match="only holds summaries"):
        metrics.read(kind)
