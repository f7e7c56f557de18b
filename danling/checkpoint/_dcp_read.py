"""Reading a DCP tensor entry straight into the tensor it restores.

DCP stores every tensor entry as a small ``torch.save`` archive inside a ``.distcp`` file, and its
reader loads each archive into a fresh tensor before copying that into the destination: every
byte is copied twice, into memory that has to be allocated first. When the entry is the whole
stored chunk and both sides are plain contiguous CPU tensors of one dtype, the archive's data
record is exactly the destination's bytes, so they can be read into it in one copy.

Only the archive's small pickled header is parsed, by an unpickler that knows the one call a
tensor header makes and nothing else; an entry that does not match in every respect is left to
DCP's own path. The bytes read are those the caller's verification has already checked.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import sys
import warnings
from collections import OrderedDict
from typing import Any

import torch

from .unpickling import SAFE_GLOBALS, torch_load

__all__ = ["read_into"]


class _Header(pickle.Unpickler):
    """Unpickles a one-tensor ``data.pkl`` into its description, building nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _describe
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name.endswith("Storage") and isinstance(getattr(torch, name, None), type):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor header")

    def persistent_load(self, pid: Any) -> Any:
        return pid


def _describe(storage: Any, offset: int, size: Any, stride: Any, *_: Any) -> tuple:
    return storage, offset, tuple(size), tuple(stride)


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for extent in reversed(size):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


@functools.cache
def _storage_dtype(storage_type: Any) -> torch.dtype | None:
    """The dtype of a legacy storage class named in an archive header (`torch.FloatStorage` ...)."""
    with warnings.catch_warnings():  # reading it is fine; torch warns that TypedStorage is deprecated
        warnings.simplefilter("ignore", UserWarning)
        return getattr(storage_type, "dtype", None)


def _data_record(archive: Any, target: torch.Tensor) -> str | None:
    """Name of the record holding `target`'s bytes in row-major order, or None if the entry is anything else."""
    if archive.has_record("byteorder") and archive.get_record("byteorder").decode() != sys.byteorder:
        return None
    found = _Header(io.BytesIO(archive.get_record("data.pkl"))).load()
    if not isinstance(found, tuple) or len(found) != 4 or not isinstance(found[0], tuple) or len(found[0]) != 5:
        return None
    (kind, storage_type, key, _, numel), offset, size, stride = found
    dtype = _storage_dtype(storage_type)
    if kind != "storage" or dtype != target.dtype or offset != 0 or numel != target.numel():
        return None
    if size != tuple(target.shape) or (target.numel() > 1 and stride != _contiguous_strides(size)):
        return None
    name = f"data/{key}"
    if not archive.has_record(name) or archive.get_record_size(name) != target.nbytes:
        return None
    return name


def read_into(file: Any, start: int, length: int, target: torch.Tensor) -> bool:
    """Read the tensor archive at ``[start, start + length)`` of `file` into `target` if it is a plain match.

    Returns:
        Whether `target` now holds the entry; ``False`` leaves it untouched for DCP's own path.
    """
    if type(target) is not torch.Tensor or target.device.type != "cpu" or not target.is_contiguous():
        return False
    if target.is_quantized or target.layout != torch.strided:
        return False
    from torch.distributed.checkpoint.filesystem import _create_file_view

    try:
        archive = torch._C.PyTorchFileReader(_create_file_view(file, start, length))
        name = _data_record(archive, target)
    except (RuntimeError, pickle.UnpicklingError, ValueError, TypeError, EOFError, AttributeError):
        return False  # not an archive this reader understands: DCP's path reads (or refuses) it
    if name is None:
        return False
    begin = start + archive.get_record_offset(name)
    if begin + target.nbytes > start + length:
        return False
    if target.nbytes:
        _pread_into(file.fileno(), target.view(-1).view(torch.uint8).numpy(), begin)
    return True


def _pread_into(fd: int, buffer: Any, position: int) -> None:
    view = memoryview(buffer).cast("B")
    done = 0
    while done < view.nbytes:
        count = os.preadv(fd, [view[done:]], position + done)
        if count <= 0:
            raise OSError(f"unexpected end of checkpoint data at byte {position + done}")
        done += count


NOT_PLAIN = object()
"""What `read_plain` returns for an entry it leaves to `torch.load`."""


_ATOMS = (int, float, bool, str, bytes, complex, type(None))


