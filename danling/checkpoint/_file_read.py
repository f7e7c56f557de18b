"""Reading a `torch.save` checkpoint straight into live tensors, verified piece by piece on the way.

`torch.load` reads every storage into freshly allocated memory, faulting each of its pages in, and
`load_state_dict` then copies that into the live tensors. When the manifest records the XXH3-128
of every 4 MiB piece of the file, the file manager's `load_into` instead walks the file once, in
order: each piece is read into one reused scratch buffer, hashed and compared with the manifest,
and only then are its bytes copied to where they belong, straight into a live tensor where the
stored tensor fits it exactly, into new memory otherwise. A damaged piece is refused before any
of its bytes reach a live tensor.

The payload's structure comes from the archive's pickle alone, read by danling's restricted
unpickler (plain containers and values, paths, NumPy arrays, dtypes: see
[`danling.checkpoint.unpickling`][]), narrowed to what torch's weights-only reader admits too and
taught the one call that rebuilds a plain tensor, which here only describes it. It is a C
unpickler, where torch's weights-only one is written in Python and cost about a quarter of a
130 MiB load. A pickle needing anything else (a tensor subclass, an object that is not plain
data) is left to the streamed reader, which reads it with torch's weights-only unpickler (or the
full one when trusted) and refuses what that refuses.
"""

from __future__ import annotations

import _compat_pickle
import bisect
import io
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._dcp_read import _contiguous_strides, _pread_into, _storage_dtype
from .checksums import _corrupt, _torn, xxhash
from .unpickling import SAFE_GLOBALS, _RestrictedUnpickler

__all__ = ["parse", "place", "read_pieces", "swap_tensors"]

Read = tuple[int, np.ndarray, bool]
"""Where a storage goes: its offset in the file, the bytes it is read into, whether those are a live tensor's."""


class _Storage:
    """A storage record of the archive: its dtype, size and place in the file."""

    __slots__ = ("dtype", "nbytes", "offset")
    __hash__ = None  # type: ignore[assignment]  # a storage put in a set would escape the walk: refuse it

    def __init__(self, dtype: torch.dtype, nbytes: int, offset: int) -> None:
        self.dtype, self.nbytes, self.offset = dtype, nbytes, offset


class _Stored:
    """A stored tensor, described: the view of its storage that `_rebuild_tensor_v2` would build."""

    __slots__ = ("storage", "offset", "size", "stride", "requires_grad")
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, storage: _Storage, offset: int, size: tuple, stride: tuple, requires_grad: bool) -> None:
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride
        self.requires_grad = requires_grad


class _Unsupported(Exception):
    pass


_WEIGHTS_ONLY = {("builtins", "set"), ("builtins", "complex"), ("builtins", "bytearray")}
_WEIGHTS_ONLY |= {("collections", "OrderedDict"), ("torch", "Size")}


