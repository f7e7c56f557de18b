"""AUROC and AUPRC of large data, from sorted per-column copies (host) or a column at a time (device).

Same values as the curves, far less memory.
"""

import contextlib
import math
from unittest import mock

import numpy as np
import pytest
import torch
from sklearn import metrics as skm

from danling.metrics import (
    GlobalMetrics,
    MetricFunc,
    MetricState,
    MetricTask,
    binary_metrics,
    multiclass_metrics,
    multilabel_metrics,
)
from danling.metrics import global_metrics as global_metrics_module
from danling.metrics.functional import _ranking
from danling.metrics.functional import binary as B
from danling.metrics.functional import multiclass as M
from danling.metrics.functional import multilabel as L
from danling.metrics.functional._common import auprc_from_curves, auroc_from_curves


# Both builders of the ranking must give the curves' values: numpy on the host, and tensor ops on
# the data's device (run here on the CPU; `benchmarks/gpu_check.py` runs them on CUDA).
def tensor_ranking(kind, chunks, num_columns, ignore_index=None, *, micro=False):
    return _ranking.tensor_ranking(kind, chunks, num_columns, ignore_index, micro)


BUILDS = pytest.mark.parametrize("build", [_ranking.ranking, tensor_ranking], ids=["host", "tensor"])


def pieces_of(many: bool):
    # Pieces of a few rows and blocks of a few positives: every boundary a piece of rows or a
    # block of searched positives can have is crossed, runs of ties included.
    if not many:
        return contextlib.nullcontext()
    return mock.patch.multiple(_ranking, ELEMENTS=29, MIN_BLOCK=5, MAX_BLOCK=5)


def tied(generator, *shape):
    return (torch.randn(*shape, generator=generator) * 2).round(decimals=1)  # few distinct values


def check(ranking, curves):
    expected_auroc, expected_auprc = auroc_from_curves(curves), auprc_from_curves(curves)
    assert torch.equal(ranking.auroc.nan_to_num(-1), expected_auroc.nan_to_num(-1))  # integer sums: same float
    torch.testing.assert_close(ranking.auprc, expected_auprc, rtol=1e-12, atol=0, equal_nan=True)
    positives = curves.tps[:, -1] if curves.tps.shape[1] else torch.zeros(curves.tps.shape[0], dtype=torch.long)
    assert torch.equal(ranking.positives, positives)


@pytest.mark.parametrize("small", [False, True], ids=["one-block", "many-blocks"])
@pytest.mark.parametrize("n", [0, 1, 9, 70_000])
@BUILDS
def test_ranking_equals_the_curves(n, small, build):
    g = torch.Generator().manual_seed(n)
    with pieces_of(small):
        scores, target = tied(g, n), torch.randint(0, 2, (n,), generator=g)
        target[::13] = -100
        half = n // 2  # two chunks, the second with narrowed targets
        chunks = [(scores[:half], target[:half]), (scores[half:], target[half:].to(torch.int8))]
        check(build("binary", chunks, 1, -100), B.binary_curves(scores, target, -100))
        for logits in (True, False):
            x = tied(g, n, 4)
            x = x if logits else x.softmax(-1)
            y = torch.randint(0, 4, (n,), generator=g)
            y[::11] = -100
            chunks = [(x[:half], y[:half]), (x[half:], y[half:].to(torch.int16))]
            for micro in (False, True):
                expected = M.multiclass_curves(x, y, -100, micro=micro)
                check(build("multiclass", chunks, 4, -100, micro=micro), expected)
        x, y = tied(g, n, 3), torch.randint(0, 2, (n, 3), generator=g)
        if n:
            y[0, 1] = -100
        for micro in (False, True):
            check(
                build("multilabel", [(x, y)], 3, -100, micro=micro),
                L.multilabel_curves(x, y, -100, micro=micro),
            )


@BUILDS
def test_invalid_targets_and_nan_scores_give_nan(build):
    scores, target = torch.rand(100), torch.randint(0, 2, (100,))
    target[5] = 3  # neither a label nor ignored
    assert build("binary", [(scores, target)], 1, -100).auroc.isnan().all()
    target[5] = -100
    assert not build("binary", [(scores, target)], 1, -100).auroc.isnan().any()
    scores[7] = float("nan")  # sklearn refuses it; the curves would rank it somewhere
    assert build("binary", [(scores, target)], 1, -100).auroc.isnan().all()
    scores[7], target[7] = float("nan"), -100  # an ignored sample's score does not matter
    assert not build("binary", [(scores, target)], 1, -100).auprc.isnan().any()


