"""The runner's checkpointing component: payloads, saves with aliases, and the restore paths.

[`RunnerCheckpointing`][danling.runners.checkpointing.component.RunnerCheckpointing] builds and
restores the backend-neutral payload (config, runner state, RNG snapshots, dataloader progress,
result rows), decides checkpoint names and aliases, and implements the resume policy
(`resume` > `auto_resume` > `pretrained`). Storage is the checkpoint manager's. The runner holds
one as `runner.checkpointing` (its class is the runner's `checkpointing_class`) and keeps the
documented hooks ([`CheckpointHooks`][danling.runners.checkpointing.hooks.CheckpointHooks]):
this component calls them back through
[`CheckpointHost`][danling.runners.checkpointing.host.CheckpointHost], so a user's override
of `load_model` or `save_checkpoint` is what every restore and save uses. Backends subclass the
component ([`TorchCheckpointing`][danling.runners.checkpointing.torch_state.TorchCheckpointing],
the DeepSpeed and parallel ones) to change what a payload holds and how it is read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any

from danling.checkpoint import read_checkpoint as read_checkpoint_source
from danling.checkpoint.failures import CheckpointSaveError
from danling.checkpoint.layout import set_aside
from danling.checkpoint.manifest import CheckpointError
from danling.utils import RoundDict

from ..config import RunnerConfig, recorded_config
from ..loop.events import CheckpointContext, Events
from ..loop.mode import RunnerMode
from ..reconcile import reconcile_on_start
from ..services.run_dirs import newest_valid_checkpoint, resolve_resume_path
from ._keys import without as _without
from .host import CheckpointHost, CheckpointSource
from .resume import (
    check_identity,
    continue_pass_meters,
    pass_meters_state,
    report_code_change,
    report_other_runs,
    shares_data_rank,
    take_run_dir,
)
from .resume import describe_source as _describe
from .saves import SaveFacts, save_when_due

if TYPE_CHECKING:
    from danling.checkpoint import CheckpointManager

    from ..loop import EventBus
    from ..services import RunnerResults, RunnerWorkspace
    from ..state import RunnerState
    from .resume import LoopState

__all__ = ["CheckpointHost", "CheckpointSource", "RunnerCheckpointing", "is_path", "read_source"]

# Components whose state a full checkpoint must carry when the runner has them bound.
_REQUIRED_COMPONENTS = ("model", "optimizer", "scheduler")
# Payload entries that differ between ranks; everything else is written once and read by every rank.
RANK_LOCAL_KEYS = ("rng", "dataloaders", "fingerprints", "pass_meters")
# Per-rank entries a resume on another data-parallel size may drop: the RNG re-seeds, the
# fingerprints only check loader positions, which such a resume never restores, and the running
# meters of an interrupted pass restart (the rows of such a resume cover the batches after it).
OPTIONAL_RANK_LOCAL_KEYS = ("rng", "fingerprints", "pass_meters")
# Set while `from_checkpoint` constructs its runner: the full restore follows construction.
RESTORING: ContextVar[bool] = ContextVar("danling_restoring_from_checkpoint", default=False)


def is_path(checkpoint: Any) -> bool:
    """Whether a checkpoint source names files (a path or an alias) rather than holding a payload."""
    return isinstance(checkpoint, (str, os.PathLike))


def read_source(checkpoint: CheckpointSource, map_location: Any = "cpu", trusted: bool = False) -> Mapping[str, Any]:
    """Payload of a checkpoint read without a runner, in any registered format."""
    return read_checkpoint_source(checkpoint, map_location=map_location, trusted=trusted)


class RunnerCheckpointing:
    """Checkpoint payloads, saving with aliases, and the restore paths of one runner (`runner.checkpointing`).

    Args:
        host: The runner, through the hooks and live objects that
            [`CheckpointHost`][danling.runners.checkpointing.host.CheckpointHost] names.
        config: The run's config (`checkpoint` section, `resume`, `auto_resume`, `pretrained`, `seed`).
        state: The runner's counters and RNG snapshots.
        loop_state: Where the loop stands (the split and batch of a pass under way).
        bookkeeping: The result rows and the best-score selection.
        workspace: The run directory (its lock, launches and sibling runs).
        events: The bus `CHECKPOINT_SAVED`, `CHECKPOINT_LOADED` and `CHECKPOINT_FALLBACK` go to.

    Attributes:
        restored: Whether a restore (or the decision not to restore) has happened; `auto_restore` sets it.
        restore_source: What `from_checkpoint` read its payload from, named by the next load instead of the payload.
        seed_was_drawn: The run drew its seed (none was configured): a resumed checkpoint's seed replaces it.
        allowed_changes: The identity keys (`optim.lr`, ...) in which the restored checkpoint's run
            differs from this one, accepted by `resume_allow_changes`; empty for a plain resume.
    """

    def __init__(
        self,
        host: CheckpointHost,
        *,
        config: RunnerConfig,
        state: RunnerState,
        loop_state: LoopState,
        bookkeeping: RunnerResults,
        workspace: RunnerWorkspace,
        events: EventBus,
    ) -> None:
        self.host, self.config, self.state, self.loop_state = host, config, state, loop_state
        self.bookkeeping, self.workspace, self.events = bookkeeping, workspace, events
        self.restored = False
        self.restore_source: CheckpointSource | None = None
        self.seed_was_drawn = False
        self.allowed_changes: tuple[str, ...] = ()
        # (global_step, micro_step) when the newest result row was stored; `best` may only go to a
        # checkpoint of exactly that state (the row's scores describe no other weights).
        self._scored_progress: tuple[int, int] | None = None
        # The newest save's failure until a later save is written; a training loop ending with one fails.
        self._save_failure: CheckpointSaveError | None = None
        # Running meters and train metrics of the pass a mid-pass checkpoint interrupted, until that pass reopens.
        self._restored_pass_meters: Mapping[str, Any] | None = None

    @property
    def manager(self) -> CheckpointManager:
        """The runner's checkpoint manager (read on each use: `set_checkpoint_manager` may swap it)."""
        return self.host.checkpoint_manager

    @property
    def backend(self) -> str:
        """`checkpoint.backend` with `"auto"` resolved; the backend-free runner writes files (`"file"`)."""
        backend = self.config.checkpoint.backend or "auto"
        return "file" if backend == "auto" else backend

    @property
    def restored_pass_meters(self) -> Mapping[str, Any] | None:
        """The running meters of the interrupted pass a restore kept for that pass to continue, else `None`."""
        return self._restored_pass_meters

    def _progress_marker(self) -> tuple[int, int]:
        train = self.state.train
        return train.global_step, train.micro_step

    def mark_scored(self) -> None:
        """Remember that the newest result row scored the weights as they are now (`best` may go to them)."""
        self._scored_progress = self._progress_marker()

    # ------------------------------------------------------------------ payload
    def state_dict(self, cls: type = dict) -> Mapping:
        """The backend-neutral payload (see the runner's `state_dict` hook for its keys); captures the RNG state."""
        host = self.host
        self.state.rng.capture()
        loaders = cls()
        for split, loader in host.dataloaders.items():
            if callable(getattr(loader, "state_dict", None)):
                loaders[split] = loader.state_dict()
        state = self.state.state_dict()
        return cls(
            runner=self.config.dict(),
            state=cls(train=state["train"], elastic=state["elastic"]),
            rng=state["rng"],
            dataloaders=loaders,
            results=self.bookkeeping.rows.dict(),
            topology=host.topology.describe(),
        )

    def load_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Restore counters, RNG state and result rows (the default of the runner's `load_state_dict` hook)."""
        if not isinstance(checkpoint, Mapping):
            raise TypeError(f"load_state_dict() expects a mapping, got {type(checkpoint).__name__}")
        self.allowed_changes = ()
        saved = checkpoint.get("runner")
        if saved is not None:
            self._check_config_matches(saved)
            self._check_same_mode(saved, checkpoint.get("results"))
        state = checkpoint.get("state")
        if state is not None:
            self.state.load_state_dict(state)
        rng = checkpoint.get("rng")
        if rng is not None and not self.resized(checkpoint):
            self.state.rng.load_state_dict(rng)
            self.state.rng.restore()
        results = checkpoint.get("results")
        if results is not None:
            self.bookkeeping.rows = RoundDict({int(index): RoundDict(row) for index, row in results.items()})

    def _check_same_mode(self, saved: Mapping[str, Any], results: Any) -> None:
        # Result rows are indexed by epoch in epoch mode and by global step in step mode: a resume
        # in the other mode would store its rows among the saved ones under the other kind of index
        # (an epoch-mode run resumed with `steps: 12` added row 15 beside rows 0-2).
        if not results or not isinstance(saved, Mapping):
            return
        was, now = saved.get("epochs") is not None, self.config.get("epochs") is not None
        if was != now:
            modes = {True: "epoch mode (epochs is set)", False: "step mode (epochs is None)"}
            raise ValueError(
                f"the checkpoint's run trained in {modes[was]} and this run is in {modes[now]}: their result rows "
                "are indexed by epoch and by step, and would mix; resume in the same mode "
                f"(epochs={saved.get('epochs')!r}, steps={saved.get('steps')!r} in the checkpoint's run), or start "
                "a new run from its weights with load_pretrained()"
            )

    def _check_config_matches(self, saved: Mapping[str, Any]) -> None:
        drawn, self.seed_was_drawn = self.seed_was_drawn, False
        if drawn and saved.get("seed") is not None:
            # Neither run chose a seed: continue with the one the checkpointed run drew.
            self.config.seed = saved["seed"]
        if saved != self.config.dict():  # equal (a resume of this very run): nothing to compare, no config to build
            # budget keys may differ; identity keys only when allowed
            self.allowed_changes = tuple(check_identity(self.config, recorded_config(saved), self.host.logger))

    def checkpoint_payload(self, *, last_step: bool) -> Mapping[str, Any]:
        """What one save hands to the checkpoint manager.

        Called when: by the runner's `save_checkpoint` (and so `save_seed_checkpoint`), once per save that is
            written, on every rank.
        Holds on entry: the runner is fully constructed; the step being saved has finished.
        Side effects: none beyond what the runner's `state_dict` does (an RNG capture).
        Overrides must not: change any state, or return objects the manager cannot serialize (plain state or objects
            with `state_dict()`).

        Values may be plain state or live stateful objects (the manager calls their `state_dict()`
        in the caller's thread). Backends return a model-only payload for final exports when
        configured (`last_step`), or the pieces their engine saves itself.
        """
        return self.host.state_dict()

    # ------------------------------------------------------------------ the running meters of a pass
    def pass_meters_state(self) -> dict[str, Any]:
        """The `pass_meters` entry of a checkpoint (see `resume.pass_meters_state`)."""
        host = self.host
        return pass_meters_state(
            self.loop_state,
            training_split=host.split if host.mode is RunnerMode.train else None,
            shares_rank=shares_data_rank(getattr(host, "topology", None), host.world_size),
            meters=host.meters,
            metrics=host._active_metrics,
        )

    def continue_pass_meters(self, split: str, device: Any = None) -> bool:
        """Put back the meters and train metrics of the interrupted `split` pass (after the pass reset them).

        Returns whether they were put back: the step logs then count the restored values as read.
        """
        state, self._restored_pass_meters = self._restored_pass_meters, None
        host = self.host
        batch = self.loop_state.batch
        return continue_pass_meters(state, split, batch, host.meters, host._active_metrics, device, host.logger)

    # ------------------------------------------------------------------ saving
    def save(
        self, name: str = "latest", epochs: int | None = None, save_best: bool = True, last_step: bool = False,
        force: bool = False,
    ) -> Path | None:  # fmt: skip
        """Save a checkpoint when one is due (the default of the runner's `save_checkpoint` hook)."""
        manager = self.manager
        while True:
            earlier = manager.pending_path
            try:
                path = save_when_due(
                    manager,
                    self._save_facts(),
                    lambda: self.checkpoint_payload(last_step=last_step),
                    name=name,
                    epochs=epochs,
                    save_best=save_best,
                    last_step=last_step,
                    force=force,
                )
            except CheckpointSaveError as err:
                if earlier is None or err.path != earlier:
                    return self.save_failed(err)
                self.host.checkpoint_save_failed(err)  # the background save before this one failed: this one still runs
                continue
            break
        if path is not None:
            self._save_failure = None
            self.events.emit(Events.CHECKPOINT_SAVED, CheckpointContext(self.host, path, name))
        return path

    def _save_facts(self) -> SaveFacts:
        train = self.state.train
        return SaveFacts(
            epoch=train.epoch,
            global_step=train.global_step,
            step_mode=self.host.is_step_mode,
            run_id=self.host.id,
            best=self._publishes_best(),
            score=self._checkpoint_score(),
            lower_is_better=self.bookkeeping.lower_is_better,
        )

    def save_failed(self, error: CheckpointSaveError) -> None:
        """The newest save failed: hand it to the runner's `checkpoint_save_failed` (fails the run unless one lands)."""
        self._save_failure = error
        return self.host.checkpoint_save_failed(error)

    def finish_checkpoints(self, *, failing: bool = False) -> None:
        """Wait until the saves the run started are durable; called as the outermost training loop ends.

        Called when: once, as the outermost training loop (`train`) ends, normally or with an exception
            (`failing=True`), on every rank.
        Holds on entry: every save the run started has been handed to the checkpoint manager; some may still be
            writing.
        Side effects: blocks until pending saves are durable (or the manager's timeout passes); clears the recorded save
            failure.
        Overrides must not: return before the last save is on disk, or raise when `failing` (that would hide the
            exception ending the loop).

        Background saves let training go on while they write, so the run's last checkpoint is still
        being written when the loop is done: `train()` returns (and the process may exit) only once
        it is on disk. A run whose newest save failed (with `checkpoint.continue_on_save_error` too)
        raises `CheckpointSaveError` here, so it ends with an error and `status.json` says `failed`.
        With `failing` (the loop is leaving with an exception) a failed save is only logged.
        """
        manager, logger = self.manager, self.host.logger
        path = manager.pending_path
        try:
            drained = manager.wait(manager.timeout)
        except Exception as err:
            if failing or not isinstance(err, CheckpointSaveError):
                logger.error("checkpoint %s was not saved: %s", path, err)
                if failing:
                    return  # the exception leaving the loop is the one to report
                raise
            self._save_failure = err
        else:
            if not drained:
                logger.error("checkpoint %s is still being written after %ss", path, manager.timeout)
        failure, self._save_failure = self._save_failure, None
        if failure is not None and not failing:
            raise CheckpointSaveError(
                f"the run ended without its last checkpoint: {failure}",
                path=failure.path,
                needed=failure.needed,
                free=failure.free,
                errno=failure.errno,
            ) from failure

    def _publishes_best(self) -> bool:
        """Whether a checkpoint saved now may be published as `best`: the newest result row is the best
        one and no training happened since it was stored, so a mid-epoch save never inherits the score
        of the weights evaluated before it."""
        book = self.bookkeeping
        return bool(book.rows) and book.is_best and self._scored_progress == self._progress_marker()

    def _checkpoint_score(self) -> float | None:
        """Score of the weights a checkpoint saved now holds (the newest row's, when `_publishes_best`'s
        condition on progress holds), else `None`; `checkpoint.save_top_k` ranks checkpoints by it."""
        scored = bool(self.bookkeeping.rows) and self._scored_progress == self._progress_marker()
        score = self.bookkeeping.latest_score if scored else None
        return None if score is None or score != score else score  # NaN ranks nowhere

    # ------------------------------------------------------------------ reading and loading
    def read(self, checkpoint: CheckpointSource, *args: Any, **kwargs: Any) -> Mapping[str, Any]:
        """Turn a checkpoint source into a payload (the default of the runner's `read_checkpoint` hook)."""
        map_location = kwargs.get("map_location", "cpu")
        manager = self.manager
        if is_path(checkpoint):
            return manager.load(checkpoint, map_location=map_location)
        if not isinstance(checkpoint, Mapping):
            trusted = self.config.checkpoint.trust_pickle
            checkpoint = read_checkpoint_source(checkpoint, map_location=map_location, trusted=trusted)
        excludes = manager.exclude_from_loading
        return _without(checkpoint, excludes) if excludes else checkpoint

    def load(self, checkpoint: CheckpointSource, *args: Any, **kwargs: Any) -> None:
        """Restore a full checkpoint through the runner's hooks (the default of its `load_checkpoint` hook)."""
        host = self.host
        map_location = kwargs.pop("map_location", "cpu")
        source = checkpoint if self.restore_source is None else self.restore_source  # what from_checkpoint read
        self.restore_source = None
        if is_path(checkpoint):
            checkpoint = resolve_resume_path(checkpoint, self.config.checkpoint.dir_name)
        excluded = {key for key in self.manager.exclude_from_loading if "." not in key}  # "model.head": still loaded
        in_place = self.in_place_components(checkpoint, excluded)
        payload = self.read_restore_payload(checkpoint, in_place, map_location)
        self.check_resumable_layout(payload, excluded, checkpoint)
        for key in _REQUIRED_COMPONENTS:
            missing = payload.get(key) is None and key not in excluded and key not in in_place
            if getattr(host, key, None) is not None and missing:
                raise ValueError(
                    f"checkpoint {_describe(checkpoint)} has no {key!r} state but the runner has a {key} bound; "
                    f"add {key!r} to checkpoint.exclude_from_loading to keep the current one"
                )
        host.load_state_dict(payload)
        if in_place:  # read straight into the live components, after every check above passed
            self.restore_in_place(checkpoint, in_place, map_location, *args, **kwargs)
            excluded = excluded | set(in_place)
        if payload.get("model") is not None and "model" not in excluded:
            host.load_model(payload["model"], *args, **kwargs)
        loaders = {
            "ema": host.load_ema,
            "optimizer": host.load_optimizer,
            "scheduler": host.load_scheduler,
            "dataloaders": host.load_dataloaders,
        }
        for key, load in loaders.items():
            if key not in excluded:
                load(payload.get(key))
        if is_path(source):
            self.config.resume = os.fspath(source)
        self.restored = True  # an explicit load is the restore: train() does not ask auto_restore for another
        self.events.emit(Events.CHECKPOINT_LOADED, CheckpointContext(host, _name(source)))
        train = self.state.train
        host.logger.info(
            "restored checkpoint %s at epoch %d, global step %d", _describe(source), train.epoch, train.global_step
        )

    def in_place_components(self, checkpoint: CheckpointSource, excluded: set[str]) -> tuple[str, ...]:
        """Components restored in place from `checkpoint` rather than from a payload read into memory.

        Called when: first by the runner's `load_checkpoint`, once per restore, on every rank.
        Holds on entry: `checkpoint` is a payload or a resolved path; `excluded` holds the keys of
            `checkpoint.exclude_from_loading`.
        Side effects: none: it only inspects `checkpoint`.
        Overrides must not: change state, or decide differently on different ranks (the split decides which collective
            reads run).

        None by default; backends whose checkpoint format reads into live tensors (DCP, an
        engine's loader) list the keys here, and `read_restore_payload` / `restore_in_place` then
        split the restore in two.
        """
        return ()

    def read_restore_payload(self, checkpoint: CheckpointSource, in_place: tuple[str, ...], map_location: Any) -> Any:
        """The payload a restore reads into memory, without the components restored in place.

        Called when: by the runner's `load_checkpoint`, once per restore, right after `in_place_components`, on every
            rank.
        Holds on entry: `in_place` lists the components `restore_in_place` will restore later.
        Side effects: reads the checkpoint; changes nothing on the runner.
        Overrides must not: restore anything (the checks run on the payload afterwards), or include components listed in
            `in_place`.

        The restore runs its checks (config, layout, missing components) on it before anything is changed.
        """
        return self.host.read_checkpoint(checkpoint, map_location=map_location)

    def restore_in_place(
        self, checkpoint: CheckpointSource, keys: tuple[str, ...], map_location: Any, *args: Any, **kwargs: Any
    ) -> None:
        """Restore the components `in_place_components` listed, after every check has passed.

        Called when: by the runner's `load_checkpoint`, once per restore and only when `in_place_components` listed
            keys, after `load_state_dict`.
        Holds on entry: every check on the restore payload has passed; the counters and RNG are already restored.
        Side effects: loads the listed components into the live model/optimizer tensors.
        Overrides must not: restore a component not in `keys`, or skip a rank (backend readers are collective).

        `args`/`kwargs` are those of `load_checkpoint` (they reach `load_model`).
        """
        raise NotImplementedError(f"{type(self).__name__} restores no component in place")

    def resized(self, payload: Mapping[str, Any]) -> bool:
        """Whether `payload` was written with another number of data-parallel ranks than this run has."""
        saved = payload.get("topology")
        return isinstance(saved, Mapping) and saved.get("data_size") != self.host.topology.size("data")

    def check_resumable_layout(self, payload: Mapping[str, Any], excluded: set[str], source: Any) -> None:
        """Refuse, on every rank alike, a resume whose per-rank state cannot follow a new data-parallel size.

        The counters, results, model and optimizer are global and restore on any layout. Loader
        positions are per rank: with another number of data-parallel ranks they describe shards
        that no longer exist, so the resume is refused unless `dataloaders` is excluded from
        loading (the interrupted pass then restarts). Per-rank RNG snapshots are dropped on a
        resize: every rank re-seeds from the seed and its data rank. The decision reads only the
        checkpoint's metadata, so every rank takes it alike, before any collective.
        """
        if not self.resized(payload):
            return
        saved, topology = payload["topology"], self.host.topology
        size, world = topology.size("data"), topology.size("world")
        if "dataloaders" not in excluded:  # decided from global facts only: never per-rank content
            raise ValueError(
                f"checkpoint {_describe(source)} was written by {saved.get('data_size')} data-parallel ranks, "
                f"but this run has {size} (world sizes {saved.get('world_size')} and {world}): its "
                "dataloader positions are per rank and cannot be split over the new ranks. Resume with "
                f"{saved.get('data_size')} data-parallel ranks, or add 'dataloaders' to "
                "checkpoint.exclude_from_loading to restart the interrupted pass on the new layout"
            )
        self.host.logger.warning(
            "resuming a checkpoint of %s data-parallel ranks on %d: per-rank RNG state is re-seeded",
            saved.get("data_size"),
            size,
        )

    # ------------------------------------------------------------------ component loaders (the hooks' defaults)
    def load_model(self, state_dict: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        """Load weights into the unwrapped model (the default of the runner's `load_model` hook)."""
        host = self.host
        if host.model is None:
            raise ValueError("cannot load model weights: self.model is not set")
        host.unwrap(host.model).load_state_dict(state_dict, *args, **kwargs)

    def load_ema(self, state_dict: Mapping[str, Any] | None, *args: Any, **kwargs: Any) -> None:
        """Load EMA weights when both the state and the runner's `ema` exist."""
        if state_dict is not None and self.host.ema is not None:
            self.host.unwrap(self.host.ema).load_state_dict(state_dict, *args, **kwargs)

    def load_optimizer(self, state_dict: Mapping[str, Any] | None, *args: Any, **kwargs: Any) -> None:
        """Load optimizer state when both the state and the runner's `optimizer` exist."""
        if state_dict is not None and self.host.optimizer is not None:
            self.host.optimizer.load_state_dict(state_dict, *args, **kwargs)

    def load_scheduler(self, state_dict: Mapping[str, Any] | None, *args: Any, **kwargs: Any) -> None:
        """Load scheduler state when both the state and the runner's `scheduler` exist."""
        if state_dict is not None and self.host.scheduler is not None:
            self.host.scheduler.load_state_dict(state_dict, *args, **kwargs)

    def load_dataloaders(self, state_dict: Mapping[str, Any] | None) -> None:
        """Restore the progress of each dataloader that has saved state and a `load_state_dict`."""
        for split, state in (state_dict or {}).items():
            loader = self.host.dataloaders.get(split)
            if loader is not None and callable(getattr(loader, "load_state_dict", None)):
                loader.load_state_dict(state)

    def load_pretrained(self, checkpoint: CheckpointSource, *args: Any, **kwargs: Any) -> None:
        """Load model weights only, EMA preferred (the default of the runner's `load_pretrained` hook)."""
        host = self.host
        if host.model is None:
            raise ValueError("load_pretrained() needs self.model to be set first")
        given = checkpoint
        if is_path(checkpoint):
            checkpoint = resolve_resume_path(checkpoint, self.config.checkpoint.dir_name)
        payload = host.read_checkpoint(checkpoint, map_location=kwargs.pop("map_location", "cpu"))
        key = next((key for key in ("ema", "model", "model_parts") if payload.get(key) is not None), None)
        if key is None:
            raise ValueError(
                f"checkpoint {_describe(checkpoint)} has no 'ema', 'model' or 'model_parts' state; "
                f"keys: {sorted(payload)}"
            )
        host.load_model(payload[key], *args, **kwargs)
        if is_path(given):
            self.config.pretrained = os.fspath(given)
        host.logger.info("loaded %s weights from %s", key, _describe(given))

    # ------------------------------------------------------------------ the resume policy
    def auto_restore(self) -> None:
        """Restore what the config asks for: `resume`, else `auto_resume`, else `pretrained` (see the runner's hook)."""
        self.restored = True
        if RESTORING.get():
            return
        config, manager, host = self.config, self.manager, self.host
        if not config.checkpoint.load_only:
            # the lock, before reconciling: never repair a directory another run writes
            take_run_dir(self.workspace, config, host.logger, host.is_main_process)
        latest = manager.latest  # as the last run left it, before reconciling corrects a lagging pointer
        reconcile_on_start(host)
        if config.get("resume"):
            host.load_checkpoint(config.resume)
            report_code_change(self.workspace, host.logger, host.is_main_process)
            return
        if config.get("auto_resume") and self._auto_resume(latest):
            return
        if config.get("pretrained"):
            host.load_pretrained(config.pretrained)

    def _auto_resume(self, latest: Path | None) -> bool:
        """Load the newest checkpoint of this run that verifies; whether one was loaded."""
        config, manager, host = self.config, self.manager, self.host
        refused: list[Path] = []
        path = newest_valid_checkpoint(manager.directory, host.logger, refused) or manager.latest_valid()
        if path is not None and refused and host.is_main_process and not config.checkpoint.load_only:
            kept = set_aside(manager.directory, refused)  # saves of the same names follow: keep them apart
            host.logger.warning(
                "auto_resume: %s do not verify; moved to %s as they are", [p.name for p in refused], kept
            )
        if path is not None:
            if latest is not None and latest in refused:  # not one that merely lagged (reconcile moved it)
                host.logger.warning("auto_resume: latest checkpoint %s is not usable; resuming from %s", latest, path)
                self.events.emit(Events.CHECKPOINT_FALLBACK, CheckpointContext(host, path, requested=latest))
            host.load_checkpoint(path)
            report_code_change(self.workspace, host.logger, host.is_main_process)
            return True
        if manager.checkpoints():  # the workspace refuses such a directory: it changed since
            raise CheckpointError(
                f"auto_resume: no checkpoint in {manager.directory} verifies (see the warnings above); "
                "they are kept as they are rather than overwritten by a run from scratch: move them away, "
                "or resume one explicitly"
            )
        start = "the pretrained weights" if config.get("pretrained") else "scratch"
        host.logger.info("auto_resume: no checkpoint in %s, starting from %s", manager.directory, start)
        report_other_runs(
            self.workspace,
            config,
            host.logger,
            is_main_process=host.is_main_process,
            seed_was_drawn=self.seed_was_drawn,
        )
        return False


def _name(checkpoint: Any) -> str:
    return os.fspath(checkpoint) if is_path(checkpoint) else _describe(checkpoint)
