"""The NumPy sink: one `.npy` file per output field, preallocated and written through memory maps.

The file of each field is created at its final size (the rank's share of the dataset) as soon
as the first batch shows the dtype and per-example shape, so writing a batch is a copy into a
short-lived memory map over exactly that batch's rows: resident memory does not grow with the
dataset. Rows past the committed count are simply written again after a resume. A run that
writes fewer rows than preallocated (`steps=`) has its header rewritten and the file cut at close.
"""

from __future__ import annotations

import glob
import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .sinks import Sink, _fsync, _replacing, register_sink

__all__ = ["NumpySink"]

_SINGLE = ""  # the field name of outputs that are not mappings
_CHUNK_BYTES = 16 << 20  # rows copied at a time when merging or shrinking


def _numpy(value: Any) -> Any:
    """A tensor as a NumPy array; other values as they are."""
    if not hasattr(value, "detach"):
        return value
    value = value.detach().cpu()
    if value.is_floating_point() and value.element_size() < 4 and value.dtype is not torch.float16:
        # NumPy has no bfloat16 or float8 (`.numpy()` raises on them): float32 holds their values exactly
        value = value.float()
    return value.numpy()


def _shape(value: Any) -> tuple[int, ...] | str:
    try:
        return tuple(np.shape(_numpy(value)))
    except ValueError:
        return "ragged"


def _array(values: Sequence[Any]) -> np.ndarray:
    return np.asarray([_numpy(value) for value in values])


def _header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    buffer = io.BytesIO()
    descr = np.lib.format.dtype_to_descr(dtype)
    np.lib.format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


