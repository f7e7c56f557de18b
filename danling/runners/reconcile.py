"""Repair what a run directory derives from its checkpoints after a crash: aliases, result files, leftovers.

A run killed at the wrong moment keeps every checkpoint intact (they are published atomically),
but what is derived from them can lag: the `latest` pointer may still name an older checkpoint,
`best` may miss a better one (a kill between the two pointer updates), `results.json`,
`latest.json` and `best.json` may be missing or stale, and temporary files of interrupted writes
stay behind. [`reconcile_run`][danling.runners.reconcile.reconcile_run] puts all of it back in
line with the checkpoints. A writing runner calls it when it starts in an existing run
directory; `danling reconcile RUN` runs it by hand (never on a run that is still writing).

The rules:

- `latest` names the newest history checkpoint (`epoch-N`, `step-N`) that verifies against
  its manifest;
- `best` names the checkpoint of the best result row among all rows stored in that checkpoint,
  scored as the run scores them (`score_split`, `score_name`, `score_mode`); on ties the
  latest row wins, as in [`best_index`][danling.runners.services.results.RunnerResults.best_index].
  When that row's checkpoint does not exist (cadence, retention) `best` is left as it is;
- the result files are rewritten from those rows when they are missing, unreadable or differ;
- hidden `*.tmp` files of interrupted writes in the run directory and the staging directories
  of interrupted checkpoint saves are removed.
"""

from __future__ import annotations

import json
import logging
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from danling.checkpoint.layout import POINTER_SUFFIX, follow_pointer, recover_directory, write_pointer
from danling.checkpoint.manifest import CheckpointError, verify_directory
from danling.utils import save

from .config import RunnerConfig, recorded_config
from .services.results import RunnerResults
from .services.run_dirs import newest_valid_checkpoint
from .services.run_lock import RunDirectoryLockedError, live_lock_holder

__all__ = ["reconcile_run", "reconcile_on_start", "newest_valid_checkpoint"]

_RESULT_FILES = ("results.json", "latest.json", "best.json")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _checkpoint_dir(run_dir: Path, config: Mapping[str, Any] | None) -> Path:
    name = ((config or {}).get("checkpoint") or {}).get("dir_name") or "checkpoints"
    return run_dir / str(name)


def _remove_leftovers(run_dir: Path, checkpoint_dir: Path, logger: logging.Logger) -> list[str]:
    """Hidden `*.tmp` files of interrupted writes in `run_dir`, and staging entries of checkpoint saves."""
    removed = []
    for entry in sorted(run_dir.iterdir()):
        # `.<name>.<pid>.tmp` (skipped while its writer lives) and atomic_write_text's `.<name>.tmp-<hex>`
        pid_named = entry.name.endswith(".tmp")
        temporary = pid_named or ".tmp-" in entry.name
        if entry.is_file() and entry.name.startswith(".") and temporary and not (pid_named and _writing(entry.name)):
            entry.unlink(missing_ok=True)
            removed.append(entry.name)
    if checkpoint_dir.is_dir():
        before = {entry.name for entry in checkpoint_dir.iterdir() if entry.name.startswith(".")}
        recover_directory(checkpoint_dir, logger)
        after = {entry.name for entry in checkpoint_dir.iterdir() if entry.name.startswith(".")}
        removed += [f"{checkpoint_dir.name}/{name}" for name in sorted(before - after)]
    for name in removed:
        logger.info("reconcile: removed %s, left by an interrupted write", name)
    return removed


def _writing(name: str) -> bool:
    """Whether the `.<file>.<pid>.tmp` file `name` belongs to a process that still runs (this one included)."""
    pid = name[: -len(".tmp")].rsplit(".", 1)[-1]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _pointer(checkpoint_dir: Path, alias: str) -> Path | None:
    try:
        return follow_pointer(checkpoint_dir / f"{alias}{POINTER_SUFFIX}")
    except (CheckpointError, OSError):
        return None


def _repoint(checkpoint_dir: Path, alias: str, target: Path, logger: logging.Logger) -> list[str] | None:
    current = _pointer(checkpoint_dir, alias)
    if current is not None and current.name == target.name:
        return None
    write_pointer(checkpoint_dir, alias, target.name)
    was = current.name if current is not None else None
    logger.warning("reconcile: %r pointed to %s; corrected to %s", alias, was, target.name)
    return [was, target.name]


