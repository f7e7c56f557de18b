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

    Columns and their types come from the first batch (pyarrow's inference, over the keys of all its
    rows); later batches are converted to them. A key first seen in a later batch, or a value the
    conversion would change (a float into an integer column), is refused. Rows are grouped
    `row_group_size` at a time.

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
        table = self._table(rows)
        self._schema = table.schema
        buffer = self.pa.BufferOutputStream()
        with self.pa.ipc.new_stream(buffer, table.schema) as writer:
            writer.write_table(table)
        payload = buffer.getvalue().to_pybytes()
        self._append(_PREFIX.pack(len(payload)) + payload, len(outputs))

    def _table(self, rows: list[dict[str, Any]]) -> Any:
        """`rows` as a table of the file's columns (those of the first batch), refusing what would be lost.

        `Table.from_pylist` takes its columns from the first row and converts values to a given schema
        without checks, so a key first seen later would be dropped and a float cut to an integer column.
        """
        pa = self.pa
        names = list(dict.fromkeys(key for row in rows for key in row))  # every key, in order of appearance
        if self._schema is None:
            return pa.table({name: pa.array([row.get(name) for row in rows]) for name in names})
        unknown = [name for name in names if name not in self._schema.names]
        if unknown:
            raise ValueError(
                f"{self.path.name}: column(s) {unknown} first appear after the first batch, whose keys "
                f"{self._schema.names} fixed the columns; give every key from the first batch on (None where empty)"
            )
        columns = [self._column(field, [row.get(field.name) for row in rows]) for field in self._schema]
        return pa.Table.from_arrays(columns, schema=self._schema)

    def _column(self, field: Any, values: list[Any]) -> Any:
        pa = self.pa
        try:
            inferred = pa.array(values)
        except pa.ArrowException:
            inferred = None
        if inferred is not None:
            if inferred.type == field.type:
                return inferred
            if pa.types.is_null(inferred.type):  # None throughout this batch: nulls of the column's type
                return inferred.cast(field.type)
            try:
                converted = inferred.cast(field.type, safe=True)
            except pa.ArrowInvalid as error:  # a value would change (a float cut to an integer, an overflow)
                raise ValueError(self._unfit(field, values, error)) from None
            except pa.ArrowNotImplementedError:
                converted = None  # no such cast (nested types): convert from the values, as for the first batch
            if converted is not None:
                # a "safe" cast still turns 2 into True: the values must come back unchanged
                try:
                    changed = not converted.cast(inferred.type).equals(inferred)
                except pa.ArrowNotImplementedError:
                    changed = False  # no way back to compare: the cast itself found nothing to refuse
                if changed:
                    raise ValueError(self._unfit(field, values, "the conversion changes them"))
                return converted
        try:
            return pa.array(values, type=field.type)
        except pa.ArrowException as error:
            raise ValueError(self._unfit(field, values, error)) from None

    def _unfit(self, field: Any, values: list[Any], error: Exception) -> str:
        why = " (None throughout it)" if self.pa.types.is_null(field.type) else ""
        return (
            f"{self.path.name}: column {field.name!r} has type {field.type} from the first batch{why}, and "
            f"values {values[:3]} do not fit it ({error}); return the same type from every batch"
        )

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
