"""Loading a DeepSpeed tag into an engine: the tag asked for, on any data-parallel size, and its fp32 export.

Functions of the engine, the tag directory and explicit settings (no runner):
[`load_tag`][danling.runners.deepspeed.checkpoint.load_tag] wraps `engine.load_checkpoint` so that
exactly the requested tag is loaded (ZeRO-3 without optimizer states through a
[`tag_view`][danling.checkpoint.deepspeed.tag_view], another data-parallel size through DeepSpeed's
universal format), and [`export_fp32`][danling.runners.deepspeed.checkpoint.export_fp32] writes the
merged fp32 weights of a tag as one `torch.save` file.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from danling.checkpoint.manifest import CheckpointError
from danling.distributed import is_distributed

__all__ = ["export_fp32", "load_tag"]


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
