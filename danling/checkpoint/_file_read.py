"""Reading a `torch.save` checkpoint straight into live tensors, verified piece by piece on the way.

`torch.load` reads every storage into freshly allocated memory, faulting each of its pages in, and
`load_state_dict` then copies that into the live tensors. When the manifest records the XXH3-128
of every 8 MiB piece of the file, the file manager's `load_into` instead walks the file once, in
order: each piece is read into one reused scratch buffer, hashed and compared with the manifest,
and only then are its bytes copied to where they belong, straight into a live tensor where the
stored tensor fits it exactly, into new memory otherwise. A damaged piece is refused before any
of its bytes reach a live tensor.

The payload's structure comes from `torch.load(mmap=True)` (the weights-only unpickler unless
trusted): it maps the file and builds every tensor on a slice of the map without reading its
bytes. A storage's place in the file is then its distance from the start of the map;
[`locate`][danling.checkpoint._file_read.locate] checks every one against the archive's record
index and gives up on anything it does not match exactly (the caller then reads the file the
streamed way). The mapped pages themselves are never touched: their page faults are what this
path avoids.
"""

from __future__ import annotations

import bisect
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._dcp_read import _pread_into
from .checksums import _corrupt, _torn, xxhash

__all__ = ["locate", "place", "read_pieces", "swap_tensors"]

Read = tuple[int, np.ndarray, bool]
"""Where a storage goes: its offset in the file, the bytes it is read into, whether those are a live tensor's."""


def _tensors(obj: Any, template: Any = None) -> Iterator[tuple[torch.Tensor, Any]]:
    """Every tensor of a loaded payload with what sits at the same place in `template` (or None).

    Walks what the weights-only unpickler builds: dicts (of any kind), lists and tuples. A tensor
    inside anything else is not found, which `locate` notices (its storage goes uncounted).
    """
    if isinstance(obj, torch.Tensor):
        yield obj, template
    elif isinstance(obj, dict):
        nested = template if isinstance(template, Mapping) else {}
        for key, value in obj.items():
            yield from _tensors(value, nested.get(key))
    elif type(obj) in (list, tuple):
        nested = template if isinstance(template, (list, tuple)) and len(template) == len(obj) else [None] * len(obj)
        for value, inner in zip(obj, nested):
            yield from _tensors(value, inner)


def _plain(tensor: torch.Tensor) -> bool:
    return (
        type(tensor) is torch.Tensor
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and tensor.device.type == "cpu"
    )


def locate(path: str | os.PathLike, payload: Any) -> dict[int, tuple[int, int]] | None:
    """Byte range in the file of every storage of a payload `torch.load(path, mmap=True)` built.

    Returns:
        ``{data pointer of the storage's map slice: (file offset, bytes)}``, or ``None`` when
        anything does not match: a tensor that is not a plain CPU tensor, a storage not found by
        walking the payload, a record whose size differs, storages that do not sit at one
        constant distance from their records (not all slices of one map), or another byte order.
    """
    found: dict[int, int] = {}
    for tensor, _ in _tensors(payload):
        if not _plain(tensor):
            return None
        storage = tensor.untyped_storage()
        if found.setdefault(storage.data_ptr(), storage.nbytes()) != storage.nbytes():
            return None
    archive = torch._C.PyTorchFileReader(os.fspath(path))
    if archive.has_record("byteorder") and archive.get_record("byteorder").decode() != sys.byteorder:
        return None
    names = [name for name in archive.get_all_records() if name.startswith("data/")]
    records = sorted((archive.get_record_offset(name), archive.get_record_size(name)) for name in names)
    if len(records) != len(found):
        return None  # a storage hidden where the walk does not look, or a record nothing refers to
    pointers = sorted(found)
    distance = pointers[0] - records[0][0] if pointers else 0
    for pointer, (offset, size) in zip(pointers, records):
        if pointer - offset != distance or found[pointer] != size:
            return None
    return {pointer: record for pointer, record in zip(pointers, records)}


def _fits(stored: torch.Tensor, target: Any) -> bool:
    """Whether `stored` (its storage's only tensor) can be read straight into the live tensor `target`."""
    if (
        stored.requires_grad
        or not isinstance(target, torch.Tensor)
        or type(target) not in (torch.Tensor, torch.nn.Parameter)
    ):
        return False
    if target.layout != torch.strided or target.is_quantized or target.device.type != "cpu":
        return False
    if target.is_conj() or target.is_neg() or not target.is_contiguous():
        return False
    return (
        target.dtype == stored.dtype
        and target.shape == stored.shape
        and stored.storage_offset() == 0
        and stored.is_contiguous()
        and stored.nbytes == stored.untyped_storage().nbytes()
    )


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """A writable uint8 view of a contiguous CPU tensor's memory."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def place(
    payload: Any, templates: Mapping[str, Any], ranges: Mapping[int, tuple[int, int]]
) -> tuple[list[Read], dict[int, torch.Tensor]]:
    """Decide where each stored storage of `payload` is read to.

    A storage with a single tensor that fits the live tensor at the same place of
    ``templates[key]`` (the object's `state_dict_to_load()`/`state_dict()`) goes straight into
    it, unless another storage would go into the same memory. Everything else gets new memory,
    and every tensor on it becomes a view of that memory as stored.

    Returns:
        The reads, ``(file offset, destination bytes, whether a live tensor's)`` sorted by
        offset, and the tensor that replaces each mapped tensor of `payload`, by `id`.
    """
    uses: dict[int, list[tuple[torch.Tensor, Any]]] = {}
    for key, value in payload.items():
        for tensor, target in _tensors(value, templates.get(key)):
            uses.setdefault(tensor.untyped_storage().data_ptr(), []).append((tensor, target))
    live: dict[int, torch.Tensor] = {}
    for pointer, found in uses.items():
        if len(found) == 1 and _fits(*found[0]):
            live[pointer] = found[0][1]
    _drop_overlaps(live)
    reads, swap = [], {}
    for pointer, found in uses.items():
        offset, size = ranges[pointer]
        if pointer in live:
            target = live[pointer]
            stored = found[0][0]
            swap[id(stored)] = target if type(target) is torch.Tensor and not target.requires_grad else target.detach()
            reads.append((offset, _bytes_of(target), True))
            continue
        memory = torch.empty(size, dtype=torch.uint8)
        for stored, _ in found:
            view = torch.empty(0, dtype=stored.dtype).set_(
                memory.untyped_storage(), stored.storage_offset(), stored.shape, stored.stride()
            )
            swap[id(stored)] = view.requires_grad_(stored.requires_grad)
        reads.append((offset, memory.numpy(), False))
    reads.sort(key=lambda read: read[0])
    return reads, swap


def _drop_overlaps(live: dict[int, torch.Tensor]) -> None:
    """Leave out live destinations whose memory overlaps another's (tied weights saved apart)."""
    spans = sorted((target.data_ptr(), target.data_ptr() + target.nbytes, pointer) for pointer, target in live.items())
    clash = set()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            clash.update((first, second))
    for pointer in clash:
        del live[pointer]


def swap_tensors(obj: Any, swap: Mapping[int, torch.Tensor]) -> Any:
    """`obj` with each mapped tensor replaced by ``swap[id(tensor)]`` (dicts and lists in place)."""
    if isinstance(obj, torch.Tensor):
        return swap.get(id(obj), obj)
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
                raise _damaged(
                    _corrupt(path, "xxh3_128", (begin, end)), any(live and offset < begin for offset, _, live in reads)
                )
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
            target[low - offset : high - offset] = piece[low - begin : high - begin]
