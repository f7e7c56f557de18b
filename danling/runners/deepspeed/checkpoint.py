"""DeepSpeed checkpoints: the runner's checkpointing component, loading a tag into an engine, and its fp32 export.

[`DeepSpeedCheckpointing`][danling.runners.deepspeed.checkpoint.DeepSpeedCheckpointing] is
`DeepSpeedRunner.checkpointing`: the engine writes module, optimizer and its scheduler into a tag
directory, danling's payload holds the rest, and a DeepSpeed tag is restored through the engine's
own loader (any other format loads as for a torch runner).

Functions of the engine, the tag directory and explicit settings (no runner):
[`load_tag`][danling.runners.deepspeed.checkpoint.load_tag] wraps `engine.load_checkpoint` so that
exactly the requested tag is loaded (ZeRO-3 without optimizer states through a
[`tag_view`][danling.checkpoint.deepspeed.tag_view], another data-parallel size through DeepSpeed's
universal format), and [`export_fp32`][danling.runners.deepspeed.checkpoint.export_fp32] writes the
merged fp32 weights of a tag as one `torch.save` file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from danling.checkpoint.manifest import CheckpointError
from danling.distributed import is_distributed

from ..checkpointing.component import CheckpointSource
from ..checkpointing.host import TorchCheckpointHost
from ..checkpointing.torch_state import TorchCheckpointing
from .update import gathered_parameters

__all__ = ["DeepSpeedCheckpointHost", "DeepSpeedCheckpointing", "export_fp32", "load_tag"]


class DeepSpeedCheckpointHost(TorchCheckpointHost, Protocol):
    """The DeepSpeed runner as its checkpointing sees it: the torch host plus who steps the scheduler."""

    @property
    def engine_owns_scheduler(self) -> bool: ...


class DeepSpeedCheckpointing(TorchCheckpointing):
    """Checkpoints written by the engine plus danling's state; `DeepSpeedRunner.checkpointing`."""

    host: DeepSpeedCheckpointHost

    @property
    def backend(self) -> str:
        """Always `"deepspeed"` (`checkpoint.backend` may be `"auto"` or `"deepspeed"`).

        Raises:
            ValueError: `checkpoint.backend` names another backend.
        """
        backend = self.config.checkpoint.backend or "auto"
        if backend not in ("auto", "deepspeed"):
            raise ValueError(
                f"checkpoint.backend={backend!r} is not supported by DeepSpeedRunner; use 'auto' or 'deepspeed'"
            )
        return "deepspeed"

    @contextlib.contextmanager
    def ema_source(self) -> Iterator[Any]:
        """The user's module inside the engine, with ZeRO-3's partitioned parameters gathered for the block."""
        module = self.host.unwrap(self.host.model)
        with gathered_parameters(self.host.model, module.parameters()):
            yield module

    def checkpoint_payload(self, *, last_step: bool) -> Mapping[str, Any]:
        """Danling's state; the engine writes module, optimizer and its scheduler itself.

        Called when: by the runner's `save_checkpoint` (and so `save_seed_checkpoint`), once per save, on every rank.
        Holds on entry: the engine is built and bound to the checkpoint manager; the step being saved has finished.
        Side effects: none.
        Overrides must not: add the module or optimizer state (the engine writes them itself) or change any state.
        """
        host = self.host
        payload = self.runner_payload()
        if host.ema is not None:
            payload["ema"] = host.unwrap(host.ema).state_dict()
        if host.scheduler is not None and not host.engine_owns_scheduler:
            payload["scheduler"] = host.scheduler.state_dict()
        return payload

    def is_engine_source(self, checkpoint: CheckpointSource) -> bool:
        """Whether `checkpoint` names a DeepSpeed tag (a path or alias the manager resolves to one)."""
        if not isinstance(checkpoint, (str, os.PathLike)):
            return False
        from danling.checkpoint import detect_format

        return detect_format(self.manager.resolve(checkpoint)) == "deepspeed"

    def in_place_components(self, checkpoint: CheckpointSource, excluded: set[str]) -> tuple[str, ...]:
        """Model, optimizer and the engine's scheduler of a DeepSpeed tag load through `engine.load_checkpoint`.

        Called when: first by the runner's `load_checkpoint`, once per restore, on every rank.
        Holds on entry: the engine is built; `excluded` holds the top-level keys of `checkpoint.exclude_from_loading`.
        Side effects: none: it only inspects the checkpoint's format.
        Overrides must not: answer differently on different ranks (the engine's load is collective) or drop `model` from
            a DeepSpeed tag.
        """
        if not self.is_engine_source(checkpoint):
            return super().in_place_components(checkpoint, excluded)
        keys = ["model", "optimizer"] + (["scheduler"] if self.host.engine_owns_scheduler else [])
        return tuple(key for key in keys if key not in excluded or key == "model")

    def read_restore_payload(self, checkpoint: CheckpointSource, in_place: tuple[str, ...], map_location: Any) -> Any:
        """Danling's state of a DeepSpeed tag (the engine's files are read later, in place).

        Called when: by the runner's `load_checkpoint`, once per restore, right after `in_place_components`, on every
            rank.
        Holds on entry: `in_place` lists what the engine will load in `restore_in_place`.
        Side effects: reads danling's state; changes nothing on the runner.
        Overrides must not: load the engine's files here (the checks on the payload run first).
        """
        if in_place and self.is_engine_source(checkpoint):
            return self.host.read_checkpoint(checkpoint, map_location=map_location)
        return super().read_restore_payload(checkpoint, in_place, map_location)

    def restore_in_place(
        self, checkpoint: CheckpointSource, keys: tuple[str, ...], map_location: Any, *args: Any, **kwargs: Any
    ) -> None:
        """Load the listed components of a DeepSpeed tag through the engine's own loader.

        Called when: by the runner's `load_checkpoint`, once per restore that lists in-place keys, after
            `load_state_dict`, on every rank.
        Holds on entry: every check has passed; the counters, RNG and results are restored.
        Side effects: loads module, optimizer and the engine's scheduler through `engine.load_checkpoint`, checking the
            saved step.
        Overrides must not: load on some ranks only (the engine's load is collective) or load keys not in `keys`.
        """
        if not self.is_engine_source(checkpoint):
            return super().restore_in_place(checkpoint, keys, map_location, *args, **kwargs)
        self.engine_load(
            self.tag_directory(checkpoint),
            load_optimizer_states="optimizer" in keys,
            load_lr_scheduler_states="scheduler" in keys,
            expected_step=self.state.train.global_step,
        )

    def tag_directory(self, checkpoint: CheckpointSource) -> Path:
        """The tag directory `checkpoint` names (a tag, a file in it, or an alias the manager resolves)."""
        path = self.manager.resolve(checkpoint)
        return path if path.is_dir() else path.parent

    def engine_load(self, tag: Path, *, expected_step: int | None = None, **options: Any) -> None:
        """[`load_tag`][danling.runners.deepspeed.checkpoint.load_tag] of `tag` into the runner's engine."""
        host = self.host
        load_tag(
            host.model,
            tag,
            trust_pickle=self.config.checkpoint.trust_pickle,
            universal_dir=self.manager.directory / ".universal",
            is_main_process=host.is_main_process,
            logger=host.logger,
            expected_step=expected_step,
            **options,
        )


