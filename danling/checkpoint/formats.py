"""One registry of on-disk checkpoint formats: tell what a path holds and open a reader for it.

Each format has a name (the `backend` its manager writes into the manifest), a `detect`
predicate over paths, and a factory building its manager. A checkpoint directory's manifest
names the format that wrote it; paths without a usable manifest (a plain `torch.save` file, a
DCP directory from elsewhere) go through the `detect` predicates, the most recently registered
first, so a specific format registered later is tried before the built-in ones. Built in:

- ``"dcp"``: a directory holding DCP's ``.metadata`` (or a file inside one);
- ``"file"``: a directory holding ``state.pt``, or any other file (a plain `torch.save` file).

Examples:
    >>> import tempfile
    >>> from danling.checkpoint import FileCheckpointManager
    >>> path = FileCheckpointManager(tempfile.mkdtemp()).save({"step": 1}, "step-000001")
    >>> detect_format(path), detect_format(path.parent / "latest.pointer")
    ('file', 'file')
    >>> read_checkpoint(path)
    {'step': 1}
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base import CheckpointManager
from .file import FileCheckpointManager, _torch_load
from .layout import POINTER_SUFFIX, follow_pointer
from .manifest import CheckpointError, CheckpointNotFoundError, read_manifest

__all__ = [
    "CheckpointFormat",
    "register_format",
    "unregister_format",
    "checkpoint_formats",
    "detect_format",
    "open_checkpoint_reader",
    "read_checkpoint",
]


@dataclass(frozen=True)
class CheckpointFormat:
    """A registered checkpoint format.

    Attributes:
        name: The format's name, as its manager writes it into manifests (`backend`).
        detect: Whether a path (a checkpoint directory or a file, pointers already followed)
            holds this format.
        manager: Builds a manager for the format: ``manager(directory, **options)``.
        reader: Optional ``reader(path, *, map_location, trusted)`` for
            [`read_checkpoint`][danling.checkpoint.read_checkpoint], when reading without a manager
            needs more than ``manager(...).load(path)``.
    """

    name: str
    detect: Callable[[Path], bool]
    manager: Callable[..., CheckpointManager]
    reader: Callable[..., dict[str, Any]] | None = None


_FORMATS: dict[str, CheckpointFormat] = {}


def register_format(
    name: str,
    *,
    detect: Callable[[Path], bool],
    manager: Callable[..., CheckpointManager],
    reader: Callable[..., dict[str, Any]] | None = None,
    replace: bool = False,
) -> CheckpointFormat:
    """Register a checkpoint format; later registrations are detected first.

    Args:
        name: Format name, equal to the `backend` its manager writes into manifests.
        detect: Predicate over paths (directory or file; pointers are followed before it is called).
        manager: Factory ``manager(directory, **options)`` returning a
            [`CheckpointManager`][danling.checkpoint.CheckpointManager] that reads the format.
        reader: Optional reader used by [`read_checkpoint`][danling.checkpoint.read_checkpoint].
        replace: Allow replacing a format registered under the same name.

    Raises:
        ValueError: `name` is taken (and `replace` is not set) or is not a non-empty string.
        TypeError: `detect`, `manager` or `reader` is not callable.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"checkpoint format name must be a non-empty string, got {name!r}")
    if name in _FORMATS and not replace:
        raise ValueError(f"checkpoint format {name!r} is already registered; pass replace=True to replace it")
    for label, value in (("detect", detect), ("manager", manager), ("reader", reader)):
        if value is not None and not callable(value):
            raise TypeError(f"register_format({name!r}): {label} must be callable, got {type(value).__name__}")
    _FORMATS.pop(name, None)
    _FORMATS[name] = CheckpointFormat(name, detect, manager, reader)
    return _FORMATS[name]


def unregister_format(name: str) -> CheckpointFormat:
    """Remove a registered format and return it; `KeyError` naming the known formats if absent."""
    if name not in _FORMATS:
        raise KeyError(f"no checkpoint format {name!r} is registered; known formats: {checkpoint_formats()}")
    return _FORMATS.pop(name)


def checkpoint_formats() -> tuple[str, ...]:
    """Names of the registered formats, in the order detection tries them."""
    return tuple(reversed(_FORMATS))


def _target(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"no checkpoint at {path}: the path does not exist")
    if path.is_file() and path.name.endswith(POINTER_SUFFIX):
        return follow_pointer(path)
    return path


def _manifest_backend(path: Path) -> str | None:
    directory = path if path.is_dir() else path.parent
    try:
        return read_manifest(directory).get("backend")
    except CheckpointError:
        return None