def _stored_rows(checkpoint: Path, trusted: bool = False) -> tuple[dict[str, Any] | None, Mapping[str, Any] | None]:
    """`results` and `runner` (config) of a checkpoint, read without its tensors where the format allows.

    `trusted` reads it with the full unpickler (`checkpoint.trust_pickle`), as the run's resume will."""
    from danling.checkpoint import detect_format, read_checkpoint
    from danling.checkpoint.unpickling import read_dcp_metadata, torch_load

    if detect_format(checkpoint) == "dcp":
        from danling.checkpoint.dcp import read_dcp_checkpoint

        keys = {
            fqn.split(".")[0]
            for fqn in read_dcp_metadata(checkpoint / ".metadata", trusted=trusted).state_dict_metadata
        }
        excluded = sorted(keys - {"results", "runner"})
        payload = read_dcp_checkpoint(checkpoint, exclude_from_loading=excluded, trusted=trusted)
    elif (checkpoint / "state.pt").is_file() and zipfile.is_zipfile(checkpoint / "state.pt"):
        # tensors stay on disk: only rows are read
        payload = torch_load(checkpoint / "state.pt", mmap=True, trusted=trusted)
    else:
        payload = read_checkpoint(checkpoint, trusted=trusted)
    return payload.get("results"), payload.get("runner")


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _rewrite_results(
    run_dir: Path, rows: RunnerResults, best: int | None, header: dict[str, Any], logger: logging.Logger
) -> list[str]:
    """Rewrite each result file whose content differs from what `rows` says."""
    plain = {index: _plain(dict(row)) for index, row in rows.rows.items()}
    last = next(reversed(plain))
    wanted = {"results.json": {**header, "results": {str(i): row for i, row in plain.items()}}}
    wanted["latest.json"] = {**header, "index": last, **plain[last]}
    if best is not None:
        wanted["best.json"] = {**header, "index": best, **plain[best]}
    rebuilt = []
    for name, content in wanted.items():
        current = _read_json(run_dir / name)
        compare = ("results",) if name == "results.json" else ("index", *plain[content["index"]])
        if not isinstance(current, Mapping) or any(current.get(k) != content.get(k) for k in compare):
            save(content, run_dir / name)
            rebuilt.append(name)
            logger.warning("reconcile: %s was %s; rebuilt from the checkpointed results", name, _state(current))
    return rebuilt


def _state(current: Any) -> str:
    return "missing or unreadable" if not isinstance(current, Mapping) else "stale"


def _header(run_dir: Path, metadata: Mapping[str, Any]) -> dict[str, Any]:
    existing = _read_json(run_dir / "results.json")
    if isinstance(existing, Mapping) and "id" in existing:
        return {"id": existing.get("id"), "timestamp": existing.get("timestamp")}
    return {"id": metadata.get("id"), "timestamp": metadata.get("timestamp")}


def reconcile_run(
    run_dir: str | os.PathLike,
    *,
    config: RunnerConfig | Mapping[str, Any] | None = None,
    logger: logging.Logger | None = None,
    trusted: bool = False,
) -> dict[str, Any]:
    """Bring the aliases, result files and leftovers of a run directory in line with its checkpoints.

    Args:
        run_dir: The run directory (holding `metadata.json` and the checkpoint directory).
        config: The run's config; by default the one stored in the newest valid checkpoint, else
            in `metadata.json`. It names the checkpoint directory and the scoring rules.
        logger: Where each repair is reported (default `danling.reconcile`).
        trusted: Read the checkpoint's rows with the full unpickler (only for files you trust;
            a starting runner passes its `checkpoint.trust_pickle`).

    Returns:
        What was done: `latest` and `best` (`[before, after]` names, or `None` when unchanged),
        `rebuilt` (result files rewritten) and `removed` (leftovers deleted), plus `checkpoint`
        (the newest valid checkpoint, or `None`).

    Raises:
        FileNotFoundError: `run_dir` is not a directory.
        RunDirectoryLockedError: Another live process trains in `run_dir` (it holds the run lock).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {os.fspath(run_dir)!r} does not exist")
    holder = live_lock_holder(run_dir)
    if holder is not None:
        raise RunDirectoryLockedError(
            f"cannot reconcile {os.fspath(run_dir)!r}: pid {holder.get('pid')} on host {holder.get('host')!r} "
            "trains there now; reconcile it once that run has stopped"
        )
    logger = logger or logging.getLogger("danling.reconcile")
    metadata = _read_json(run_dir / "metadata.json") or {}
    stored_config = config if config is not None else metadata.get("config")
    checkpoint_dir = _checkpoint_dir(run_dir, stored_config)
    report: dict[str, Any] = {"checkpoint": None, "latest": None, "best": None, "rebuilt": []}
    report["removed"] = _remove_leftovers(run_dir, checkpoint_dir, logger)
    newest = newest_valid_checkpoint(checkpoint_dir, logger)
    if newest is None:
        return report
    report["checkpoint"] = str(newest)
    report["latest"] = _repoint(checkpoint_dir, "latest", newest, logger)
    results, saved_config = _stored_rows(newest, trusted)
    if not results:
        return report
    if not isinstance(config, RunnerConfig):
        config = recorded_config(config if config is not None else saved_config or stored_config or {})
    rows = RunnerResults(config, results)  # scored with the run's own selection rules
    best = rows.best_index if rows.scores else None
    if best is not None:
        target = checkpoint_dir / f"{'epoch' if config.get('epochs') is not None else 'step'}-{best:06d}"
        if target.is_dir() and _verifies(target):
            report["best"] = _repoint(checkpoint_dir, "best", target, logger)
    report["rebuilt"] = _rewrite_results(run_dir, rows, best, _header(run_dir, metadata), logger)
    return report


def _verifies(path: Path) -> bool:
    """Whether the checkpoint at `path` verifies against its manifest."""
    try:
        verify_directory(path)
    except CheckpointError:
        return False
    return True


def reconcile_on_start(runner: Any) -> dict[str, Any] | None:
    """Reconcile the run directory of a starting `runner` that writes, on its main process only.

    Returns the report of [`reconcile_run`][danling.runners.reconcile.reconcile_run], or `None`
    when there is nothing to do (another rank, a load-only run, or a new run directory).
    """
    path = runner.workspace.path
    if not runner.is_main_process or runner.config.checkpoint.load_only or not Path(path).is_dir():
        return None
    trusted = bool(runner.config.checkpoint.trust_pickle)
    return reconcile_run(path, config=runner.config, logger=runner.logger, trusted=trusted)
