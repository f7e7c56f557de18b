"""The Parquet sink (`.parquet`); needs pyarrow, installed with the `parquet` extra.

A Parquet file only becomes readable when its footer is written, and the footer describes every
row group before it, so a half-written Parquet file cannot be cut back and continued. The sink
therefore stages each batch as a length-prefixed Arrow IPC message in `<path>.staging` (which can
be cut at any committed byte offset) and converts the staging file into `path` at `close()`, in row
groups of a fixed number of rows. The row groups depend only on the rows, not on where batches or
restarts fell, so a resumed run writes the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from .sinks import _ByteStreamSink, _replacing, register_sink, to_plain

__all__ = ["ParquetSink"]

_PREFIX = struct.Struct("<Q")


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError as error:
        raise ImportError(
            "a .parquet output needs pyarrow, which is not installed: pip install 'danling[parquet]'"
        ) from error
    return pyarrow


class ParquetSink(_ByteStreamSink):
    """`.parquet` output: one column per key of mapping outputs, else a single column named `output`.

    Column types come from the first batch (pyarrow's inference); later batches are converted to
    them. Rows are grouped `row_group_size` at a time.

    Raises:
        ImportError: pyarrow is missing; the message names the `parquet` extra.
    """

    suffixes = (".parquet",)
    row_group_size = 65536

    def __init__(self, path: str | os.PathLike[str], capacity: int | None = None) -> None:
        super().__init__(path, capacity)
        self.pa = _pyarrow()
        self.staging = self.path.with_name(self.path.name + ".staging")
        self._schema: Any = None

    @property
    def stream_path(self) -> Path:
        return self.staging  # staged IPC messages, rewritten as row groups at close

    def open(self) -> None:
        super().open()
        self._schema = None

    def truncate(self, state: Mapping[str, Any]) -> None:
        super().truncate(state)
        handle = self._require()
        handle.seek(0)
        first = next(_messages(self.pa, handle), None)
        self._schema = None if first is None else first.schema
        handle.seek(int(state["bytes"]))

    def write(self, outputs: Sequence[Any]) -> None:
        if not outputs:
            return
        rows = [to_plain(item) if isinstance(item, Mapping) else {"output": to_plain(item)} for item in outputs]
        table = self.pa.Table.from_pylist(rows, schema=self._schema)
        self._schema = table.schema
        buffer = self.pa.BufferOutputStream()
        with self.pa.ipc.new_stream(buffer, table.schema) as writer:
            writer.write_table(table)
        payload = buffer.getvalue().to_pybytes()
        self._append(_PREFIX.pack(len(payload)) + payload, len(outputs))

    def close(self) -> None:
        handle = self._require()
        handle.seek(0)
        _write_grouped(self.pa, self.path, _messages(self.pa, handle), self._schema, self.row_group_size)
        handle.close()
        self._handle = None
        self.staging.unlink()

    @classmethod
    def files(cls, path: Path, state: Mapping[str, Any]) -> list[Path]:
        return [path, path.with_name(path.name + ".staging")]

    @classmethod
    def merge(cls, target: Path, shards: Sequence[Path], states: Sequence[Mapping[str, Any]]) -> None:
        pa = _pyarrow()
        files = [pa.parquet.ParquetFile(shard) for shard in shards]
        schema = files[0].schema_arrow
        _write_grouped(pa, target, _interleaved(pa, files, cls.row_group_size), schema, cls.row_group_size)


def _messages(pa: Any, handle: IO[bytes]) -> Iterator[Any]:
    """The tables staged in `handle`, from its current position to its end."""
    while True:
        prefix = handle.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            return
        (size,) = _PREFIX.unpack(prefix)
        yield pa.ipc.open_stream(pa.py_buffer(handle.read(size))).read_all()


def _write_grouped(pa: Any, target: Path, tables: Iterator[Any], schema: Any, group: int) -> None:
    """Write `tables` to `target` in row groups of exactly `group` rows (the last may be shorter)."""
    if schema is None:
        schema = pa.schema([("output", pa.null())])
    with _replacing(target) as out:
        writer = pa.parquet.ParquetWriter(out, schema)
        pending: list[Any] = []
        count = 0
        for table in tables:
            pending.append(table)
            count += table.num_rows
            while count >= group:
                merged = pa.concat_tables(pending)
                writer.write_table(merged.slice(0, group), row_group_size=group)
                rest = merged.slice(group)
                pending, count = [rest], rest.num_rows
        if count:
            writer.write_table(pa.concat_tables(pending), row_group_size=group)
        writer.close()


def _interleaved(pa: Any, files: Sequence[Any], size: int) -> Iterator[Any]:
    """Rows of the shards in dataset order (row `i` from shard `i % W`), `size` rows per shard at a time."""
    import pyarrow.compute  # noqa: F401 - loads `take`

    iterators = [file.iter_batches(batch_size=size) for file in files]
    while True:
        parts = [next(iterator, None) for iterator in iterators]
        parts = [pa.Table.from_batches([part]) for part in parts if part is not None]
        if not parts:
            return
        lengths = [part.num_rows for part in parts]
        starts = [sum(lengths[:i]) for i in range(len(parts))]
        order = [starts[r] + i for i in range(lengths[0]) for r in range(len(parts)) if i < lengths[r]]
        yield pa.concat_tables(parts).take(pa.array(order, pa.int64()))


register_sink(".parquet", ParquetSink)
