"""Every functional metric against scikit-learn / SciPy on random inputs, plus edge cases."""

import math
import re
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from sklearn import metrics as skm

from danling.metrics import MetricTask, StreamMetrics, regression_metrics
from danling.metrics import functional as F

IGNORE = -100
SETTINGS = settings(max_examples=40, deadline=None)


def close(actual, expected, tol=1e-6):
    actual = torch.as_tensor(actual, dtype=torch.float64).numpy()
    expected = np.asarray(expected, dtype=np.float64)
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol, equal_nan=True)


def scores(rng, shape, ties):
    """Probabilities; with `ties`, drawn from a handful of values so that ties are common."""
    if ties:
        return (rng.integers(0, 4, size=shape) / 4).astype(np.float32)
    return rng.random(shape, dtype=np.float32)


def with_ignored(rng, target, ignore):
    if not ignore:
        return target
    target = target.copy()
    target[rng.random(target.shape) < 0.2] = IGNORE
    return target


def sk(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def binary_auc(fn, y, s):
    """scikit-learn's AUROC / AP, or nan where they are undefined (a single class / no positives)."""
    if fn is skm.roc_auc_score and len(np.unique(y)) < 2:
        return math.nan
    if fn is skm.average_precision_score and not (y == 1).any():
        return math.nan
    return sk(fn, y, s)


cases = dict(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 40), ties=st.booleans(), ignore=st.booleans())


@SETTINGS
@given(**cases)
def test_binary_matches_sklearn(seed, n, ties, ignore):
    rng = np.random.default_rng(seed)
    p = scores(rng, n, ties)
    t = with_ignored(rng, rng.integers(0, 2, n), ignore)
    kw = dict(ignore_index=IGNORE if ignore else None)
    keep = t != IGNORE
    y, s = t[keep], p[keep]
    pred = (s > 0.5).astype(int)
    if len(y) == 0:
        assert math.isnan(F.binary_accuracy(p, t, **kw)) and math.isnan(F.binary_auroc(p, t, **kw))
        return
    close(F.binary_accuracy(p, t, **kw), skm.accuracy_score(y, pred))
    close(F.binary_balanced_accuracy(p, t, **kw), sk(skm.balanced_accuracy_score, y, pred))
    close(F.binary_precision(p, t, **kw), skm.precision_score(y, pred, zero_division=0))
    close(F.binary_recall(p, t, **kw), skm.recall_score(y, pred, zero_division=0))
    close(F.binary_f1_score(p, t, **kw), skm.f1_score(y, pred, zero_division=0))
    close(F.binary_mcc(p, t, **kw), sk(skm.matthews_corrcoef, y, pred))
    close(F.binary_confusion_matrix(p, t, **kw), skm.confusion_matrix(y, pred, labels=[0, 1]))
    close(F.binary_auroc(p, t, **kw), binary_auc(skm.roc_auc_score, y, s))
    close(F.binary_auprc(p, t, **kw), binary_auc(skm.average_precision_score, y, s))
    # Logits give the same answers as their probabilities.
    logits = torch.logit(torch.as_tensor(p).double().clamp(1e-6, 1 - 1e-6)) * 3
    logits[0] = 5.0  # guarantees a value outside [0, 1]
    logit_probs = logits.sigmoid().numpy()
    close(F.binary_auroc(logits, t, **kw), binary_auc(skm.roc_auc_score, y, logit_probs[keep]))
    close(F.binary_accuracy(logits, t, **kw), skm.accuracy_score(y, logit_probs[keep] > 0.5))


