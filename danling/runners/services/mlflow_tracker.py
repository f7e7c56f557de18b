"""MLflow tracker: parameters from the config, metrics per step, in a local store or a server."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from danling.utils import optional_import

from .trackers import Tracker, flatten_result

__all__ = ["MLflowTracker", "flatten_params"]

# MLflow caps a parameter value at 6000 characters (older servers at 500); longer values are cut.
_PARAM_LIMIT = 500
_BATCH = 200  # MLflow's log_batch accepts at most 1000 metrics and 100 params per call


def flatten_params(config: Mapping[str, Any], sep: str = ".") -> dict[str, str]:
    """Flatten a nested config into `{"optim.lr": "0.01", ...}`; `None` values are left out.

    Examples:
        >>> flatten_params({"optim": {"lr": 0.01, "type": "adamw"}, "seed": None, "tags": [1, 2]})
        {'optim.lr': '0.01', 'optim.type': 'adamw', 'tags': '[1, 2]'}
    """
    flat: dict[str, str] = {}

    def visit(node: Mapping, prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{sep}{key}" if prefix else str(key)
            if isinstance(value, Mapping):
                visit(value, name)
            elif value is not None:
                flat[name] = str(value)[:_PARAM_LIMIT]

    visit(config, "")
    return flat


class MLflowTracker(Tracker):
    """Record a run in MLflow: the config as parameters, each logged result as metrics at its step.

    Requires the `mlflow` extra (`mlflow-skinny` is enough for a local file store or a remote
    server). Talks to MLflow through `MlflowClient` only, so it never touches MLflow's global
    "active run" and several trackers can live in one process.

    Without `tracking_uri` the run goes to a file store at `<dir>/mlruns` (view it with
    `mlflow ui --backend-store-uri <dir>/mlruns`). MLflow has put its file store in maintenance
    mode and refuses to open one unless `MLFLOW_ALLOW_FILE_STORE` is true; this tracker sets
    that variable (unless you set it yourself) only when it uses the file store it chose. Pass a
    `tracking_uri` (`sqlite:///path/mlflow.db` with full `mlflow`, or `http://server:5000`) to
    use another store.

    Args:
        dir: Directory of the default file store (`<dir>/mlruns`); ignored with `tracking_uri`.
        tracking_uri: Where MLflow stores the run.
        experiment: MLflow experiment name (created when missing).
        run_name: Display name of the run.
        params: Parameters to record once (a nested config is flattened with dots).
        tags: Tags set on the run.
        run_id: Continue this run (a resumed training run) instead of creating one; a run the
            store does not hold is an error naming it. Parameters it already records keep their
            first value (MLflow cannot change one): a changed value is recorded as the tag
            `danling.resumed.<name>`.
    """

    def __init__(
        self,
        dir: str | os.PathLike | None = None,  # same name as the other trackers' directory argument
        *,
        tracking_uri: str | None = None,
        experiment: str = "danling",
        run_name: str | None = None,
        params: Mapping[str, Any] | None = None,
        tags: Mapping[str, str] | None = None,
        run_id: str | None = None,
    ) -> None:
        tracking = optional_import("mlflow.tracking", "mlflow")
        entities = optional_import("mlflow.entities", "mlflow")
        if tracking_uri is None:
            if dir is None:
                raise ValueError("MLflowTracker needs a directory for its file store or a tracking_uri, got neither")
            store = Path(dir) / "mlruns"
            store.mkdir(parents=True, exist_ok=True)
            tracking_uri = store.resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.tracking_uri = tracking_uri
        self._entities = entities
        self.client = tracking.MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        recorded: dict[str, str] = {}
        if run_id is None:
            created = self.client.create_run(experiment_id, run_name=run_name, tags=dict(tags or {}))
            self.run_id: str = created.info.run_id
        else:
            try:
                run = self.client.get_run(run_id)
            except Exception as error:  # MlflowException: not in this store
                raise ValueError(
                    f"MLflow run {run_id!r} to continue is not in the store {tracking_uri!r}: {error}"
                ) from error
            self.run_id, recorded = run_id, dict(run.data.params)
            self.client.update_run(run_id, status="RUNNING")
        if params:
            flat = flatten_params(params)
            items = [entities.Param(key, value) for key, value in flat.items() if key not in recorded]
            changed = [
                entities.RunTag(f"danling.resumed.{key}", value)
                for key, value in flat.items()
                if key in recorded and recorded[key] != value
            ]
            for start in range(0, len(items), 100):
                self.client.log_batch(self.run_id, params=items[start : start + 100])
            for start in range(0, len(changed), 100):
                self.client.log_batch(self.run_id, tags=changed[start : start + 100])
        self._closed = False

    def log(self, result: Mapping[str, Any], step: int) -> None:
        timestamp = int(time.time() * 1000)
        metrics = [
            self._entities.Metric(_metric_key(key), value, timestamp, int(step))
            for key, value in flatten_result(result).items()
        ]
        for start in range(0, len(metrics), _BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + _BATCH])

    def close(self, status: str = "FINISHED") -> None:
        """Mark the run terminated (`FINISHED`, `FAILED` or `KILLED`); idempotent."""
        if not self._closed:
            self._closed = True
            self.client.set_terminated(self.run_id, status=status)


def _metric_key(key: str) -> str:
    # MLflow accepts letters, digits, `_ - . space /`; anything else becomes `_`.
    return "".join(char if char.isalnum() or char in "_-. /" else "_" for char in key)
