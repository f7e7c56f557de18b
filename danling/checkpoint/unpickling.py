"""Reading pickled data without running its code: one restricted unpickler for every loader.

A pickle can name any importable callable and have it called on load, so a checkpoint from
somewhere else can run code the moment it is read; a manifest does not help (anyone can compute
a SHA-256). Every checkpoint reader of danling therefore goes through this module:

- [`torch_load`][danling.checkpoint.unpickling.torch_load] reads `torch.save` files with
  `weights_only=True` plus [`SAFE_GLOBALS`][danling.checkpoint.unpickling.SAFE_GLOBALS], the few
  plain-data types danling's payloads may hold beyond what torch admits;
- [`restricted_load`][danling.checkpoint.unpickling.restricted_load] reads plain pickles (DCP's
  `.metadata` index, `danling.load("x.pkl")`) with an unpickler that admits containers, plain
  values, NumPy arrays and DCP's metadata classes, and nothing that can run code.

Anything else raises [`UnsafePickleError`][danling.checkpoint.unpickling.UnsafePickleError],
naming the refused type and the opt-in: `trusted=True` (runner config: `checkpoint.trust_pickle`)
for a file you trust, which loads it with the full unpickler.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import re
import struct
from collections.abc import Sequence
from typing import Any, BinaryIO

import numpy as np
import torch

from danling.tensors import nested_tensor

from .manifest import CheckpointError

__all__ = ["SAFE_GLOBALS", "TRUST_HINT", "UnsafePickleError", "torch_load", "restricted_load", "read_dcp_metadata"]

TRUST_HINT = (
    "if you trust this file, load it with trusted=True "
    "(runner config: checkpoint.trust_pickle: true; danling.load(..., trusted=True))"
)

_PATH_NAMES = ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
# The module a pickled path names: `pathlib` up to Python 3.12, `pathlib._local` from 3.13, where
# the classes moved. Both spellings read as this interpreter's classes, so a checkpoint written
# under one version loads under the other (plain `pickle` cannot import `pathlib._local` before 3.13).
_PATH_MODULES = ("pathlib", "pathlib._local")


def _numpy_globals() -> tuple[Any, ...]:
    """What a pickled NumPy array or scalar refers to: its rebuild function, `ndarray` and dtypes."""
    multiarray = getattr(np, "_core", None) or np.core
    dtypes = {type(np.dtype(code)) for code in "?bhilqBHILQefdgFDGUSV"} | {np.dtype}
    return (multiarray.multiarray._reconstruct, multiarray.multiarray.scalar, np.ndarray, *dtypes)


# Plain-data types a danling payload may hold beyond torch's weights-only defaults: paths in
# configs, NumPy arrays and scalars in results and user state. None of them runs code on load
# (an object array's items still go through the same allow-list).
SAFE_GLOBALS: tuple[Any, ...] = (
    *(getattr(pathlib, name) for name in _PATH_NAMES),
    # torch's weights-only unpickler matches a global by the name the file gives it: each path
    # class is also admitted under the other Python versions' module name.
    *((getattr(pathlib, name), f"{module}.{name}") for module in _PATH_MODULES for name in _PATH_NAMES),
    *_numpy_globals(),
    # A NestedTensor pickles as this function over its packed values (a tensor), the elements'
    # shapes and three flags: it builds the tensor and runs nothing it is given.
    nested_tensor._rebuild,
)
"""Types admitted beyond torch's weights-only defaults: `pathlib` paths (under the module names of
every Python version, as `(class, name)` pairs too), NumPy arrays, scalars, dtypes, and the
rebuild of danling's own `NestedTensor`."""

_PLAIN_BUILTINS = {"set", "frozenset", "complex", "bytearray", "range", "slice", "list", "dict", "tuple", "int"}
_PLAIN_BUILTINS |= {"float", "str", "bytes", "bool"}
_PLAIN = {("collections", "OrderedDict"), ("collections", "defaultdict"), ("torch.serialization", "_get_layout")}
_PLAIN |= {("datetime", name) for name in ("datetime", "date", "time", "timedelta", "timezone")}
_NUMPY = {"_reconstruct", "scalar", "ndarray", "dtype"}
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")


class UnsafePickleError(CheckpointError, pickle.UnpicklingError):
    """A file needs a type the restricted unpickler refuses; the message names it and the opt-in."""


def _refusal(origin: Any, what: str) -> UnsafePickleError:
    return UnsafePickleError(
        f"{origin} needs {what}, which the restricted unpickler refuses because loading it could run code "
        f"stored in the file; {TRUST_HINT}"
    )


class _RestrictedUnpickler(pickle.Unpickler):
    """Admits containers, plain values, NumPy arrays, dtypes and DCP metadata; refuses all else."""

    origin: Any = "<pickle>"

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _PLAIN_BUILTINS or (module, name) in _PLAIN:
            return super().find_class(module, name)
        if module in _PATH_MODULES and name in _PATH_NAMES:
            return getattr(pathlib, name)  # whichever Python wrote it (see `_PATH_MODULES`)
        if module in _DCP_MODULES:
            value = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(value, type) or name == "_MEM_FORMAT_ENCODING":
                return value
        elif module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        elif module.split(".")[0] == "numpy" and (name in _NUMPY or name.endswith("DType")):
            return super().find_class(module, name)
        raise _refusal(self.origin, f"{module}.{name}")