@SETTINGS
@given(**cases, num_classes=st.integers(2, 5))
def test_multiclass_matches_sklearn(seed, n, ties, ignore, num_classes):
    rng = np.random.default_rng(seed)
    p = scores(rng, (n, num_classes), ties)
    p = p / np.maximum(p.sum(1, keepdims=True), 1e-6)
    t = with_ignored(rng, rng.integers(0, num_classes, n), ignore)
    kw = dict(num_classes=num_classes, ignore_index=IGNORE if ignore else None)
    keep = t != IGNORE
    y, s = t[keep], p[keep]
    pred = s.argmax(1)
    if len(y) == 0:
        for fn in (F.multiclass_accuracy, F.multiclass_f1_score, F.multiclass_mcc, F.multiclass_auroc):
            assert math.isnan(fn(p, t, **kw))
        return
    labels = list(range(num_classes))
    close(F.multiclass_accuracy(p, t, **kw), skm.accuracy_score(y, pred))
    close(F.multiclass_accuracy(p, t, average="macro", **kw), sk(skm.recall_score, y, pred, average="macro"))
    close(F.multiclass_balanced_accuracy(p, t, **kw), sk(skm.balanced_accuracy_score, y, pred))
    close(F.multiclass_mcc(p, t, **kw), sk(skm.matthews_corrcoef, y, pred))
    close(F.multiclass_confusion_matrix(p, t, **kw), skm.confusion_matrix(y, pred, labels=labels))
    for ours, theirs in (
        (F.multiclass_precision, skm.precision_score),
        (F.multiclass_recall, skm.recall_score),
        (F.multiclass_f1_score, skm.f1_score),
    ):
        for average in ("macro", "micro", "weighted"):
            close(ours(p, t, average=average, **kw), sk(theirs, y, pred, average=average, zero_division=0))
        close(ours(p, t, average=None, **kw), sk(theirs, y, pred, average=None, labels=labels, zero_division=0))
    one_hot = np.eye(num_classes)[y]
    for ours, theirs in ((F.multiclass_auroc, skm.roc_auc_score), (F.multiclass_auprc, skm.average_precision_score)):
        per_class = np.array([binary_auc(theirs, one_hot[:, c], s[:, c]) for c in labels])
        close(ours(p, t, average=None, **kw), per_class)
        defined = ~np.isnan(per_class)
        expected = per_class[defined].mean() if defined.any() else math.nan
        close(ours(p, t, **kw), expected)
        support = one_hot.sum(0) * defined
        weighted = (np.nan_to_num(per_class) * support).sum() / support.sum() if support.sum() else math.nan
        close(ours(p, t, average="weighted", **kw), weighted)
        close(ours(p, t, average="micro", **kw), binary_auc(theirs, one_hot.ravel(), s.ravel()))
    # scikit-learn's own multiclass AUROC needs every class and rows that sum to one.
    if num_classes > 2 and len(np.unique(y)) == num_classes and np.allclose(s.sum(1), 1, atol=1e-5):
        close(F.multiclass_auroc(p, t, **kw), skm.roc_auc_score(y, s, multi_class="ovr", labels=labels))


@SETTINGS
@given(**cases, num_labels=st.integers(1, 4))
def test_multilabel_matches_sklearn(seed, n, ties, ignore, num_labels):
    rng = np.random.default_rng(seed)
    p = scores(rng, (n, num_labels), ties)
    t = with_ignored(rng, rng.integers(0, 2, (n, num_labels)), ignore)
    kw = dict(num_labels=num_labels, ignore_index=IGNORE if ignore else None)
    keep = t != IGNORE
    columns = [(t[keep[:, j], j], p[keep[:, j], j]) for j in range(num_labels)]
    flat_y, flat_s = t[keep], p[keep]
    if keep.sum() == 0:
        assert math.isnan(F.multilabel_accuracy(p, t, **kw)) and math.isnan(F.multilabel_f1_score(p, t, **kw))
        return

    def pooled_and_per_label(metric, active):
        pooled = sk(metric, flat_y, flat_s > 0.5)
        per_label = np.array([sk(metric, y, s > 0.5) if len(y) else math.nan for y, s in columns])
        macro = per_label[active].mean() if active.any() else math.nan
        return pooled, per_label, macro

    counted = np.array([len(y) > 0 for y, _ in columns])
    for ours, metric in (
        (F.multilabel_accuracy, skm.accuracy_score),
        (F.multilabel_balanced_accuracy, skm.balanced_accuracy_score),
        (F.multilabel_mcc, skm.matthews_corrcoef),
    ):
        pooled, _, macro = pooled_and_per_label(metric, counted)
        close(ours(p, t, **kw), pooled)
        close(ours(p, t, average="macro", **kw), macro)
    active = np.array([((y == 1) | (s > 0.5)).any() for y, s in columns])
    support = np.array([(y == 1).sum() for y, _ in columns])
    for ours, theirs in (
        (F.multilabel_precision, skm.precision_score),
        (F.multilabel_recall, skm.recall_score),
        (F.multilabel_f1_score, skm.f1_score),
    ):
        metric = lambda y, pred, theirs=theirs: theirs(y, pred, zero_division=0)  # noqa: E731
        pooled, per_label, macro = pooled_and_per_label(metric, active)
        close(ours(p, t, average="micro", **kw), pooled)
        close(ours(p, t, **kw), macro)
        close(ours(p, t, average=None, **kw), np.nan_to_num(per_label))
        weighted = (np.nan_to_num(per_label) * support).sum() / support.sum() if support.sum() else math.nan
        close(ours(p, t, average="weighted", **kw), weighted)
    expected_cm = np.stack(
        [skm.confusion_matrix(y, s > 0.5, labels=[0, 1]) if len(y) else np.zeros((2, 2)) for y, s in columns]
    )
    close(F.multilabel_confusion_matrix(p, t, **kw), expected_cm)
    for ours, theirs in ((F.multilabel_auroc, skm.roc_auc_score), (F.multilabel_auprc, skm.average_precision_score)):
        per_label = np.array([binary_auc(theirs, y, s) if len(y) else math.nan for y, s in columns])
        close(ours(p, t, average=None, **kw), per_label)
        defined = ~np.isnan(per_label)
        close(ours(p, t, **kw), per_label[defined].mean() if defined.any() else math.nan)
        close(ours(p, t, average="micro", **kw), binary_auc(theirs, flat_y, flat_s))