class _Field:
    """One field's file: where its rows start and how big each row is."""

    def __init__(self, path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.path, self.dtype, self.shape = path, np.dtype(dtype), tuple(shape)
        self.row_bytes = self.dtype.itemsize * int(np.prod(self.shape, dtype=np.int64))

    def create(self, rows: int) -> None:
        header = _header(self.dtype, (rows, *self.shape))
        with open(self.path, "wb") as handle:
            handle.write(header)
            handle.truncate(len(header) + rows * self.row_bytes)  # sparse: no memory, no writes
        self.offset = len(header)

    def attach(self) -> None:
        with open(self.path, "rb") as handle:
            np.lib.format.read_magic(handle)
            np.lib.format.read_array_header_1_0(handle)
            self.offset = handle.tell()

    def check(self, values: np.ndarray) -> None:
        """Refuse values that the file's dtype (from the first batch) would change: a float cut to an
        int, a number turned into a bool, a string cut to the first batch's width."""
        if values.dtype.kind not in "OSU" and np.can_cast(values.dtype, self.dtype, "same_kind"):
            return  # within a kind only precision may go (float64 outputs into a float32 file)
        try:
            with np.errstate(invalid="ignore"):
                same = values.dtype.kind != "O" and bool(np.array_equal(values.astype(self.dtype), values))
        except (TypeError, ValueError, UnicodeError):
            same = False
        if not same:
            raise ValueError(
                f"{self.path.name}: outputs of dtype {values.dtype} after a first batch that made the file "
                f"{self.dtype}; converting would change them (e.g. {values.ravel()[:3].tolist()}): "
                "return the same type from every batch, or write .jsonl or .parquet"
            )

    def put(self, start: int, values: np.ndarray) -> None:
        if values.shape[1:] != self.shape:
            raise ValueError(
                f"{self.path.name}: outputs of shape {values.shape[1:]} after earlier ones of shape {self.shape}; "
                "every example must give the same shape"
            )
        window = np.memmap(self.path, self.dtype, "r+", offset=self.offset + start * self.row_bytes, shape=values.shape)
        window[...] = values
        del window  # unmapped now: the written pages stay in the page cache, not in this process

    def shrink(self, rows: int) -> None:
        """Make the file hold exactly `rows` rows (a rewritten header; data moved only if its size changed)."""
        header = _header(self.dtype, (rows, *self.shape))
        if len(header) == self.offset:
            with open(self.path, "r+b") as handle:
                handle.write(header)
                handle.truncate(self.offset + rows * self.row_bytes)
                _fsync(handle)
            return
        with _replacing(self.path) as out, open(self.path, "rb") as source:
            out.write(header)
            source.seek(self.offset)
            _copy(source, out, rows * self.row_bytes)

    def describe(self) -> dict[str, Any]:
        return {"file": self.path.name, "dtype": self.dtype.str, "shape": list(self.shape)}


def _copy(source: Any, out: Any, size: int) -> None:
    while size > 0:
        chunk = source.read(min(size, _CHUNK_BYTES))
        if not chunk:
            raise ValueError(f"{source.name} ended {size} bytes early")
        out.write(chunk)
        size -= len(chunk)


class NumpySink(Sink):
    """`.npy` output: a single array at `path`, or for mapping outputs one `<stem>.<field>.npy` per key.

    Needs the dataset length (`capacity`). The dtype and per-example shape come from the first
    batch; later batches are converted to that dtype and must have the same shape. A conversion that
    would change values (floats into an integer file, numbers into a boolean one, strings longer than
    the first batch's) is refused, as are outputs NumPy can only hold as Python objects (None, ragged
    lists). NumPy has no bfloat16 or float8 dtype: such tensors are stored as float32, which holds
    their values exactly.
    """

    suffixes = (".npy",)

    def __init__(self, path: str | os.PathLike[str], capacity: int | None = None) -> None:
        super().__init__(path, capacity)
        if capacity is None:
            raise ValueError(f"a .npy output ({self.path}) is preallocated and needs a dataset with a length")
        self._fields: dict[str, _Field] | None = None
        self._rows = 0

    def field_path(self, name: str) -> Path:
        """The file of field `name` (`path` itself for outputs that are not mappings)."""
        if name == _SINGLE:
            return self.path
        return self.path.with_name(f"{self.path.name[: -len('.npy')]}.{name}.npy")

    def open(self) -> None:
        self._fields, self._rows = None, 0

    def truncate(self, state: Mapping[str, Any]) -> None:
        self._rows = int(state["rows"])
        fields = state.get("fields")
        if not fields:
            self._fields = None
            return
        self._fields = {}
        for name, spec in fields.items():
            field = _Field(self.path.with_name(spec["file"]), np.dtype(spec["dtype"]), tuple(spec["shape"]))
            if not field.path.exists():
                raise FileNotFoundError(f"cannot resume {field.path}: the file is gone (start over with resume=False)")
            field.attach()
            self._fields[name] = field

    def write(self, outputs: Sequence[Any]) -> None:
        if not outputs:
            return
        columns = self._columns(outputs)
        if self._fields is None:
            for name, values in columns.items():
                if values.dtype.kind == "O":  # the file would hold the addresses of Python objects
                    raise ValueError(
                        f"{self.field_path(name).name}: outputs {values.ravel()[:3].tolist()} are not numbers, "
                        "booleans or strings of one shape (None, mixed types or ragged lists); "
                        "a .npy output cannot hold them: write .jsonl or .parquet"
                    )
            self._fields = {}
            for name, values in columns.items():
                field = _Field(self.field_path(name), values.dtype, values.shape[1:])
                field.create(self.capacity)
                self._fields[name] = field
        if set(columns) != set(self._fields):
            raise ValueError(f"{self.path.name}: output fields {sorted(columns)} after {sorted(self._fields)}")
        if self._rows + len(outputs) > self.capacity:
            raise ValueError(
                f"{self.path.name}: {self._rows + len(outputs)} outputs for a file preallocated for "
                f"{self.capacity} (the dataset length); infer_step must return one output per example"
            )
        for name, values in columns.items():
            field = self._fields[name]
            field.check(values)
            field.put(self._rows, values.astype(field.dtype, copy=False))
        self._rows += len(outputs)

    def _columns(self, outputs: Sequence[Any]) -> dict[str, np.ndarray]:
        if isinstance(outputs[0], Mapping):
            keys = set(outputs[0])
            for item in outputs:  # a key of one example only would be dropped, or fail as a bare KeyError
                if not isinstance(item, Mapping) or set(item) != keys:
                    got = sorted(map(str, item)) if isinstance(item, Mapping) else type(item).__name__
                    raise ValueError(
                        f"{self.path.name}: every output must be a mapping with the keys "
                        f"{sorted(map(str, keys))} (one file per key), got {got}"
                    )
            return {str(key): self._array(str(key), [item[key] for item in outputs]) for key in outputs[0]}
        return {_SINGLE: self._array(_SINGLE, outputs)}

    def _array(self, name: str, values: Sequence[Any]) -> np.ndarray:
        try:
            return _array(values)
        except ValueError as error:  # numpy's "inhomogeneous shape" names neither the file nor the cure
            shapes = sorted({_shape(value) for value in values}, key=str)
            raise ValueError(
                f"{self.field_path(name).name}: the examples of one batch have different shapes {shapes[:4]}; "
                "a .npy output holds one shape per file: pad them, or write .jsonl or .parquet"
            ) from error

    def state(self) -> dict[str, Any]:
        for field in (self._fields or {}).values():
            with open(field.path, "rb+") as handle:  # fsync also writes back pages dirtied through maps
                os.fsync(handle.fileno())
        fields = {name: field.describe() for name, field in (self._fields or {}).items()}
        return {"rows": self._rows, "fields": fields}

    def close(self) -> None:
        if self._fields is None:  # nothing was written: an empty array, so the path exists
            np.save(self.path, np.zeros((0,)))
            return
        for field in self._fields.values():
            if self._rows < self.capacity:
                field.shrink(self._rows)
            else:
                with open(field.path, "rb+") as handle:
                    os.fsync(handle.fileno())

    @classmethod
    def files(cls, path: Path, state: Mapping[str, Any]) -> list[Path]:
        return [path.with_name(spec["file"]) for spec in (state.get("fields") or {}).values()] or [path]

    @classmethod
    def present(cls, path: Path) -> bool:
        # mapping outputs are one `<stem>.<field>.npy` per key, and no file at `path` itself
        return path.exists() or any(path.parent.glob(f"{glob.escape(path.name[: -len('.npy')])}.*.npy"))

    @classmethod
    def merge(cls, target: Path, shards: Sequence[Path], states: Sequence[Mapping[str, Any]]) -> None:
        fields = next((state["fields"] for state in states if state.get("fields")), None)
        if fields is None:
            np.save(target, np.zeros((0,)))
            return
        sink = cls(target, 0)
        for name, spec in fields.items():
            sources = []
            for shard, state in zip(shards, states):
                source = _Field(shard.with_name(state["fields"][name]["file"]), spec["dtype"], spec["shape"])
                source.attach()
                sources.append((source, int(state["rows"])))
            _interleave(sink.field_path(name), sources)


def _interleave(target: Path, sources: list[tuple[_Field, int]]) -> None:
    """Write rows `i` of the shards in turn (shard `i % W`, row `i // W`) into `target`, a block at a time."""
    first = sources[0][0]
    total, width = sum(rows for _, rows in sources), len(sources)
    expected = [len(range(rank, total, width)) for rank in range(width)]
    if [rows for _, rows in sources] != expected:
        raise ValueError(f"shards of {[rows for _, rows in sources]} rows are not a strided split of {total} rows")
    per_block = max(1, _CHUNK_BYTES // max(first.row_bytes * width, 1))  # shard rows per block
    handles = [open(source.path, "rb") for source, _ in sources]  # noqa: SIM115
    try:
        with _replacing(target) as out:
            out.write(_header(first.dtype, (total, *first.shape)))
            for start in range(0, sources[0][1], per_block):
                block = np.empty((min(per_block * width, total - start * width), *first.shape), first.dtype)
                for index, ((source, rows), handle) in enumerate(zip(sources, handles)):
                    count = max(0, min(per_block, rows - start))
                    handle.seek(source.offset + start * source.row_bytes)
                    values = np.fromfile(handle, source.dtype, count * int(np.prod(source.shape, dtype=np.int64)))
                    block[index : index + count * width : width] = values.reshape(count, *source.shape)
                out.write(block.tobytes())
    finally:
        for handle in handles:
            handle.close()


register_sink(".npy", NumpySink)