class _Describer(_RestrictedUnpickler):
    """danling's restricted unpickler, with plain tensors described instead of rebuilt."""

    def __init__(self, data: bytes, archive: Any) -> None:
        super().__init__(io.BytesIO(data))
        self.archive = archive
        self.storages: dict[str, _Storage] = {}
        self.described = 0

    def find_class(self, module: str, name: str) -> Any:
        # torch.save writes pickle protocol 2, which names builtins as Python 2 did (`__builtin__.set`)
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return self._describe
        if module == "torch" and name.endswith("Storage") and _storage_dtype(getattr(torch, name, None)) is not None:
            return getattr(torch, name)
        found = super().find_class(module, name)
        # Only what the streamed reader (torch's weights-only one plus SAFE_GLOBALS) admits as well: a
        # payload it refuses (a datetime, a frozenset, ...) must be refused the same way, by it.
        if found in SAFE_GLOBALS or (module, name) in _WEIGHTS_ONLY or isinstance(found, torch.dtype):
            return found
        raise _Unsupported(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage":
            raise _Unsupported(f"persistent id {pid!r}")
        _, storage_type, key, _, numel = pid
        if key not in self.storages:
            dtype = _storage_dtype(storage_type)
            name = f"data/{key}"
            if dtype is None or not isinstance(numel, int) or not self.archive.has_record(name):
                raise _Unsupported(f"storage {pid!r}")
            nbytes = numel * dtype.itemsize
            if self.archive.get_record_size(name) != nbytes:
                raise _Unsupported(f"record {name} does not hold {nbytes} bytes")
            self.storages[key] = _Storage(dtype, nbytes, self.archive.get_record_offset(name))
        return self.storages[key]

    def _describe(
        self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, *metadata: Any
    ) -> _Stored:
        if not isinstance(storage, _Storage) or hooks or any(metadata) or not isinstance(offset, int):
            raise _Unsupported("a tensor with hooks or metadata")  # torch's own reader handles those
        self.described += 1
        return _Stored(storage, offset, tuple(size), tuple(stride), bool(requires_grad))


def parse(path: str | os.PathLike) -> Any:
    """The payload of `torch.save` file `path`, each tensor a description of the bytes it needs.

    Returns:
        The payload, or ``None`` when it is not one this reader understands (a type the
        restricted unpickler refuses, a tensor subclass, a tensor where the walk of dicts, lists
        and tuples does not reach, another byte order, an unreadable archive).
    """
    try:
        archive = torch._C.PyTorchFileReader(os.fspath(path))
        if archive.has_record("byteorder") and archive.get_record("byteorder").decode() != sys.byteorder:
            return None
        unpickler = _Describer(archive.get_record("data.pkl"), archive)
        unpickler.origin = path
        payload = unpickler.load()
    except Exception:
        return None  # the streamed reader reads it, or says why not
    found = 0
    for leaf, _ in _leaves(payload):
        if isinstance(leaf, _Storage):
            return None  # a bare storage in the payload
        found += 1
    return payload if found == unpickler.described else None


def _leaves(obj: Any, template: Any = None) -> list[tuple[Any, Any]]:
    """Every described tensor (or bare storage) of `obj`, with what sits at the same place in `template`."""
    found: list[tuple[Any, Any]] = []
    _collect(obj, template, found)
    return found


_PLAIN = frozenset({int, float, bool, str, bytes, type(None), torch.dtype})


def _collect(obj: Any, template: Any, found: list[tuple[Any, Any]]) -> None:
    # A list the recursion appends to, and plain values skipped before any call: a generator
    # chain re-yielding through every level, entered once per number of an optimizer's
    # `param_groups`, was a fifth of the metadata time of a 12 MiB load.
    if isinstance(obj, (_Stored, _Storage)):
        found.append((obj, template))
    elif isinstance(obj, dict):
        nested = template if isinstance(template, Mapping) else {}
        for key, value in obj.items():
            if type(value) not in _PLAIN:
                _collect(value, nested.get(key), found)
    elif type(obj) in (list, tuple):
        nested = template if isinstance(template, (list, tuple)) and len(template) == len(obj) else [None] * len(obj)
        for value, inner in zip(obj, nested):
            if type(value) not in _PLAIN:
                _collect(value, inner, found)


def _fits(stored: _Stored, target: Any) -> bool:
    """Whether `stored` (its storage's only tensor) can be read straight into the live tensor `target`."""
    if stored.requires_grad or not isinstance(target, torch.Tensor):
        return False
    if type(target) not in (torch.Tensor, torch.nn.Parameter) or target.layout != torch.strided:
        return False
    if target.is_quantized or target.device.type != "cpu" or target.is_conj() or target.is_neg():
        return False
    storage = stored.storage
    return (
        target.dtype == storage.dtype
        and tuple(target.shape) == stored.size
        and target.is_contiguous()
        and stored.offset == 0
        and target.nbytes == storage.nbytes
        and (target.numel() <= 1 or stored.stride == _contiguous_strides(stored.size))
    )


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """A writable uint8 view of a contiguous CPU tensor's memory."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def place(payload: Mapping[str, Any], templates: Mapping[str, Any]) -> tuple[list[Read], dict[int, torch.Tensor]]:
    """Decide where each storage the (parsed) `payload` refers to is read to.

    A storage with a single tensor that fits the live tensor at the same place of
    ``templates[key]`` (the object's `state_dict_to_load()`/`state_dict()`) goes straight into
    it, unless another storage would go into the same memory. Everything else gets new memory,
    and every tensor on it becomes a view of that memory as stored.

    Returns:
        The reads, ``(file offset, destination bytes, whether a live tensor's)`` sorted by
        offset, and the tensor that replaces each description in `payload`, by `id`.
    """
    uses: dict[int, list[tuple[_Stored, Any]]] = {}
    for key, value in payload.items():
        for stored, target in _leaves(value, templates.get(key)):
            uses.setdefault(id(stored.storage), []).append((stored, target))
    live = {key: found[0][1] for key, found in uses.items() if len(found) == 1 and _fits(*found[0])}
    _drop_overlaps(live)
    reads, swap = [], {}
    for key, found in uses.items():
        storage = found[0][0].storage
        if key in live:
            target = live[key]
            swap[id(found[0][0])] = (
                target if type(target) is torch.Tensor and not target.requires_grad else target.detach()
            )
            reads.append((storage.offset, _bytes_of(target), True))
            continue
        memory = torch.empty(storage.nbytes, dtype=torch.uint8)
        for stored, _ in found:
            view = torch.empty(0, dtype=storage.dtype).set_(
                memory.untyped_storage(), stored.offset, stored.size, stored.stride
            )
            swap[id(stored)] = view.requires_grad_(stored.requires_grad)
        reads.append((storage.offset, memory.numpy(), False))
    reads.sort(key=lambda read: read[0])
    return reads, swap


def _drop_overlaps(live: dict[int, torch.Tensor]) -> None:
    """Leave out live destinations whose memory overlaps another's (tied weights saved apart)."""
    spans = sorted((target.data_ptr(), target.data_ptr() + target.nbytes, key) for key, target in live.items())
    clash = set()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            clash.update((first, second))
    for key in clash:
        del live[key]


def swap_tensors(obj: Any, swap: Mapping[int, torch.Tensor]) -> Any:
    """`obj` with each described tensor replaced by ``swap[id(description)]`` (dicts and lists in place)."""
    if isinstance(obj, _Stored):
        return swap[id(obj)]
    if isinstance(obj, dict):
        for key, value in obj.items():
            obj[key] = swap_tensors(value, swap)
    elif type(obj) is list:
        obj[:] = [swap_tensors(value, swap) for value in obj]
    elif type(obj) is tuple:
        return tuple(swap_tensors(value, swap) for value in obj)
    return obj


def read_pieces(path: Path, size: int, reads: list[Read], pieces: tuple[int, list[str]] | None) -> None:
    """Read each storage of `reads` into its destination, checking every piece of the file first.

    With `pieces` (``(span, XXH3-128 of each piece)``), the whole file is walked in order, one
    piece at a time, through one scratch buffer: a piece is hashed and compared before any of its
    bytes is copied. Without (the file verified earlier in this scope), each destination is read
    directly.

    Raises:
        CheckpointError: The file's size differs from `size`, or a piece's digest from the
            manifest (naming the file and the piece's byte range).
    """
    with open(path, "rb", buffering=0) as handle:
        fd = handle.fileno()
        actual = os.fstat(fd).st_size
        if actual != size:
            raise _torn(path, actual, size)
        if pieces is None:
            for offset, target, _ in reads:
                if target.nbytes:
                    _pread_into(fd, target, offset)
            return
        span, digests = pieces
        scratch = np.empty(min(span, size), dtype=np.uint8)
        starts = [offset for offset, _, _ in reads]
        for index, expected in enumerate(digests):
            begin, end = index * span, min(size, (index + 1) * span)
            piece = scratch[: end - begin]
            _pread_into(fd, piece, begin)
            if xxhash.xxh3_128_hexdigest(piece) != expected:
                reached = any(live and offset < begin for offset, _, live in reads)
                raise _damaged(_corrupt(path, "xxh3_128", (begin, end)), reached)
            _copy_piece(piece, begin, end, reads, starts)


def _damaged(error: Exception, reached_live: bool) -> Exception:
    """The mismatch of a piece, saying whether the live objects already received bytes of earlier pieces."""
    if not reached_live:
        return error
    return type(error)(
        f"{error}. The pieces before it matched and were already read into the live objects, so they may hold "
        "part of this checkpoint; load another checkpoint into them"
    )


def _copy_piece(piece: np.ndarray, begin: int, end: int, reads: list[Read], starts: list[int]) -> None:
    """Copy the part of each read that lies in the file's bytes ``[begin, end)`` (held by `piece`)."""
    first = max(bisect.bisect_right(starts, begin) - 1, 0)
    for offset, target, _ in reads[first:]:
        if offset >= end:
            break
        low, high = max(offset, begin), min(offset + target.nbytes, end)
        if low < high:
            _copy(target[low - offset : high - offset], piece[low - begin : high - begin])


def _copy(destination: np.ndarray, source: np.ndarray) -> None:
    # torch splits a large copy over its intra-op threads where numpy copies on one: reading,
    # checking and copying a checkpoint into live tensors took 0.91x (12 MiB) and 0.87x (129 MiB)
    # of the time with numpy's copy. Below 1 MiB, wrapping the arrays costs more than it saves.
    if destination.nbytes >= 1 << 20:
        torch.from_numpy(destination).copy_(torch.from_numpy(source))
    else:
        destination[...] = source
