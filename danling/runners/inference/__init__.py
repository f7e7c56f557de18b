"""Inference into files: `runner.infer(split, output=PATH)` streamed, resumable after a kill, in dataset order.

- [`sinks`][danling.runners.inference.sinks]: the [`Sink`][danling.runners.inference.sinks.Sink]
  interface, the suffix registry and JSON Lines;
  [`npy`][danling.runners.inference.npy] and [`parquet`][danling.runners.inference.parquet]: the
  NumPy and Parquet sinks.
- [`progress`][danling.runners.inference.progress]: the per-rank progress record and the model digest.
- [`writer`][danling.runners.inference.writer]: the loop that writes, commits, resumes and merges.
"""

from . import npy, parquet  # noqa: F401 - registers the .npy and .parquet sinks
from .npy import NumpySink
from .parquet import ParquetSink
from .progress import Commit, ProgressRecord, model_digest
from .sinks import JsonLinesSink, Sink, register_sink, registered_suffixes, sink_for
from .writer import InferencePlan, run_inference

__all__ = [
    "Commit",
    "InferencePlan",
    "JsonLinesSink",
    "NumpySink",
    "ParquetSink",
    "ProgressRecord",
    "Sink",
    "model_digest",
    "register_sink",
    "registered_suffixes",
    "run_inference",
    "sink_for",
]
