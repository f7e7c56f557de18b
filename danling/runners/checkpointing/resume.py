"""How a runner finds what to resume from and how loudly it reports what changed since.

Used by [`CheckpointMixin`][danling.runners.checkpointing.api.CheckpointMixin]:

- [`resolve_resume_path`][danling.runners.checkpointing.resume.resolve_resume_path] turns every
  form a user may give (`resume: <run dir>`, its `checkpoints/` directory, `.../checkpoints/latest`,
  a pointer file, a checkpoint directory, a payload file) into what the checkpoint manager loads;
- [`check_identity`][danling.runners.checkpointing.resume.check_identity] refuses a checkpoint
  of a run that trained something else, unless `resume_allow_changes` is set;
- [`report_code_change`][danling.runners.checkpointing.resume.report_code_change] and
  [`report_other_runs`][danling.runners.checkpointing.resume.report_other_runs] warn when
  `auto_resume` continues across a commit or finds runs of the same experiment with another identity.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from danling.checkpoint.layout import NAME_PATTERN, POINTER_SUFFIX
from danling.checkpoint.manifest import MANIFEST_NAME, CheckpointNotFoundError

from ..reconcile import newest_valid_checkpoint
from ..services.run_dirs import format_differences, identity_differences, recorded_run_config, sibling_runs

if TYPE_CHECKING:
    from ..base_runner import BaseRunner
    from ..config import RunnerConfig

__all__ = ["check_identity", "report_code_change", "report_other_runs", "resolve_resume_path", "take_run_dir"]


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


def check_identity(runner: BaseRunner, saved: RunnerConfig) -> None:
    """Refuse a checkpoint whose run trained a different config, naming each differing key.

    With `resume_allow_changes: true` the checkpoint is accepted and each difference is logged as
    a warning. The budget (`epochs`, `steps`), cadences and logging are not part of the identity.

    Raises:
        ValueError: Identity keys differ and `resume_allow_changes` is not set.
    """
    config = runner.config
    saved = _judged_like(saved, config)
    if saved.config_id == config.config_id:
        return
    differences = identity_differences(saved.semantic_dict(), config.semantic_dict())
    if not config.get("resume_allow_changes"):
        keys = [key for key, _, _ in differences]
        raise ValueError(
            "the checkpoint was written by a run with a different config "
            f"(config_id {saved.config_id} vs {config.config_id}); keys that differ: {keys} "
            f"({format_differences(differences)}). Resume with the original config, set "
            "resume_allow_changes: true to continue it with these changes, or use load_pretrained() "
            "to start a new run from its weights."
        )
    for key, old, new in differences:
        runner.logger.warning("resume_allow_changes: %s was %r in the checkpoint's run, now %r", key, old, new)


def _judged_like(saved: RunnerConfig, config: RunnerConfig) -> RunnerConfig:
    """`saved` with the identity rules (`CONFIG_ID_IGNORES`) of `config`'s class.

    A record is read back as a plain `RunnerConfig`: a subclass that extends the ignored keys would
    otherwise find its own ignored keys counted in the record's identity and nowhere in its own.
    """
    ignores = type(config).CONFIG_ID_IGNORES
    if ignores == type(saved).CONFIG_ID_IGNORES:
        return saved
    judged = type(f"{type(saved).__name__}Judged", (type(saved),), {"CONFIG_ID_IGNORES": ignores})
    return judged(**saved.dict())


def take_run_dir(runner: BaseRunner) -> None:
    """Lock the run directory for this run and say when it is a new version beside an earlier run.

    Raises:
        RunDirectoryLockedError: Another live process trains in the directory.
    """
    workspace = runner.workspace
    workspace.lock(runner.logger)
    if not runner.is_main_process:
        return
    for run_dir, reasons in workspace.refused.items():
        runner.logger.warning(
            "auto_resume: no checkpoint in %s verifies, so this run starts from scratch in %s and leaves them "
            "as they are; refused: %s",
            Path(run_dir) / runner.config.checkpoint.dir_name,
            workspace.path,
            "; ".join(f"{name}: {reason}" for name, reason in reasons.items()),
        )
    if workspace.version > 1 and not workspace.refused:
        earlier = workspace.base_path if workspace.version == 2 else f"{workspace.base_path}-v{workspace.version - 1}"
        runner.logger.warning(
            "%s already holds the checkpoints of an earlier run of this config, so this run writes into %s; "
            "to continue that run instead, set auto_resume: true or resume: <its run directory>",
            earlier,
            workspace.path,
        )


def report_code_change(runner: BaseRunner) -> None:
    """Warn when this launch continues a run whose previous launch ran another commit (or dirty code)."""
    workspace = runner.workspace
    previous = workspace.previous_launch
    if not runner.is_main_process or not previous:
        return
    old, new = previous.get("code_id"), workspace.code_id
    old_dirty = bool((previous.get("git") or {}).get("dirty"))
    if old != new:
        runner.logger.warning(
            "continuing run %s with other code: its previous launch ran commit %s%s, this one runs commit %s "
            "(every launch is recorded in metadata.json under 'launches')",
            workspace.path,
            old,
            " with uncommitted changes" if old_dirty else "",
            new,
        )


def report_other_runs(runner: BaseRunner, limit: int = 3) -> None:
    """Warn about runs of this experiment whose identity differs, naming each differing key.

    Called when `auto_resume` finds no checkpoint of this identity: the user may have expected one
    of these runs to continue. At most `limit` runs (the newest) are described.
    """
    if not runner.is_main_process:
        return
    from ..config import recorded_config

    workspace = runner.workspace
    current = runner.config.semantic_dict()
    for run_dir in sibling_runs(workspace.base_path, workspace.experiment)[:limit]:
        saved = recorded_run_config(run_dir)
        if saved is None:
            continue
        try:
            differences = identity_differences(recorded_config(saved).semantic_dict(), current)
        except (TypeError, ValueError):  # a record this version cannot read as a config
            continue
        if "_seed_was_drawn" in runner.__dict__:  # neither seed was chosen: drawn seeds always differ
            differences = [item for item in differences if item[0] != "seed"]
        if differences:
            runner.logger.warning(
                "auto_resume: run %s of experiment %r trained a different config, so it is not continued; "
                "differences (that run -> this one): %s",
                run_dir,
                workspace.experiment,
                format_differences(differences),
            )


def describe_source(checkpoint: Any) -> str:
    """A checkpoint source for messages: the path, or the type of an in-memory payload."""
    if isinstance(checkpoint, (str, os.PathLike)):
        return repr(os.fspath(checkpoint))
    return f"<{type(checkpoint).__name__}>"
