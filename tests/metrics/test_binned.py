"""Binned AUROC / AUPRC: within the documented bound of the exact values, in constant memory."""

import math

import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score

from danling.metrics import MetricTask, binary_metrics, multiclass_metrics, multilabel_metrics
from danling.metrics.functional.binned import (
    binned_auprc,
    binned_auroc,
    binned_auroc_bound,
    binned_counts,
    binned_invalid,
)

N, BATCH, BINS = 20_000, 1_000, 1_000


def data(kind, generator):
    if kind == "binary":
        return torch.rand(N, generator=generator), torch.randint(0, 2, (N,), generator=generator)
    if kind == "multiclass":  # logits: the binned form reads their softmax, as the exact one does
        target = torch.randint(0, 4, (N,), generator=generator)
        return torch.randn(N, 4, generator=generator) + torch.nn.functional.one_hot(target, 4), target
    target = torch.randint(0, 2, (N, 3), generator=generator)
    return (torch.rand(N, 3, generator=generator) + 0.3 * target).clamp(max=1), target


def make(kind, bins):
    if kind == "binary":
        return binary_metrics(["auroc", "auprc"], bins=bins)
    if kind == "multiclass":
        return multiclass_metrics(4, ["acc", "auroc", "auprc"], bins=bins)
    return multilabel_metrics(3, ["auroc", "auprc"], bins=bins)


def store_of(metrics):
    (store,) = metrics._stores.values()
    return store


def sklearn_values(kind, input, target):
    if kind == "binary":
        return roc_auc_score(target, input), average_precision_score(target, input)
    if kind == "multiclass":
        probs, onehot = input.softmax(-1), torch.nn.functional.one_hot(target, 4)
        return roc_auc_score(target, probs, multi_class="ovr"), average_precision_score(onehot, probs)
    return roc_auc_score(target, input), average_precision_score(target, input)


@pytest.mark.parametrize("kind", ["binary", "multiclass", "multilabel"])
def test_binned_matches_exact_within_the_bound(kind):
    input, target = data(kind, torch.Generator().manual_seed(0))
    exact, binned = make(kind, None), make(kind, BINS)
    for start in range(0, N, BATCH):
        exact.update(input[start : start + BATCH], target[start : start + BATCH])
        binned.update(input[start : start + BATCH], target[start : start + BATCH])
    exact_values, binned_values = exact.avg, binned.avg
    bound = binned_auroc_bound(store_of(binned).bins).mean().item()  # macro: the mean of the column bounds
    sk_auroc, sk_auprc = sklearn_values(kind, input, target)
    assert abs(binned_values["auroc"] - exact_values["auroc"]) <= bound + 1e-12
    assert abs(binned_values["auroc"] - sk_auroc) <= bound + 1e-9
    assert bound < 2e-3  # half the largest bin share: about 0.5 / BINS here
    assert binned_values["auprc"] == pytest.approx(exact_values["auprc"], abs=2e-3)
    assert binned_values["auprc"] == pytest.approx(sk_auprc, abs=2e-3)
    if kind == "multiclass":
        assert binned_values["acc"] == exact_values["acc"]  # other metrics keep their exact form


def test_uniform_scores_with_1000_bins_are_within_1e_3():
    generator = torch.Generator().manual_seed(1)
    target = torch.randint(0, 2, (100_000,), generator=generator)
    scores = (torch.rand(100_000, generator=generator) + 0.2 * target) / 1.2
    counts = binned_counts(scores, target, "binary", 1000)
    error = abs(binned_auroc(counts).item() - roc_auc_score(target, scores))
    assert error <= binned_auroc_bound(counts).item() < 1e-3


def test_the_bound_is_reached_when_every_score_shares_one_bin():
    target = torch.tensor([0, 1, 0, 1])
    scores = torch.tensor([0.10, 0.11, 0.12, 0.13])  # exact AUROC 0.75; one bin of ten: 0.5
    counts = binned_counts(scores, target, "binary", 10)
    assert binned_auroc(counts).item() == 0.5
    assert binned_auroc_bound(counts).item() == 0.5
    assert abs(0.5 - roc_auc_score(target, scores)) <= 0.5