def load_tag(
    engine: Any,
    tag: Path,
    *,
    trust_pickle: Any,
    universal_dir: Path,
    is_main_process: bool,
    logger: logging.Logger,
    expected_step: int | None = None,
    **options: Any,
) -> None:
    """`engine.load_checkpoint` of one tag directory, making sure this tag is the one loaded.

    A ZeRO-3 load without optimizer states goes through a [`tag_view`][danling.checkpoint.deepspeed.tag_view]
    (DeepSpeed would read the weights of its directory's `latest` tag); optimizer partitions of
    another data-parallel size go through DeepSpeed's universal format, converted into `universal_dir`.

    Args:
        engine: The `DeepSpeedEngine`.
        tag: The tag directory.
        trust_pickle: `checkpoint.trust_pickle` (DeepSpeed unpickles; see `restricted_deepspeed_loads`).
        universal_dir: Where a resized load converts the tag (removed afterwards).
        is_main_process: Whether this rank converts.
        logger: Where the conversion is reported.
        expected_step: The global step the tag was saved at, checked against the loaded one.
        **options: `engine.load_checkpoint` options (`load_optimizer_states`, `load_module_only`, ...).

    Raises:
        CheckpointError: the engine loaded nothing, or another tag than `tag` (its recorded step differs).
    """
    from danling.checkpoint.deepspeed import CLIENT_STEP_KEY, restricted_deepspeed_loads, tag_view, zero_data_size

    with_optimizer = options.get("load_optimizer_states", True) and not options.get("load_module_only", False)
    saved = zero_data_size(tag)
    with restricted_deepspeed_loads(trust_pickle):  # DeepSpeed unpickles with no limits
        if with_optimizer and saved is not None and saved != engine.dp_world_size:
            load_path, client = _load_resized(engine, tag, saved, universal_dir, is_main_process, logger, **options)
        elif engine.zero_optimization_stage() >= 3 and not options.get("load_optimizer_states", True):
            with tag_view(tag) as view:
                load_path, client = engine.load_checkpoint(str(view), tag=tag.name, **options)
        else:
            load_path, client = engine.load_checkpoint(str(tag.parent), tag=tag.name, **options)
    if load_path is None:
        raise CheckpointError(f"DeepSpeed could not load checkpoint tag {tag}")
    loaded = (client or {}).get(CLIENT_STEP_KEY)
    if expected_step is not None and loaded is not None and loaded != expected_step:
        raise CheckpointError(
            f"DeepSpeed loaded a checkpoint of global step {loaded} when tag {tag} (step {expected_step}) was requested"
        )


