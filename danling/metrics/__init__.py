"""Metrics for training loops, usable on their own.

- [`AverageMeter`][danling.metrics.AverageMeter] / [`AverageMeters`][danling.metrics.AverageMeters]:
  running averages of values you compute (loss, timings).
- [`MetricMeter`][danling.metrics.MetricMeter] / [`StreamMetrics`][danling.metrics.StreamMetrics]:
  metric functions evaluated per batch and averaged, in constant memory.
- [`GlobalMetrics`][danling.metrics.GlobalMetrics]: exact dataset-level metrics (AUROC, AUPRC,
  Spearman, ...) that store only what their metrics need.
- [`MultiTaskMetrics`][danling.metrics.MultiTaskMetrics]: one container per task or dataset,
  with a macro, micro or weighted aggregate.
- [`binary_metrics`][danling.metrics.binary_metrics], [`multiclass_metrics`][danling.metrics.multiclass_metrics],
  [`multilabel_metrics`][danling.metrics.multilabel_metrics],
  [`regression_metrics`][danling.metrics.regression_metrics] and the
  [`METRICS`][danling.metrics.METRICS] registry: ready-made containers.
- [`danling.metrics.functional`][danling.metrics.functional]: the metric functions themselves.

Updates never synchronise with the device or across processes; values are synchronised
across ranks when `bat` / `avg` are read.
"""

from . import functional as functional  # the submodule, kept out of `danling.*`
from .factories import METRICS, binary_metrics, metric_funcs, multiclass_metrics, multilabel_metrics, regression_metrics
from .global_metrics import GlobalMetrics
from .meter import AverageMeter, AverageMeters, MetersBase
from .metric_meter import MetricMeter
from .multitask import MultiTaskBase, MultiTaskMetrics
from .preprocess import base_preprocess
from .state import MetricFunc, MetricState, MetricTask
from .stream_metrics import StreamMetrics

__all__ = [
    "METRICS",
    "AverageMeter",
    "AverageMeters",
    "GlobalMetrics",
    "MetersBase",
    "MetricFunc",
    "MetricMeter",
    "MetricState",
    "MetricTask",
    "MultiTaskBase",
    "MultiTaskMetrics",
    "StreamMetrics",
    "base_preprocess",
    "binary_metrics",
    "metric_funcs",
    "multiclass_metrics",
    "multilabel_metrics",
    "regression_metrics",
]
