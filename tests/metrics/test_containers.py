import math
import pickle

import pytest
import torch

from danling.metrics import (
    METRICS,
    GlobalMetrics,
    MetricFunc,
    MetricMeter,
    MetricTask,
    StreamMetrics,
    binary_metrics,
    multiclass_metrics,
    multilabel_metrics,
    regression_metrics,
)
from danling.metrics import functional as F
from danling.metrics.functional import _common, _host
from danling.metrics.state import MetricState


def batches(seed=0, count=5, num_classes=4):
    generator = torch.Generator().manual_seed(seed)
    for i in range(count):
        n = 7 + 3 * i
        logits = torch.randn(n, num_classes, generator=generator)
        target = torch.randint(0, num_classes, (n,), generator=generator)
        target[torch.rand(n, generator=generator) < 0.1] = -100
        yield logits, target


def test_metric_meter_weights_by_batch_size_and_accepts_tensor_results():
    meter = MetricMeter(F.binary_accuracy)
    meter.update([0.9, 0.1], [1, 1])
    meter.update([0.9, 0.1, 0.2], [1, 0, 0])
    assert meter.count == 5 and meter.avg == pytest.approx((0.5 * 2 + 1.0 * 3) / 5)
    meter.update([0.9], [0], n=5)
    assert meter.count == 10 and meter.avg == pytest.approx(4 / 10)
    per_class = MetricMeter(lambda x, y: F.multiclass_recall(x, y, average=None))
    per_class.update(torch.tensor([[0.9, 0.1], [0.2, 0.8]]), torch.tensor([0, 0]))
    per_class.update(torch.tensor([[0.9, 0.1], [0.2, 0.8]]), torch.tensor([0, 1]))
    assert torch.allclose(per_class.avg, torch.tensor([0.75, 0.5], dtype=torch.float64))
    with pytest.raises(TypeError, match="callable"):
        MetricMeter("accuracy")


@pytest.mark.parametrize("host_counts", [True, False], ids=["host counts", "confusion matrix"])
def test_stream_metrics_share_one_state_per_batch(monkeypatch, host_counts):
    # Small CPU batches are counted from Python lists, larger ones (or any, with the host path
    # off) through the confusion matrix; either artifact is built once per batch.
    if not host_counts:
        monkeypatch.setattr(_common, "HOST_CONFUSION_SIZE", 0)
    built = {"confusion": 0, "host": 0}
    confusion, counts = MetricTask.confusion, _host.host_counts

    def counting_confusion(self, input, target):
        built["confusion"] += 1
        return confusion(self, input, target)

    def counting_counts(*args):
        built["host"] += 1
        return counts(*args)

    monkeypatch.setattr(MetricTask, "confusion", counting_confusion)
    monkeypatch.setattr(_host, "host_counts", counting_counts)
    metrics = multiclass_metrics(4, mode="stream", metrics=["acc", "f1", "mcc", "precision"])
    assert isinstance(metrics, StreamMetrics)
    for logits, target in batches():
        metrics.update(logits, target)
    # One artifact per batch for four metrics.
    assert built == ({"confusion": 0, "host": 5} if host_counts else {"confusion": 5, "host": 5})
    # Per-batch values averaged with batch-size weights.
    expected = [F.multiclass_f1_score(x, y, ignore_index=-100) for x, y in batches()]
    sizes = [len(y) for _, y in batches()]
    assert metrics.avg["f1"] == pytest.approx(sum(v.item() * n for v, n in zip(expected, sizes)) / sum(sizes))
    assert metrics.val["f1"] == pytest.approx(expected[-1].item())


def test_stream_metrics_with_plain_functions_and_names():
    metrics = StreamMetrics(F.binary_accuracy, auc=F.binary_auroc, preprocess=None)
    assert list(metrics) == ["binary_accuracy", "auc"]
    metrics.update(torch.tensor([0.2, 0.8, 0.7]), torch.tensor([0, 1, 0]))
    assert metrics.avg.dict() == {"binary_accuracy": pytest.approx(2 / 3), "auc": 1.0}
    metrics["mse"] = F.mse
    assert isinstance(metrics["mse"], MetricMeter)
    with pytest.raises(ValueError, match="cannot name"):
        StreamMetrics(lambda x, y: 0.0)


