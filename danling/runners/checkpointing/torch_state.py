"""Checkpoint payload and restore paths of [`TorchRunner`][danling.runners.TorchRunner].

[`TorchCheckpointing`][danling.runners.checkpointing.torch_state.TorchCheckpointing] extends the
backend-neutral payload of [`RunnerCheckpointing`][danling.runners.checkpointing.component.RunnerCheckpointing]
with the torch components and everything an exact resume needs:

- `model` / `optimizer`: keyed by parameter name (through
  [`get_training_state`][danling.checkpoint.dcp.get_training_state]), so the same payload works
  with the file and the DCP backends and survives a change of wrapping (DDP, `torch.compile`);
- `ema`, `scheduler`;
- `loop`: the loop cursor (the train split whose pass was under way, whether the round had
  finished training and was evaluating, the results of the round's finished splits), the
  accumulation position, the optimizer container (skipped updates, gradient scaler) and a
  fingerprint of the next batch each training loader would yield. On restore the fingerprint is
  recomputed from the rebuilt loader, and a mismatch (other data, batch size, seed or world size)
  raises [`DataResumeError`][danling.data.DataResumeError] instead of silently training on a
  different stream. So does a mid-pass resume whose loader cannot restore its position (a plain
  `DataLoader`); a position that can be restored but not fingerprinted (iterable datasets,
  samplers that cannot be copied) is logged as a warning.

A checkpoint can also be resumed on another number of data-parallel ranks: the `loop` entry
carries the layout-free data position and global batch that
[`danling.runners.checkpointing.elastic`][] continues from (see "Resuming on a different number
of ranks" in the docs).

Checkpoints written by either backend can be read back whatever backend the runner uses now.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from danling.checkpoint import detect_format, open_checkpoint_reader
from danling.checkpoint.manifest import verification_scope
from danling.optim import LRScheduler, PhaseScheduler
from danling.optim.lr_scheduler import apply_last_lr

from ..update.ema import EMA
from .component import OPTIONAL_RANK_LOCAL_KEYS, RANK_LOCAL_KEYS, CheckpointSource, RunnerCheckpointing, is_path
from .elastic import data_positions, elastic_accum_steps, restore_positions
from .host import TorchCheckpointHost
from .resume import describe_source as _describe
from .resume import loader_fingerprint, position_excluded, restore_loader_positions, shares_data_rank

__all__ = ["RANK_LOCAL_KEYS", "TorchCheckpointing"]

_EXPORT_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
}


# Read on another data-parallel size, the per-rank loader states are left out too: the global
# position in `loop.data` continues the pass instead.
_ELASTIC_OPTIONAL_KEYS = (*OPTIONAL_RANK_LOCAL_KEYS, "dataloaders")
# Checkpoint backends whose runs keep the global batch on another data-parallel size.
_ELASTIC_BACKENDS = ("file", "dcp")


class TorchCheckpointing(RunnerCheckpointing):
    """Torch checkpoint payload, exact-resume state and backend-agnostic reading; `TorchRunner.checkpointing`."""

    host: TorchCheckpointHost

    def __init__(self, host: TorchCheckpointHost, **kwargs: Any) -> None:
        super().__init__(host, **kwargs)
        # Next-batch fingerprints of the training loaders, kept from `load_state_dict` for `load_dataloaders`.
        self._restored_fingerprints: dict[str, Any] | None = None
        # The update strategy's state, kept from `load_state_dict` until the optimizer container is rebound.
        self._restored_update_state: Mapping[str, Any] | None = None
        # Global data positions to continue from, set while a checkpoint of another data-parallel size loads.
        self._elastic_positions: dict[str, Any] | None = None
        # Per-rank micro-batches summed over the data-parallel ranks that one update covers (None: this run's own).
        self._micro_batches_per_update: int | None = None

    @property
    def backend(self) -> str:
        """`checkpoint.backend` with `"auto"` resolved: `"dcp"` for distributed runs and for TorchFT dataloader
        checkpoints (`checkpoint.enable_ft_dataloader_checkpoints`, written with DCP), `"file"` otherwise."""
        checkpoint = self.config.checkpoint
        backend = checkpoint.backend or "auto"
        if backend == "auto":
            return "dcp" if self.host.distributed or checkpoint.enable_ft_dataloader_checkpoints else "file"
        return backend

    @property
    def checkpoint_model(self) -> Any:
        """The module whose weights checkpoints hold and restore: the runner's `model` (a runner with several
        local model parts returns one module over all of them)."""
        return self.host.model

    @property
    def elastic_positions(self) -> dict[str, Any] | None:
        """Global data positions a load on another data-parallel size continues from (`None` otherwise)."""
        return self._elastic_positions

    # ------------------------------------------------------------------ saving
    def state_dict(self, cls: type = dict) -> Mapping:
        """The full payload: `runner_payload` plus the state of every live component (see the runner's hook)."""
        payload = self.runner_payload(cls)
        payload.update((key, live.state_dict()) for key, live in self._live_objects().items())
        return payload

    def runner_payload(self, cls: type = dict) -> Any:
        """The checkpoint payload without the live components: runner state, results, loaders, loop position.

        Called when: by `state_dict` and `checkpoint_payload` on every checkpoint save, on every rank;
            a backend whose engine writes model and optimizer itself (DeepSpeed) saves only this.
        Holds on entry: the runner is built; the loop state is that of the step being saved.
        Side effects: captures the RNG state.
        Overrides must not: drop `loop`, `dataloaders` or `results` (an exact resume needs them); extend the
            returned mapping instead (`payload = super().runner_payload(cls)`).
        """
        host = self.host
        payload = super().state_dict(cls)
        payload["results"] = cls((str(index), row) for index, row in payload["results"].items())
        keep = {*host.train_splits, self.loop_state.split}
        loaders = cls((split, state) for split, state in payload["dataloaders"].items() if split in keep)
        payload["dataloaders"] = loaders
        payload["loop"] = cls(
            **self.loop_state.state_dict(),
            update=host.update.state_dict(),
            data=cls(data_positions(host.dataloaders, loaders)),
            micro_batches_per_update=self.micro_batches_per_update,
        )
        # Per rank, like the loader positions they check.
        dataloaders = host.dataloaders
        payload["fingerprints"] = cls(
            (split, loader_fingerprint(dataloaders.get(split), state)) for split, state in loaders.items()
        )
        # Per rank: the running loss meters and train metrics of a pass this checkpoint interrupts.
        payload["pass_meters"] = self.pass_meters_state()
        payload["backend"] = cls(stack="torch", world_size=host.world_size, checkpoint=self.manager.backend)
        return payload

    def _live_objects(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The runner's live components as stateful objects, restored through the runner's `load_*` hooks.

        Checkpoint managers take them as they are: a save asks each for its `state_dict()`, and an
        in-place load (DCP) reads each one's entries straight into its tensors (a sharded
        parameter receives only its local shard) before the hook gets them. `args`/`kwargs` go to
        `load_model`.
        """
        from danling.checkpoint.training import ModelState, OptimizerState

        host = self.host
        objects: dict[str, Any] = {}
        model = self.checkpoint_model
        if model is not None:
            objects["model"] = _ThroughHook(ModelState(model), lambda state: host.load_model(state, *args, **kwargs))
        if host.optimizer is not None:
            optimizer = OptimizerState(model, host.optimizer, host.update.outside_parameters)
            objects["optimizer"] = _ThroughHook(optimizer, host.load_optimizer)
        if host.ema is not None:
            objects["ema"] = _ThroughHook(ModelState(host.unwrap(host.ema)), host.load_ema)
        if host.scheduler is not None:
            objects["scheduler"] = _ThroughHook(host.scheduler, host.load_scheduler)
        return objects

    def checkpoint_payload(self, *, last_step: bool) -> Mapping[str, Any]:
        """The live components and the runner state, or a model-only export for a final save.

        Called when: by the runner's `save_checkpoint` (and so `save_seed_checkpoint`), once per save that is
            written, on every rank.
        Holds on entry: the step being saved has finished; model, optimizer, EMA and scheduler are the live ones.
        Side effects: none: the live objects are handed over as they are and the manager asks each for its state.
        Overrides must not: change any state, or leave out `runner_payload`'s keys from a full save (a resume needs
            them).

        The model-only export (model and EMA weights, cast to `checkpoint.export_dtype` when set) is
        returned for the final save when `checkpoint.last_save_model_only` is set.
        """
        checkpoint, host = self.config.checkpoint, self.host
        if not (last_step and checkpoint.last_save_model_only):
            return {**self.runner_payload(), **self._live_objects()}
        dtype = _EXPORT_DTYPES.get(checkpoint.export_dtype) if checkpoint.export_dtype else None

        def export(state: Mapping[str, Any]) -> dict[str, Any]:
            if dtype is None:
                return dict(state)
            return {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in state.items()}

        payload = {"runner": self.config.dict(), "model": export(host.unwrap(host.model).state_dict())}
        if host.ema is not None:
            payload["ema"] = export(host.unwrap(host.ema).state_dict())
        return payload

    @property
    def micro_batches_per_update(self) -> int:
        """Per-rank micro-batches, summed over the data-parallel ranks, that one optimizer update covers.

        It is data-parallel size x `accum_steps` of the run that started training, and stays so
        when the run is resumed on another number of ranks (elastic resume adjusts `accum_steps`).
        """
        if self._micro_batches_per_update is not None:
            return self._micro_batches_per_update
        return self.host.topology.size("data") * self.host.accum_steps

    # ------------------------------------------------------------------ restoring
    def load_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Restore counters, RNG, results and the loop position of an exact resume (see the runner's hook).

        On another data-parallel size the interrupted pass continues as a new pass over its
        remaining samples, and `accum_steps` is set to keep the global batch (see `_keep_global_batch`).
        When `checkpoint.exclude_from_loading` leaves out the interrupted split's loader position
        (`dataloaders` or `dataloaders.<split>`), that pass restarts from its first batch instead
        (see `_restart_excluded_pass`).
        """
        super().load_state_dict(checkpoint)
        loop = checkpoint.get("loop") or {}
        self.loop_state.load_state_dict(loop)
        self._restored_fingerprints = dict(checkpoint.get("fingerprints") or {})
        self._restored_update_state = loop.get("update")
        self._restored_pass_meters = None
        if not self._restart_excluded_pass():
            self._keep_pass_meters(checkpoint, loop)
        self._keep_global_batch(checkpoint)
        if self.resized(checkpoint):
            # The per-rank positions are not restored: the rest of the pass is dealt anew (or the pass
            # restarts, with `dataloaders` excluded), so its accumulation windows start over too.
            if self.loop_state.accumulator is not None:
                self.loop_state.accumulator.load_state_dict({"total": None, "position": 0})
            if self._elastic_positions is not None:
                self.loop_state.batch = 0  # batches of the dealt remainder, which is a pass of its own

    def _restart_excluded_pass(self) -> bool:
        """Restart the interrupted training pass when its loader position is excluded from loading.

        The loader of that split then starts from the beginning of its data, so continuing the
        pass's batch count, accumulation window and running meters would misplace the pass's end
        and average the interrupted part's batches twice into its row. Instead the pass starts
        over: batch position 0, a new accumulation window, and meters and train metrics that
        restart when the pass opens. `global_step`, the scheduler and the optimizer stay as the
        checkpoint left them (they count updates, and those updates were applied), so the
        restarted pass's updates count on from there. Returns whether the pass restarts.
        """
        position = self.loop_state
        split, done = position.split, position.batch
        if split is None or not done or not position_excluded(split, self.manager.exclude_from_loading):
            return False
        position.batch = 0
        if position.accumulator is not None:  # `start` then opens a new pass rather than continuing this one
            position.accumulator.load_state_dict({"total": None, "position": 0})
        self.host.logger.warning(
            "checkpoint.exclude_from_loading leaves out the loader position of the interrupted %s pass, so the "
            "pass restarts from its first batch: the %d batch(es) it had trained are trained again, its loss "
            "meters, train metrics and accumulation window start over, and global step %d and the scheduler "
            "count on from the checkpoint",
            split,
            done,
            self.state.train.global_step,
        )
        return True

    def _keep_pass_meters(self, checkpoint: Mapping[str, Any], loop: Mapping[str, Any]) -> None:
        """Keep the running meters of the interrupted training pass for the pass to continue when it reopens.

        Only for the same data-parallel layout with one state per rank: on another number of ranks
        (or from a single-file checkpoint, which holds the main process's state only) the pass's
        meters restart, and the row of the interrupted pass averages the batches after the resume.
        """
        split, saved = loop.get("split"), checkpoint.get("pass_meters")
        if split is None or not int(loop.get("batch") or 0):
            return  # not a mid-pass checkpoint (old checkpoints have no `pass_meters` either)
        host = self.host
        single_copy = getattr(self.manager, "backend", None) == "file" and host.topology.size("data") > 1
        shared = shares_data_rank(host.topology, host.world_size)
        if self.resized(checkpoint) or single_copy or shared:
            host.logger.info(
                "the interrupted %s pass restarts its loss meters and train metrics (%s): its row's training values "
                "cover the batches after the resume",
                split,
                "one file for several ranks"
                if single_copy
                else "processes sharing a data-parallel rank"
                if shared
                else "another number of data-parallel ranks",
            )
        elif saved is not None and saved.get("split") == split:
            self._restored_pass_meters = saved

    def _keep_global_batch(self, checkpoint: Mapping[str, Any]) -> None:
        """Set `accum_steps` so that an update covers as many micro-batches as in the run that wrote `checkpoint`."""
        if getattr(self.manager, "backend", None) not in _ELASTIC_BACKENDS:
            return  # an engine's own checkpoints (DeepSpeed) keep their own resize rules
        if "accum_steps" in self.allowed_changes:
            return  # changed on purpose (resume_allow_changes): the configured value is the new global batch
        loop, topology = checkpoint.get("loop") or {}, checkpoint.get("topology") or {}
        reference = loop.get("micro_batches_per_update")
        if reference is None:  # written before the global batch was recorded
            saved_accum = (loop.get("accumulator") or {}).get("accum_steps")
            if topology.get("data_size") is None or saved_accum is None:
                return
            reference = int(topology["data_size"]) * int(saved_accum)
        self._micro_batches_per_update = int(reference)
        host = self.host
        loaders = [host.dataloaders[split] for split in host.train_splits if split in host.dataloaders]
        batch_size = getattr(loaders[0], "batch_size", None) if loaders else None
        configured = int(self.config.accum_steps or 1)
        accum = elastic_accum_steps(int(reference), host.topology.size("data"), configured, batch_size, host.logger)
        if accum != host.accum_steps:
            host._rescale_accumulation(accum)

    def check_resumable_layout(self, payload: Mapping[str, Any], excluded: set[str], source: Any) -> None:
        """Accept a checkpoint of another data-parallel size that records global data positions.

        Its interrupted pass then continues from the global sample count (see
        [`danling.runners.checkpointing.elastic`][]). A checkpoint without them (written before
        elastic resume) is refused as before unless `dataloaders` is excluded from loading.
        """
        self._elastic_positions = None
        positions = (payload.get("loop") or {}).get("data")
        elastic = getattr(self.manager, "backend", None) in _ELASTIC_BACKENDS
        if not (elastic and self.resized(payload)) or "dataloaders" in excluded or positions is None:
            super().check_resumable_layout(payload, excluded, source)
            return
        # A split whose position is excluded (`dataloaders.<split>`) restarts its pass rather than continuing it.
        excluded_keys = self.manager.exclude_from_loading
        positions = {split: pos for split, pos in positions.items() if not position_excluded(split, excluded_keys)}
        self._elastic_positions = positions
        self.host.logger.warning(
            "resuming checkpoint %s of %s data-parallel ranks on %d: each training pass continues from the "
            "samples consumed over all ranks %s; per-rank RNG state is re-seeded",
            _describe(source),
            payload["topology"].get("data_size"),
            self.host.topology.size("data"),
            {split: position.get("samples_consumed") for split, position in positions.items()},
        )

    def load(self, checkpoint: CheckpointSource, *args: Any, **kwargs: Any) -> None:
        """Restore a full checkpoint, then rebind the optimizer container to the restored optimizer and scheduler.

        With `resume_allow_changes`, the `optim.*` and `scheduler.*` keys that differ from the
        checkpoint's run keep this run's values (see `_ConfiguredOptimization`).
        """
        self._restored_fingerprints = None
        host = self.host
        configured = _ConfiguredOptimization(host.optimizer, host.scheduler)
        try:
            with verification_scope():  # the state and the in-place components read one directory: hash it once
                super().load(checkpoint, *args, **kwargs)
        finally:
            update_state, self._restored_update_state = self._restored_update_state, None
            self._restored_fingerprints = self._elastic_positions = None
        configured.keep_changed(host.optimizer, host.scheduler, self.allowed_changes, host.logger)
        # The same optimizer object: the parameters outside its model found when it was bound still hold.
        host.update.bind(host.optimizer, host.scheduler, host.scheduler_interval, host.update.outside_parameters)
        if update_state:
            host.update.load_state_dict(update_state)

    def load_pretrained(self, checkpoint: CheckpointSource, *args: Any, **kwargs: Any) -> None:
        """Load model weights only, EMA preferred; the run's EMA copy, when it keeps one, restarts from them.

        The EMA was copied from the initial weights when the model was built; left there, the
        evaluations of a fine-tune (which run on the EMA) would score a mostly untrained model for
        the first ~1 / (1 - decay) updates.
        """
        super().load_pretrained(checkpoint, *args, **kwargs)
        if isinstance(self.host.ema, EMA):
            with self.ema_source() as source:
                self.host.ema.reset(source)

    @contextlib.contextmanager
    def ema_source(self) -> Iterator[Any]:
        """The module the runner's EMA follows, readable for the block (a backend may gather it first).

        Called when: by `load_pretrained`, after the weights are loaded, to restart the EMA from them.
        Holds on entry: the runner keeps an `EMA` and its model is built.
        Side effects: none here; a backend override may gather partitioned parameters for the block.
        Overrides must not: yield a copy (the EMA must read the live weights) or keep the gather open after it.
        """
        ema = self.host.ema
        yield ema.live if ema.live is not None else self.host.unwrap(self.host.model)

    def load_model(self, state_dict: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        """Load weights keyed by parameter name into the runner's model, whatever wrapper it has."""
        from danling.checkpoint.dcp import set_training_state

        if self.host.model is None:
            raise ValueError("cannot load model weights: self.model is not set")
        strict = kwargs.pop("strict", args[0] if args else True)
        state_dict = self._keep_excluded_weights(state_dict, "model", self.checkpoint_model)
        set_training_state(self.checkpoint_model, None, {"model": state_dict}, strict=strict)

    def load_ema(self, state_dict: Mapping[str, Any] | None, *args: Any, **kwargs: Any) -> None:
        """Load EMA weights; those a dotted `exclude_from_loading` key names (`ema.head`, and `model.head`
        too: an average of the old head beside a new one would evaluate the old) keep their values."""
        if state_dict is not None and self.host.ema is not None:
            module = self.host.unwrap(self.host.ema)
            state_dict = self._keep_excluded_weights(state_dict, ("ema", "model"), module)
        super().load_ema(state_dict, *args, **kwargs)

    def _excluded_names(self, parts: tuple[str, ...]) -> list[str]:
        """The module names that dotted `exclude_from_loading` keys of `parts` name (`model.head`: `head`)."""
        prefixes = tuple(part + "." for part in parts)
        return [key.split(".", 1)[1] for key in self.manager.exclude_from_loading if key.startswith(prefixes)]

    def _keep_excluded_weights(
        self, state_dict: Mapping[str, Any], parts: str | tuple[str, ...], module: Any
    ) -> Mapping[str, Any]:
        """`state_dict` with the entries a dotted `exclude_from_loading` key of `parts` names
        (`model.head`, `model.head.weight` for `"model"`) taken from the live `module`: those weights
        keep their current values, while strict loading still refuses any other entry the checkpoint lacks."""
        names = self._excluded_names((parts,) if isinstance(parts, str) else parts)
        if not names:
            return state_dict
        from danling.checkpoint.training import ModelState

        live = ModelState(module).state_dict()
        kept = {key: value for key, value in live.items() if any(key == n or key.startswith(n + ".") for n in names)}
        return {**state_dict, **kept}

    def load_optimizer(self, state_dict: Mapping[str, Any] | None, *args: Any, **kwargs: Any) -> None:
        """Load optimizer state keyed by parameter name (or torch's positional layout) into the runner's optimizer."""
        from danling.checkpoint.training import OptimizerState

        optimizer = self.host.optimizer
        if state_dict is None or optimizer is None:
            return
        if "optim.type" in self.allowed_changes:
            # Another algorithm's state (SGD's momentum buffers for AdamW's moments) cannot be continued.
            self.host.logger.warning(
                "resume_allow_changes: optim.type changed, so the optimizer state of the checkpoint is not loaded; "
                "%s starts afresh",
                type(optimizer).__name__,
            )
            return
        groups = state_dict.get("param_groups") or []
        if groups and all(isinstance(param, int) for group in groups for param in group["params"]):
            optimizer.load_state_dict(state_dict)  # written by optimizer.state_dict() itself
            self._forget_excluded_state(optimizer)
            return
        live = OptimizerState(self.checkpoint_model, optimizer, self.host.update.outside_parameters)
        live.load_state_dict(state_dict)
        self._forget_excluded_state(optimizer)

    def _forget_excluded_state(self, optimizer: Any) -> None:
        # Weights a dotted `model.*` exclusion keeps fresh start with a fresh optimizer state too:
        # the checkpoint's moments and step count belong to the weights that were not loaded.
        names = self._excluded_names(("model",))
        if not names:
            return
        for name, param in self.checkpoint_model.named_parameters():
            if any(name == n or name.startswith(n + ".") for n in names):
                optimizer.state.pop(param, None)

    def load_dataloaders(self, state_dict: Mapping[str, Any] | None) -> None:
        """Restore loader progress after checking each loader against the fingerprint in the checkpoint."""
        host = self.host
        cursor = self.loop_state.split
        if self._elastic_positions is not None:  # another data-parallel size: per-rank states describe old shards
            excluded = self.manager.exclude_from_loading  # `dataloaders.<split>`: that split starts afresh
            train = {
                split: host.dataloaders[split]
                for split in host.train_splits
                if split in host.dataloaders and not position_excluded(split, excluded)
            }
            restore_positions(train, self._elastic_positions, cursor, self.config.seed)
            return
        restore_loader_positions(
            host.dataloaders,
            dict(state_dict or {}),
            self._restored_fingerprints or {},
            cursor=cursor,
            seed=self.config.seed,
            excluded=self.manager.exclude_from_loading,
            logger=host.logger,
        )

    # ------------------------------------------------------------------ in-place restore (DCP)
    def in_place_components(self, checkpoint: CheckpointSource, excluded: set[str]) -> tuple[str, ...]:
        """Model, optimizer, EMA and scheduler of a DCP checkpoint load straight into the live objects.

        Called when: first by the runner's `load_checkpoint`, once per restore, on every rank.
        Holds on entry: `excluded` holds the top-level keys of `checkpoint.exclude_from_loading`.
        Side effects: none: it only inspects the checkpoint's format.
        Overrides must not: answer differently on different ranks (the DCP read that follows is collective).
        """
        if not is_path(checkpoint) or detect_format(self.manager.resolve(checkpoint)) != "dcp":
            return ()
        return tuple(key for key in self._live_objects() if key not in excluded)

    def _dcp_reader(self, directory: Path, exclude: Any, **options: Any) -> Any:
        from danling.checkpoint.dcp import TorchDistributedCheckpointManager

        options |= self.reader_options("dcp")
        logger = self.manager.logger
        return TorchDistributedCheckpointManager(
            directory, load_only=True, exclude_from_loading=exclude, logger=logger, **options
        )

    def read_restore_payload(self, checkpoint: CheckpointSource, in_place: tuple[str, ...], map_location: Any) -> Any:
        """The plain entries of a DCP checkpoint, without the components restored in place.

        Called when: by the runner's `load_checkpoint`, once per restore, right after `in_place_components`, on every
            rank.
        Holds on entry: `in_place` lists what `restore_in_place` will read into the live objects.
        Side effects: reads and verifies this rank's share of the checkpoint files; changes nothing on the runner.
        Overrides must not: read the in-place components into memory, or skip a rank (verification is shared out over
            ranks).

        Every rank restores, so each verifies a share of the files (see `danling.checkpoint._dcp_shared`)
        and `restore_in_place` later finds them all verified.
        """
        if not in_place:
            return super().read_restore_payload(checkpoint, in_place, map_location)
        path = self.manager.resolve(checkpoint)
        exclude = [*self._load_excludes(), *in_place]
        reader = self._dcp_reader(path.parent, exclude, verify_together=True)
        return reader.load(path, map_location=map_location)

    def restore_in_place(
        self, checkpoint: CheckpointSource, keys: tuple[str, ...], map_location: Any, *args: Any, **kwargs: Any
    ) -> None:
        """Read the listed components of a DCP checkpoint straight into the live model, optimizer, EMA and scheduler.

        Called when: by the runner's `load_checkpoint`, once per restore of a DCP checkpoint, after `load_state_dict`,
            on every rank.
        Holds on entry: every check has passed; the counters, RNG and results are restored.
        Side effects: loads the listed components into the live model, optimizer, EMA and scheduler through the
            runner's `load_*` hooks.
        Overrides must not: restore keys not in `keys`, or skip a rank (the DCP read is collective).
        """
        path = self.manager.resolve(checkpoint)
        objects = {key: live for key, live in self._live_objects(*args, **kwargs).items() if key in keys}
        reader = self._dcp_reader(path.parent, self._load_excludes())
        reader.load_into(path, objects, map_location=map_location)

    def _load_excludes(self) -> list[str]:
        """`exclude_from_loading`, with `ema.X` for every `model.X` (see `load_ema`): a DCP read in place
        must leave those EMA weights alone, since nothing could take their values back afterwards."""
        excluded = list(self.manager.exclude_from_loading)
        return excluded + [f"ema.{name}" for name in self._excluded_names(("model",)) if f"ema.{name}" not in excluded]

    # ------------------------------------------------------------------ reading
    def read(self, checkpoint: CheckpointSource, *args: Any, **kwargs: Any) -> Mapping[str, Any]:
        """Payload of a mapping, bytes, alias or path of any registered format, whatever the current backend.

        The format comes from the checkpoint registry ([`detect_format`][danling.checkpoint.detect_format]);
        the runner's own manager reads its own format, and a reader of the other format is opened for the rest.
        """
        if not is_path(checkpoint):
            return super().read(checkpoint, *args, **kwargs)
        manager = self.manager
        path = manager.resolve(checkpoint)
        reader = open_checkpoint_reader(path, manager=manager, **self.reader_options(detect_format(path)))
        return reader.load(path, map_location=kwargs.get("map_location", "cpu"))

    def reader_options(self, name: str) -> dict[str, Any]:
        """Options of a checkpoint reader of format `name`: a DCP reader takes this rank's place in the data domain."""
        trusted = {"trusted": bool(self.config.checkpoint.trust_pickle)}
        if name != "dcp":
            return trusted
        topology = self.host.topology
        return trusted | {
            "rank_local_keys": RANK_LOCAL_KEYS,
            "optional_rank_local_keys": _ELASTIC_OPTIONAL_KEYS,
            "data_rank": topology.rank("data"),
            "data_size": topology.size("data"),
        }


# Scheduler entries that record how far the schedule has come (restored); the others are its settings.
_SCHEDULER_PROGRESS = frozenset(
    ("last_epoch", "_step_count", "_last_lr", "base_lrs", "_get_lr_called_within_step", "_is_initial")
    + ("best", "num_bad_epochs", "cooldown_counter")  # ReduceLROnPlateau's
)
_LR_KEYS = ("lr", "initial_lr")


class _ConfiguredOptimization:
    """The optimizer and scheduler settings this run was built with, taken before a checkpoint loads.

    A checkpoint's optimizer state carries its run's hyperparameters in every parameter group and its
    scheduler state carries the scheduler's settings and initial learning rates, so loading them
    brings back the saved run's values. When `resume_allow_changes` accepted a changed `optim.*` or
    `scheduler.*` key, `keep_changed` puts this run's values back: the changed hyperparameters, the
    new initial learning rates (the schedule continues from its saved step at the new rate) and the
    changed scheduler settings. Without it a changed `optim.lr` was reported as "now 0.001" and
    trained at the saved rate.
    """

    def __init__(self, optimizer: Any, scheduler: Any) -> None:
        groups = getattr(optimizer, "param_groups", None) or []
        # Copies: a tensor learning rate is filled in place by the restore.
        self.groups = [{key: _copy(value) for key, value in dict(g, params=None).items()} for g in groups]
        self.scheduler = scheduler
        state = scheduler.state_dict() if callable(getattr(scheduler, "state_dict", None)) else {}
        self.settings = {key: value for key, value in state.items() if key not in _SCHEDULER_PROGRESS}

    def keep_changed(self, optimizer: Any, scheduler: Any, changes: tuple[str, ...], logger: Any) -> None:
        optim = [key for key in changes if key.startswith("optim.")]
        sched = [key for key in changes if key.split(".", 1)[0] in ("sched", "scheduler")]
        if not (optim or sched) or len(self.groups) != len(getattr(optimizer, "param_groups", None) or []):
            return
        if sched and scheduler is self.scheduler:  # (an elastic resume rebuilds it from the config already)
            scheduler.__dict__.update(self.settings)
        if optim:
            self._keep_hyperparameters(optimizer, optim)
        if scheduler is None:
            if optim:
                for group, configured in zip(optimizer.param_groups, self.groups):
                    _set_lr(group, configured["lr"])
            return
        bases = [configured.get("initial_lr", configured["lr"]) for configured in self.groups]
        saved_bases = list(getattr(scheduler, "base_lrs", None) or [])
        if optim and not saved_bases:
            logger.warning(
                "resume_allow_changes: %s keeps no initial learning rate to replace, so the learning rate "
                "continues from the checkpoint's (%s); optim.* changes other than the rate apply",
                type(scheduler).__name__,
                scheduler.get_last_lr() if callable(getattr(scheduler, "get_last_lr", None)) else "unknown",
            )
            return
        if optim:
            scheduler.base_lrs = list(bases)
            for group, base in zip(optimizer.param_groups, bases):
                group["initial_lr"] = base
        if isinstance(scheduler, (LRScheduler, PhaseScheduler)):  # closed form: the rate of the saved step
            scheduler._last_lr = scheduler.get_lr()
        elif optim:  # a recursive torch schedule: scale the rate it reached by the change of its initial rate
            scheduler._last_lr = [
                float(lr) * float(new) / float(old) if float(old) else float(new)
                for lr, new, old in zip(scheduler.get_last_lr(), bases, saved_bases)
            ]
        apply_last_lr(scheduler)
        if optim:  # after any "schedule rebuilt" warning, which computed its rate from the saved initial rates
            logger.warning(
                "resume_allow_changes: the schedule continues from step %s with initial learning rates %s: "
                "the next update uses %s",
                getattr(scheduler, "last_epoch", "?"),
                [float(base) for base in bases],
                [float(lr) for lr in scheduler.get_last_lr()],
            )

    def _keep_hyperparameters(self, optimizer: Any, changes: list[str]) -> None:
        rebuilt = "optim.type" in changes or any(key.startswith("optim.param_groups") for key in changes)
        for group, configured in zip(optimizer.param_groups, self.groups):
            if rebuilt:
                for key in [key for key in group if key not in configured]:
                    del group[key]
            for key, value in configured.items():
                if key != "params" and key not in _LR_KEYS and (rebuilt or f"optim.{key}" in changes):
                    group[key] = value


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _set_lr(group: dict[str, Any], lr: Any) -> None:
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(float(lr))
    else:
        group["lr"] = lr


class _ThroughHook:
    """A live component whose restore goes through the runner's `load_*` hook (overrides apply)."""

    def __init__(self, source: Any, load: Any) -> None:
        self.source, self.load = source, load

    def state_dict(self) -> Any:
        return self.source.state_dict()

    def state_dict_to_load(self) -> Any:
        to_load = getattr(self.source, "state_dict_to_load", None)
        return to_load() if callable(to_load) else self.source.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        self.load(state_dict)