@pytest.mark.parametrize("average", ["macro", "weighted", "micro", None])
def test_averages_and_ignored_targets_follow_the_exact_metrics(average):
    generator = torch.Generator().manual_seed(2)
    scores, target = torch.rand(5_000, 3, generator=generator), torch.randint(0, 2, (5_000, 3), generator=generator)
    target[torch.rand(5_000, 3, generator=generator) < 0.1] = -100
    exact = multilabel_metrics(3, ["auroc"], average=average)
    binned = multilabel_metrics(3, ["auroc"], average=average, bins=BINS)
    exact.update(scores, target)
    binned.update(scores, target)
    expected = torch.as_tensor(exact.avg["auroc"])
    assert torch.allclose(torch.as_tensor(binned.avg["auroc"]).double(), expected.double(), atol=2e-3)


def test_logits_are_binned_as_probabilities():
    generator = torch.Generator().manual_seed(3)
    logits, target = torch.randn(2_000, generator=generator), torch.randint(0, 2, (2_000,), generator=generator)
    from_logits = binned_counts(logits, target, "binary", 100)
    assert torch.equal(from_logits, binned_counts(logits.sigmoid(), target, "binary", 100))


def test_state_does_not_grow_with_updates_and_keeps_no_scores():
    metrics = multiclass_metrics(10, ["auroc", "auprc"], bins=256)
    store = store_of(metrics)
    sizes = []
    for _ in range(5):
        metrics.update(torch.randn(4_096, 10), torch.randint(0, 10, (4_096,)))
        sizes.append(store.bins.numel() * store.bins.element_size())
        assert not store.chunks and not store.inputs  # no scores held
    assert sizes == [10 * 2 * 256 * 8] * 5
    assert int(store.bins.sum()) == 5 * 4_096 * 10  # every score counted once per column


def test_counts_of_shards_add_up_to_the_counts_of_the_union():
    # what the distributed read does with one all-reduce (tests/metrics/test_distributed.py runs it)
    generator = torch.Generator().manual_seed(4)
    scores, target = torch.randn(3_000, 4, generator=generator), torch.randint(0, 4, (3_000,), generator=generator)
    whole, first, second = (multiclass_metrics(4, ["auroc"], bins=64) for _ in range(3))
    whole.update(scores, target)
    first.update(scores[:1_000], target[:1_000])
    second.update(scores[1_000:], target[1_000:])
    assert torch.equal(store_of(first).bins + store_of(second).bins, store_of(whole).bins)


def test_state_dict_round_trip_and_states_without_bins():
    metrics = binary_metrics(["acc", "auroc"], bins=32)
    metrics.update(torch.rand(100), torch.randint(0, 2, (100,)))
    state = metrics.state_dict()
    again = binary_metrics(["acc", "auroc"], bins=32)
    again.load_state_dict(state)
    assert again.avg.dict() == metrics.avg.dict()
    again.update(torch.rand(50), torch.randint(0, 2, (50,)))  # loaded counts keep adding up
    assert int(store_of(again).bins.sum()) == 150
    exact = binary_metrics(["acc"])
    exact.update(torch.rand(10), torch.randint(0, 2, (10,)))
    old = exact.state_dict()
    del old["tasks"]["0"]["bins"]  # written before binned metrics existed
    binary_metrics(["acc"]).load_state_dict(old)


@pytest.mark.parametrize("bins", [1, 0, 2.5, True])
def test_bad_bins_are_refused(bins):
    with pytest.raises(ValueError, match="bins must be an integer of at least 2"):
        binary_metrics(bins=bins)


def test_regression_tasks_take_no_bins():
    with pytest.raises(ValueError, match="classification task"):
        MetricTask("regression", num_outputs=1, bins=10)