def scipy_corr(fn, x, y):
    if len(x) < 2 or np.all(x == x[0]) or np.all(y == y[0]):
        return math.nan
    return fn(x, y)[0]


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 40), outputs=st.integers(1, 3), ties=st.booleans())
def test_regression_matches_sklearn_and_scipy(seed, n, outputs, ties):
    rng = np.random.default_rng(seed)
    x = (rng.integers(0, 3, (n, outputs)) if ties else rng.normal(size=(n, outputs))).astype(np.float64)
    y = (rng.integers(0, 3, (n, outputs)) if ties else x + rng.normal(size=(n, outputs))).astype(np.float64)
    r2 = [sk(skm.r2_score, y[:, j], x[:, j], force_finite=False) if n > 1 else math.nan for j in range(outputs)]
    expected = {
        F.pearson: [scipy_corr(stats.pearsonr, x[:, j], y[:, j]) for j in range(outputs)],
        F.spearman: [scipy_corr(stats.spearmanr, x[:, j], y[:, j]) for j in range(outputs)],
        F.r2_score: r2,
        F.mse: [skm.mean_squared_error(y[:, j], x[:, j]) for j in range(outputs)],
        F.rmse: [math.sqrt(skm.mean_squared_error(y[:, j], x[:, j])) for j in range(outputs)],
        F.mae: [skm.mean_absolute_error(y[:, j], x[:, j]) for j in range(outputs)],
    }
    inputs = (x[:, 0], y[:, 0]) if outputs == 1 else (x, y)
    for fn, per_output in expected.items():
        if n == 1 and fn is F.r2_score:  # one sample: scikit-learn warns and returns nan; our SST is 0
            assert math.isnan(fn(*inputs)) or math.isinf(fn(*inputs))
            continue
        if outputs == 1:
            close(fn(*inputs), per_output[0])
        else:
            close(fn(*inputs, average=None), per_output)
            close(fn(*inputs), np.mean(per_output))
    close(F.mse(x, y, average="micro"), skm.mean_squared_error(y.ravel(), x.ravel()))
    close(F.pearson(x, y, average="micro"), scipy_corr(stats.pearsonr, x.ravel(), y.ravel()))
    close(F.spearman(x, y, average="micro"), scipy_corr(stats.spearmanr, x.ravel(), y.ravel()))


def test_regression_ignore_index_drops_entries():
    x = torch.tensor([[1.0, 2.0], [2.0, 1.0], [3.0, 5.0], [9.0, 4.0]])
    y = torch.tensor([[1.5, -1.0], [2.5, 1.0], [-1.0, 4.0], [8.0, 3.0]])
    for fn in (F.mse, F.mae, F.pearson, F.spearman, F.r2_score):
        per_output = fn(x, y, average=None, ignore_index=-1.0)
        for j in range(2):
            keep = y[:, j] != -1
            close(per_output[j], fn(x[keep, j], y[keep, j]))


