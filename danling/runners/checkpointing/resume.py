"""Resuming a run: where from, whether it is the same experiment, and where the loop and data stood.

Used by the runner's checkpointing component
([`RunnerCheckpointing`][danling.runners.checkpointing.component.RunnerCheckpointing] and
[`TorchCheckpointing`][danling.runners.checkpointing.torch_state.TorchCheckpointing]):

- [`resolve_resume_path`][danling.runners.services.run_dirs.resolve_resume_path] turns every
  form a user may give (`resume: <run dir>`, its `checkpoints/` directory, `.../checkpoints/latest`,
  a pointer file, a checkpoint directory, a payload file) into what the checkpoint manager loads;
- [`check_identity`][danling.runners.checkpointing.resume.check_identity] refuses a checkpoint
  of a run that trained something else, unless `resume_allow_changes` is set;
- [`report_code_change`][danling.runners.checkpointing.resume.report_code_change] and
  [`report_other_runs`][danling.runners.checkpointing.resume.report_other_runs] warn when
  `auto_resume` continues across a commit or finds runs of the same experiment with another identity;
- the loop and data position of a mid-pass checkpoint, all here:
  [`LoopState`][danling.runners.checkpointing.resume.LoopState] (which split, how far, the
  round's results), [`pass_meters_state`][danling.runners.checkpointing.resume.pass_meters_state] /
  [`continue_pass_meters`][danling.runners.checkpointing.resume.continue_pass_meters] (the running
  meters and train metrics of the interrupted pass), and
  [`loader_fingerprint`][danling.runners.checkpointing.resume.loader_fingerprint] /
  [`restore_loader_positions`][danling.runners.checkpointing.resume.restore_loader_positions]
  (each training loader's position, checked against the next batch it would yield). Resuming on
  another number of data-parallel ranks continues from the global positions of
  [`danling.runners.checkpointing.elastic`][].
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from danling.data import DataResumeError, ResumableSampler, batch_fingerprint, check_batch_fingerprint
from danling.utils import RoundDict

from ..services.run_dirs import (
    format_differences,
    has_checkpoints,
    identity_differences,
    recorded_run_config,
    sibling_runs,
)

if TYPE_CHECKING:
    from ..config import RunnerConfig
    from ..services import RunnerWorkspace

__all__ = [
    "LoopState",
    "check_identity",
    "continue_pass_meters",
    "loader_fingerprint",
    "pass_meters_state",
    "position_excluded",
    "report_code_change",
    "report_other_runs",
    "restore_loader_positions",
    "shares_data_rank",
    "take_run_dir",
]


def check_identity(config: RunnerConfig, saved: RunnerConfig, logger: Any) -> list[str]:
    """Refuse a checkpoint whose run trained a different config, naming each differing key.

    With `resume_allow_changes: true` the checkpoint is accepted and each difference is logged as
    a warning. The budget (`epochs`, `steps`), cadences and logging are not part of the identity.

    Returns:
        The dotted identity keys that differ (empty when none does): the restore keeps this run's
        values for them where the checkpoint would otherwise bring back the saved ones.

    Raises:
        ValueError: Identity keys differ and `resume_allow_changes` is not set.
    """
    saved = _judged_like(saved, config)
    if saved.config_id == config.config_id:
        return []
    differences = identity_differences(saved.semantic_dict(), config.semantic_dict())
    if not differences:  # equal values spelled apart (`lr: 1` and `--optim.lr 1.0`) hash apart: the same config
        return []
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
        logger.warning("resume_allow_changes: %s was %r in the checkpoint's run, now %r", key, old, new)
    return [key for key, _, _ in differences]


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


def take_run_dir(workspace: RunnerWorkspace, config: RunnerConfig, logger: Any, is_main_process: bool) -> None:
    """Lock the run directory for this run and say when it is a new version beside an earlier run.

    Raises:
        RunDirectoryLockedError: Another live process trains in the directory.
    """
    workspace.lock(logger)
    if not is_main_process:
        return
    for run_dir, reasons in workspace.refused.items():
        logger.warning(
            "auto_resume: no checkpoint in %s verifies, so this run starts from scratch in %s and leaves them "
            "as they are; refused: %s",
            Path(run_dir) / config.checkpoint.dir_name,
            workspace.path,
            "; ".join(f"{name}: {reason}" for name, reason in reasons.items()),
        )
    # A version that already holds checkpoints is one this run continues (auto_resume, resume):
    # only a run starting afresh in a later version is the new run beside an earlier one.
    starts_afresh = not has_checkpoints(workspace.path, config.checkpoint.dir_name)
    if workspace.version > 1 and not workspace.refused and starts_afresh:
        earlier = workspace.base_path if workspace.version == 2 else f"{workspace.base_path}-v{workspace.version - 1}"
        logger.warning(
            "%s already holds the checkpoints of an earlier run of this config, so this run writes into %s; "
            "to continue that run instead, set auto_resume: true or resume: <its run directory>",
            earlier,
            workspace.path,
        )


def report_code_change(workspace: RunnerWorkspace, logger: Any, is_main_process: bool) -> None:
    """Warn when this launch continues a run whose previous launch ran another commit (or dirty code)."""
    previous = workspace.previous_launch
    if not is_main_process or not previous:
        return
    old, new = previous.get("code_id"), workspace.code_id
    old_dirty = bool((previous.get("git") or {}).get("dirty"))
    if old != new:
        logger.warning(
            "continuing run %s with other code: its previous launch ran commit %s%s, this one runs commit %s "
            "(every launch is recorded in metadata.json under 'launches')",
            workspace.path,
            old,
            " with uncommitted changes" if old_dirty else "",
            new,
        )


def report_other_runs(
    workspace: RunnerWorkspace,
    config: RunnerConfig,
    logger: Any,
    *,
    is_main_process: bool,
    seed_was_drawn: bool,
    limit: int = 3,
) -> None:
    """Warn about runs of this experiment whose identity differs, naming each differing key.

    Called when `auto_resume` finds no checkpoint of this identity: the user may have expected one
    of these runs to continue. At most `limit` runs (the newest) are described; `seed_was_drawn`
    (neither run chose a seed) leaves the seed out of the comparison.
    """
    if not is_main_process:
        return
    from ..config import recorded_config

    current = config.semantic_dict()
    for run_dir in sibling_runs(workspace.base_path, workspace.experiment)[:limit]:
        saved = recorded_run_config(run_dir)
        if saved is None:
            continue
        try:
            differences = identity_differences(recorded_config(saved).semantic_dict(), current)
        except (TypeError, ValueError):  # a record this version cannot read as a config
            continue
        if seed_was_drawn:  # neither seed was chosen: drawn seeds always differ
            differences = [item for item in differences if item[0] != "seed"]
        # metadata.json is strict JSON, so it records a non-finite value as null: null there is no difference
        differences = [item for item in differences if not (item[1] is None and _non_finite(item[2]))]
        if differences:
            logger.warning(
                "auto_resume: run %s of experiment %r trained a different config, so it is not continued; "
                "differences (that run -> this one): %s",
                run_dir,
                workspace.experiment,
                format_differences(differences),
            )


def _non_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def describe_source(checkpoint: Any) -> str:
    """A checkpoint source for messages: the path, or the type of an in-memory payload."""
    if isinstance(checkpoint, (str, os.PathLike)):
        return repr(os.fspath(checkpoint))
    return f"<{type(checkpoint).__name__}>"


# ------------------------------------------------------------------ the loop position


class LoopState:
    """The loops' position: which train split is under way, how far, and what the round has produced.

    A checkpoint written mid-round carries it, so a resumed run continues the interrupted split
    (and accumulation window) instead of restarting the round, and its result row ends up
    identical to the uninterrupted one. A resume that excludes that split's loader position from
    loading keeps the split but starts its pass over (`batch` 0, a new accumulation window).

    Attributes:
        split: Train split whose pass is under way (`None` between passes, or once a pass ran to its end).
        batch: Batches consumed by that pass so far.
        trained: Whether the round's training is over (it was evaluating).
        round: Results of the splits the round has finished.
        accumulator: The accumulation window position, kept by the update strategy
            ([`GradientAccumulator`][danling.runners.update.accumulation.GradientAccumulator]).

    Examples:
        >>> state = LoopState()
        >>> state.split, state.batch = "train", 3
        >>> restored = LoopState()
        >>> restored.load_state_dict(state.state_dict())
        >>> restored.split, restored.batch, restored.trained
        ('train', 3, False)
    """

    def __init__(self, accumulator: Any = None) -> None:
        self.accumulator = accumulator
        self.split: str | None = None
        self.batch = 0
        self.trained = False
        self.round: RoundDict | None = None

    def begin_round(self) -> RoundDict:
        """The current round's result: the restored partial one of a resumed round, else a new one."""
        if self.round is None:
            self.round = RoundDict()
        return self.round

    def end_round(self) -> None:
        """The round's row is stored: the next round starts with training and an empty result."""
        self.round = None
        self.trained = False

    def splits_from_cursor(self, splits: list[str]) -> list[str]:
        """`splits` starting at the one whose pass was interrupted, if any."""
        return splits[splits.index(self.split) :] if self.split in splits else splits

    def state_dict(self) -> dict[str, Any]:
        """The position as plain data, for the `loop` entry of a checkpoint."""
        return {
            "split": self.split,
            "batch": self.batch,
            "trained": self.trained,
            "round": None if not self.round else self.round.dict(),
            "accumulator": None if self.accumulator is None else self.accumulator.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the position a checkpoint's `loop` entry recorded (missing keys: the start of a round)."""
        self.split = state.get("split")
        self.batch = int(state.get("batch") or 0)
        self.trained = bool(state.get("trained", False))
        round_result = state.get("round")
        self.round = RoundDict(round_result) if round_result else None
        if self.accumulator is not None and state.get("accumulator"):
            self.accumulator.load_state_dict(state["accumulator"])


# ------------------------------------------------------------------ the running meters of a pass


def shares_data_rank(topology: Any, world_size: int) -> bool:
    """Whether several processes share this data-parallel rank (pipeline stages, tensor shards).

    Checkpoints keep one entry per data rank, and the stages of a pipeline keep different meters
    (only the last one has a loss), so such runs do not checkpoint the running meters of a pass.
    """
    return topology is not None and topology.size("data") < world_size


def pass_meters_state(
    position: LoopState, *, training_split: str | None, shares_rank: bool, meters: Any, metrics: Any
) -> dict[str, Any]:
    """This rank's running loss meters and train metrics, when a training pass is under way.

    A checkpoint written in the middle of a training pass carries them, so that the resumed pass
    averages every batch of the pass, as an uninterrupted one does. Outside a training pass only
    `{"split": None}`: evaluation passes always start afresh.

    Args:
        position: The loop position.
        training_split: The split the runner trains on now (`None` when it is not training).
        shares_rank: Several processes share this data rank (see `shares_data_rank`): not saved.
        meters: The pass's running loss meters.
        metrics: The pass's metric container, or `None`.
    """
    if position.split is None or position.split != training_split or shares_rank or not position.batch:
        return {"split": None}  # not training, per-rank entries would collide, or nothing trained yet
    state: dict[str, Any] = {"split": position.split, "batch": position.batch, "meters": meters.state_dict()}
    saved = metrics.state_dict() if metrics is not None and callable(getattr(metrics, "state_dict", None)) else None
    state["metrics"] = saved  # None with a container that has no state: the resume resets it (warning)
    return state


def continue_pass_meters(
    state: Mapping[str, Any] | None,
    split: str,
    batch: int,
    meters: Any,
    metrics: Any,
    device: Any,
    logger: logging.Logger,
) -> bool:
    """Put back the meters and train metrics of the interrupted `split` pass (after they were reset).

    `state` is what `pass_meters_state` saved; it applies only to the same split at the same batch.
    Metrics without checkpointed state restart (with a warning). Returns whether the meters were
    restored (the caller's step-log window then starts from them).
    """
    if state is None or state.get("split") != split or state.get("batch") != batch:
        return False
    meters.load_state_dict(_to_device(state["meters"], device))
    if metrics is None:
        return True
    saved, load = state.get("metrics"), getattr(metrics, "load_state_dict", None)
    try:
        if saved is None or not callable(load):
            raise ValueError(f"{type(metrics).__name__} has no checkpointed state (state_dict/load_state_dict)")
        load(_to_device(saved, device))
    except ValueError as error:
        metrics.reset()
        logger.warning(
            "the train metrics of the interrupted %s pass restart at the resume (%s): the row's metrics "
            "cover the batches after it; its loss covers the whole pass",
            split,
            error,
        )
    return True


def _to_device(state: Any, device: Any) -> Any:
    """`state` with its tensors moved to `device` (checkpoints are read onto the CPU); `None` keeps them."""
    if device is None:
        return state
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, Mapping):
        return {key: _to_device(value, device) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_device(value, device) for value in state)
    return state


