"""Which trackers a run gets: a registry of tracker builders, looked up by name from the config.

A runner builds, at construction and on the main process only, every registered tracker whose
`enabled(config)` is true, in registration order: `tensorboard` (`tensorboard: true`), `wandb`
(`wandb.enabled`), `csv` (`csv.enabled`, on by default) and `mlflow` (`mlflow.enabled`). Each
builder receives a [`TrackerSetup`][danling.runners.services.tracking.TrackerSetup] (the typed
config and the run's workspace) and returns a [`Tracker`][danling.runners.services.trackers.Tracker].

Add your own in either of two ways:

- per runner, at any time: `runner.trackers.append(MyTracker(...))`;
- for every runner, by name:
  `register_tracker("jsonl", lambda setup: JSONLinesTracker(setup.workspace.dir / "metrics.jsonl"),
  enabled=lambda config: config.get("jsonl", False))`.

A tracker that writes JSON (such as the JSON Lines tracker of the trackers guide) encodes it with
[`dumps_strict`][danling.utils.io.dumps_strict]: logged values may be NaN or infinite, which
Python's `json.dumps` writes as `NaN` or `Infinity`, no JSON at all; strict JSON has `null`.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from danling.checkpoint.manifest import atomic_write_text

from .trackers import Tracker

if TYPE_CHECKING:
    from ..config import RunnerConfig
    from .workspace import RunnerWorkspace

__all__ = [
    "TRACKERS",
    "TrackerEntry",
    "TrackerSetup",
    "register_tracker",
    "tensorboard_tracker",
    "wandb_options",
    "wandb_tracker",
]


@dataclass(frozen=True)
class TrackerSetup:
    """What a tracker builder may read: the run's typed config and its workspace (run directory, ids)."""

    config: RunnerConfig
    workspace: RunnerWorkspace


@dataclass(frozen=True)
class TrackerEntry:
    """A registered tracker: `build(setup)` makes it when `enabled(config)` says so."""

    build: Callable[[TrackerSetup], Tracker]
    enabled: Callable[[Any], bool]


TRACKERS: dict[str, TrackerEntry] = {}


def register_tracker(
    name: str, build: Callable[[TrackerSetup], Tracker], enabled: Callable[[Any], bool] = lambda config: True
) -> None:
    """Register (or replace) the tracker `name`: runners built afterwards call `build(setup)` on their
    main process when `enabled(config)` is true, after the trackers registered before it.

    Raises:
        TypeError: `build` or `enabled` is not callable.

    Examples:
        >>> from danling.runners.services import Tracker
        >>> register_tracker("quiet", lambda setup: Tracker(), enabled=lambda config: False)
        >>> "quiet" in TRACKERS
        True
        >>> del TRACKERS["quiet"]
    """
    if not callable(build) or not callable(enabled):
        raise TypeError(f"register_tracker({name!r}, ...) needs callables build(setup) and enabled(config)")
    TRACKERS[name] = TrackerEntry(build, enabled)


def tensorboard_tracker(setup: TrackerSetup, *args: Any, **kwargs: Any) -> Tracker:
    """A [`TensorBoardTracker`][danling.runners.services.trackers.TensorBoardTracker] writing to
    `<run dir>/tensorboard` (or `log_dir`) with the config as its text entry; further arguments go to
    `SummaryWriter`."""
    from .trackers import TensorBoardTracker

    log_dir = kwargs.pop("log_dir", os.path.join(setup.workspace.dir, "tensorboard"))
    kwargs.setdefault("config", setup.config.dict())
    return TensorBoardTracker(log_dir, *args, **kwargs)


def wandb_options(setup: TrackerSetup, **overrides: Any) -> dict[str, Any]:
    """`wandb.init` arguments of a run: project, group and name default to the lineage, experiment and
    run id; the `wandb.*` keys, then `overrides`, replace them. Unless `overrides` names an `id`, the
    W&B run id is kept in `<run dir>/wandb-run-id`, so a run resumed in its directory continues the
    same W&B run."""
    wandb, workspace = setup.config.wandb, setup.workspace
    options = {
        "project": wandb.project or workspace.lineage,
        "name": wandb.name or workspace.id,
        "dir": wandb.dir or os.fspath(workspace.dir),
        "mode": wandb.mode,
        "config": setup.config.dict(),
        "entity": wandb.entity,
        "group": wandb.group or workspace.experiment,
        "job_type": wandb.job_type,
        "tags": [wandb.tags] if isinstance(wandb.tags, str) else wandb.tags,
    }
    options = {key: value for key, value in options.items() if value is not None}
    options.update(overrides)
    if "id" not in options:
        options["id"], options["resume"] = _wandb_run_id(workspace), "allow"
    return options


def _wandb_run_id(workspace: RunnerWorkspace) -> str:
    """The W&B run id of this run directory, chosen (and written) the first time."""
    path = workspace.path / "wandb-run-id"
    if path.is_file():
        return path.read_text().strip()
    run_id = f"{workspace.id}-{secrets.token_hex(4)}"  # unique even when run directories share an id
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, run_id + "\n")
    return run_id


def wandb_tracker(setup: TrackerSetup, *args: Any, **kwargs: Any) -> Tracker:
    """A [`WandbTracker`][danling.runners.services.trackers.WandbTracker] with
    [`wandb_options`][danling.runners.services.tracking.wandb_options]; `kwargs` override them."""
    from .trackers import WandbTracker

    return WandbTracker(*args, **wandb_options(setup, **kwargs))


def _csv(setup: TrackerSetup) -> Tracker:
    from .csv_tracker import CSVTracker

    csv = setup.config.csv
    return CSVTracker(setup.workspace.resolve(csv.file_name), flush_seconds=csv.flush_seconds)


def _mlflow(setup: TrackerSetup) -> Tracker:
    from .mlflow_tracker import MLflowTracker

    mlflow, workspace = setup.config.mlflow, setup.workspace
    # A resumed run continues the MLflow run of its directory (as W&B's does), written the first time.
    path = workspace.path / "mlflow-run-id"
    tracker = MLflowTracker(
        os.fspath(workspace.dir),
        tracking_uri=mlflow.tracking_uri,
        experiment=mlflow.experiment or workspace.lineage,
        run_name=mlflow.run_name or f"{workspace.experiment}-{workspace.id}",
        params=setup.config.dict(),
        tags={"danling.run_id": workspace.id, "danling.run_dir": os.fspath(workspace.path)},
        run_id=path.read_text().strip() if path.is_file() else None,
    )
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, tracker.run_id + "\n")
    return tracker


register_tracker("tensorboard", tensorboard_tracker, enabled=lambda config: bool(config.tensorboard))
register_tracker("wandb", wandb_tracker, enabled=lambda config: bool(config.wandb.enabled))
register_tracker("csv", _csv, enabled=lambda config: bool(config.csv.enabled))
register_tracker("mlflow", _mlflow, enabled=lambda config: bool(config.mlflow.enabled))