@pytest.mark.parametrize("ignore_index", [-1.0, math.nan])
def test_regression_leaves_ignored_entries_out_whatever_they_hold(ignore_index):
    # A NaN prediction beside an ignored target reached the sums as NaN * 0 = NaN, and
    # ignore_index=nan (missing targets stored as NaN) ignored nothing, since NaN != NaN.
    x = torch.tensor([[1.0, 2.0], [math.nan, 1.0], [3.0, 5.0], [9.0, 4.0], [2.0, 7.0]])
    y = torch.tensor([[1.5, ignore_index], [ignore_index, 1.0], [-1.0, 4.0], [8.0, 3.0], [2.0, 6.0]])
    keep = ~(y.isnan() if math.isnan(ignore_index) else y == ignore_index)
    for fn, name in (
        (F.mse, "mse"),
        (F.mae, "mae"),
        (F.pearson, "pearson"),
        (F.spearman, "spearman"),
        (F.r2_score, "r2"),
    ):
        per_output = fn(x, y, average=None, ignore_index=ignore_index)
        expected = [fn(x[keep[:, j], j], y[keep[:, j], j]) for j in range(2)]
        for j in range(2):
            close(per_output[j], expected[j])
        metrics = regression_metrics(2, [name], average=None, ignore_index=ignore_index)
        metrics.update(x[:2], y[:2])
        metrics.update(x[2:], y[2:])
        torch.testing.assert_close(metrics.avg[name], torch.stack(expected))


def test_spearman_of_a_counted_nan_is_nan_as_pearson_is():
    # The ranks placed a NaN after every number, so Spearman gave a value where Pearson (and
    # scipy.stats.spearmanr) give NaN.
    x = torch.tensor([[1.0, 2.0], [math.nan, 1.0], [3.0, 5.0], [9.0, 4.0]])
    y = torch.tensor([[1.5, 1.0], [2.5, math.nan], [-1.0, 4.0], [8.0, 3.0]])
    assert F.pearson(x, y, average=None).isnan().all()
    assert F.spearman(x, y, average=None).isnan().all()
    assert F.spearman(x, y).isnan() and F.spearman(x, y, average="micro").isnan()
    assert not F.spearman(x[[0, 2, 3]], y[[0, 2, 3]], average=None).isnan().any()
    metrics = regression_metrics(2, ["spearman"], ignore_index=-1.0)
    metrics.update(x, y)
    assert math.isnan(metrics.avg["spearman"])
    assert F.spearman(x[:, 0], y[:, 0], ignore_index=-1.0).isnan()


@pytest.mark.parametrize("n", [0])
def test_empty_input_is_nan_not_a_crash(n):
    empty1, empty_long = torch.empty(n), torch.empty(n, dtype=torch.long)
    for fn in (
        F.binary_accuracy, F.binary_balanced_accuracy, F.binary_precision, F.binary_recall, F.binary_f1_score,
        F.binary_mcc, F.binary_auroc, F.binary_auprc,
    ):  # fmt: skip
        assert math.isnan(fn(empty1, empty_long)), fn.__name__
    scores2 = torch.empty((n, 3))
    for fn in (F.multiclass_accuracy, F.multiclass_f1_score, F.multiclass_mcc, F.multiclass_auroc, F.multiclass_auprc):
        assert math.isnan(fn(scores2, empty_long)), fn.__name__
    for fn in (F.multilabel_accuracy, F.multilabel_f1_score, F.multilabel_mcc, F.multilabel_auroc):
        assert math.isnan(fn(scores2, torch.empty((n, 3), dtype=torch.long))), fn.__name__
    for fn in (F.pearson, F.spearman, F.r2_score, F.mse, F.rmse, F.mae):
        assert math.isnan(fn(empty1, empty1)), fn.__name__
    assert F.multiclass_confusion_matrix(scores2, empty_long).sum() == 0
    # Everything ignored is empty as well.
    assert math.isnan(F.binary_auroc([0.3, 0.6], [-100, -100], ignore_index=-100))


