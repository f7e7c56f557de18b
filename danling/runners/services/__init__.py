"""Services a runner is built from, each usable on its own: run directory and logging, signals and
heartbeats, trackers (CSV, TensorBoard, W&B, MLflow), result bookkeeping and `torch.compile` settings."""

from .compiler import Compiler
from .csv_tracker import CSVTracker, read_metrics_csv
from .mlflow_tracker import MLflowTracker
from .observability import ObservabilityMixin
from .progress_bar import ProgressBar
from .results import ResultsMixin
from .supervisor import RunnerSupervisor
from .trackers import TensorBoardTracker, Tracker, Trackers, WandbTracker, flatten_result
from .workspace import RunnerWorkspace

__all__ = [
    "CSVTracker",
    "Compiler",
    "MLflowTracker",
    "ObservabilityMixin",
    "ProgressBar",
    "ResultsMixin",
    "RunnerSupervisor",
    "RunnerWorkspace",
    "TensorBoardTracker",
    "Tracker",
    "Trackers",
    "WandbTracker",
    "flatten_result",
    "read_metrics_csv",
]