# ------------------------------------------------------------------ the data position


def loader_fingerprint(loader: Any, state: Mapping[str, Any]) -> str | None:
    """Fingerprint of the next batch `loader` yields from `state`, or `None` when it cannot be taken."""
    if getattr(loader, "batch_sampler", None) is None and getattr(loader, "sampler", None) is None:
        return None
    try:
        return batch_fingerprint(loader, state)
    except TypeError:  # a custom sampler that cannot be copied: no resume check for this split
        return None


def restore_loader_positions(
    loaders: Mapping[str, Any],
    states: Mapping[str, Any],
    fingerprints: Mapping[str, Any],
    *,
    cursor: str | None,
    seed: int | None,
    excluded: Collection[str],
    logger: logging.Logger,
) -> None:
    """Restore each loader's position after checking it against the fingerprint the checkpoint recorded.

    Args:
        loaders: The runner's dataloaders by split.
        states: The checkpoint's loader states by split.
        fingerprints: The checkpoint's next-batch fingerprints by split.
        cursor: The split whose pass the checkpoint interrupted, if any.
        seed: The run's seed (a resumable sampler takes it: the seed may be adopted from the checkpoint).
        excluded: The `exclude_from_loading` keys (`dataloaders.<split>` skips that split's position).
        logger: Where a position that cannot be verified is reported.

    Raises:
        DataResumeError: a rebuilt loader would yield a different next batch than the saved one, or
            the interrupted pass cannot continue where it stopped.
    """
    if cursor is not None:
        _check_resumable(loaders.get(cursor), cursor, states, excluded)
    for split, state in states.items():
        loader = loaders.get(split)
        if loader is None or not callable(getattr(loader, "load_state_dict", None)):
            logger.warning("checkpoint has progress for split %r, which has no resumable loader now", split)
            continue
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, ResumableSampler) and seed is not None:
            sampler.seed = int(seed)  # a seed adopted from the checkpoint (see set_seed)
        expected = fingerprints.get(split)
        if split == cursor and expected is None:
            logger.warning(
                "resuming split %r mid-pass without verifying the data position: its loader has no "
                "fingerprintable index sampler (an iterable dataset, or a sampler that cannot be copied); "
                "the loader's own state decides where the pass continues",
                split,
            )
        check_batch_fingerprint(loader, state, expected)
        loader.load_state_dict(state)


