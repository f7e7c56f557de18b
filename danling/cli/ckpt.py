"""`danling ckpt PATH`: what a checkpoint holds, read without a runner and without running its code.

A `torch.save` payload is loaded with `weights_only=True` (tensors, containers and plain values;
a pickled class or function is refused, never called). A DCP checkpoint is described from its
`.metadata` index alone, read with an unpickler that only admits DCP's own metadata classes,
`torch.Size`, dtypes and paths; no tensor data is loaded.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from danling.utils.io import dumps_strict

from .records import CLIError, _read_json, is_run_dir
from .runs import format_table

__all__ = ["inspect_checkpoint", "ckpt_command", "resolve_checkpoint"]


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint `path` names: a checkpoint directory or file, an alias (`best.pointer`, or
    `best` for short, as `from_checkpoint` takes it), a checkpoint directory of a manager (its
    `latest`), or a run directory (its latest checkpoint)."""
    from danling.checkpoint.layout import POINTER_SUFFIX, follow_pointer
    from danling.checkpoint.manifest import CheckpointError

    target = Path(path)
    alias = target.with_name(target.name + POINTER_SUFFIX)
    if not target.exists() and alias.is_file():  # `checkpoints/best` names the alias `best.pointer`
        target = alias
    if not target.exists():
        raise CLIError(f"{os.fspath(target)} does not exist")
    if target.is_dir() and is_run_dir(target):
        # a damaged metadata.json (a run killed while writing it) still leaves its checkpoints readable
        metadata = _read_json(target / "metadata.json")
        config = metadata.get("config") if isinstance(metadata, dict) else None
        section = config.get("checkpoint") if isinstance(config, dict) else None
        target = target / str((section.get("dir_name") if isinstance(section, dict) else None) or "checkpoints")
        if not target.is_dir():
            raise CLIError(f"{os.fspath(path)} is a run directory without checkpoints ({target} does not exist)")
    if target.is_dir() and (target / f"latest{POINTER_SUFFIX}").is_file():
        target = target / f"latest{POINTER_SUFFIX}"
    if target.is_file() and target.name.endswith(POINTER_SUFFIX):
        try:
            return follow_pointer(target)
        except CheckpointError as err:
            raise CLIError(str(err)) from None
    if target.is_file() and (target.parent / "manifest.json").is_file():
        return target.parent
    return target


def _dcp_contents(directory: Path) -> dict[str, dict[str, int]]:
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from danling.checkpoint.unpickling import UnsafePickleError, read_dcp_metadata

    try:
        metadata = read_dcp_metadata(directory / ".metadata")
    except UnsafePickleError as err:
        raise CLIError(str(err)) from None
    components: dict[str, dict[str, int]] = {}
    for key, entry in metadata.state_dict_metadata.items():
        counts = components.setdefault(key.split(".", 1)[0], {"tensors": 0, "bytes": 0, "objects": 0})
        if isinstance(entry, TensorStorageMetadata):
            itemsize = torch.empty((), dtype=entry.properties.dtype).element_size()
            counts["tensors"] += 1
            counts["bytes"] += int(torch.Size(entry.size).numel()) * itemsize
        else:
            counts["objects"] += 1
    return components


def _file_contents(file: Path) -> tuple[dict[str, dict[str, int]], dict[str, Any]]:
    import torch

    try:
        # mmap (tensors stay on disk until touched) only works for the zip format of torch.save
        payload = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    except Exception as err:
        # torch's message is a paragraph; the reason is the first line after "WeightsUnpickler error:"
        text = str(err).split("WeightsUnpickler error:", 1)[-1]
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        reason = lines[0] if lines else repr(err)
        raise CLIError(f"{file} cannot be read with weights_only=True, and its code is never run: {reason}") from None
    if not isinstance(payload, Mapping):
        payload = {"<payload>": payload}
    components = {}
    for key, value in payload.items():
        counts = {"tensors": 0, "bytes": 0, "objects": 0}
        _count(value, counts)
        components[str(key)] = counts
    return components, payload


def _count(value: Any, counts: dict[str, int]) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        counts["tensors"] += 1
        counts["bytes"] += value.numel() * value.element_size()
    elif isinstance(value, Mapping):
        for item in value.values():
            _count(item, counts)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _count(item, counts)
    else:
        counts["objects"] += 1