def test_one_class_and_constant_scores():
    target = torch.tensor([1, 1, 1])
    assert math.isnan(F.binary_auroc(torch.tensor([0.2, 0.5, 0.9]), target))
    assert F.binary_auprc(torch.tensor([0.2, 0.5, 0.9]), target) == 1
    assert F.binary_mcc(torch.tensor([0.2, 0.5, 0.9]), target) == 0  # scikit-learn's convention
    constant = torch.full((4,), 0.3)
    assert F.binary_auroc(constant, torch.tensor([0, 1, 0, 1])) == 0.5
    assert F.binary_auprc(constant, torch.tensor([0, 1, 0, 1])) == 0.5
    assert math.isnan(F.pearson(constant, torch.tensor([1.0, 2.0, 3.0, 4.0])))
    assert math.isnan(F.spearman(torch.tensor([1.0, 2.0, 3.0, 4.0]), constant))
    # A constant target with rounding-prone values still has zero variance.
    assert F.r2_score(torch.tensor([0.1, 0.2, 0.3]), torch.full((3,), 0.1, dtype=torch.float64)) == -math.inf


def test_invalid_labels_give_nan_without_synchronising():
    assert math.isnan(F.binary_accuracy([0.2, 0.9], [0, 2]))
    assert math.isnan(F.binary_auroc([0.2, 0.9, 0.4], [0, 1, 3]))
    assert math.isnan(F.multiclass_f1_score([[0.2, 0.8], [0.6, 0.4]], [0, 5]))
    assert math.isnan(F.multiclass_auroc([[0.2, 0.8], [0.6, 0.4], [0.5, 0.5]], [0, 1, 7]))
    assert math.isnan(F.multilabel_recall([[0.2, 0.8]], [[0, 3]]))


def test_generic_dispatch_matches_task_functions():
    p, t = torch.tensor([0.1, 0.8, 0.6, 0.2]), torch.tensor([0, 1, 0, 0])
    assert F.accuracy(p, t) == F.binary_accuracy(p, t)
    scores = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.2, 0.7], [0.2, 0.6, 0.2]])
    labels = torch.tensor([0, 2, 2])
    assert F.f1_score(scores, labels) == F.multiclass_f1_score(scores, labels)
    assert F.precision(scores, labels, average="micro") == F.multiclass_precision(scores, labels, average="micro")
    assert F.mcc(scores, labels) == F.multiclass_mcc(scores, labels)
    assert F.balanced_accuracy(scores, labels) == F.multiclass_balanced_accuracy(scores, labels)
    ml = torch.tensor([[1, 0, 0], [0, 0, 1], [0, 1, 1]])
    assert F.recall(scores, ml, num_labels=3) == F.multilabel_recall(scores, ml)
    assert F.auprc(scores, ml, task="multilabel") == F.multilabel_auprc(scores, ml)
    assert F.confusion_matrix(scores, labels).shape == (3, 3)
    assert F.confusion_matrix(scores, ml, task="multilabel").shape == (3, 2, 2)
    with pytest.raises(ValueError, match="task must be one of"):
        F.accuracy(p, t, task="ranking")