def read_plain(stream: Any, safe_globals: list, cache: dict[bytes, Any] | None = None) -> Any:
    """Unpickle a non-tensor DCP entry (a ``torch.save`` archive without storages) weights-only.

    It runs the unpickler `torch.load(weights_only=True)` runs, with the same allowed globals, on
    the archive's ``data.pkl`` alone, skipping the rest of `torch.load`'s set-up (most of its cost
    for a small value). An archive holding tensor data, or any error, returns `NOT_PLAIN`: the
    caller's `torch.load` then reads the entry, or refuses it with its own message. With a `cache`
    (one per load, same `safe_globals`), a pickle already unpickled to an immutable scalar is not
    unpickled again: an optimizer stores each hyperparameter once per parameter.
    """
    from torch import _weights_only_unpickler

    try:
        archive = torch._C.PyTorchFileReader(stream)
        if any(name.startswith("data/") for name in archive.get_all_records()):
            return NOT_PLAIN
        if archive.has_record("byteorder") and archive.get_record("byteorder").decode() != sys.byteorder:
            return NOT_PLAIN
        data = archive.get_record("data.pkl")
        if cache is not None and data in cache:
            return cache[data]
        value = _load_without_globals(data)
        if value is _NEEDS_GLOBALS:
            unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(data), encoding="utf-8")
            unpickler.persistent_load = _no_storage
            with torch.serialization.safe_globals(safe_globals):
                value = unpickler.load()
    except Exception:
        stream.seek(0)
        return NOT_PLAIN
    if cache is not None and type(value) in _ATOMS:
        cache[data] = value
    return value


def read_entry(stream: Any, origin: str, trusted: bool, cache: dict[bytes, Any] | None = None) -> Any:
    """A non-tensor DCP entry: `read_plain` (unless `trusted`), and `torch_load` for what it leaves.

    `origin` names the entry in errors; the restricted unpickler's refusal propagates.
    """
    value = NOT_PLAIN if trusted else read_plain(stream, list(SAFE_GLOBALS), cache)
    if value is NOT_PLAIN:
        value = torch_load(stream, map_location="cpu", origin=origin, trusted=trusted)
    return value


_NEEDS_GLOBALS = object()


class _GlobalRefused(Exception):
    pass


class _NoGlobalsUnpickler(pickle.Unpickler):
    """The C unpickler with every global and persistent id refused: what it returns is built from
    atoms, lists, tuples, dicts and sets alone, so it cannot run code. The weights-only unpickler,
    written in Python, takes a few hundred microseconds for what this does in a few (an optimizer
    stores each hyperparameter once per parameter; RNG states are tuples of hundreds of ints)."""

    def find_class(self, module: str, name: str) -> Any:
        raise _GlobalRefused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _GlobalRefused("a persistent id")


def _load_without_globals(data: bytes) -> Any:
    """`data` unpickled when it needs no global, else `_NEEDS_GLOBALS` (the weights-only unpickler decides)."""
    try:
        return _NoGlobalsUnpickler(io.BytesIO(data), encoding="utf-8").load()
    except _GlobalRefused:
        return _NEEDS_GLOBALS


def _no_storage(pid: Any) -> Any:
    raise pickle.UnpicklingError("a plain entry refers to tensor storage")


PACKED = "__danling_packed__"
"""Sub-key under which a tensor-free top-level entry is stored as one archive."""


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(item) for item in value.values())
    if isinstance(value, (list, tuple, set)):
        return any(_holds_tensor(item) for item in value)
    return False


def pack_plain(value: Any) -> Any:
    """Store a non-empty mapping without tensors as one DCP entry instead of one entry per leaf.

    DCP writes and reads every leaf as its own ``torch.save`` archive, which costs far more than
    the value for a config of a hundred small fields. The mapping becomes ``{PACKED: <one
    torch.save archive of it>}``; [`unpack_plain`][danling.checkpoint._dcp_read.unpack_plain] turns it back.
    """
    if not isinstance(value, dict) or not value or _holds_tensor(value):
        return value
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return {PACKED: buffer.getvalue()}


def unpack_plain(payload: dict[str, Any], origin: Any, trusted: bool, safe_globals: list) -> None:
    """Replace each packed top-level entry of `payload` by the mapping it holds (weights-only unless trusted)."""
    from .unpickling import torch_load

    for key, value in payload.items():
        if isinstance(value, dict) and len(value) == 1 and isinstance(value.get(PACKED), bytes):
            stream = io.BytesIO(value[PACKED])
            found = NOT_PLAIN if trusted else read_plain(stream, safe_globals)
            if found is NOT_PLAIN:
                found = torch_load(stream, origin=f"{origin} (entry {key})", trusted=trusted)
            payload[key] = found