def _load_resized(
    engine: Any, tag: Path, saved: int, root: Path, is_main_process: bool, logger: logging.Logger, **options: Any
) -> tuple[Any, Any]:
    """Load ZeRO partitions of `saved` data-parallel ranks on another number: through DeepSpeed's universal format.

    The main process converts the tag (`ds_to_universal`) into `root`; every rank learns whether
    that worked (one broadcast) before any rank loads, so a failed conversion is the same
    `CheckpointError` everywhere instead of a hang. The engine then loads it with `load_universal`
    switched on for this one call, and the converted copy is removed.
    """
    from danling.checkpoint.deepspeed import convert_to_universal

    error = None
    if is_main_process:
        try:
            shutil.rmtree(root, ignore_errors=True)
            convert_to_universal(tag, root)
        except Exception as exc:  # reported to every rank below
            error = f"{type(exc).__name__}: {exc}"
    if is_distributed():
        message = [error]
        dist.broadcast_object_list(message, src=0)
        error = message[0]
    if error is not None:
        raise CheckpointError(
            f"checkpoint {tag} holds ZeRO partitions of {saved} data-parallel ranks and this run has "
            f"{engine.dp_world_size}; converting it to DeepSpeed's universal format failed: {error}"
        )
    logger.info(
        "checkpoint %s holds ZeRO partitions of %d data-parallel ranks and this run has %d: "
        "converted it to DeepSpeed's universal format, loading it with load_universal",
        tag,
        saved,
        engine.dp_world_size,
    )
    config = engine._config
    previous, config.load_universal_checkpoint = config.load_universal_checkpoint, True
    try:
        result = engine.load_checkpoint(str(root), tag=tag.name, **options)
    finally:
        config.load_universal_checkpoint = previous
    if is_distributed():
        dist.barrier()
    if is_main_process:
        shutil.rmtree(root, ignore_errors=True)
    return result


def export_fp32(tag: Path, file: Path, *, trust_pickle: Any, is_main_process: bool) -> Path:
    """Write the fp32 weights of DeepSpeed tag `tag` as one `torch.save` state dict, usable without DeepSpeed.

    Reads the ZeRO partitions on the main process only (no collective besides a final barrier), so
    it also works after training. Returns `file` (on every rank).
    """
    if is_main_process:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        from danling.checkpoint.deepspeed import restricted_deepspeed_loads

        with restricted_deepspeed_loads(trust_pickle):
            state = get_fp32_state_dict_from_zero_checkpoint(str(tag.parent), tag=tag.name)
        file.parent.mkdir(parents=True, exist_ok=True)
        torch.save(dict(state), file)
    if is_distributed():
        dist.barrier()
    return file