def test_functional_form_matches_the_container():
    generator = torch.Generator().manual_seed(5)
    scores, target = torch.rand(1_000, generator=generator), torch.randint(0, 2, (1_000,), generator=generator)
    counts = binned_counts(scores, target, "binary", 50)
    metrics = binary_metrics(["auroc", "auprc"], bins=50)
    metrics.update(scores, target)
    assert metrics.avg["auroc"] == pytest.approx(binned_auroc(counts).item())
    assert metrics.avg["auprc"] == pytest.approx(binned_auprc(counts).item())


def exact(kind):
    if kind == "binary":
        return binary_metrics(["auroc", "auprc"])
    if kind == "multiclass":
        return multiclass_metrics(4, ["auroc", "auprc"])
    return multilabel_metrics(3, ["auroc", "auprc"])


@pytest.mark.parametrize("kind", ["binary", "multiclass", "multilabel"])
@pytest.mark.parametrize("spoil", ["none", "target that is no label", "nan score", "nan score of an ignored sample"])
def test_errors_make_the_binned_values_nan_as_they_make_the_exact_ones(kind, spoil):
    # The bins counted a target of 2 as a negative and put a NaN score in the lowest bin: a number
    # where the exact metrics give nan.
    scores, target = data(kind, torch.Generator().manual_seed(6))
    scores, target = scores[:500].clone(), target[:500].clone()
    target[3] = -100  # an ignored sample
    if spoil == "target that is no label":
        target[1] = 7
    if spoil == "nan score":
        scores[2] = float("nan")
    if spoil == "nan score of an ignored sample":
        scores[3] = float("nan")
    binned, reference = make(kind, 32), exact(kind)
    for metrics in (binned, reference):
        metrics.update(scores[:250], target[:250])
        metrics.update(scores[250:], target[250:])
    for name in ("auroc", "auprc"):
        for read in ("val", "avg"):
            ours, theirs = getattr(binned, read)[name], getattr(reference, read)[name]
            assert math.isnan(ours) == math.isnan(theirs), (read, name, ours, theirs)
        assert math.isnan(binned.avg[name]) == (spoil in ("target that is no label", "nan score"))


def test_errors_survive_checkpoints_and_mark_their_own_column():
    metrics = multilabel_metrics(3, ["auroc"], bins=16, average=None)
    scores, target = torch.rand(40, 3), torch.randint(0, 2, (40, 3))
    target[0, 1] = 5  # label 1 only
    metrics.update(scores, target)
    values = metrics.avg["auroc"]
    assert [math.isnan(v) for v in values] == [False, True, False]
    counts = binned_counts(scores, target, "multilabel", 16, -100)
    invalid = binned_invalid(scores, target, "multilabel", -100)
    assert invalid.tolist() == [0, 1, 0]
    assert [math.isnan(v) for v in binned_auroc(counts, None, invalid).tolist()] == [False, True, False]
    assert math.isnan(binned_auroc(counts, "macro", invalid).item())
    again = multilabel_metrics(3, ["auroc"], bins=16, average=None)
    again.load_state_dict(metrics.state_dict())
    assert [math.isnan(v) for v in again.avg["auroc"]] == [False, True, False]
    old = metrics.state_dict()
    del old["tasks"]["0"]["bins_invalid"]  # written before errors were counted: read as none
    again.load_state_dict(old)
    assert not any(math.isnan(v) for v in again.avg["auroc"])


def test_a_label_equal_to_ignore_index_still_counts_as_a_label():
    # As in the exact form: the bins used to drop every positive here, and AUROC was nan.
    scores, target = data("binary", torch.Generator().manual_seed(7))
    labelled, plain = binary_metrics(["auroc"], bins=64, ignore_index=1), binary_metrics(["auroc"], bins=64)
    for metrics in (labelled, plain):
        metrics.update(scores[:1000], target[:1000])
    assert labelled.avg["auroc"] == plain.avg["auroc"] and not math.isnan(plain.avg["auroc"])