def position_excluded(split: str, excluded: Collection[str]) -> bool:
    """Whether `checkpoint.exclude_from_loading` (`excluded`) leaves out the loader position of `split`.

    Both `dataloaders` and `dataloaders.<split>` do; a key for another split does not.

    Examples:
        >>> position_excluded("train", ["dataloaders"]), position_excluded("train", ["dataloaders.train"])
        (True, True)
        >>> position_excluded("train", ["dataloaders.extra", "optimizer"])
        False
    """
    return "dataloaders" in excluded or f"dataloaders.{split}" in excluded


def _check_resumable(loader: Any, split: str, states: Mapping[str, Any], excluded: Collection[str]) -> None:
    """Refuse a mid-pass resume of `split` whose loader would start the pass again (and replay its batches)."""
    if loader is None or position_excluded(split, excluded):
        return  # the split is gone (the loops will not continue it) or its position is skipped on purpose
    restorable = callable(getattr(loader, "load_state_dict", None))
    if split in states and restorable:
        return
    reason = (
        f"the checkpoint holds no position for it (its loader, a {type(loader).__name__}, had no state_dict)"
        if split not in states
        else f"its loader, a {type(loader).__name__}, has no load_state_dict"
    )
    raise DataResumeError(
        f"cannot resume split {split!r} mid-pass: {reason}, so the pass would start over and replay "
        "the batches already trained on. Let the runner build the loader from self.datasets (or bind a "
        "torchdata StatefulDataLoader), resume from a checkpoint saved at an epoch boundary, or add "
        "'dataloaders' to checkpoint.exclude_from_loading to restart the pass deliberately"
    )
