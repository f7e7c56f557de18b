"""The runner's checkpoint hooks: the documented names a user calls and overrides, over `runner.checkpointing`.

[`CheckpointHooks`][danling.runners.checkpointing.hooks.CheckpointHooks] holds no state. Each hook
delegates to the runner's checkpointing component
([`RunnerCheckpointing`][danling.runners.checkpointing.component.RunnerCheckpointing], or a
backend's subclass), and the component calls the hooks back, so an override here is what every
save and restore uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import RunnerConfig, recorded_config
from ..services.run_dirs import resolve_resume_path
from .component import RESTORING, CheckpointSource, RunnerCheckpointing, is_path, read_source
from .resume import describe_source

if TYPE_CHECKING:
    from ..base_runner import BaseRunner

__all__ = ["CheckpointHooks"]


class CheckpointHooks:
    """The runner's checkpoint API (`save_checkpoint`, `load_checkpoint`, `state_dict`, ...); no state of its own."""

    checkpointing: RunnerCheckpointing

    # ------------------------------------------------------------------ payload
    def state_dict(self, cls: type = dict) -> Mapping:
        """Return the checkpoint payload: the runner state plus, for torch runners, every live component's state.

        Called when: by the backend-free runner's saves (once per save, on every rank) and by callers that want the
            payload in memory (`load_checkpoint(runner.state_dict())`, tests); a torch runner's save does not call it:
            its `checkpointing.checkpoint_payload` hands the manager `runner_payload` plus the live objects.
        Holds on entry: the runner is fully constructed; `state`, `rng_state`, `results`, `topology` and the dataloaders
            are bound.
        Side effects: captures the current RNG state into `rng_state`; every live component is copied through its own
            `state_dict()`; nothing else changes.
        Overrides must not: drop a key `load_state_dict` / `load_checkpoint` reads back, or mutate a component (a save
            must leave the run exactly as it was).

        Keys: `runner` (the config as a plain mapping, used to refuse resuming a different
        experiment), `state` (the counters: one copy, the same on every rank), `rng` (this
        rank's RNG snapshots), `dataloaders` (progress of every dataloader that has a
        `state_dict`, per rank), `results` (all result rows, so best-score tracking and early
        stop continue after a resume) and `topology` (world and data-domain sizes, to detect a
        resume on another layout). A torch runner adds `model` / `optimizer` (keyed by parameter
        name), `ema`, `scheduler`, `loop` (the loop position), `fingerprints`, `pass_meters` and
        `backend`; its result-row indices are strings (DCP only stores string keys) and only the
        training splits' loader progress is kept.

        Args:
            cls: Mapping type used for the payload and its nested sections.
        """
        return self.checkpointing.state_dict(cls)

    def load_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Restore the runner state, RNG state and result rows (and, for torch runners, the loop position).

        Called when: by `load_checkpoint` (and so `from_checkpoint`, `auto_restore`, spike rollback and the dry run),
            once per restore, on every rank, before any component is loaded.
        Holds on entry: the payload passed the config, layout and missing-component checks of `load_checkpoint`; the
            model, optimizer, loaders and update strategy are built.
        Side effects: replaces the counters, the RNG state (unless the data-parallel size changed) and `results`; may
            adopt the saved seed; a torch runner also restores `loop_state`, keeps the fingerprints, update and
            pass-meter state for the later loaders, and may change `accum_steps` on another data-parallel size.
        Overrides must not: restore the model, optimizer or dataloaders here (`load_checkpoint` does that afterwards),
            or skip `super().load_state_dict` (it checks the config).

        On another data-parallel size the interrupted pass continues as a new pass over its
        remaining samples, and `accum_steps` is set to keep the global batch.

        When `checkpoint.exclude_from_loading` holds `dataloaders` or `dataloaders.<split>` of the
        split whose pass the checkpoint interrupted, that loader starts from the beginning of its
        data, and so does the pass, on any data-parallel size: its batch position and accumulation
        window start over, its running loss meters and train metrics are not restored (its row
        covers the restarted pass alone), and a WARNING says how many batches are trained again.
        `global_step`, `micro_step`, `epoch`, the optimizer and the scheduler are restored as saved:
        the restarted pass's updates count on from the checkpoint's.

        Raises:
            ValueError: The checkpoint's config differs from the current one in a key that
                changes the experiment (any key `RunnerConfig.config_id` covers) and
                `resume_allow_changes` is not set.
        """
        self.checkpointing.load_state_dict(checkpoint)

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
        return self.checkpointing.save(name, epochs, save_best, last_step, force)

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
        through [`save_checkpoint`][danling.runners.checkpointing.hooks.CheckpointHooks.save_checkpoint]
        (so an overriding `save_checkpoint` applies, and a backend's model-only export setting):
        written whatever the cadence, never published as `best`. By default the directory is
        `step-<global_step>` and `latest` points at it too.
        """
        return self.save_checkpoint(name=name, save_best=False, last_step=True, force=True)

    # ------------------------------------------------------------------ reading and loading
    def read_checkpoint(self, checkpoint: CheckpointSource, *args: Any, **kwargs: Any) -> Mapping[str, Any]:
        """Turn a checkpoint source (mapping, bytes, alias or path of any registered format) into a payload.

        Called when: by the restore's payload read and `load_pretrained` (and `from_checkpoint` / `from_pretrained`
            through them), once per restore.
        Holds on entry: `self.checkpoint_manager` is bound; `checkpoint` is a path, alias, bytes or mapping.
        Side effects: reads (and verifies) files or unpickles bytes; returns a new mapping, never changing the
            caller's.
        Overrides must not: ignore `checkpoint.exclude_from_loading` or `map_location`, or bypass the manager's
            verification and the `checkpoint.trust_pickle` setting.

        Strings or paths go through the checkpoint manager, so aliases (`"latest"`, `"best"`),
        checkpoint names, directories and files all work and are verified against their manifest;
        a torch runner opens a reader of the checkpoint's format
        ([`detect_format`][danling.checkpoint.detect_format]) when it is not the manager's own.
        Bytes are unpickled and mappings used as they are, except that the keys of
        `checkpoint.exclude_from_loading` (dotted ones too: `"state.train"`) are left out of them
        as the manager leaves them out of what it loads. Other arguments are accepted for backend
        overrides.
        """
        return self.checkpointing.read(checkpoint, *args, **kwargs)

    def load_checkpoint(self, checkpoint: CheckpointSource, *args: Any, **kwargs: Any) -> None:
        """Restore a full checkpoint: runner state, RNG, results, model/EMA, optimizer, scheduler, dataloaders.

        Called when: by `auto_restore` (`resume` / `auto_resume`), `from_checkpoint`, spike rollback and the dry run;
            once per restore, on every rank.
        Holds on entry: the runner is fully constructed: model, optimizer, scheduler, update strategy and dataloaders
            are built.
        Side effects: replaces runner state, RNG, results, model/EMA, optimizer, scheduler and dataloader positions
            through the `load_*` hooks; a torch runner then rebinds `self.update` to the restored optimizer and
            scheduler and restores its accumulation state; sets `config.resume` for a path; emits `CHECKPOINT_LOADED`.
        Overrides must not: change any component before the checks have passed (a refused resume must leave the runner
            untouched), skip a rank (the restore may be collective), or skip the rebinding of `self.update`.

        A torch runner also verifies the next-batch fingerprint of every training loader before
        its state is loaded.

        Args:
            checkpoint: Payload mapping, bytes, alias, or path.
            *args: Forwarded to `load_model` (e.g. `strict`).
            **kwargs: `map_location` is used for reading; the rest goes to `load_model`.

        Raises:
            ValueError: The runner has a model/optimizer/scheduler bound but the checkpoint has no
                state for it (and the key is not in `checkpoint.exclude_from_loading`), or the
                checkpoint's config differs semantically.
            DataResumeError: a training loader would not continue the data stream of the checkpoint.
        """
        self.checkpointing.load(checkpoint, *args, **kwargs)

    def load_model(self, state_dict: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        """Load weights into `self.model`, whatever wrapper it has.

        Called when: by `load_checkpoint` (directly or through an in-place reader) and `load_pretrained`, once per
            restore that carries model weights.
        Holds on entry: `self.model` is built (and wrapped or sharded); `state_dict` holds weights for the unwrapped
            model (a torch runner's are keyed by parameter name).
        Side effects: replaces the model's weights in place; a sharded parameter receives its local shard.
        Overrides must not: replace `self.model` or its parameters with new objects (the optimizer holds them) or load
            into the wrapper instead of `unwrap(model)`.

        `strict` may be given as the first positional argument or as a keyword (default `True`).
        """
        self.checkpointing.load_model(state_dict, *args, **kwargs)

    def load_ema(self, state_dict: Mapping[str, Any] | None, *args: Any, **kwargs: Any) -> None:
        """Load EMA weights when both the state and `self.ema` exist.

        Called when: by `load_checkpoint`, once per restore unless `ema` is excluded from loading; `state_dict` may be
            `None`.
        Holds on entry: the model is restored; `self.ema` is bound if the run uses one.
        Side effects: replaces the EMA weights in place.
        Overrides must not: fail on `None` state (a checkpoint without EMA) or rebind `self.ema`.
        """
        self.checkpointing.load_ema(state_dict, *args, **kwargs)

    def load_optimizer(self, state_dict: Mapping[str, Any] | None, *args: Any, **kwargs: Any) -> None:
        """Load optimizer state (keyed by parameter name, or torch's positional layout) into `self.optimizer`.

        Called when: by `load_checkpoint` (directly or through an in-place reader), once per restore unless
            `optimizer` is excluded from loading, after the model is restored.
        Holds on entry: the optimizer is built over the restored model's parameters; `state_dict` may be `None`.
        Side effects: replaces the optimizer state (moments, step counts, param-group hyper-parameters) in place.
        Overrides must not: rebuild or rebind `self.optimizer` (the update strategy and scheduler hold it).
        """
        self.checkpointing.load_optimizer(state_dict, *args, **kwargs)

    def load_scheduler(self, state_dict: Mapping[str, Any] | None, *args: Any, **kwargs: Any) -> None:
        """Load scheduler state when both the state and `self.scheduler` exist.

        Called when: by `load_checkpoint`, once per restore unless `scheduler` is excluded from loading, after the
            optimizer.
        Holds on entry: the scheduler is built over the restored optimizer; `state_dict` may be `None`.
        Side effects: replaces the scheduler state (its step count and learning rates).
        Overrides must not: rebind `self.scheduler` (the update strategy steps the bound one).
        """
        self.checkpointing.load_scheduler(state_dict, *args, **kwargs)

    def load_dataloaders(self, state_dict: Mapping[str, Any] | None) -> None:
        """Restore the progress of each dataloader that has saved state (checked against its fingerprint).

        Called when: once per `load_checkpoint`, last of the component loaders, after the runner state, model, EMA,
            optimizer and scheduler are restored (unless `dataloaders` is excluded from loading: the interrupted
            pass then restarts, see `load_state_dict`).
        Holds on entry: `loop_state` holds the checkpoint's position (batch 0 for a pass that restarts); the
            dataloaders are built.
        Side effects: moves each matching loader to its saved position (a torch runner checks it first, see
            [`restore_loader_positions`][danling.runners.checkpointing.resume.restore_loader_positions]),
            or, on another data-parallel size, to the global position of its pass; a split excluded as
            `dataloaders.<split>` keeps the position it was built with.
        Overrides must not: fail on a split the run no longer has, rebuild the loaders (their position would be
            lost), or skip the fingerprint check; call `super().load_dataloaders(state_dict)`.

        Raises:
            DataResumeError: a rebuilt loader would yield a different next batch than the saved one.
        """
        self.checkpointing.load_dataloaders(state_dict)

    def load_pretrained(self, checkpoint: CheckpointSource, *args: Any, **kwargs: Any) -> None:
        """Load model weights only, preferring the EMA weights when the checkpoint has them.

        Called when: by `auto_restore` when `pretrained` is set and no checkpoint is resumed, and by
            `from_pretrained`; once per run.
        Holds on entry: the runner is constructed and `self.model` is built.
        Side effects: replaces the model weights only (EMA weights preferred), and restarts the run's EMA
            (when it keeps one) from them; sets `config.pretrained` for a path.
        Overrides must not: restore the optimizer, scheduler, counters or dataloaders (that is a resume:
            `load_checkpoint`).

        Optimizer, scheduler, counters and dataloaders stay as they are: use this to fine-tune
        from another run, and `load_checkpoint` to resume one.

        Raises:
            ValueError: `self.model` is not set, or the checkpoint has no `ema`, `model` or
                `model_parts` state.
        """
        self.checkpointing.load_pretrained(checkpoint, *args, **kwargs)

    def auto_restore(self) -> None:
        """Restore what the config asks for: `resume`, else `auto_resume`, else `pretrained`.

        Called when: once, at the end of `TorchRunner.__post_init__` (unless a restore already happened), on every rank;
            by `train()` when nothing restored before it (a `BaseRunner` subclass that never called it).
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
        [`from_checkpoint`][danling.runners.checkpointing.hooks.CheckpointHooks.from_checkpoint],
        which restores the full state right after construction, it does nothing.
        """
        self.checkpointing.auto_restore()

    # ------------------------------------------------------------------ constructors
    @classmethod
    def read_config(cls, checkpoint: CheckpointSource, *args: Any, **kwargs: Any) -> RunnerConfig:
        """Return the `RunnerConfig` stored in a checkpoint (mapping, bytes, or path of any format).

        Pickled data is read without running code; pass `trusted=True` for a checkpoint you trust
        that holds other types (the error of a refused one names the type).
        """
        payload = read_source(checkpoint, kwargs.get("map_location", "cpu"), bool(kwargs.get("trusted")))
        saved = payload.get("runner")
        if not isinstance(saved, Mapping):
            raise ValueError(f"checkpoint {describe_source(checkpoint)} has no runner config; keys: {sorted(payload)}")
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
        source = resolve_resume_path(checkpoint) if is_path(checkpoint) else checkpoint
        payload = read_source(source, kwargs.get("map_location", "cpu"), trusted)
        config = cls.read_config(payload)
        config.resume, config.auto_resume = None, False
        if trusted:
            config.checkpoint.trust_pickle = True
        token = RESTORING.set(True)
        try:
            runner = cls(config)  # type: ignore[call-arg]
        finally:
            RESTORING.reset(token)
        runner.checkpointing.restore_source = checkpoint  # logged and recorded instead of the in-memory payload
        runner.load_checkpoint(payload, *args, **kwargs)
        return runner  # type: ignore[return-value]

    @classmethod
    def from_pretrained(
        cls, config: RunnerConfig | Mapping[str, Any], checkpoint: CheckpointSource, *args: Any, **kwargs: Any
    ) -> BaseRunner:
        """Build a runner from `config` and load only model weights from `checkpoint`."""
        runner = cls(config)  # type: ignore[call-arg]
        runner.load_pretrained(checkpoint, *args, **kwargs)
        return runner  # type: ignore[return-value]
