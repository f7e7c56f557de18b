"""Services a runner is built from, each usable on its own: run directory and logging, signals and
heartbeats, trackers (CSV, TensorBoard, W&B, MLflow), result bookkeeping and `torch.compile` settings."""

from .compiler import Compiler
from .csv_tracker import CSVTracker, read_metrics_csv
from .mlflow_tracker import MLflowTracker
from .observability import RunStatus, Throughput
from .progress_bar import ProgressBar
from .results import RunnerResults
from .supervisor import RunnerSupervisor
from .trackers import TensorBoardTracker, Tracker, Trackers, WandbTracker, flatten_result
from .tracking import TRACKERS, TrackerSetup, register_tracker
from .workspace import RunnerWorkspace

__all__ = [
    "TRACKERS",
    "CSVTracker",
    "Compiler",
    "MLflowTracker",
    "ProgressBar",
    "RunnerResults",
    "RunnerSupervisor",
    "RunStatus",
    "RunnerWorkspace",
    "TensorBoardTracker",
    "Tracker",
    "TrackerSetup",
    "Trackers",
    "Throughput",
    "WandbTracker",
    "flatten_result",
    "register_tracker",
    "read_metrics_csv",
]
