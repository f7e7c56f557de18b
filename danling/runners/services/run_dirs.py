"""Which directory a run writes into, and how the other runs of its experiment differ from it.

One identity (`<experiment>-<id>`) may hold several runs: a run that does not resume never
writes into a directory holding another run's checkpoints, so it gets the next version,
`<experiment>-<id>-v2`, `-v3`, ... The rule, applied by every rank alike from the files alone:

- `resume` pointing inside one of the versions continues that version (a `resume` path
  elsewhere starts a new version, even with `auto_resume`);
- `auto_resume` (or `resume` naming an alias such as `latest`) continues the newest version that
  holds a checkpoint; with `auto_resume` alone, only when one of its checkpoints verifies: checkpoints
  that do not are evidence of what went wrong, never overwritten by a run starting from scratch, so
  that run takes a new version (and reports why each checkpoint was refused);
- otherwise the first version without a checkpoint is used (the plain name when it has none).

Every rank decides before any of them can write a checkpoint (the process group forms after the
workspace, and the first save needs every rank), so all ranks pick the same directory.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from danling.checkpoint.layout import NAME_PATTERN, POINTER_SUFFIX, scan_checkpoints
from danling.checkpoint.manifest import MANIFEST_NAME, CheckpointError, CheckpointNotFoundError, verify_directory
from danling.distributed.slurm import SlurmJob
from danling.utils.io import dumps_strict

__all__ = [
    "atomic_write",
    "choose_run_dir",
    "has_checkpoints",
    "refused_checkpoints",
    "identity_differences",
    "launch_record",
    "record_launch",
    "save_code_diff",
    "set_aside_failed_launch",
    "run_versions",
    "sibling_runs",
]

_VERSION = re.compile(r"^(?P<base>.+)-v(?P<number>[2-9]|[1-9]\d+)$")
_MISSING = object()
_ANY_NAME = re.compile(r"")


def has_checkpoints(run_dir: Path, dir_name: str = "checkpoints") -> bool:
    """Whether `run_dir/<dir_name>` holds a published checkpoint or alias (hidden temporary entries do not count)."""
    directory = run_dir / dir_name
    try:
        return any(not entry.name.startswith(".") for entry in directory.iterdir())
    except OSError:
        return False


def refused_checkpoints(run_dir: Path, dir_name: str = "checkpoints") -> dict[str, str]:
    """Why each checkpoint of `run_dir` cannot be resumed, or `{}` as soon as one verifies (newest first)."""
    refused = {}
    for path, _ in scan_checkpoints(run_dir / dir_name, _ANY_NAME):
        try:
            verify_directory(path)
        except CheckpointError as err:
            refused[path.name] = str(err)
            continue
        return {}
    return refused


def version_dir(base: Path, number: int) -> Path:
    """Directory of version `number` of `base` (`base` itself for 1)."""
    return base if number == 1 else base.with_name(f"{base.name}-v{number}")


def run_versions(base: Path) -> list[Path]:
    """Existing versions of the run directory `base`, oldest first (`base`, `base-v2`, ...)."""
    numbered = []
    if base.parent.is_dir():
        for entry in base.parent.iterdir():
            match = _VERSION.match(entry.name)
            if match and match["base"] == base.name and entry.is_dir():
                numbered.append((int(match["number"]), entry))
    return ([base] if base.is_dir() else []) + [path for _, path in sorted(numbered)]


def _inside(path: Path, directory: Path) -> bool:
    try:
        path.resolve().relative_to(directory.resolve())
    except ValueError:
        return False
    return True


def choose_run_dir(
    base: Path, *, dir_name: str, auto_resume: bool, resume: str | None, refused: dict | None = None
) -> Path:
    """The version of `base` this run writes into (see the module docstring for the rule).

    Args:
        refused: Filled, when given, with `{version: {checkpoint name: reason}}` for a version that
            `auto_resume` did not continue because none of its checkpoints verifies.

    Raises:
        CheckpointNotFoundError: `resume` is a path where no checkpoint can be found.
    """
    versions = run_versions(base)
    continuing = bool(auto_resume)
    if resume:
        target = Path(os.path.expanduser(resume))
        if target.is_absolute() or target.exists() or os.sep in resume:
            resolve_resume_path(resume, dir_name)  # a bad path fails now, before anything is written
            for version in versions:
                if _inside(target, version):
                    return version
            continuing = False  # `resume` wins over `auto_resume`: a checkpoint from elsewhere starts a new run
        else:  # an alias or checkpoint name: one of this experiment's own checkpoints
            continuing = True
    if continuing:
        for version in reversed(versions):
            if has_checkpoints(version, dir_name):
                reasons = refused_checkpoints(version, dir_name) if auto_resume and not resume else {}
                if not reasons:
                    return version
                if refused is not None:
                    refused[version] = reasons
                break  # its checkpoints stay as they are: a new version starts from scratch
    number = 1
    while has_checkpoints(version_dir(base, number), dir_name):
        number += 1
    return version_dir(base, number)


def set_aside_failed_launch(run_dir: Path, dir_name: str = "checkpoints") -> Path | None:
    """Move the files of a launch that died before its first checkpoint into `failed/<launch>/`.

    A run directory without a checkpoint is where the next launch of the same config writes; left
    as they are, the dead launch's `run.log`, `metrics.csv`, result files and launch list would
    mix with the new run's rows at the same steps. Only a launch whose `status.json` says it was
    training (`running`, then killed) or `failed` is moved; nothing moves while a live process
    holds the directory's lock, or when the directory holds a checkpoint (the next launch
    continues it, or starts a version beside it).

    Returns:
        The directory the files went to, or None when nothing moved.
    """
    from .run_lock import LOCK_NAME, held_here, live_lock_holder

    if not run_dir.is_dir() or has_checkpoints(run_dir, dir_name):
        return None
    if live_lock_holder(run_dir) is not None or held_here(run_dir):
        return None
    # only a launch that started training and did not finish: killed (`running`) or crashed (`failed`)
    if (read_json(run_dir / "status.json") or {}).get("status") not in ("running", "failed"):
        return None
    keep = {LOCK_NAME, "failed", dir_name}
    entries = [entry for entry in run_dir.iterdir() if entry.name not in keep]
    if not entries:
        return None
    launches = (read_json(run_dir / "metadata.json") or {}).get("launches") or [{}]
    started = str((launches[-1] if isinstance(launches[-1], dict) else {}).get("start_time") or "unknown")
    name = "launch-" + re.sub(r"[^0-9A-Za-z]+", "", started.split(".")[0].split("+")[0])
    target, number = run_dir / "failed" / name, 1
    while target.exists():
        number += 1
        target = run_dir / "failed" / f"{name}-{number}"
    target.mkdir(parents=True)
    for entry in entries:
        os.replace(entry, target / entry.name)
    return target


def sibling_runs(base: Path, experiment: str) -> list[Path]:
    """Run directories of `experiment` beside `base` that are not versions of `base`, newest first."""
    parent, own = base.parent, set(run_versions(base))
    if not parent.is_dir():
        return []
    pattern = re.compile(rf"^{re.escape(experiment)}-[0-9a-f]{{12}}(-v\d+)?$")  # not `<experiment>-other-<id>`
    found = []
    for entry in parent.iterdir():
        if pattern.match(entry.name) and entry not in own and (entry / "metadata.json").is_file():
            found.append((entry.stat().st_mtime_ns, entry))
    return [entry for _, entry in sorted(found, reverse=True)]


def recorded_run_config(run_dir: Path) -> Mapping[str, Any] | None:
    """The config a run recorded in its `metadata.json`, or None when unreadable."""
    metadata = read_json(run_dir / "metadata.json")
    config = metadata.get("config") if metadata is not None else None
    return config if isinstance(config, Mapping) else None


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def identity_differences(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """`(key, before, after)` for each dotted key whose value differs between two semantic configs.

    A key missing on one side is reported as `None` there (unset and None mean the same in an identity).

    Examples:
        >>> identity_differences({"optim": {"lr": 0.1}, "seed": 1}, {"optim": {"lr": 0.2}, "seed": 1})
        [('optim.lr', 0.1, 0.2)]
    """
    old, new = _flatten(before), _flatten(after)
    changed = []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key, _MISSING), new.get(key, _MISSING)
        if a != b:
            changed.append((key, None if a is _MISSING else a, None if b is _MISSING else b))
    return changed


def format_differences(differences: list[tuple[str, Any, Any]]) -> str:
    """`key: old -> new` for each difference, separated by `; `."""
    return "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in differences)


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, or None when missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def launch_record(config: Any, start_time: Any, code_id: str | None, git: Any, world_size: int) -> dict[str, Any]:
    """One entry of `metadata.json["launches"]`: when, which code (commit, dirty flag), budget and seed.

    Inside a Slurm job it also holds `slurm`: the job id, array job id and index, and restart count.
    """

    def get(key: str) -> Any:
        return config.get(key) if isinstance(config, Mapping) else None

    job = SlurmJob.from_environ()
    record = {
        "start_time": start_time.isoformat(),
        "code_id": code_id,
        "git": git,
        "argv": list(sys.argv),
        "world_size": world_size,
        "hostname": platform.node(),
        "seed": get("seed"),
        "epochs": get("epochs"),
        "steps": get("steps"),
    }
    if job is not None:
        record["slurm"] = job.record()
    return record


def save_code_diff(run_dir: Path, index: int, git: Mapping[str, Any] | None) -> str | None:
    """Write the uncommitted changes of a dirty checkout to `<run_dir>/code/launch-<index>.diff`.

    Returns the file's path relative to `run_dir` (recorded in the launch), or None when the
    checkout is clean, not a repository, or the diff cannot be read.
    """
    from .git_info import git_diff

    if not git or not git.get("dirty") or not git.get("root"):
        return None
    diff = git_diff(git["root"])
    if diff is None:
        return None
    name = f"code/launch-{index}.diff"
    (run_dir / "code").mkdir(parents=True, exist_ok=True)
    (run_dir / name).write_text(diff, encoding="utf-8")
    return name


def record_launch(
    metadata_file: Path, launch: dict[str, Any], initial: Callable[[], dict[str, Any]]
) -> dict[str, Any] | None:
    """Append `launch` to `metadata.json["launches"]` (starting from `initial()` when the file is missing).

    The diff of a dirty checkout is saved beside it (`save_code_diff`). Returns the launch before
    this one, or None for the first.
    """
    payload = read_json(metadata_file) or initial()
    launches = payload.setdefault("launches", [])
    previous = launches[-1] if launches else None
    launch["diff"] = save_code_diff(metadata_file.parent, len(launches), launch.get("git"))
    launches.append(launch)
    atomic_write(metadata_file, dumps_strict(payload, indent=2, default=str) + "\n")
    return previous


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to a temporary sibling, fsync it, then rename it over `path`."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()


def _checkpoint_in(directory: Path) -> Path | None:
    """The `latest` pointer of a checkpoint directory, else its newest checkpoint that verifies."""
    pointer = directory / f"latest{POINTER_SUFFIX}"
    if pointer.is_file():
        return pointer
    return newest_valid_checkpoint(directory)


def resolve_resume_path(source: str | os.PathLike, dir_name: str = "checkpoints") -> str | os.PathLike:
    """What to hand the checkpoint manager for a resume `source` given as a name or a path.

    Accepted forms: an alias or checkpoint name of the run's own checkpoint directory (returned as
    is: the manager looks it up), a checkpoint directory (it holds `manifest.json`), a payload or
    pointer file, a run directory (its `<dir_name>/latest`), a checkpoint directory of a run (its
    `latest`), and an alias path `<checkpoints>/<alias>` (the `<alias>.pointer` beside it). A run
    or checkpoint directory without a `latest` alias resumes its newest checkpoint that verifies.

    Raises:
        CheckpointNotFoundError: Nothing usable is there; the message lists every place looked at.
    """
    text = os.fspath(source)
    path = Path(os.path.expanduser(text))
    if isinstance(source, str) and NAME_PATTERN.match(text) and not path.exists():
        return source  # an alias or checkpoint name: the manager searches its own directory
    if path.is_file() or (path / MANIFEST_NAME).is_file():
        return source
    looked = [f"{path / MANIFEST_NAME} (a checkpoint directory)"]
    if path.is_dir():
        for directory in dict.fromkeys((path / dir_name, path / "checkpoints", path)):
            found = _checkpoint_in(directory) if directory.is_dir() else None
            if found is not None:
                return found
            looked.append(f"{directory / ('latest' + POINTER_SUFFIX)} or a checkpoint in {directory}")
        if not any(path.iterdir()):
            looked.append(f"anything in {path}, which is empty")
    else:
        pointer = path.with_name(path.name + POINTER_SUFFIX)
        if pointer.is_file():
            return pointer
        looked[0:1] = [f"{path} (no such file or directory)", f"{pointer} (an alias path)"]
    raise CheckpointNotFoundError(
        f"cannot resume from {text!r}: found no checkpoint; looked for: " + "; ".join(looked) + ". "
        "Give a run directory, its checkpoint directory, an alias (latest, best), an alias path "
        "(<run>/checkpoints/latest), a pointer file or a checkpoint directory"
    )


# The checkpoints a run keeps as history (the aliases and named saves are not).
HISTORY_NAME = re.compile(r"^(epoch|step|iter)-\d+$")


def newest_valid_checkpoint(
    checkpoint_dir: Path, logger: logging.Logger | None = None, refused: list[Path] | None = None
) -> Path | None:
    """The newest history checkpoint under `checkpoint_dir` that verifies, logging each one skipped
    (and appending it to `refused` when given)."""
    for path, manifest in scan_checkpoints(checkpoint_dir, HISTORY_NAME):
        if not manifest.get("history"):
            continue
        try:
            verify_directory(path)
        except CheckpointError as err:
            if logger is not None:
                logger.warning("reconcile: skipping checkpoint %s: %s", path, err)
            if refused is not None:
                refused.append(path)
            continue
        return path
    return None