@pytest.mark.parametrize("ignore_index", [None, -100, 2, 300])
@BUILDS
def test_invalid_targets_of_classes_and_labels_give_what_the_curves_give(ignore_index, build):
    """A target that is neither a label nor ignored makes its column nan (multiclass: every column)."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.rand(90, 3, generator=g), torch.randint(0, 2, (90, 3), generator=g)
    y[4, 1], y[9, 2] = 7, -100  # label 1 has an invalid target; label 2 an ignored (or invalid) one
    y[11, 0] = 2  # a label value only when ignore_index is 2... which 0/1 labels never are
    narrowed = y.to(torch.int8)
    for micro in (False, True):
        expected = L.multilabel_curves(x, y, ignore_index, micro=micro)
        check(build("multilabel", [(x, narrowed)], 3, ignore_index, micro=micro), expected)
    logits, classes = torch.randn(90, 4, generator=g), torch.randint(0, 4, (90,), generator=g)
    classes[5] = 9
    classes[6] = -100
    for micro in (False, True):
        expected = M.multiclass_curves(logits, classes, ignore_index, micro=micro)
        chunks = [(logits, classes.to(torch.int16))]
        check(build("multiclass", chunks, 4, ignore_index, micro=micro), expected)


@BUILDS
def test_a_nan_score_of_an_ignored_row_does_not_hide_logits_beside_it(build):
    """Logits are found as the curves find them: an ignored row's nan next to them changes nothing."""
    g = torch.Generator().manual_seed(4)
    logits, classes = torch.randn(50, 3, generator=g), torch.randint(0, 3, (50,), generator=g)
    logits[7, 1], classes[7] = float("nan"), -100  # min/max of this piece would be nan
    check(build("multiclass", [(logits, classes)], 3, -100), M.multiclass_curves(logits, classes, -100))


@BUILDS
def test_negative_zero_ties_with_zero(build):
    scores = torch.tensor([0.0, -0.0, 0.5, -0.0, 0.0, -1.0])
    target = torch.tensor([1, 0, 1, 1, 0, 0])
    ranking = build("binary", [(scores, target)], 1)
    assert ranking.auroc.item() == pytest.approx(skm.roc_auc_score(target.numpy(), scores.numpy()))
    assert ranking.auprc.item() == pytest.approx(skm.average_precision_score(target.numpy(), scores.numpy()))


def feed(metrics, input, target, batch=4096):
    for start in range(0, target.shape[0], batch):
        metrics.update(input[start : start + batch], target[start : start + batch])


