"""Reading a run directory back: identity, config, results, status and progress, without a runner.

A run directory (see [`RunnerWorkspace`][danling.runners.services.workspace.RunnerWorkspace])
holds `metadata.json` and `config.yaml`, the result files (`results.json`, `latest.json`,
`best.json`), `metrics.csv`, `status.json`, heartbeats and checkpoints. Every reader here
tolerates missing files: a run that crashed early, or was written by an older version, still
lists with what it has.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["CLIError", "Run", "find_runs", "load_run", "flatten"]

_SCORE_SPLITS = ("val", "validate", "validation")
# A heartbeat older than this many intervals means the process stopped beating.
_STALE_BEATS = 3.0


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _object(value: Any) -> dict[str, Any]:
    """`value` if it is a JSON object, else an empty one: a damaged file reads as a missing one."""
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> float | None:
    """`value` as a float when it is a JSON number, else None (a damaged field counts as absent)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def flatten(mapping: Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`; leaves are kept as they are."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name, sep))
        else:
            flat[name] = value
    return flat


def is_run_dir(path: Path) -> bool:
    """Whether `path` is a run directory (it has the `metadata.json` every run writes)."""
    return (path / "metadata.json").is_file()


@dataclass
class Run:
    """What a run directory says about its run."""

    path: Path
    metadata: dict[str, Any] = field(default_factory=dict)
    # Why the run's own records cannot be read (a damaged metadata.json); listed, not skipped.
    damaged: str = ""

    @property
    def config(self) -> dict[str, Any]:
        config = self.metadata.get("config")
        return config if isinstance(config, dict) else {}

    @property
    def launches(self) -> list[dict[str, Any]]:
        """Each launch's record (time, code, budget, seed), oldest first."""
        launches = self.metadata.get("launches")
        return [launch for launch in launches if isinstance(launch, dict)] if isinstance(launches, list) else []

    @property
    def current_config(self) -> dict[str, Any]:
        """`config` (what the first launch recorded) with the budget of the latest launch: a
        continued run may have raised `epochs` or `steps`, which is what it trains to now."""
        config = dict(self.config)
        for launch in reversed(self.launches):
            if launch.get("epochs") is not None or launch.get("steps") is not None:
                config["epochs"], config["steps"] = launch.get("epochs"), launch.get("steps")
                break
        return config

    def budget_history(self) -> list[Any]:
        """The budget of each launch that changed it (`[15, 20]`: launched for 15, extended to 20)."""
        unit = "epochs" if self.current_config.get("epochs") else "steps"
        history: list[Any] = []
        for launch in self.launches:
            total = launch.get(unit)
            if total is not None and (not history or history[-1] != total):
                history.append(total)
        return history

    @property
    def id(self) -> str:
        return str(self.metadata.get("id") or self.path.name.rsplit("-", 1)[-1])

    @property
    def experiment(self) -> str:
        return str(self.metadata.get("experiment") or self.path.name.rsplit("-", 1)[0])

    @property
    def label(self) -> str:
        return f"{self.experiment}-{self.id}"

    def read(self, name: str) -> Any:
        """Parsed JSON file `name` of the run directory, or None when missing or unreadable."""
        return _read_json(self.path / name)

    @property
    def results(self) -> dict[int, dict[str, Any]]:
        """Result rows by index (epoch in epoch mode, global step in step mode)."""
        rows = (self.read("results.json") or {}).get("results") or {}
        return {int(index): row for index, row in rows.items() if isinstance(row, dict)}

    def result_row(self, which: str) -> dict[str, Any] | None:
        """`best.json` or `latest.json` as a row (index kept, file header dropped)."""
        row = self.read(f"{which}.json")
        if not isinstance(row, dict):
            return None
        return {key: value for key, value in row.items() if key not in ("id", "timestamp")}

    # ---------------------------------------------------------------- score and progress
    def score(self) -> tuple[str, float] | None:
        """(`split/name`, value) of the best row, with the runner's score split and name."""
        best = self.result_row("best")
        if not best:
            return None
        name = self.config.get("score_name") or "loss"
        split = self.config.get("score_split")
        if not split:
            splits = [key for key, value in best.items() if isinstance(value, dict)]
            preferred = [s for s in _SCORE_SPLITS if s in splits]
            split = (preferred or splits or [None])[0]
        value = (best.get(split) or {}).get(name) if split else None
        return (f"{split}/{name}", float(value)) if isinstance(value, (int, float)) else None

    def heartbeats(self) -> list[dict[str, Any]]:
        directory = self.path / str((self.config.get("heartbeat") or {}).get("dir_name") or "heartbeats")
        beats = [_read_json(path) for path in sorted(directory.glob("heartbeat-rank*.json"))]
        return [beat for beat in beats if isinstance(beat, dict)]

    def _beat_numbers(self, beats: list[dict[str, Any]], key: str) -> list[float]:
        return [number for beat in beats if (number := _number(beat.get(key))) is not None]

    def progress(self) -> dict[str, Any]:
        """Steps or epochs done (from status, heartbeats or results, in that order), the budget of the
        latest launch, and `history`: the budget of each launch that changed it."""
        status = _object(self.read("status.json"))
        beats = self.heartbeats()
        epoch = status.get("epoch")
        step = status.get("global_step")
        if step is None and beats:
            step = int(max(self._beat_numbers(beats, "step"), default=0))
            epoch = int(max(self._beat_numbers(beats, "epoch"), default=0))
        config = self.current_config  # the budget now, not the first launch's
        epochs, steps, history = config.get("epochs"), config.get("steps"), self.budget_history()
        if epochs:
            done = epoch if epoch is not None else len(self.results)
            return {"unit": "epochs", "done": done, "total": epochs, "global_step": step, "history": history}
        if step is None and self.results:
            step = max(self.results)
        return {"unit": "steps", "done": step, "total": steps, "global_step": step, "history": history}

    # ---------------------------------------------------------------- status
    def status(self, now: float | None = None) -> dict[str, Any]:
        """`status` (running/finished/failed/preempted/unknown), `heartbeat_age` and a `note`."""
        now = time.time() if now is None else now
        if self.damaged:
            return {"status": "damaged", "heartbeat_age": None, "note": self.damaged, "end_time": None}
        record = _object(self.read("status.json"))
        beats = self.heartbeats()
        last_beat = max(self._beat_numbers(beats, "time"), default=None)
        age = None if last_beat is None else max(now - last_beat, 0.0)
        status, note = record.get("status") or "unknown", record.get("error") or ""
        if status == "running":
            interval = float((self.config.get("heartbeat") or {}).get("interval_seconds") or 60.0)
            if record.get("host") == socket.gethostname() and not _alive(record.get("pid")):
                status, note = "failed", "process gone without recording an end"
            elif age is not None and age > _STALE_BEATS * max(interval, 1.0):
                status, note = "failed", f"no heartbeat for {_duration(age)}"
        elif status == "unknown" and beats:
            closed = all(beat.get("phase") == "closed" for beat in beats)
            status = "finished" if closed else "running"
        if status == "unknown" and (self.path / "checkpoints" / "shutdown.pointer").is_file():
            status = "preempted"
        end = _number(record.get("time")) if status != "running" else None
        return {"status": status, "heartbeat_age": age, "note": note, "end_time": end}

    def start_time(self) -> float | None:
        text = self.metadata.get("start_time")
        try:
            return datetime.fromisoformat(text).timestamp() if isinstance(text, str) and text else None
        except ValueError:
            return None


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return True  # nothing to check: trust the record
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def load_run(path: str | os.PathLike) -> Run:
    """Read the run directory `path`.

    Raises:
        CLIError: `path` does not exist or holds no `metadata.json`.
    """
    path = Path(path)
    if not path.exists():
        raise CLIError(f"{os.fspath(path)} does not exist")
    if not is_run_dir(path):
        raise CLIError(f"{os.fspath(path)} is not a run directory: it has no metadata.json (a run writes one)")
    metadata = _read_json(path / "metadata.json")
    if not isinstance(metadata, dict):
        raise CLIError(f"{os.fspath(path / 'metadata.json')} is not a JSON object; the run directory is damaged")
    return Run(path, metadata)


def find_runs(root: str | os.PathLike) -> Iterator[Run]:
    """Every run directory under `root` (or `root` itself), in path order; checkpoints are not searched."""
    root = Path(root)
    if not root.is_dir():
        raise CLIError(f"{os.fspath(root)} is not a directory (expected a workspace root or a run directory)")
    for directory, subdirs, _ in os.walk(root):
        path = Path(directory)
        if is_run_dir(path):
            subdirs.clear()
            try:
                yield load_run(path)
            except CLIError:  # listed as damaged: skipping it hid a run from the listing
                yield Run(path, damaged="metadata.json is no JSON object")
        else:
            subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