def test_multiclass_layouts_and_label_inputs():
    logits = torch.randn(2, 4, 5)  # (N, C, L) with target (N, L): class dimension second
    target = torch.randint(0, 4, (2, 5))
    flat = logits.movedim(1, -1).reshape(-1, 4)
    assert F.multiclass_accuracy(logits, target) == F.multiclass_accuracy(flat, target.reshape(-1))
    tokens = torch.randn(2, 5, 4)  # (N, L, C) with target (N, L): class dimension last
    assert F.multiclass_f1_score(tokens, target) == F.multiclass_f1_score(tokens.reshape(-1, 4), target.reshape(-1))
    column = target.reshape(-1, 1)  # (N, 1) class indices are accepted next to (N, C) scores
    assert F.multiclass_accuracy(flat, column) == F.multiclass_accuracy(flat, target.reshape(-1))
    as_numpy = F.multiclass_accuracy(flat.numpy(), target.reshape(-1).numpy())
    assert as_numpy == F.multiclass_accuracy(flat, target.reshape(-1))
    predicted = flat.argmax(-1)
    assert F.multiclass_accuracy(predicted, target.reshape(-1), num_classes=4) == F.multiclass_accuracy(
        flat, target.reshape(-1)
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: F.binary_accuracy(torch.rand(4, 2), torch.zeros(4, dtype=torch.long)), r"\(4, 2\).*\(4,\)"),
        (lambda: F.multiclass_accuracy(torch.rand(4, 3), torch.zeros(5, dtype=torch.long)), r"\(4, 3\).*\(5,\)"),
        (lambda: F.multiclass_accuracy(torch.rand(4, 3), torch.zeros(4), num_classes=3), "integer class indices"),
        (lambda: F.multiclass_f1_score(torch.rand(4, 3), torch.zeros(4, dtype=torch.long), num_classes=5), r"num_cla"),
        (lambda: F.multiclass_accuracy(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)), "num_cla"),
        (lambda: F.multilabel_f1_score(torch.rand(4, 3), torch.zeros(4, 2, dtype=torch.long)), r"\(4, 3\).*\(4, 2\)"),
        (lambda: F.multilabel_f1_score(torch.rand(4, 3), torch.zeros(4, 3), num_labels=2), "num_labels=2"),
        (lambda: F.mse(torch.rand(4, 2), torch.rand(4, 3)), r"\(4, 2\).*\(4, 3\)"),
        (lambda: F.mse(torch.rand(4, 2), torch.rand(4, 2), num_outputs=3), "num_outputs=3"),
        (lambda: F.mse(torch.rand(4), torch.zeros(4, dtype=torch.bool)), "real numbers"),
        (lambda: F.multiclass_f1_score(torch.rand(4, 3), torch.zeros(4, dtype=torch.long), average="samples"), "avera"),
    ],
)
def test_bad_input_raises_value_error_naming_the_problem(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("threshold", ["0.5", None, math.nan, torch.tensor([0.2, 0.8])])
@pytest.mark.parametrize(
    "call",
    [
        lambda threshold: F.binary_accuracy(torch.rand(4), torch.tensor([0, 1, 1, 0]), threshold=threshold),
        lambda threshold: F.binary_f1_score(torch.rand(400), torch.ones(400, dtype=torch.long), threshold=threshold),
        lambda threshold: F.binary_confusion_matrix(torch.rand(4), torch.tensor([0, 1, 1, 0]), threshold=threshold),
        lambda threshold: F.multilabel_f1_score(torch.rand(4, 2), torch.ones(4, 2), threshold=threshold),
        lambda threshold: F.accuracy(torch.rand(4), torch.tensor([0, 1, 1, 0]), threshold=threshold),
        lambda threshold: MetricTask("binary", threshold=threshold),
    ],
)
def test_a_threshold_that_is_no_number_is_refused_naming_it(call, threshold):
    # A string or None failed inside a comparison ("'<=' not supported") or in struct ("required
    # argument is not a float"); a NaN threshold silently made every prediction negative.
    with pytest.raises(ValueError, match=rf"threshold must be a number.*got {re.escape(repr(threshold))}"):
        call(threshold)


@pytest.mark.parametrize("threshold", [2.0, -0.1])
def test_a_task_threshold_outside_the_probabilities_is_refused(threshold):
    with pytest.raises(ValueError, match=rf"threshold must be a number in \[0, 1\], got {threshold!r}"):
        MetricTask("binary", threshold=threshold)


def test_a_list_of_equally_shaped_tensors_is_stacked():
    # Per-sample outputs collected in a list: a list of 0-d tensors converted, one of score
    # vectors failed with torch's "only one element tensors can be converted to Python scalars".
    scores = torch.tensor([[2.0, 0.1, -1.0], [0.3, 1.5, 0.2], [0.1, 0.2, 3.0]])
    target = torch.tensor([0, 2, 2])
    expected = F.multiclass_f1_score(scores, target)
    assert F.multiclass_f1_score(list(scores), list(target)) == expected
    assert F.f1_score(list(scores), target.tolist()) == expected
    metrics = StreamMetrics(f1=F.f1_score)
    metrics.update(list(scores), list(target))
    assert metrics.avg["f1"] == expected.item() and metrics.count["f1"] == 3
    with pytest.raises(TypeError, match=r"input is a list of tensors of different shapes \(3,\) and \(2,\)"):
        F.multiclass_accuracy([scores[0], scores[1, :2]], target[:2])


def test_unconvertible_input_raises_type_error():
    with pytest.raises(TypeError, match="input"):
        F.binary_accuracy("abc", [0, 1, 0])
    with pytest.raises(TypeError, match="target"):
        F.binary_accuracy([0.1, 0.2], [object(), 1])