@pytest.mark.parametrize("kind", ["binary", "multiclass", "multilabel"])
def test_the_ranking_serves_from_8192_scores_with_sklearns_values(kind):
    """From `RANKING_MIN_SCORES` (8,192) host scores on, AUROC and AUPRC come from the ranking.

    It was faster than the sorted curves from about 5,000 scores of ten columns, and from a few
    dozen of one (the curves hold about fifteen times the scores as well).
    """
    g = torch.Generator().manual_seed(3)
    rows, columns = (8192, 1) if kind == "binary" else (820, 10)
    scores = torch.rand((rows,) if kind == "binary" else (rows, columns), generator=g)
    if kind == "multiclass":
        target = torch.randint(0, columns, (rows,), generator=g)
        task = MetricTask(kind, num_classes=columns)
    else:
        target = torch.randint(0, 2, scores.shape, generator=g)
        task = MetricTask(kind, num_labels=columns) if kind == "multilabel" else MetricTask(kind)
    state = MetricState.from_batch(task, scores, target)
    ranking = state.ranking()
    assert ranking is not None
    assert MetricState.from_batch(task, scores[: rows // 2], target[: rows // 2]).ranking() is None
    y, p = target.numpy(), scores.reshape(rows, columns).numpy()
    truth = (y[:, None] == np.arange(columns)) if kind == "multiclass" else y.reshape(rows, columns)
    for column in range(columns):
        assert ranking.auroc[column].item() == pytest.approx(
            skm.roc_auc_score(truth[:, column], p[:, column]), abs=1e-12
        )
        expected = skm.average_precision_score(truth[:, column], p[:, column])
        assert ranking.auprc[column].item() == pytest.approx(expected, abs=1e-12)


def test_splitting_small_binary_data_holds_little_beside_its_sorted_copy():
    """The host ranking's numpy allocations peak near its sorted copy (1x the scores), at any N.

    Splitting 1e5 binary scores in pieces of 65,536 peaked at 1.6x: two masks and `np.compress`'s
    int64 positions of a piece were half the scores. Pieces of a sixteenth of the data (8,192 at
    least) keep them small. (tracemalloc sees numpy's arrays; the ranking holds no torch tensor.)
    """
    import tracemalloc

    g = torch.Generator().manual_seed(5)
    n = 100_000
    target = torch.randint(0, 2, (n,), generator=g)
    scores = torch.randn(n, generator=g) + target
    chunks = list(zip(scores.split(30_000), target.to(torch.int8).split(30_000)))
    expected = skm.roc_auc_score(target.numpy(), scores.numpy())
    tracemalloc.start()
    try:
        ranking = _ranking.ranking("binary", chunks, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ranking.auroc.item() == pytest.approx(expected, abs=1e-12)
    assert peak < 1.3 * scores.numel() * scores.element_size()


@pytest.mark.parametrize("small", [False, True], ids=["one-block", "many-blocks"])
def test_global_metrics_at_scale_match_sklearn(small):
    """Above `RANKING_MIN_SCORES` the containers read kept chunks through the ranking: sklearn's values."""
    g = torch.Generator().manual_seed(0)
    n = 80_000
    with pieces_of(small):
        target = torch.randint(0, 2, (n,), generator=g)
        scores = tied(g, n) + target
        metrics = binary_metrics(["auroc", "auprc"])
        feed(metrics, scores, target)
        result = metrics.compute()
        assert result["auroc"] == pytest.approx(skm.roc_auc_score(target, scores), abs=1e-12)
        assert result["auprc"] == pytest.approx(skm.average_precision_score(target, scores), abs=1e-12)

        labels = torch.randint(0, 5, (n,), generator=g)
        logits = tied(g, n, 5) + torch.nn.functional.one_hot(labels, 5)
        metrics = multiclass_metrics(5, metrics=["acc", "auroc", "auprc"])
        feed(metrics, logits, labels)
        result = metrics.compute()
        probabilities = logits.softmax(-1).numpy()
        assert result["auroc"] == pytest.approx(skm.roc_auc_score(labels, probabilities, multi_class="ovr"), abs=1e-12)
        one_hot = np.eye(5)[labels.numpy()]
        expected = skm.average_precision_score(one_hot, probabilities, average="macro")
        assert result["auprc"] == pytest.approx(expected, abs=1e-12)

        flags = torch.randint(0, 2, (n, 3), generator=g)
        scores = tied(g, n, 3) + flags
        metrics = multilabel_metrics(3, metrics=["auroc", "auprc"], average="weighted")
        feed(metrics, scores, flags)
        result = metrics.compute()
        assert result["auroc"] == pytest.approx(skm.roc_auc_score(flags, scores, average="weighted"), abs=1e-12)
        expected = skm.average_precision_score(flags, scores, average="weighted")
        assert result["auprc"] == pytest.approx(expected, abs=1e-12)


def test_kept_targets_are_narrowed_and_read_back_exactly():
    """Class targets are kept in the smallest dtype holding them; every reader still gets int64."""
    g = torch.Generator().manual_seed(1)
    n = 70_000
    labels = torch.randint(0, 3, (n,), generator=g)
    labels[::7] = -100
    logits = torch.randn(n, 3, generator=g)
    seen = []
    task = MetricTask("multiclass", num_classes=3, ignore_index=-100)  # the task of multiclass_metrics(3)
    custom = MetricFunc("custom", lambda state: seen.append(state.data[1]) or 0.0, task, "data")
    metrics = GlobalMetrics(custom, auroc=multiclass_metrics(3, metrics=["auroc"]).metrics["auroc"])
    feed(metrics, logits, labels, batch=1000)
    metrics.compute()
    (store,) = metrics._stores.values()  # one task: its metrics share the kept data
    assert {target.dtype for _, target in store.chunks} == {torch.int8}  # 1 byte per sample, not 8
    assert len(store.chunks) < n // 1000  # batches joined into chunks
    assert seen[0].dtype is torch.int64 and torch.equal(seen[0], labels)
    state = metrics.state_dict()["tasks"]["0"]
    assert state["targets"].dtype is torch.int64 and torch.equal(state["targets"], labels)


def in_order(names):
    """Binary catalogue metrics with a reader of the data in order: their store keeps the batches as
    they came (joined into chunks), as every store does whose metrics read more than a ranking."""
    catalogue = binary_metrics(names).metrics
    task = next(iter(catalogue.values())).task
    return GlobalMetrics(**catalogue, ordered=MetricFunc("ordered", lambda state: 0.0, task, "data"))


def test_joining_copies_in_bounded_groups():
    """Kept batches are joined once they hold `DATA_BYTES`, so a join never copies much at once."""
    # A batch of 400 float32 scores and int64 targets holds 4,800 bytes: joined every third.
    with mock.patch.multiple(global_metrics_module, DATA_BYTES=10_000, DATA_BATCHES=64):
        metrics = in_order(["auroc"])
        for _ in range(10):
            metrics.update(torch.rand(400), torch.randint(0, 2, (400,)))
        (store,) = metrics._stores.values()
        assert [chunk.shape[0] for chunk, _ in store.chunks] == [1200, 1200, 1200]  # joined at 1000+ scores
        assert len(store.inputs) == 1


def test_the_latest_batch_is_read_from_the_kept_data_not_held_twice():
    """Once joined, the latest batch is the tail of a chunk: `val` and checkpoints read it back there."""
    from danling.metrics.functional import binary_auroc

    generator = torch.Generator().manual_seed(3)
    scores, labels = torch.rand(2400, generator=generator), torch.randint(0, 2, (2400,), generator=generator)
    batches = list(zip(scores.split(400), labels.split(400)))  # different batches: `val` must be the latest
    with mock.patch.multiple(global_metrics_module, DATA_BYTES=10_000, DATA_BATCHES=64):
        metrics = in_order(["acc", "auroc"])
        for input, target in batches:
            metrics.update(input, target)
            (store,) = metrics._stores.values()
            expected = {"acc": ((input > 0.5).long() == target).double().mean().item()}
            expected["auroc"], expected["ordered"] = binary_auroc(input, target).item(), 0.0
            assert metrics.val == pytest.approx(expected)  # before and after each join
        assert store.last is None and not store.inputs  # the sixth batch was joined: nothing held apart
        input, target = store.latest()
        assert input.untyped_storage().data_ptr() == store.chunks[-1][0].untyped_storage().data_ptr()
        assert target.dtype is torch.int64 and torch.equal(target, batches[-1][1])
        state = metrics.state_dict()["tasks"]["0"]
        # A checkpoint holds the latest batch on its own, not the whole chunk it is a view of.
        assert state["last_input"].untyped_storage().nbytes() == 400 * 4
        assert state["last_target"].dtype is torch.int64 and torch.equal(state["last_target"], batches[-1][1])
        restored = in_order(["acc", "auroc"])
        restored.load_state_dict(metrics.state_dict())
        assert restored.val == pytest.approx(metrics.val) and restored.avg == pytest.approx(metrics.avg)


def test_a_local_read_joins_the_batches_kept_since_the_last_join_and_narrows_their_targets():
    """`compute` joins the batches kept since the last join, then reads the chunks where they lie.

    The join narrows their int64 targets before the ranking copies the scores: read unjoined,
    binary AUROC over 1e5 scores peaked at 2.66x the scores instead of 2.48x.
    """
    generator = torch.Generator().manual_seed(4)
    input, target = torch.rand(1200, generator=generator), torch.randint(0, 2, (1200,), generator=generator)
    # A batch of 200 holds 2,400 bytes: the fifth reaches 10,000 and joins, the sixth waits.
    with mock.patch.multiple(global_metrics_module, DATA_BYTES=10_000, DATA_BATCHES=64):
        metrics = in_order(["auroc"])
        for start in range(0, 1200, 200):
            metrics.update(input[start : start + 200], target[start : start + 200])
        (store,) = metrics._stores.values()
        assert [chunk.shape[0] for chunk, _ in store.chunks] == [1000] and len(store.inputs) == 1
        joined = store.chunks[0][0].untyped_storage().data_ptr()
        assert metrics.compute()["auroc"] == pytest.approx(skm.roc_auc_score(target, input), abs=1e-12)
        assert [chunk.shape[0] for chunk, _ in store.chunks] == [1000, 200] and not store.inputs
        assert all(labels.dtype is torch.int8 for _, labels in store.chunks)
        assert store.chunks[0][0].untyped_storage().data_ptr() == joined  # the earlier chunk is not copied again
        assert torch.equal(store.latest()[1], target[1000:])  # `val` still reads the latest batch
        metrics.update(input[:200], target[:200])  # later batches join after the chunks as before
        assert metrics.compute()["auroc"] == pytest.approx(
            skm.roc_auc_score(torch.cat([target, target[:200]]), torch.cat([input, input[:200]])), abs=1e-12
        )


@pytest.mark.parametrize("n", [8, 70_000])  # the sorted curves (small, or any device) and the sorted per-column copies
def test_a_nan_score_gives_nan_on_every_path_unless_its_sample_is_ignored(n):
    # The curves ranked a nan score at one end: [0.1, nan, 0.8, 0.4] against [0, 1, 1, 0] gave AUROC 1.0.
    from danling.metrics import GlobalMetrics
    from danling.metrics.functional import binary_auprc, binary_auroc, multiclass_auroc

    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(n, generator=generator)
    target = (torch.rand(n, generator=generator) < scores).long()
    scores[1] = float("nan")
    assert binary_auroc(scores, target).isnan() and binary_auprc(scores, target).isnan()
    metrics = GlobalMetrics(auroc=binary_auroc)
    metrics.update(scores, target)
    assert math.isnan(metrics.avg["auroc"])
    logits = torch.randn(n, 3, generator=generator)
    logits[1, 2] = float("nan")
    assert multiclass_auroc(logits, target, num_classes=3).isnan()
    target[1] = -100  # an ignored sample's score does not matter
    assert not binary_auroc(scores, target, ignore_index=-100).isnan()


@pytest.mark.parametrize("average", ["macro", "weighted"])
@pytest.mark.parametrize("n", [8, 70_000])  # the sorted curves, and the sorted per-column copies
def test_a_nan_score_or_invalid_target_of_one_label_makes_the_label_average_nan(n, average):
    # Averages over labels skip labels whose value is undefined by their classes (no positives,
    # or no negatives for AUROC). A label made nan by a NaN score or a target that is no label
    # was skipped the same way: the average silently covered the other labels only.
    from danling.metrics import multilabel_metrics
    from danling.metrics.functional import multilabel_auprc, multilabel_auroc

    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(n, 3, generator=generator)
    target = (torch.rand(n, 3, generator=generator) < scores).long()
    target[:, 0] = 1  # label 0: no negatives, so no AUROC; skipped as before
    clean = multilabel_auroc(scores, target, average=average)
    assert not clean.isnan()
    assert multilabel_auroc(scores, target, average=None)[0].isnan()
    for spoil in ("score", "target"):
        spoilt_scores, spoilt_target = scores.clone(), target.clone()
        if spoil == "score":
            spoilt_scores[1, 2] = float("nan")
        else:
            spoilt_target[1, 2] = 7
        assert multilabel_auroc(spoilt_scores, spoilt_target, average=average).isnan()
        assert multilabel_auprc(spoilt_scores, spoilt_target, average=average).isnan()
        metrics = multilabel_metrics(3, ["auroc", "auprc"], average=average, ignore_index=None)
        metrics.update(spoilt_scores, spoilt_target)
        assert all(math.isnan(value) for value in metrics.avg.values())
    spoilt_target = target.clone()
    spoilt_target[1, 2] = -100  # an ignored entry is no error
    assert not multilabel_auroc(scores, spoilt_target, average=average, ignore_index=-100).isnan()


@pytest.mark.parametrize("kind", ["binary", "multiclass", "multilabel"])
def test_data_off_the_host_is_ranked_on_its_device_without_joining_the_chunks(kind):
    """Device data (here `meta`, which any non-CPU device stands for) takes `tensor_ranking`.

    The curves of all columns at once took 20-22x the scores on an H200; the ranking keeps its
    results on the device (nothing read on the host) and reads the chunks as they are.
    """
    shape = (5000,) if kind == "binary" else (5000, 4)
    chunks = [
        (
            torch.randn(shape, device="meta"),
            torch.zeros(shape[: 1 if kind == "multiclass" else None], dtype=torch.int8, device="meta"),
        )
    ] * 2
    size = {"binary": {}, "multiclass": {"num_classes": 4}, "multilabel": {"num_labels": 4}}[kind]
    task = MetricTask(kind, **size)
    state = MetricState(task, chunks=chunks)
    ranking = state.ranking()
    columns = 1 if kind == "binary" else 4
    assert ranking.auroc.device.type == "meta" and ranking.auroc.shape == (columns,)
    assert ranking.positives.shape == (columns,)
    assert state.input is None  # the chunks were not concatenated
    assert state.ranking(micro=True).auroc.shape == (1,)