def restricted_load(
    source: BinaryIO | str | os.PathLike, *, origin: Any = None, trusted: bool = False, **options: Any
) -> Any:
    """Unpickle `source` (an open binary file or a path) without running code unless `trusted`.

    `options` (`encoding`, `errors`, `fix_imports`, `buffers`) go to the unpickler either way.

    Raises:
        UnsafePickleError: The pickle refers to a type outside the allow-list (named in the message).
    """
    if not hasattr(source, "read"):
        with open(source, "rb") as handle:
            return restricted_load(handle, origin=origin or os.fspath(source), trusted=trusted, **options)
    if trusted:
        return pickle.load(source, **options)
    unpickler = _RestrictedUnpickler(source, **options)
    unpickler.origin = origin or "<pickle>"
    return unpickler.load()


# torch names a refused global as "GLOBAL posix.system was not an allowed global" or "unsupported
# GLOBAL posix.system whose module posix is blocked", depending on the version and the module.
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
# torch's own advice around the reason; never repeated: it suggests loading with weights_only=False.
_BOILERPLATE = ("weights only load failed", "weights_only", "check the documentation of torch.load")


def _weights_only_reason(err: Exception) -> str:
    """The refused type (or torch's one-line reason) from a weights-only unpickling error."""
    text = str(err)
    found = _GLOBAL.search(text)
    if found:
        return found.group(1)
    text = text.split("WeightsUnpickler error:", 1)[-1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lines = [line for line in lines if not any(part in line.lower() for part in _BOILERPLATE)]
    return lines[0] if lines else "a type outside the allow-list"


# Damaged bytes fail inside torch's readers in many ways (an empty stack, an unknown memo key, a
# short struct, a bad zip): each is the same finding about the file.
DAMAGED_READ_ERRORS = (EOFError, RuntimeError, OSError, ValueError, IndexError, KeyError, struct.error)


def weights_only_refusal(err: pickle.UnpicklingError, origin: Any) -> UnsafePickleError | None:
    """The refusal a failed `weights_only` read stands for, or `None` when no type was refused.

    An opcode torch.save never writes ("Unsupported operand") is what random or damaged bytes look
    like, not a type to admit: advising `trusted=True` there would ask the user to run whatever the
    damage spells. The same rule serves checkpoints and `danling.load`.
    """
    if "weights_only" not in str(err) and "WeightsUnpickler" not in str(err):
        return None
    reason = _weights_only_reason(err)
    return None if reason.startswith("Unsupported operand") else _refusal(origin, reason)


def torch_load(
    source: str | os.PathLike | BinaryIO,
    *,
    map_location: Any = "cpu",
    origin: Any = None,
    trusted: bool = False,
    mmap: bool = False,
    extra_globals: Sequence[Any] = (),
) -> Any:
    """`torch.load` with `weights_only=True` and [`SAFE_GLOBALS`][danling.checkpoint.unpickling.SAFE_GLOBALS].

    Args:
        source: A path or an open binary file.
        map_location: Forwarded to `torch.load`.
        origin: How messages name the source (default: the path).
        trusted: Load with the full unpickler (may run code stored in the file).
        mmap: Map tensors from the file instead of reading them (zip-format files only).
        extra_globals: Further types admitted for this load (a backend's own plain-data classes).

    Raises:
        UnsafePickleError: The file needs a type outside the allow-list.
        CheckpointError: The file is truncated or corrupt (the message names it).
    """
    origin = origin if origin is not None else (os.fspath(source) if isinstance(source, (str, os.PathLike)) else source)
    try:
        # torch.serialization.load is torch.load, but stays so while DeepSpeed's reads are redirected here
        if trusted:
            return torch.serialization.load(source, map_location=map_location, weights_only=False, mmap=mmap)
        with torch.serialization.safe_globals([*SAFE_GLOBALS, *extra_globals]):
            return torch.serialization.load(source, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        refusal = weights_only_refusal(err, origin)
        if refusal is not None:
            raise refusal from None
        raise CheckpointError(
            f"checkpoint {origin} is truncated or corrupt: cannot be unpickled ({_weights_only_reason(err)})"
        ) from err
    except DAMAGED_READ_ERRORS as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise CheckpointError(f"checkpoint {origin} is truncated or corrupt: cannot be unpickled ({err!r})") from err


def read_dcp_metadata(path: str | os.PathLike, *, trusted: bool = False) -> Any:
    """DCP's `.metadata` index at `path`, read with the restricted unpickler unless `trusted`."""
    return restricted_load(path, origin=os.fspath(path), trusted=trusted)


def loads(data: bytes, *, map_location: Any = "cpu", origin: Any = "<bytes>", trusted: bool = False) -> Any:
    """[`torch_load`][danling.checkpoint.unpickling.torch_load] of in-memory bytes."""
    return torch_load(io.BytesIO(bytes(data)), map_location=map_location, origin=origin, trusted=trusted)