def test_a_metric_meter_keeps_its_own_preprocess_inside_stream_metrics():
    # A MetricMeter's own `preprocess` ran when it was updated alone and was silently skipped
    # inside a StreamMetrics, which hands its meters the output of the shared preprocess only.
    def flip(input, target):
        return 1 - torch.as_tensor(input), torch.as_tensor(target)

    alone = MetricMeter(F.binary_accuracy, preprocess=flip)
    inside = StreamMetrics(flipped=MetricMeter(F.binary_accuracy, preprocess=flip), plain=F.binary_accuracy)
    for scores, labels in (([0.9, 0.2], [0, 1]), ([0.7, 0.6, 0.1], [0, 0, 1])):
        alone.update(scores, labels)
        inside.update(scores, labels)
    assert inside.avg["flipped"] == alone.avg == 1.0 and inside.avg["plain"] == 0.0
    assert inside.count["flipped"] == alone.count == 5
    # A meter the container wraps itself holds the container's preprocess, which is not its own:
    # replacing the container's later must not leave the old one running in that meter.
    shared = StreamMetrics(acc=F.binary_accuracy, preprocess=flip)
    shared.preprocess = None
    shared.update([0.9, 0.2], [1, 0])
    assert shared.avg["acc"] == 1.0


def test_global_metrics_equal_functional_on_the_union():
    metrics = multiclass_metrics(
        4, metrics=["acc", "balanced_acc", "precision", "recall", "f1", "mcc", "auroc", "auprc"]
    )
    for logits, target in batches():
        metrics.update(logits, target)
    inputs = torch.cat([x for x, _ in batches()])
    targets = torch.cat([y for _, y in batches()])
    kw = dict(num_classes=4, ignore_index=-100)
    expected = {
        "acc": F.multiclass_accuracy(inputs, targets, **kw),
        "balanced_acc": F.multiclass_balanced_accuracy(inputs, targets, **kw),
        "precision": F.multiclass_precision(inputs, targets, **kw),
        "recall": F.multiclass_recall(inputs, targets, **kw),
        "f1": F.multiclass_f1_score(inputs, targets, **kw),
        "mcc": F.multiclass_mcc(inputs, targets, **kw),
        "auroc": F.multiclass_auroc(inputs, targets, **kw),
        "auprc": F.multiclass_auprc(inputs, targets, **kw),
    }
    result = metrics.compute()
    for name, value in expected.items():
        assert result[name] == pytest.approx(value.item()), name
    last_x, last_y = list(batches())[-1]
    assert metrics.val["f1"] == pytest.approx(F.multiclass_f1_score(last_x, last_y, **kw).item())
    assert metrics.bat.dict() == metrics.val.dict()
    assert metrics.count == len(targets)


def test_global_metrics_store_only_what_they_need():
    confusion_only = multiclass_metrics(4, metrics=["acc", "f1"])
    moments_only = regression_metrics(2, metrics=["r2", "rmse"])
    for logits, target in batches():
        confusion_only.update(logits, target)
        moments_only.update(logits[:, :2], logits[:, 2:])
    (store,) = confusion_only._stores.values()
    assert store.inputs == [] and store.confusion is not None and store.moments is None
    (store,) = moments_only._stores.values()
    assert store.inputs == [] and store.moments.shape == (2, 12)
    with_auroc = multiclass_metrics(4, metrics=["acc", "auroc"])
    with_auroc.update(*next(batches()))
    (store,) = with_auroc._stores.values()
    assert len(store.inputs) == 1 and store.confusion is not None