def detect_format(path: str | os.PathLike) -> str:
    """Name of the format of the checkpoint at `path` (directory, ``*.pointer`` file, or file).

    Raises:
        CheckpointNotFoundError: Nothing exists at `path`, or a pointer names nothing.
        CheckpointError: No registered format recognises it (the message lists the known formats).
    """
    target = _target(path)
    backend = _manifest_backend(target)
    if backend in _FORMATS:
        return backend
    for name in checkpoint_formats():
        if _FORMATS[name].detect(target):
            return name
    known = ", ".join(checkpoint_formats())
    raise CheckpointError(
        f"{os.fspath(path)} is not a checkpoint of any known format (known formats: {known}); "
        "register its format with danling.checkpoint.register_format"
    )


def open_checkpoint_reader(
    path: str | os.PathLike, *, manager: CheckpointManager | None = None, **options: Any
) -> CheckpointManager:
    """A manager that reads the checkpoint at `path`, whatever its format.

    Args:
        path: Checkpoint directory, ``*.pointer`` file, or file (resolve aliases such as
            ``"latest"`` with a manager's `resolve` first).
        manager: A manager in use: returned as it is when it reads this format; otherwise its
            `exclude_from_loading` and logger carry over to the new reader.
        **options: Manager options for a new reader (``exclude_from_loading``, backend options).

    Returns:
        A load-only manager (or `manager`); call `load(path)` or `load_into(path, objects)` on it.
    """
    name = detect_format(path)
    if manager is not None and manager.backend == name:
        return manager
    if manager is not None:
        inherited = {"exclude_from_loading": manager.exclude_from_loading, "logger": manager.logger}
        options = {**inherited, "trusted": manager.trusted, **options}
    options["load_only"] = True
    return _FORMATS[name].manager(Path(path).parent, **options)


def read_checkpoint(
    checkpoint: Mapping[str, Any] | bytes | str | os.PathLike, *, map_location: Any = "cpu", trusted: bool = False
) -> dict[str, Any]:
    """Load a checkpoint payload of any registered format without keeping a manager around.

    Directories and files inside a checkpoint are verified against the manifest first; pointer
    files (`latest.pointer`) are followed; a plain `torch.save` file with no manifest is loaded
    as is; bytes are unpickled with `torch.load`; a mapping is returned as a shallow `dict` copy.
    Pickled data is read with the restricted unpickler of [`danling.checkpoint.unpickling`][]
    (no code stored in the file runs) unless `trusted` is set.
    A DCP checkpoint is read whole, per-rank entries as this rank's copy (rank 0 outside a
    process group; see [`read_dcp_checkpoint`][danling.checkpoint.dcp.read_dcp_checkpoint]).

    Examples:
        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory()
        >>> path = FileCheckpointManager(tmp.name).save({"step": 7}, "step-000007")
        >>> read_checkpoint(path)["step"], read_checkpoint(path.parent / "latest.pointer")["step"]
        (7, 7)
        >>> read_checkpoint({"step": 1})
        {'step': 1}
        >>> tmp.cleanup()
    """
    if isinstance(checkpoint, Mapping):
        return dict(checkpoint)
    if isinstance(checkpoint, (str, os.PathLike)):
        fmt = _FORMATS[detect_format(checkpoint)]
        if fmt.reader is not None:
            return fmt.reader(checkpoint, map_location=map_location, trusted=trusted)
        return open_checkpoint_reader(checkpoint, trusted=trusted).load(checkpoint, map_location=map_location)
    if not isinstance(checkpoint, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"read_checkpoint() accepts a mapping, bytes or a path, got {type(checkpoint).__name__}: {checkpoint!r}"
        )
    payload = _torch_load(io.BytesIO(bytes(checkpoint)), map_location, "<bytes>", trusted)
    if not isinstance(payload, dict):
        raise CheckpointError(f"checkpoint <bytes> holds a {type(payload).__name__}, expected a mapping")
    return payload


def _is_file_checkpoint(path: Path) -> bool:
    return path.is_file() or (path / FileCheckpointManager.payload_name).is_file()


def _is_dcp_checkpoint(path: Path) -> bool:
    return ((path if path.is_dir() else path.parent) / ".metadata").is_file()


def _dcp_manager(directory: Path, **options: Any) -> CheckpointManager:
    from .dcp import TorchDistributedCheckpointManager  # imports torch.distributed.checkpoint: on first use only

    return TorchDistributedCheckpointManager(directory, **options)


def _dcp_reader(path: str | os.PathLike, *, map_location: Any = "cpu", trusted: bool = False) -> dict[str, Any]:
    from .dcp import read_dcp_checkpoint

    return read_dcp_checkpoint(path, map_location=map_location, trusted=trusted)


register_format("file", detect=_is_file_checkpoint, manager=FileCheckpointManager)
register_format("dcp", detect=_is_dcp_checkpoint, manager=_dcp_manager, reader=_dcp_reader)
