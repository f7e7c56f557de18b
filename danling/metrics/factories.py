"""Ready-made metric containers per task, and a registry so configurations can name them.

Each factory returns a [`GlobalMetrics`][danling.metrics.GlobalMetrics] (exact, the default)
or, with `mode="stream"`, a [`StreamMetrics`][danling.metrics.StreamMetrics] (constant memory,
per-batch values averaged). `metrics=` picks names from the task's catalogue:

| task | default names | other names |
| --- | --- | --- |
| binary, multiclass, multilabel | acc, f1, mcc, auroc, auprc | balanced_acc, precision, recall, confmat |
| regression | pearson, spearman, r2, mse, rmse, mae | |

The streaming defaults leave out the rank-based metrics (auroc, auprc, spearman), whose
per-batch averages can differ a lot from the dataset value (and are `nan` on batches with a
single class); ask for them explicitly if you want them. `confmat` is only available in
global mode. Classification factories ignore targets equal to `-100` by default, the
convention of `torch.nn.CrossEntropyLoss`. `bins=` (classification) computes auroc and auprc
from counts per score bin instead of every score: memory independent of the number of samples,
AUROC within a stated bound of the exact value (see
[`danling.metrics.functional.binned`][danling.metrics.functional.binned]).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from ..utils.registry import Registry
from .functional import _common, _host
from .functional import binary as _binary
from .functional import binned as _binned
from .functional import multiclass as _multiclass
from .functional import multilabel as _multilabel
from .functional import regression as _regression
from .global_metrics import GlobalMetrics
from .metric_meter import Preprocess
from .preprocess import base_preprocess
from .state import MetricFunc, MetricState, MetricTask
from .stream_metrics import StreamMetrics

__all__ = [
    "METRICS",
    "binary_metrics",
    "metric_funcs",
    "multiclass_metrics",
    "multilabel_metrics",
    "regression_metrics",
]

CLASSIFICATION_GLOBAL = ("acc", "f1", "mcc", "auroc", "auprc")
CLASSIFICATION_STREAM = ("acc", "f1", "mcc")
REGRESSION_GLOBAL = ("pearson", "spearman", "r2", "mse", "rmse", "mae")
REGRESSION_STREAM = ("pearson", "r2", "mse", "rmse", "mae")
GLOBAL_ONLY = ("confmat",)

# name -> (artifact, function of (state, average)); average is ignored where it does not apply.
Entry = tuple[str, Callable[[MetricState, Any], Any]]


def _curve_metric(module: Any, which: str) -> Callable[[MetricState, Any], Any]:
    def compute(state: MetricState, average: Any) -> Any:
        micro = average == "micro"
        ranking = state.ranking(micro=micro)  # large host data: the same values in far less memory
        if ranking is not None:
            defined = _multiclass.defined_columns(which, ranking.positives, ranking.negatives)
            return _multiclass.column_average(getattr(ranking, which), ranking.positives, average, defined)
        return getattr(module, f"{which}_from_curves")(state.curves(micro=micro), average)

    return compute


def _binary_curve_metric(which: str) -> Callable[[MetricState, Any], Any]:
    function = _multiclass.columns_auroc if which == "auroc" else _multiclass.columns_auprc

    def compute(state: MetricState, average: Any) -> Any:
        ranking = state.ranking()
        return getattr(ranking, which)[0] if ranking is not None else function(state.curves())[0]

    return compute


# Binary and multiclass metrics of a small CPU batch or of accumulated CPU counts, from the
# statistics of `_host` (same values, few tensor ops; a score as a Python float, which a container
# reads as is and a `MetricFunc` call returns as a float64 tensor); the multiclass ones average
# over classes as asked, the binary ones score class 1.
HOST_METRICS: dict[str, Callable[[_host.HostCounts, Any], Any]] = {
    # Called with `(counts, average)` directly (no wrapper per call): those without classes to
    # average over take `average` and leave it.
    "accuracy": _host.accuracy_of,
    "balanced_accuracy": _host.balanced_accuracy_of,
    "precision": partial(_host.class_score_of, which="precision"),
    "recall": partial(_host.class_score_of, which="recall"),
    "f1": partial(_host.class_score_of, which="f1"),
    "mcc": _host.mcc_of,
}
BINARY_HOST_METRICS: dict[str, Callable[[_host.HostCounts, Any], Any]] = {
    **HOST_METRICS,
    "precision": lambda counts, average: _host.binary_score_of(counts, "precision"),
    "recall": lambda counts, average: _host.binary_score_of(counts, "recall"),
    "f1": lambda counts, average: _host.binary_score_of(counts, "f1"),
}
# Multilabel metrics of accumulated CPU counts: accuracy, balanced accuracy and MCC of the pooled
# decisions (their default, `micro`), the class scores of every label's positive class.
LABEL_HOST_METRICS: dict[str, Callable[[_host.LabelHostCounts, Any], Any]] = {
    "accuracy": lambda counts, average: _host.accuracy_of(counts.pooled),
    "balanced_accuracy": lambda counts, average: _host.balanced_accuracy_of(counts.pooled),
    "precision": partial(_host.label_score_of, which="precision"),
    "recall": partial(_host.label_score_of, which="recall"),
    "f1": partial(_host.label_score_of, which="f1"),
    "mcc": lambda counts, average: _host.mcc_of(counts.pooled),
}


def _held_counts(state: MetricState) -> Any:
    """The host statistics of accumulated CPU counts held by `state` (`GlobalMetrics`' `avg`), if any."""
    confusion = state.held("confusion")
    # Read once per confusion, which the metrics of a read share (`counts_of_confusion` keeps it).
    return None if confusion is None else _host.counts_of_confusion(confusion)


def _host_counts(state: MetricState) -> _host.HostCounts | None:
    """Counts of a small binary or multiclass CPU batch, or of accumulated CPU counts, held by `state`.

    `None` where the tensor path applies; built once per state.
    """
    confusion = state.held("confusion")
    if confusion is not None:  # `_held_counts`, without its call: this runs for every metric of a read
        return _host.counts_of_confusion(confusion)
    if state.input is None or state.target is None:
        return None
    input, target, task = state.input, state.target, state.task
    if task.kind == "binary":
        return state.cached(
            "host_counts", lambda: _host.host_binary_counts(input, target, task.threshold, task.ignore_index)
        )
    return state.cached("host_counts", lambda: _host.host_counts(input, target, None, task.ignore_index))


def _classification(module: Any, averaged: bool) -> dict[str, Entry]:
    def confusion(name: str, takes_average: bool) -> Entry:
        function = getattr(module, f"{name}_from_confusion")
        if module is _multilabel:  # no per-batch host path: only accumulated counts
            host, counts_of = LABEL_HOST_METRICS[name], _held_counts
        else:
            host, counts_of = (HOST_METRICS if module is _multiclass else BINARY_HOST_METRICS)[name], _host_counts

        def compute(state: MetricState, average: Any) -> Any:
            counts = counts_of(state)
            if counts is not None:
                return host(counts, average if takes_average else None)
            return function(state.confusion, average) if takes_average else function(state.confusion)

        # The host form, for a `GlobalMetrics` that reads accumulated counts straight into it (see
        # `_CatalogMetric.host`): what `compute` calls once it has the host statistics.
        compute.host = (host, takes_average)  # type: ignore[attr-defined]
        return "confusion", compute

    catalog = {
        "acc": confusion("accuracy", False),
        "balanced_acc": confusion("balanced_accuracy", False),
        "precision": confusion("precision", averaged),
        "recall": confusion("recall", averaged),
        "f1": confusion("f1", averaged),
        "mcc": confusion("mcc", False),
        # A copy: the matrix of accumulated counts is a view of the running counts, which later
        # updates add to in place (a value already returned would change).
        "confmat": ("confusion", lambda state, average: state.confusion.matrix.clone()),
    }
    if averaged:
        catalog["auroc"] = ("ranking", _curve_metric(module, "auroc"))
        catalog["auprc"] = ("ranking", _curve_metric(module, "auprc"))
    else:
        catalog["auroc"] = ("ranking", _binary_curve_metric("auroc"))
        catalog["auprc"] = ("ranking", _binary_curve_metric("auprc"))
    return catalog


def _regression_catalog() -> dict[str, Entry]:
    def moments(name: str) -> Entry:
        function = getattr(_regression, f"{name}_from_moments")
        return "moments", lambda state, average: function(state.moments, average)

    catalog = {name: moments(name) for name in ("pearson", "mse", "rmse", "mae")}
    catalog["r2"] = moments("r2")
    catalog["spearman"] = (
        "data",
        lambda state, average: _regression.spearman_from_data(*state.data, state.task.ignore_index, average),
    )
    return catalog


CATALOGS: dict[str, dict[str, Entry]] = {
    "binary": _classification(_binary, averaged=False),
    "multiclass": _classification(_multiclass, averaged=True),
    "multilabel": _classification(_multilabel, averaged=True),
    "regression": _regression_catalog(),
}


# With `MetricTask.bins` set, these replace the exact entries: counts per score bin, not the scores.
BINNED: dict[str, Entry] = {
    "auroc": ("bins", lambda state, average: _binned.binned_auroc(state.bins, average, state.bins_invalid)),
    "auprc": ("bins", lambda state, average: _binned.binned_auprc(state.bins, average, state.bins_invalid)),
}


def metric_funcs(task: MetricTask, names: Sequence[str], average: str | None = "macro") -> dict[str, MetricFunc]:
    """Build the named [`MetricFunc`][danling.metrics.MetricFunc]s of `task`'s catalogue.

    `average` applies to the metrics that average over classes, labels or outputs
    (precision, recall, f1, auroc, auprc, and all regression metrics). A task with `bins`
    computes auroc and auprc from per-bin score counts
    ([`danling.metrics.functional.binned`][danling.metrics.functional.binned]).

    Raises:
        ValueError: For names outside the catalogue, listing the valid ones, or an `average`
            the task does not take.
    """
    catalog = CATALOGS[task.kind]
    unknown = [name for name in names if name not in catalog]
    if unknown:
        raise ValueError(f"unknown {task.kind} metrics {unknown}; available: {', '.join(catalog)}")
    # Checked now, not at the first read (after a whole evaluation) or halfway through an update.
    average = _common.check_average(
        average, _regression.REGRESSION_AVERAGES if task.kind == "regression" else _common.AVERAGES
    )
    funcs = {}
    for name in names:
        binned = task.bins is not None and name in BINNED
        requires = (BINNED if binned else catalog)[name][0]
        funcs[name] = MetricFunc(name, _CatalogMetric(task.kind, name, binned, average), task, requires)
    return funcs


class _CatalogMetric(partial):
    """A catalogue entry's function with its `average`: `partial(compute, average=average)` (called as
    fast), but picklable. The entries are closures, which pickle cannot name, so a copy or pickle of a
    factory's container names the entry instead and finds the same function again."""

    def __new__(cls, kind: str, name: str, binned: bool, average: str | None) -> _CatalogMetric:
        compute = (BINNED if binned else CATALOGS[kind])[name][1]
        self = super().__new__(cls, compute, average=average)
        self.entry = (kind, name, binned, average)
        # A confusion metric's host form and the `average` it takes: `host(counts, average)` of the
        # statistics `_host.counts_of_confusion` reads is what this function returns for a state
        # holding those counts. `None` for metrics without one.
        form = getattr(compute, "host", None)
        self.host = None if form is None else (form[0], average if form[1] else None)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return _CatalogMetric, self.entry


def _container(
    task: MetricTask,
    metrics: Sequence[str] | None,
    mode: str,
    average: str | None,
    preprocess: Preprocess | None,
    device: torch.device | str | None,
    defaults: tuple[tuple[str, ...], tuple[str, ...]],
) -> GlobalMetrics | StreamMetrics:
    if mode not in ("global", "stream"):
        raise ValueError(f"mode must be 'global' (exact) or 'stream' (per-batch averages), got {mode!r}")
    if isinstance(metrics, str):  # a sequence too, of one-letter "names"
        raise TypeError(f"metrics must be a list of metric names, got the string {metrics!r}; pass [{metrics!r}]")
    names = tuple(metrics) if metrics is not None else defaults[mode == "stream"]
    if mode == "stream" and any(name in GLOBAL_ONLY for name in names):
        raise ValueError(f"{', '.join(GLOBAL_ONLY)} cannot be averaged over batches; use mode='global'")
    funcs = metric_funcs(task, names, average)
    if mode == "stream":
        return StreamMetrics(preprocess=preprocess, device=device, **funcs)
    return GlobalMetrics(preprocess=preprocess, device=device, **funcs)


def binary_metrics(
    metrics: Sequence[str] | None = None,
    *,
    mode: str = "global",
    threshold: float = 0.5,
    ignore_index: int | None = -100,
    bins: int | None = None,
    preprocess: Preprocess | None = base_preprocess,
    device: torch.device | str | None = None,
) -> GlobalMetrics | StreamMetrics:
    """Metrics for binary classification (one score per sample).

    Examples:
        >>> metrics = binary_metrics()
        >>> metrics
        GlobalMetrics(acc, f1, mcc, auroc, auprc)
        >>> metrics.update([0.9, 0.2, 0.7, 0.4], [1, 0, 0, -100])
        >>> round(metrics.avg["acc"], 4), metrics.avg["auroc"]
        (0.6667, 1.0)
        >>> binary_metrics(["acc", "precision"], mode="stream")
        StreamMetrics(acc=MetricMeter(acc), precision=MetricMeter(precision))
    """
    task = MetricTask("binary", threshold=threshold, ignore_index=ignore_index, bins=bins)
    defaults = (CLASSIFICATION_GLOBAL, CLASSIFICATION_STREAM)
    return _container(task, metrics, mode, None, preprocess, device, defaults)


def multiclass_metrics(
    num_classes: int,
    metrics: Sequence[str] | None = None,
    *,
    mode: str = "global",
    average: str | None = "macro",
    ignore_index: int | None = -100,
    bins: int | None = None,
    preprocess: Preprocess | None = base_preprocess,
    device: torch.device | str | None = None,
) -> GlobalMetrics | StreamMetrics:
    """Metrics for single-label classification into `num_classes` classes.

    `acc` is always the plain fraction of correct predictions; `average` applies to
    precision, recall, f1, auroc and auprc. `bins` (for example 1000) computes auroc and
    auprc from per-bin score counts, in memory independent of the number of samples.

    Examples:
        >>> import torch
        >>> metrics = multiclass_metrics(num_classes=3)
        >>> metrics.update(torch.tensor([[2.0, 0.1, 0.3], [0.1, 1.5, 0.2], [1.2, 0.2, 0.1]]), torch.tensor([0, 1, 2]))
        >>> metrics.update(torch.tensor([[0.1, 0.2, 3.0], [0.2, 1.0, 0.9]]), torch.tensor([2, 1]))
        >>> result = metrics.compute()
        >>> round(result["acc"], 4), round(result["f1"], 4), round(result["auroc"], 4)
        (0.8, 0.7778, 0.9444)
    """
    task = MetricTask("multiclass", num_classes=num_classes, ignore_index=ignore_index, bins=bins)
    defaults = (CLASSIFICATION_GLOBAL, CLASSIFICATION_STREAM)
    return _container(task, metrics, mode, average, preprocess, device, defaults)


def multilabel_metrics(
    num_labels: int,
    metrics: Sequence[str] | None = None,
    *,
    mode: str = "global",
    threshold: float = 0.5,
    average: str | None = "macro",
    ignore_index: int | None = -100,
    bins: int | None = None,
    preprocess: Preprocess | None = base_preprocess,
    device: torch.device | str | None = None,
) -> GlobalMetrics | StreamMetrics:
    """Metrics for `num_labels` independent binary labels per sample.

    `acc` and `mcc` pool all label decisions; `average` applies to precision, recall, f1,
    auroc and auprc.

    Examples:
        >>> metrics = multilabel_metrics(num_labels=2, metrics=["acc", "f1"])
        >>> metrics.update([[0.9, 0.2], [0.8, 0.6], [0.1, 0.7], [0.3, 0.4]], [[1, 0], [0, 1], [0, 1], [1, 0]])
        >>> metrics.avg.dict()
        {'acc': 0.75, 'f1': 0.75}
    """
    task = MetricTask("multilabel", num_labels=num_labels, threshold=threshold, ignore_index=ignore_index, bins=bins)
    defaults = (CLASSIFICATION_GLOBAL, CLASSIFICATION_STREAM)
    return _container(task, metrics, mode, average, preprocess, device, defaults)


def regression_metrics(
    num_outputs: int = 1,
    metrics: Sequence[str] | None = None,
    *,
    mode: str = "global",
    average: str | None = "macro",
    ignore_index: float | None = None,
    preprocess: Preprocess | None = base_preprocess,
    device: torch.device | str | None = None,
) -> GlobalMetrics | StreamMetrics:
    """Metrics for regression with `num_outputs` outputs per sample.

    Only `spearman` needs the stored predictions; the others are computed from running
    moments, so `regression_metrics(metrics=["r2", "rmse"])` uses constant memory even in
    global mode.

    Examples:
        >>> metrics = regression_metrics(metrics=["r2", "mse", "spearman"])
        >>> metrics.update([2.5, 0.0], [3.0, -0.5])
        >>> metrics.update([2.0, 8.0], [2.0, 7.0])
        >>> {name: round(value, 4) for name, value in metrics.avg.items()}
        {'r2': 0.9486, 'mse': 0.375, 'spearman': 1.0}
    """
    task = MetricTask("regression", num_outputs=num_outputs, ignore_index=ignore_index)
    return _container(task, metrics, mode, average, preprocess, device, (REGRESSION_GLOBAL, REGRESSION_STREAM))


METRICS = Registry("metric factory")
"""Factories by task name, for configurations: `METRICS.build(type="multiclass", num_classes=10)`."""
METRICS.register(binary_metrics, "binary")
METRICS.register(multiclass_metrics, "multiclass")
METRICS.register(multilabel_metrics, "multilabel")
METRICS.register(regression_metrics, "regression")