def _verify(directory: Path) -> dict[str, Any]:
    from danling.checkpoint.manifest import MANIFEST_NAME, CheckpointError, verify_directory

    if not (directory / MANIFEST_NAME).is_file():
        return {"ok": None, "message": "no manifest.json: nothing to verify (not written by a danling manager)"}
    try:
        manifest = verify_directory(directory)
    except CheckpointError as err:
        return {"ok": False, "message": str(err)}
    files = manifest["files"]
    size = sum(entry["size"] for entry in files.values())
    return {"ok": True, "message": f"{len(files)} file(s), {size} bytes: sizes and checksums match the manifest"}


def _progress(manifest_meta: Mapping[str, Any], payload: Mapping[str, Any] | None) -> tuple[Any, Any]:
    step, epoch = manifest_meta.get("global_step"), manifest_meta.get("epoch")
    train = ((payload or {}).get("state") or {}).get("train") if isinstance(payload, Mapping) else None
    if isinstance(train, Mapping):
        step = train.get("global_step", step) if step is None else step
        epoch = train.get("epoch", epoch) if epoch is None else epoch
    return step, epoch


def inspect_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Describe the checkpoint at `path` (see `resolve_checkpoint` for what `path` may be).

    Returns:
        `path`, `name`, `format`, `created`, `step`, `epoch`, `components` (per top-level key:
        tensor count, tensor bytes, other objects), totals and `verification` (`ok` is True,
        False, or None without a manifest).

    Raises:
        CLIError: `path` is not a checkpoint of a known format, or cannot be read safely.
    """
    from danling.checkpoint.formats import detect_format
    from danling.checkpoint.manifest import CheckpointError

    target = resolve_checkpoint(path)
    try:
        backend = detect_format(target)
    except CheckpointError as err:
        raise CLIError(str(err)) from None
    directory = target if target.is_dir() else target.parent
    manifest = {}
    if (directory / "manifest.json").is_file():
        manifest = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
    verification = _verify(directory)
    payload, components = None, {}
    if verification["ok"] is False:
        pass  # a corrupt payload is not unpickled: the verification result is the answer
    elif backend == "dcp":
        components = _dcp_contents(directory)
    elif backend == "file":
        file = target / "state.pt" if target.is_dir() else target
        components, payload = _file_contents(file)
    else:
        components = {key: {"tensors": 0, "bytes": 0, "objects": 0} for key in manifest.get("files", {})}
    step, epoch = _progress(manifest.get("metadata") or {}, payload)
    created = manifest.get("created_ns")
    return {
        "path": str(target),
        "name": manifest.get("name") or target.name,
        "format": backend,
        "created": None if created is None else datetime.fromtimestamp(created / 1e9, timezone.utc).isoformat(),
        "step": step,
        "epoch": epoch,
        "components": components,
        "tensors": sum(c["tensors"] for c in components.values()),
        "bytes": sum(c["bytes"] for c in components.values()),
        "verification": verification,
    }


def _size(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return str(count)


def ckpt_command(path: str, as_json: bool, out: TextIO) -> int:
    """Print what the checkpoint at `path` holds; exit status 1 when verification fails."""
    info = inspect_checkpoint(path)
    status = 1 if info["verification"]["ok"] is False else 0
    if as_json:
        out.write(dumps_strict(info, indent=2, default=str) + "\n")
        return status
    verdict = {True: "ok", False: "FAILED", None: "skipped"}[info["verification"]["ok"]]
    out.write(
        f"checkpoint: {info['path']}\nformat:     {info['format']}\ncreated:    {info['created'] or '-'}\n"
        f"step:       {info['step'] if info['step'] is not None else '-'}\n"
        f"epoch:      {info['epoch'] if info['epoch'] is not None else '-'}\n"
        f"tensors:    {info['tensors']} ({_size(info['bytes'])})\n"
        f"manifest:   {verdict}: {info['verification']['message']}\n\n"
    )
    rows = [[key, str(c["tensors"]), _size(c["bytes"]), str(c["objects"])] for key, c in info["components"].items()]
    out.write(format_table(["component", "tensors", "bytes", "other values"], rows) + "\n")
    return status