def test_global_metrics_build_each_artifact_once_per_read_and_invalidate_on_update(monkeypatch):
    calls = {"curves": 0}
    original = MetricTask.curves

    def counting(self, *args, **kwargs):
        calls["curves"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(MetricTask, "curves", counting)
    metrics = multiclass_metrics(4)
    data = list(batches())
    for logits, target in data[:3]:
        metrics.update(logits, target)
    first = metrics.avg
    assert calls["curves"] == 1  # auroc and auprc share the sorted curves
    assert metrics.avg is first and calls["curves"] == 1  # unchanged data: cached
    metrics.update(*data[3])
    assert metrics.avg["auroc"] != first["auroc"] and calls["curves"] == 2


def test_global_metrics_plain_functions_get_the_concatenated_data():
    seen = []

    def spy(input, target):
        seen.append((input.shape, target.shape))
        return F.binary_auroc(input, target)

    metrics = GlobalMetrics(spy, acc=F.binary_accuracy)
    assert math.isnan(metrics.avg["spy"])  # no data yet: nan, the function is not called
    metrics.update([0.1, 0.9], [0, 1])
    metrics.update([0.95], [0])
    assert metrics.avg["spy"] == 0.5 and seen[-1] == (torch.Size([3]), torch.Size([3]))
    assert metrics.avg["acc"] == pytest.approx(2 / 3)
    assert repr(metrics) == "GlobalMetrics(spy, acc)"


def test_empty_global_metrics_read_nan():
    for metrics in (multiclass_metrics(3), multilabel_metrics(2), binary_metrics(), regression_metrics(2)):
        values = metrics.avg
        assert all(math.isnan(v) for v in values.values()), values
        assert f"{metrics:.2f}".startswith(next(iter(values)) + ": nan (nan)")


def test_global_metrics_raise_on_bad_batches():
    metrics = multiclass_metrics(3)
    with pytest.raises(ValueError, match=r"num_classes=3.*\(2, 4\)"):
        metrics.update(torch.rand(2, 4), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="needs the size"):
        GlobalMetrics(acc=MetricFunc("acc", lambda s: s.confusion.matrix, MetricTask("multiclass"), "confusion"))


@pytest.mark.parametrize(
    ("n", "error"), [(-5, ValueError), (math.nan, ValueError), ("3", TypeError), (True, TypeError)]
)
def test_global_metrics_refuse_a_bad_weight_before_keeping_the_batch(n, error):
    # `n` weights the container in a micro aggregate: a negative or NaN weight corrupted it
    # silently, and a string failed after the batch was kept (counted, but not in `count`).
    metrics = binary_metrics(["acc"])
    metrics.update([0.9, 0.1], [1, 0])
    with pytest.raises(error, match=f"n must be a finite non-negative number, got {n!r}"):
        metrics.update([0.9, 0.9], [0, 0], n=n)
    assert metrics.count == 2 and metrics.avg["acc"] == 1.0
    metrics.update([0.9, 0.9], [0, 0], n=3)
    assert metrics.count == 5 and metrics.avg["acc"] == 0.5


def _scores(kind, generator):
    if kind == "binary":
        return torch.rand(6, generator=generator), torch.randint(0, 2, (6,), generator=generator)
    if kind == "multiclass":
        return torch.randn(6, 3, generator=generator), torch.randint(0, 3, (6,), generator=generator)
    if kind == "multilabel":
        return torch.rand(6, 2, generator=generator), torch.randint(0, 2, (6, 2), generator=generator)
    return torch.randn(6, 2, generator=generator), torch.randn(6, 2, generator=generator)


@pytest.mark.parametrize("mode", ["global", "stream"])
@pytest.mark.parametrize(
    ("kind", "build"),
    [
        ("binary", lambda mode: binary_metrics(["acc", "precision", "balanced_acc", "auroc"], mode=mode)),
        ("multiclass", lambda mode: multiclass_metrics(3, mode=mode)),
        ("multiclass", lambda mode: multiclass_metrics(3, ["acc", "auroc", "auprc"], mode=mode, bins=100)),
        ("multilabel", lambda mode: multilabel_metrics(2, ["acc", "f1", "mcc"], mode=mode)),
        ("regression", lambda mode: regression_metrics(2, mode=mode)),
    ],
)
def test_factory_containers_pickle_and_keep_counting(kind, build, mode):
    # GlobalMetrics counts its queue for a pickle, and meters pickle their sums; a factory's
    # container must pickle too (its metrics were closures, which pickle cannot name).
    metrics, generator = build(mode), torch.Generator().manual_seed(0)
    for _ in range(3):
        metrics.update(*_scores(kind, generator))
    restored = pickle.loads(pickle.dumps(metrics))
    assert restored.avg.dict() == metrics.avg.dict()
    batch = _scores(kind, generator)
    metrics.update(*batch)
    restored.update(*batch)
    assert restored.avg.dict() == metrics.avg.dict()


def test_factories_modes_catalogue_and_registry():
    assert isinstance(binary_metrics(), GlobalMetrics)
    assert list(binary_metrics(mode="stream")) == ["acc", "f1", "mcc"]
    assert list(regression_metrics().metrics) == ["pearson", "spearman", "r2", "mse", "rmse", "mae"]
    assert list(multilabel_metrics(3, mode="stream").keys()) == ["acc", "f1", "mcc"]
    built = METRICS.build(type="multiclass", num_classes=5, mode="stream")
    assert isinstance(built, StreamMetrics)
    assert METRICS.build({"type": "regression", "num_outputs": 2}).metrics["r2"].task.num_outputs == 2
    with pytest.raises(ValueError, match="available"):
        binary_metrics(["acc", "roc"])
    with pytest.raises(ValueError, match="mode"):
        binary_metrics(mode="exact")
    with pytest.raises(ValueError, match="confmat"):
        multiclass_metrics(3, ["confmat"], mode="stream")
    confmat = multiclass_metrics(3, ["confmat"])
    confmat.update(torch.tensor([[0.9, 0.05, 0.05]]), torch.tensor([1]))
    assert torch.equal(confmat.avg["confmat"], torch.tensor([[0, 0, 0], [1, 0, 0], [0, 0, 0]]))


@pytest.mark.parametrize("mode", ["global", "stream"])
@pytest.mark.parametrize(
    ("build", "average"),
    [
        (lambda mode, average: multiclass_metrics(3, mode=mode, average=average), "Macro"),
        (lambda mode, average: multilabel_metrics(2, mode=mode, average=average), "samples"),
        (lambda mode, average: regression_metrics(mode=mode, average=average), "weighted"),
        (lambda mode, average: METRICS.build(type="multiclass", num_classes=3, mode=mode, average=average), "mean"),
    ],
)
def test_factories_refuse_an_unknown_average_when_built(build, mode, average):
    # A misspelt `average` was only refused at the first read (global: after a whole evaluation)
    # or halfway through the first update (stream: acc counted, f1 and mcc not).
    with pytest.raises(ValueError, match=f"average must be one of .*, got {average!r}"):
        build(mode, average)
    assert list(build(mode, "none").values() if mode == "stream" else build(mode, "none").metrics)


@pytest.mark.parametrize("mode", ["global", "stream"])
def test_factories_name_a_single_string_given_as_metrics(mode):
    # `metrics="acc"` (a config's `metrics: acc`) was read letter by letter: "unknown multiclass
    # metrics ['a', 'c', 'c']".
    with pytest.raises(TypeError, match=r"metrics must be a list of metric names, got the string 'acc'"):
        multiclass_metrics(3, "acc", mode=mode)
    with pytest.raises(TypeError, match=r"metrics must be a list of metric names, got the string 'r2'"):
        METRICS.build(type="regression", metrics="r2", mode=mode)


@pytest.mark.parametrize("rows", [1, 6000])  # queued, and counted at update
@pytest.mark.parametrize("kind", ["multiclass", "binary", "multilabel"])
def test_a_confusion_matrix_read_earlier_does_not_change_with_later_updates(kind, rows):
    # `avg["confmat"]` was a view of the running counts: a later update changed a value already returned.
    build = {
        "multiclass": lambda: multiclass_metrics(3, ["confmat"]),
        "binary": lambda: binary_metrics(["confmat"]),
        "multilabel": lambda: multilabel_metrics(3, ["confmat"]),
    }[kind]
    batch = {
        "multiclass": (torch.eye(3).repeat(rows, 1), torch.arange(3).repeat(rows)),
        "binary": (torch.tensor([0.9, 0.1]).repeat(rows), torch.tensor([1, 0]).repeat(rows)),
        "multilabel": (torch.eye(3).repeat(rows, 1), torch.eye(3, dtype=torch.long).repeat(rows, 1)),
    }[kind]
    metrics = build()
    metrics.update(*batch)
    read = {which: metrics.read(which)[0]["confmat"] for which in ("val", "bat", "avg")}
    kept = {which: value.clone() for which, value in read.items()}
    metrics.update(*batch)
    assert int(metrics.avg["confmat"].sum()) == 2 * int(kept["avg"].sum())
    for which, value in read.items():
        assert torch.equal(value, kept[which]), which


def test_metric_func_and_state():
    task = MetricTask("binary")
    acc = MetricFunc("acc", lambda s: F.binary.accuracy_from_confusion(s.confusion), task, "confusion")
    assert acc([0.9, 0.1], [1, 1]) == 0.5
    state = MetricState.from_batch(task, [0.9, 0.1], [1, 1])
    assert acc(state) == 0.5
    with pytest.raises(TypeError):
        acc(state, [1, 1])
    with pytest.raises(ValueError, match="unknown artifacts"):
        MetricFunc("x", lambda s: 0, task, "histogram")
    with pytest.raises(ValueError, match="summaries"):
        MetricState(task, confusion=state.confusion).data  # noqa: B018
    with pytest.raises(ValueError, match="kind"):
        MetricTask("ranking")


def test_stream_weights_are_target_rows_and_n_makes_an_ignoring_mean_exact():
    # What docs/metrics.md states: rows weigh a batch, ignored ones included; `n` says otherwise.
    from danling.metrics import multiclass_metrics

    first = (torch.tensor([[5.0, 0, 0], [5, 0, 0], [0, 5, 0], [0, 5, 0]]), torch.tensor([0, 0, 0, -100]))
    second = (torch.tensor([[5.0, 0, 0], [0, 5, 0]]), torch.tensor([0, 1]))
    rows, counted = multiclass_metrics(3, mode="stream"), multiclass_metrics(3, mode="stream")
    for input, target in (first, second):
        rows.update(input, target)
        counted.update(input, target, n=int((target != -100).sum()))
    assert rows.avg["acc"] == pytest.approx(7 / 9)
    assert counted.avg["acc"] == pytest.approx(4 / 5)
