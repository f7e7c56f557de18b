"""The runner's checkpoint API, delegating storage to `self.checkpoint_manager`.

[`CheckpointMixin`][danling.runners.checkpointing.api.CheckpointMixin] builds and restores the
backend-neutral payload (config, runner state, RNG snapshots, dataloader progress, result rows),
decides checkpoint names and aliases, and implements the resume policy
(`resume` > `auto_resume` > `pretrained`). Backends extend `state_dict` with their components
(model, optimizer, ...) and inherit the rest.
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
from ..loop import RunnerMode
from ..loop.events import CheckpointContext, Events
from ..reconcile import reconcile_on_start
from ..services.run_dirs import newest_valid_checkpoint, resolve_resume_path
from ._keys import without as _without
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
    from ..base_runner import BaseRunner

__all__ = ["CheckpointMixin"]

CheckpointSource = Mapping[str, Any] | bytes | str | os.PathLike
# Components whose state a full checkpoint must carry when the runner has them bound.
_REQUIRED_COMPONENTS = ("model", "optimizer", "scheduler")
# Payload entries that differ between ranks; everything else is written once and read by every rank.
RANK_LOCAL_KEYS = ("rng", "dataloaders", "fingerprints", "pass_meters")
# Per-rank entries a resume on another data-parallel size may drop: the RNG re-seeds, the
# fingerprints only check loader positions, which such a resume never restores, and the running
# meters of an interrupted pass restart (the rows of such a resume cover the batches after it).
OPTIONAL_RANK_LOCAL_KEYS = ("rng", "fingerprints", "pass_meters")


def _is_path(checkpoint: Any) -> bool:
    return isinstance(checkpoint, (str, os.PathLike))


class CheckpointMixin:
    """Checkpoint payloads, saving with aliases, and the restore paths; mixed into `BaseRunner`."""

    config: RunnerConfig
    # (global_step, micro_step) when the newest result row was stored; `best` may only go to a
    # checkpoint of exactly that state (the row's scores describe no other weights).
    _scored_progress: tuple[int, int] | None = None
    # The newest save's failure until a later save is written; a training loop ending with one fails.
    _save_failure: CheckpointSaveError | None = None
    # Running meters and train metrics of the pass a mid-pass checkpoint interrupted, until that pass reopens.
    _restored_pass_meters: Mapping[str, Any] | None = None

    def _progress_marker(self) -> tuple[int, int]:
        state = self.train_state
        return state.global_step, state.micro_step

    # ------------------------------------------------------------------ payload
    def state_dict(self, cls: type = dict) -> Mapping:
        """Return the backend-neutral checkpoint payload.

        Called when: by `checkpoint_payload`, once per save (interval, best, final and seed saves), on every rank.
        Holds on entry: the runner is fully constructed; `state`, `rng_state`, `results`, `topology` and the dataloaders
            are bound.
        Side effects: captures the current RNG state into `rng_state`; nothing else changes.
        Overrides must not: drop a key `load_state_dict` reads back, or mutate a component (a save must leave the
            run exactly as it was).

        Keys: `runner` (the config as a plain mapping, used to refuse resuming a different
        experiment), `state` (the counters: one copy, the same on every rank), `rng` (this
        rank's RNG snapshots), `dataloaders` (progress of every dataloader that has a
        `state_dict`, per rank), `results` (all result rows, so best-score tracking and early
        stop continue after a resume) and `topology` (world and data-domain sizes, to detect a
        resume on another layout). The current RNG state is captured first. Backends call
        `super().state_dict(cls)` and add their components; building the payload must leave
        every component as it was.

        Args:
            cls: Mapping type used for the payload and its nested sections.
        """
        self.rng_state.capture()
        loaders = cls()
        for split, loader in self.dataloaders.items():
            if callable(getattr(loader, "state_dict", None)):
                loaders[split] = loader.state_dict()
        state = self.state.state_dict()
        return cls(
            runner=self.config.dict(),
            state=cls(train=state["train"], elastic=state["elastic"]),
            rng=state["rng"],
            dataloaders=loaders,
            results=self.results.dict(),
            topology=self.topology.describe(),
        )

    def load_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Restore the runner state, RNG state and result rows from a payload.

        Called when: by `load_checkpoint` (and so `from_checkpoint`, `auto_restore`, spike rollback and the dry run),
            once per restore, on every rank.
        Holds on entry: the payload passed the config, layout and missing-component checks of `load_checkpoint`; the
            model and optimizer are built.
        Side effects: replaces the counters, the RNG state (unless the data-parallel size changed) and `results`; may
            adopt the saved seed.
        Overrides must not: restore the model, optimizer or dataloaders here (`load_checkpoint` does that afterwards) or
            skip the config check.

        Model, optimizer, scheduler and dataloader state are not touched here; `load_checkpoint`
        restores those through the component loaders.

        Raises:
            ValueError: The checkpoint's config differs from the current one in a key that
                changes the experiment (any key `RunnerConfig.config_id` covers) and
                `resume_allow_changes` is not set.
        """
        if not isinstance(checkpoint, Mapping):
            raise TypeError(f"load_state_dict() expects a mapping, got {type(checkpoint).__name__}")
        saved = checkpoint.get("runner")
        if saved is not None:
            self._check_config_matches(saved)
        state = checkpoint.get("state")
        if state is not None:
            self.state.load_state_dict(state)
        rng = checkpoint.get("rng")
        if rng is not None and not self._resized(checkpoint):
            self.rng_state.load_state_dict(rng)
            self.rng_state.restore()
        results = checkpoint.get("results")
        if results is not None:
            self.results = RoundDict({int(index): RoundDict(row) for index, row in results.items()})

    def _check_config_matches(self, saved: Mapping[str, Any]) -> None:
        if self.__dict__.pop("_seed_was_drawn", False) and saved.get("seed") is not None:
            # Neither run chose a seed: continue with the one the checkpointed run drew.
            self.config.seed = saved["seed"]
        if saved != self.config.dict():  # equal (a resume of this very run): nothing to compare, no config to build
            check_identity(self, recorded_config(saved))  # budget keys may differ; identity keys only when allowed

    # ------------------------------------------------------------------ the running meters of a pass
    def _pass_meters_state(self) -> dict[str, Any]:
        """The `pass_meters` entry of a checkpoint (see `resume.pass_meters_state`)."""
        return pass_meters_state(
            self.loop_state,
            training_split=self.split if self.mode is RunnerMode.train else None,
            shares_rank=shares_data_rank(getattr(self, "topology", None), self.world_size),
            meters=self.meters,
            metrics=self._active_metrics,
        )

    def _continue_pass_meters(self, split: str) -> None:
        """Put back the meters and train metrics of the interrupted `split` pass (after the pass reset them)."""
        state, self._restored_pass_meters = self._restored_pass_meters, None
        device, batch = getattr(self, "device", None), self.loop_state.batch
        if continue_pass_meters(state, split, batch, self.meters, self._active_metrics, device, self.logger):
            # The step logs average the steps since the previous log: the restored ones are not new.
            self._step_window._marks = {name: (meter._sum, meter._count) for name, meter in self.meters.items()}

    # ------------------------------------------------------------------ saving
    def save_checkpoint(
        self,
        name: str = "latest",
        epochs: int | None = None,
        save_best: bool = True,
        last_step: bool = False,
        force: bool = False,
    ) -> Path | None:
        """Save a checkpoint through `self.checkpoint_manager` when one is due.

        Called when: by the training loops after each epoch (epoch mode) or every
            `checkpoint_interval` steps, at the end of training (`last_step`), on a graceful
            shutdown (`name="shutdown"`), and by `save_seed_checkpoint`; on every rank.
        Holds on entry: the counters, results and components describe the state to save; an
            earlier background save may still be writing.
        Side effects: writes a checkpoint and moves its aliases when due (on the writing ranks),
            emits `CHECKPOINT_SAVED` after a write.
        Overrides must not: skip calling it on some ranks only (collective backends need all of
            them), or change the runner's state; call `super().save_checkpoint(...)` to write.

        The decision is [`save_when_due`][danling.runners.checkpointing.saves.save_when_due]: the
        checkpoint directory is named `epoch-<epochs>` when `epochs` is given (epoch loops pass
        the index of the epoch just finished) and `step-<global_step>` otherwise, and the `name`
        alias and `latest` are pointed at it, plus `best` when `save_best` is set and the newest
        result row is the best one and no training happened since it was stored (so a mid-epoch
        save never inherits the score of the weights evaluated before it).
        To change the policy (cadence, names, aliases), override this method.

        Args:
            name: Alias to publish (`"latest"`, `"shutdown"`, any valid name).
            epochs: Index of the finished epoch, for naming and cadence.
            save_best: Also publish `best` when the newest row is the best.
            last_step: This is the run's final save; always written.
            force: Write regardless of the cadence.

        Returns:
            The checkpoint directory, or `None` when nothing was written by this process (or the
            write failed and `checkpoint.continue_on_save_error` is set; see `checkpoint_save_failed`).
        """
        manager = self.checkpoint_manager
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
                    return self._save_failed(err)
                self.checkpoint_save_failed(err)  # the background save before this one failed: this one still runs
                continue
            break
        if path is not None:
            self._save_failure = None
            self.events.emit(Events.CHECKPOINT_SAVED, CheckpointContext(self, path, name))
        return path

    def _save_facts(self) -> SaveFacts:
        state = self.train_state
        return SaveFacts(
            epoch=state.epoch,
            global_step=state.global_step,
            step_mode=self.is_step_mode,
            run_id=self.id,
            best=self._publishes_best(),
            score=self._checkpoint_score(),
            lower_is_better=self.bookkeeping.lower_is_better,
        )

    def _save_failed(self, error: CheckpointSaveError) -> None:
        """The newest save failed: hand it to `checkpoint_save_failed`, and fail the run if no later save lands."""
        self._save_failure = error
        return self.checkpoint_save_failed(error)

    def finish_checkpoints(self, *, failing: bool = False) -> None:
        """Wait until the saves the run started are durable; called as the outermost training loop ends.

        Called when: once, as the outermost training loop (`train`) ends, normally or with an exception
            (`failing=True`), on every rank.
        Holds on entry: every save the run started has been handed to `self.checkpoint_manager`; some may still be
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
        manager = self.checkpoint_manager
        path = manager.pending_path
        try:
            drained = manager.wait(manager.timeout)
        except Exception as err:
            if failing or not isinstance(err, CheckpointSaveError):
                self.logger.error("checkpoint %s was not saved: %s", path, err)
                if failing:
                    return  # the exception leaving the loop is the one to report
                raise
            self._save_failure = err
        else:
            if not drained:
                self.logger.error("checkpoint %s is still being written after %ss", path, manager.timeout)
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
        one (`is_best`) and no training happened since it was stored, so a mid-epoch save never
        inherits the score of the weights evaluated before it."""
        return bool(self.results) and self.is_best and self._scored_progress == self._progress_marker()

    def _checkpoint_score(self) -> float | None:
        """Score of the weights a checkpoint saved now holds (the newest row's, when `_publishes_best`'s
        condition on progress holds), else `None`; `checkpoint.save_top_k` ranks checkpoints by it."""
        scored = bool(self.results) and self._scored_progress == self._progress_marker()
        score = self.latest_score if scored else None
        return None if score is None or score != score else score  # NaN ranks nowhere

    def save_seed_checkpoint(self, name: str = "seed") -> Path | None:
        """Save the initial state now, under the alias `name`, which retention never prunes.

        Called when: only when the user calls it, typically after construction and before `train()`; never by the runner
            itself.
        Holds on entry: the model (and optimizer) are built; training has not advanced yet.
        Side effects: one forced, final save through `save_checkpoint` under the alias `name`; never published as
            `best`.
        Overrides must not: bypass `save_checkpoint` (an override of it would no longer apply) or advance any counter.

        Meant to be called before training advances, so runs with different parallel layouts can
        start from identical weights (`resume`/`pretrained` pointing at it). It is a final save
        through [`save_checkpoint`][danling.runners.checkpointing.api.CheckpointMixin.save_checkpoint]
        (so an overriding `save_checkpoint` applies, and a backend's model-only export setting):
        written whatever the cadence, never published as `best`. By default the directory is
        `step-<global_step>` and `latest` points at it too.
        """
        return self.save_checkpoint(name=name, save_best=False, last_step=True, force=True)

    def checkpoint_payload(self, *, last_step: bool) -> Mapping[str, Any]:
        """What one save hands to `self.checkpoint_manager`.

        Called when: by `save_checkpoint` (and so `save_seed_checkpoint`), once per save that is written, on every rank.
        Holds on entry: the runner is fully constructed; the step being saved has finished.
        Side effects: none beyond what `state_dict` does (an RNG capture).
        Overrides must not: change any state, or return objects the manager cannot serialize (plain state or objects
            with `state_dict()`).

        Called by `save_checkpoint` and `save_seed_checkpoint` on every rank. Values may be
        plain state or live stateful objects (the manager calls their `state_dict()` in the
        caller's thread). Backends return a model-only payload for final exports when configured
        (`last_step`), or the pieces their engine saves itself. Must not change any state.
        """
        return self.state_dict()

    # ------------------------------------------------------------------ loading
    def read_checkpoint(self, checkpoint: CheckpointSource, *args: Any, **kwargs: Any) -> Mapping[str, Any]:
        """Turn a checkpoint source into a payload mapping.

        Called when: by `read_restore_payload` and `load_pretrained` (and `from_checkpoint` / `from_pretrained` through
            them), once per restore.
        Holds on entry: `self.checkpoint_manager` is bound; `checkpoint` is a path, alias, bytes or mapping.
        Side effects: reads files or unpickles bytes; returns a new mapping, never changing the caller's.
        Overrides must not: ignore `checkpoint.exclude_from_loading` or `map_location`, or bypass the manager's
            verification and the `checkpoint.trust_pickle` setting.

        Strings or paths go through `self.checkpoint_manager.load`, so aliases (`"latest"`,
        `"best"`), checkpoint names, directories and files all work and are verified against their
        manifest. Bytes are unpickled and mappings used as they are, except that the keys of
        `checkpoint.exclude_from_loading` (dotted ones too: `"state.train"`) are left out of them
        as the manager leaves them out of what it loads; the caller's mapping is not changed.
        `map_location` is honoured; other arguments are accepted for backend overrides.
        """
        map_location = kwargs.get("map_location", "cpu")
        if _is_path(checkpoint):
            return self.checkpoint_manager.load(checkpoint, map_location=map_location)
        if not isinstance(checkpoint, Mapping):
            trusted = self.config.checkpoint.trust_pickle
            checkpoint = read_checkpoint_source(checkpoint, map_location=map_location, trusted=trusted)
        excludes = self.checkpoint_manager.exclude_from_loading
        return _without(checkpoint, excludes) if excludes else checkpoint

    def load_checkpoint(self, checkpoint: CheckpointSource, *args: Any, **kwargs: Any) -> None:
        """Restore a full checkpoint: runner state, RNG, results, model/EMA, optimizer, scheduler, dataloaders.

        Called when: by `auto_restore` (`resume` / `auto_resume`), `from_checkpoint`, spike rollback and the dry run;
            once per restore, on every rank.
        Holds on entry: the runner is fully constructed: model, optimizer, scheduler and dataloaders are built.
        Side effects: replaces runner state, RNG, results, model/EMA, optimizer, scheduler and dataloader positions;
            sets `config.resume` for a path; emits `CHECKPOINT_LOADED`.
        Overrides must not: change any component before the checks have passed (a refused resume must leave the runner
            untouched) or skip a rank (the restore may be collective).

        Args:
            checkpoint: Payload mapping, bytes, alias, or path.
            *args: Forwarded to `load_model` (e.g. `strict`).
            **kwargs: `map_location` is used for reading; the rest goes to `load_model`.

        Raises:
            ValueError: The runner has a model/optimizer/scheduler bound but the checkpoint has no
                state for it (and the key is not in `checkpoint.exclude_from_loading`), or the
                checkpoint's config differs semantically.
        """
        map_location = kwargs.pop("map_location", "cpu")
        source = self.__dict__.pop("_restore_source", checkpoint)  # what from_checkpoint read the payload from
        if _is_path(checkpoint):
            checkpoint = resolve_resume_path(checkpoint, self.config.checkpoint.dir_name)
        excluded = self._excluded_components()
        in_place = self.in_place_components(checkpoint, excluded)
        payload = self.read_restore_payload(checkpoint, in_place, map_location)
        self._check_resumable_layout(payload, excluded, checkpoint)
        for key in _REQUIRED_COMPONENTS:
            missing = payload.get(key) is None and key not in excluded and key not in in_place
            if getattr(self, key, None) is not None and missing:
                raise ValueError(
                    f"checkpoint {_describe(checkpoint)} has no {key!r} state but the runner has a {key} bound; "
                    f"add {key!r} to checkpoint.exclude_from_loading to keep the current one"
                )
        self.load_state_dict(payload)
        if in_place:  # read straight into the live components, after every check above passed
            self.restore_in_place(checkpoint, in_place, map_location, *args, **kwargs)
            excluded = excluded | set(in_place)
        if payload.get("model") is not None and "model" not in excluded:
            self.load_model(payload["model"], *args, **kwargs)
        loaders = {
            "ema": self.load_ema,
            "optimizer": self.load_optimizer,
            "scheduler": self.load_scheduler,
            "dataloaders": self.load_dataloaders,
        }
        for key, load in loaders.items():
            if key not in excluded:
                load(payload.get(key))
        if _is_path(source):
            self.config.resume = os.fspath(source)
        self.events.emit(Events.CHECKPOINT_LOADED, CheckpointContext(self, _name(source)))
        self.logger.info(
            "restored checkpoint %s at epoch %d, global step %d",
            _describe(source),
            self.train_state.epoch,
            self.train_state.global_step,
        )

    def in_place_components(self, checkpoint: CheckpointSource, excluded: set[str]) -> tuple[str, ...]:
        """Components restored in place from `checkpoint` rather than from a payload read into memory.

        Called when: first by `load_checkpoint`, once per restore, on every rank.
        Holds on entry: `checkpoint` is a payload or a resolved path; `excluded` holds the keys of
            `checkpoint.exclude_from_loading`.
        Side effects: none: it only inspects `checkpoint`.
        Overrides must not: change state, or decide differently on different ranks (the split decides which collective
            reads run).

        Called first by `load_checkpoint`, on every rank. None by default; backends whose checkpoint
        format reads into live tensors (DCP, an engine's loader) list the keys here, and
        `read_restore_payload` / `restore_in_place` then split the restore in two."""
        return ()

    def read_restore_payload(self, checkpoint: CheckpointSource, in_place: tuple[str, ...], map_location: Any) -> Any:
        """The payload a restore reads into memory, without the components restored in place.

        Called when: by `load_checkpoint`, once per restore, right after `in_place_components`, on every rank.
        Holds on entry: `in_place` lists the components `restore_in_place` will restore later.
        Side effects: reads the checkpoint; changes nothing on the runner.
        Overrides must not: restore anything (the checks run on the payload afterwards), or include components listed in
            `in_place`.

        `load_checkpoint` runs its checks (config, layout, missing components) on it before
        anything is changed.
        """
        return self.read_checkpoint(checkpoint, map_location=map_location)

    def restore_in_place(
        self, checkpoint: CheckpointSource, keys: tuple[str, ...], map_location: Any, *args: Any, **kwargs: Any
    ) -> None:
        """Restore the components `in_place_components` listed, after every check has passed.

        Called when: by `load_checkpoint`, once per restore and only when `in_place_components` listed keys, after
            `load_state_dict`.
        Holds on entry: every check on the restore payload has passed; the counters and RNG are already restored.
        Side effects: loads the listed components into the live model/optimizer tensors.
        Overrides must not: restore a component not in `keys`, or skip a rank (backend readers are collective).

        `args`/`kwargs` are those of `load_checkpoint` (they reach `load_model`).
        """
        raise NotImplementedError(f"{type(self).__name__} restores no component in place")

    def _resized(self, payload: Mapping[str, Any]) -> bool:
        """Whether `payload` was written with another number of data-parallel ranks than this run has."""
        saved = payload.get("topology")
        return isinstance(saved, Mapping) and saved.get("data_size") != self.topology.size("data")

    def _check_resumable_layout(self, payload: Mapping[str, Any], excluded: set[str], source: Any) -> None:
        """Refuse, on every rank alike, a resume whose per-rank state cannot follow a new data-parallel size.

        The counters, results, model and optimizer are global and restore on any layout. Loader
        positions are per rank: with another number of data-parallel ranks they describe shards
        that no longer exist, so the resume is refused unless `dataloaders` is excluded from
        loading (the interrupted pass then restarts). Per-rank RNG snapshots are dropped on a
        resize: every rank re-seeds from the seed and its data rank. The decision reads only the
        checkpoint's metadata, so every rank takes it alike, before any collective.
        """
        if not self._resized(payload):
            return
        saved = payload["topology"]
        size, world = self.topology.size("data"), self.topology.size("world")
        if "dataloaders" not in excluded:  # decided from global facts only: never per-rank content
            raise ValueError(
                f"checkpoint {_describe(source)} was written by {saved.get('data_size')} data-parallel ranks, "
                f"but this run has {size} (world sizes {saved.get('world_size')} and {world}): its "
                "dataloader positions are per rank and cannot be split over the new ranks. Resume with "
                f"{saved.get('data_size')} data-parallel ranks, or add 'dataloaders' to "
                "checkpoint.exclude_from_loading to restart the interrupted pass on the new layout"
            )
        self.logger.warning(
            "resuming a checkpoint of %s data-parallel ranks on %d: per-rank RNG state is re-seeded",
            saved.get("data_size"),
            size,
        )

    def _excluded_components(self) -> set[str]:  # dotted entries ("model.head") trim a component, still loaded
        return {key for key in self.checkpoint_manager.exclude_from_loading if "." not in key}

    def load_model(self, state_dict: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        """Load weights into `self.model` (through `unwrap`).

        Called when: by `load_checkpoint` and `load_pretrained` (and the in-place readers), once per restore that
            carries model weights.
        Holds on entry: `self.model` is built; `state_dict` holds weights for the unwrapped model.
        Side effects: replaces the model's weights in place.
        Overrides must not: replace `self.model` with a new object (the optimizer holds its parameters) or load into the
            wrapper instead of `unwrap(model)`.
        """
        if self.model is None:
            raise ValueError("cannot load model weights: self.model is not set")
        self.unwrap(self.model).load_state_dict(state_dict, *args, **kwargs)

    def load_ema(self, state_dict: Mapping[str, Any] | None, *args: Any, **kwargs: Any) -> None:
        """Load EMA weights when both the state and `self.ema` exist.

        Called when: by `load_checkpoint`, once per restore unless `ema` is excluded from loading; `state_dict` may be
            `None`.
        Holds on entry: the model is restored; `self.ema` is bound if the run uses one.
        Side effects: replaces the EMA weights in place.
        Overrides must not: fail on `None` state (a checkpoint without EMA) or rebind `self.ema`.
        """
        if state_dict is not None and self.ema is not None:
            self.unwrap(self.ema).load_state_dict(state_dict, *args, **kwargs)

    def load_optimizer(self, state_dict: Mapping[str, Any] | None, *args: Any, **kwargs: Any) -> None:
        """Load optimizer state when both the state and `self.optimizer` exist.

        Called when: by `load_checkpoint`, once per restore unless `optimizer` is excluded from loading, after the model
            is restored.
        Holds on entry: the optimizer is built over the restored model's parameters; `state_dict` may be `None`.
        Side effects: replaces the optimizer state (moments, step counts, param-group hyper-parameters).
        Overrides must not: rebuild or rebind `self.optimizer` (the update strategy and scheduler hold it).
        """
        if state_dict is not None and self.optimizer is not None:
            self.optimizer.load_state_dict(state_dict, *args, **kwargs)

    def load_scheduler(self, state_dict: Mapping[str, Any] | None, *args: Any, **kwargs: Any) -> None:
        """Load scheduler state when both the state and `self.scheduler` exist.

        Called when: by `load_checkpoint`, once per restore unless `scheduler` is excluded from loading, after the
            optimizer.
        Holds on entry: the scheduler is built over the restored optimizer; `state_dict` may be `None`.
        Side effects: replaces the scheduler state (its step count and learning rates).
        Overrides must not: rebind `self.scheduler` (the update strategy steps the bound one).
        """
        if state_dict is not None and self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict, *args, **kwargs)

    def load_dataloaders(self, state_dict: Mapping[str, Any] | None) -> None:
        """Restore the progress of each dataloader that has saved state and a `load_state_dict`.

        Called when: by `load_checkpoint`, last of the component loaders, unless `dataloaders` is excluded from loading.
        Holds on entry: the dataloaders are built; the counters are restored.
        Side effects: sets each matching loader's position so the interrupted pass continues where it stopped.
        Overrides must not: fail on a split the run no longer has, or rebuild the loaders (their position would be
            lost).
        """
        for split, state in (state_dict or {}).items():
            loader = self.dataloaders.get(split)
            if loader is not None and callable(getattr(loader, "load_state_dict", None)):
                loader.load_state_dict(state)

    def load_pretrained(self, checkpoint: CheckpointSource, *args: Any, **kwargs: Any) -> None:
        """Load model weights only, preferring the EMA weights when the checkpoint has them.

        Called when: by `auto_restore` when `pretrained` is set and no checkpoint is resumed, and by
            `from_pretrained`; once per run.
        Holds on entry: the runner is constructed and `self.model` is built.
        Side effects: replaces the model weights only (EMA weights preferred); sets `config.pretrained` for a path.
        Overrides must not: restore the optimizer, scheduler, counters or dataloaders (that is a resume:
            `load_checkpoint`).

        Optimizer, scheduler, counters and dataloaders stay as they are: use this to fine-tune
        from another run, and `load_checkpoint` to resume one.

        Raises:
            ValueError: `self.model` is not set, or the checkpoint has no `ema`, `model` or
                `model_parts` state.
        """
        if self.model is None:
            raise ValueError("load_pretrained() needs self.model to be set first")
        given = checkpoint
        if _is_path(checkpoint):
            checkpoint = resolve_resume_path(checkpoint, self.config.checkpoint.dir_name)
        payload = self.read_checkpoint(checkpoint, map_location=kwargs.pop("map_location", "cpu"))
        key = next((key for key in ("ema", "model", "model_parts") if payload.get(key) is not None), None)
        if key is None:
            raise ValueError(
                f"checkpoint {_describe(checkpoint)} has no 'ema', 'model' or 'model_parts' state; "
                f"keys: {sorted(payload)}"
            )
        self.load_model(payload[key], *args, **kwargs)
        if _is_path(given):
            self.config.pretrained = os.fspath(given)
        self.logger.info("loaded %s weights from %s", key, _describe(given))

    def auto_restore(self) -> None:
        """Restore what the config asks for: `resume`, else `auto_resume`, else `pretrained`.

        Called when: once, at the end of `TorchRunner.__post_init__` (unless a restore already happened), on every rank.
        Holds on entry: the model, optimizer, scheduler, update strategy and dataloaders are built.
        Side effects: may take the run-directory lock, reconcile the run directory, and restore a checkpoint or
            pretrained weights.
        Overrides must not: restore on some ranks only, or train (construction has not finished).

        First, on the main process of a writing run, the run directory is reconciled with its
        checkpoints ([`reconcile_run`][danling.runners.reconcile.reconcile_run]: aliases, result
        files, leftovers of interrupted writes). With `auto_resume`, the newest checkpoint in this
        run's checkpoint directory that passes verification is loaded; when that is not the one
        `latest` pointed to, the fallback is logged as a warning. Without any checkpoint the run
        starts fresh, from the `pretrained` weights when they are set (the first launch of a
        fine-tuning job that is resubmitted with `auto_resume`). Inside
        [`from_checkpoint`][danling.runners.checkpointing.api.CheckpointMixin.from_checkpoint],
        which restores the full state right after construction, it does nothing.
        """
        self._restored = True
        if _RESTORING.get():
            return
        config, manager = self.config, self.checkpoint_manager
        if not config.checkpoint.load_only:
            take_run_dir(self)  # the lock, before reconciling: never repair a directory another run writes
        latest = manager.latest  # as the last run left it, before reconciling corrects a lagging pointer
        reconcile_on_start(self)
        if config.get("resume"):
            self.load_checkpoint(config.resume)
            report_code_change(self)
            return
        if config.get("auto_resume"):
            refused: list[Path] = []
            path = newest_valid_checkpoint(manager.directory, self.logger, refused) or manager.latest_valid()
            if path is not None and refused and self.is_main_process and not config.checkpoint.load_only:
                kept = set_aside(manager.directory, refused)  # saves of the same names follow: keep them apart
                self.logger.warning(
                    "auto_resume: %s do not verify; moved to %s as they are", [p.name for p in refused], kept
                )
            if path is not None:
                if latest is not None and latest in refused:  # not one that merely lagged (reconcile moved it)
                    self.logger.warning(
                        "auto_resume: latest checkpoint %s is not usable; resuming from %s", latest, path
                    )
                    self.events.emit(Events.CHECKPOINT_FALLBACK, CheckpointContext(self, path, requested=latest))
                self.load_checkpoint(path)
                report_code_change(self)
                return
            if manager.checkpoints():  # the workspace refuses such a directory: it changed since
                raise CheckpointError(
                    f"auto_resume: no checkpoint in {manager.directory} verifies (see the warnings above); "
                    "they are kept as they are rather than overwritten by a run from scratch: move them away, "
                    "or resume one explicitly"
                )
            start = "the pretrained weights" if config.get("pretrained") else "scratch"
            self.logger.info("auto_resume: no checkpoint in %s, starting from %s", manager.directory, start)
            report_other_runs(self)
        if config.get("pretrained"):
            self.load_pretrained(config.pretrained)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def _read_source(
        cls, checkpoint: CheckpointSource, map_location: Any = "cpu", trusted: bool = False
    ) -> Mapping[str, Any]:
        """Payload of a checkpoint read without a runner instance, in any registered format."""
        return read_checkpoint_source(checkpoint, map_location=map_location, trusted=trusted)

    @classmethod
    def read_config(cls, checkpoint: CheckpointSource, *args: Any, **kwargs: Any) -> RunnerConfig:
        """Return the `RunnerConfig` stored in a checkpoint (mapping, bytes, or path of any format).

        Pickled data is read without running code; pass `trusted=True` for a checkpoint you trust
        that holds other types (the error of a refused one names the type).
        """
        payload = cls._read_source(checkpoint, kwargs.get("map_location", "cpu"), bool(kwargs.get("trusted")))
        saved = payload.get("runner")
        if not isinstance(saved, Mapping):
            raise ValueError(f"checkpoint {_describe(checkpoint)} has no runner config; keys: {sorted(payload)}")
        return recorded_config(saved)

    @classmethod
    def from_checkpoint(cls, checkpoint: CheckpointSource, *args: Any, **kwargs: Any) -> BaseRunner:
        """Build a runner from the config stored in `checkpoint`, then restore its full state.

        The config is used as saved (`pretrained` included, so it matches the checkpoint); no
        `resume`, `auto_resume` or `pretrained` restore runs during construction. `*args` and
        `**kwargs` are forwarded to `load_checkpoint`, except `trusted=True`, which reads a
        checkpoint you trust with the full unpickler (and sets `checkpoint.trust_pickle`). The source
        run is only read: the new runner writes into a new version of the run directory.
        """
        trusted = bool(kwargs.pop("trusted", False))
        source = resolve_resume_path(checkpoint) if _is_path(checkpoint) else checkpoint
        payload = cls._read_source(source, kwargs.get("map_location", "cpu"), trusted)
        config = cls.read_config(payload)
        config.resume, config.auto_resume = None, False
        if trusted:
            config.checkpoint.trust_pickle = True
        token = _RESTORING.set(True)
        try:
            runner = cls(config)
        finally:
            _RESTORING.reset(token)
        runner._restore_source = checkpoint  # logged and recorded instead of the in-memory payload
        runner.load_checkpoint(payload, *args, **kwargs)
        return runner

    @classmethod
    def from_pretrained(
        cls, config: RunnerConfig | Mapping[str, Any], checkpoint: CheckpointSource, *args: Any, **kwargs: Any
    ) -> BaseRunner:
        """Build a runner from `config` and load only model weights from `checkpoint`."""
        runner = cls(config)
        runner.load_pretrained(checkpoint, *args, **kwargs)
        return runner


# Set while `from_checkpoint` constructs its runner: the full restore follows construction.
_RESTORING: ContextVar[bool] = ContextVar("danling_restoring_from_checkpoint", default=False)


def _name(checkpoint: Any) -> str:
    return os.fspath(checkpoint) if _is_path(checkpoint) else _describe(checkpoint)
