"""Output sinks of `runner.infer(split, output=PATH)`: one file format each, picked by the path's suffix.

A [`Sink`][danling.runners.inference.sinks.Sink] receives the outputs of one batch at a time and
can say, at any point, how much of its file is committed (`state`). After a crash the file is cut
back to a committed state (`truncate`) and writing continues, so a resumed run ends with the same
bytes as one that never stopped. Sinks are registered per suffix with
[`register_sink`][danling.runners.inference.sinks.register_sink]; `.jsonl`/`.ndjson` (JSON Lines)
and `.npy` (NumPy) are built in, `.parquet` lives in
[`parquet`][danling.runners.inference.parquet] and needs the `parquet` extra (pyarrow).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, ClassVar

from danling.utils.io import dumps_strict

__all__ = ["JsonLinesSink", "Sink", "register_sink", "registered_suffixes", "sink_for", "to_plain"]


class Sink(ABC):
    """One output file written batch by batch, whose committed position can be restored after a crash.

    The runner drives a sink as follows: `open()` for a fresh file, or `truncate(state)` to
    continue from a `state` that an earlier `state()` call returned; then `write(outputs)` once per
    batch; `state()` at every progress record; and `close()` once all batches are written.

    Args:
        path: The file to write (under data parallelism, this rank's shard).
        capacity: How many outputs at most will be written (the rank's share of the dataset), or
            `None` when the dataset has no length. Sinks that preallocate need it.

    Attributes:
        suffixes: The file suffixes this sink is registered for by default.
    """

    suffixes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, path: str | os.PathLike[str], capacity: int | None = None) -> None:
        self.path = Path(path)
        self.capacity = capacity

    @abstractmethod
    def open(self) -> None:
        """Start an empty file, replacing whatever is at `path`."""

    @abstractmethod
    def truncate(self, state: Mapping[str, Any]) -> None:
        """Reopen the existing file cut back to `state` (from `state()`), ready to append after it."""

    @abstractmethod
    def write(self, outputs: Sequence[Any]) -> None:
        """Append the outputs of one batch, one entry per example."""

    @abstractmethod
    def state(self) -> dict[str, Any]:
        """Make everything written so far durable and return the position reached (JSON-serialisable)."""

    @abstractmethod
    def close(self) -> None:
        """Finish the file (footers, final sizes) and release it; `path` is complete afterwards."""

    @classmethod
    def files(cls, path: Path, state: Mapping[str, Any]) -> list[Path]:
        """Every file a sink at `path` in `state` wrote (removed once shards are merged)."""
        return [path]

    @classmethod
    def present(cls, path: Path) -> bool:
        """Whether a finished output at `path` is still on disk (a rerun writes it anew when it is not)."""
        return path.exists()

    @classmethod
    def merge(cls, target: Path, shards: Sequence[Path], states: Sequence[Mapping[str, Any]]) -> None:
        """Interleave closed shard files into `target` in dataset order.

        Row `i` of the whole is row `i // W` of shard `i % W` for `W` shards, which is how a
        `DistributedSampler` that does not shuffle deals out the dataset. A sink that cannot
        merge leaves the shards in place, and the runner writes an index over them instead.
        """
        raise NotImplementedError(f"{cls.__name__} does not merge shards")


_SINKS: dict[str, type[Sink]] = {}


def register_sink(suffix: str, sink: type[Sink]) -> None:
    """Write outputs whose path ends with `suffix` (e.g. `".csv"`) through `sink`; replaces an earlier one.

    Raises:
        ValueError: `suffix` does not start with a dot.
        TypeError: `sink` is not a `Sink` subclass.
    """
    if not isinstance(suffix, str) or not suffix.startswith(".") or len(suffix) < 2:
        raise ValueError(f"a sink suffix starts with a dot, like '.jsonl'; got {suffix!r}")
    if not (isinstance(sink, type) and issubclass(sink, Sink)):
        raise TypeError(f"register_sink needs a Sink subclass, got {sink!r}")
    _SINKS[suffix.lower()] = sink


def registered_suffixes() -> list[str]:
    """The suffixes that have a sink, sorted."""
    return sorted(_SINKS)


def sink_for(path: str | os.PathLike[str]) -> type[Sink]:
    """The sink class registered for the longest suffix `path` ends with.

    Raises:
        ValueError: No registered suffix matches; the message lists the accepted ones.
    """
    name = Path(path).name.lower()
    matches = [suffix for suffix in _SINKS if name.endswith(suffix) and len(name) > len(suffix)]
    if not matches:
        raise ValueError(
            f"no inference sink for output {str(path)!r}: accepted suffixes are "
            f"{', '.join(registered_suffixes())} (register_sink adds others)"
        )
    return _SINKS[max(matches, key=len)]


def to_plain(value: Any) -> Any:
    """`value` with tensors and NumPy values turned into Python numbers and lists (for JSON)."""
    if isinstance(value, Mapping):
        return {str(key): to_plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(item) for item in value]
    tolist = getattr(value, "tolist", None)  # torch.Tensor, numpy arrays and scalars
    if callable(tolist) and not isinstance(value, (str, bytes)):
        return tolist()
    return value


def _fsync(handle: IO[bytes]) -> None:
    handle.flush()
    os.fsync(handle.fileno())


class _ByteStreamSink(Sink):
    """A sink that appends bytes to one file (`stream_path`) and commits a byte offset, so a
    truncation back to a commit is exact. Subclasses encode batches and call `_append`."""

    def __init__(self, path: str | os.PathLike[str], capacity: int | None = None) -> None:
        super().__init__(path, capacity)
        self._handle: IO[bytes] | None = None
        self._rows = 0

    @property
    def stream_path(self) -> Path:
        return self.path

    def open(self) -> None:
        self._handle = open(self.stream_path, "w+b")  # noqa: SIM115 - held for the whole run
        self._rows = 0

    def truncate(self, state: Mapping[str, Any]) -> None:
        path = self.stream_path
        if not path.exists():
            raise FileNotFoundError(f"cannot resume {path}: the file is gone (start over with resume=False)")
        self._handle = open(path, "r+b")  # noqa: SIM115
        self._handle.truncate(int(state["bytes"]))
        self._handle.seek(int(state["bytes"]))
        self._rows = int(state["rows"])

    def state(self) -> dict[str, Any]:
        handle = self._require()
        _fsync(handle)
        return {"rows": self._rows, "bytes": handle.tell()}

    def _append(self, data: bytes, rows: int) -> None:
        self._require().write(data)
        self._rows += rows

    def _require(self) -> IO[bytes]:
        if self._handle is None:
            raise RuntimeError(f"{type(self).__name__} for {self.path} is not open")
        return self._handle


class JsonLinesSink(_ByteStreamSink):
    """JSON Lines: one compact JSON value per example and line, UTF-8.

    Tensors and NumPy values are written as numbers or nested lists; a mapping output becomes a
    JSON object. Every line is strict JSON: a NaN or infinite prediction is written as `null`
    (Python's `json` would write `NaN`, a line `jq` and JavaScript refuse), which a JSON reader
    gives back as `None`. The committed position is a byte offset, so truncation is exact.
    """

    suffixes = (".jsonl", ".ndjson")

    def write(self, outputs: Sequence[Any]) -> None:
        lines = (dumps_strict(to_plain(item), ensure_ascii=False, separators=(",", ":")) for item in outputs)
        self._append("".join(line + "\n" for line in lines).encode("utf-8"), len(outputs))

    def close(self) -> None:
        if self._handle is not None:
            _fsync(self._handle)
            self._handle.close()
            self._handle = None

    @classmethod
    def merge(cls, target: Path, shards: Sequence[Path], states: Sequence[Mapping[str, Any]]) -> None:
        with _replacing(target) as out:
            handles = [open(shard, "rb") for shard in shards]  # noqa: SIM115
            try:
                for line in _round_robin(handles):
                    out.write(line)
            finally:
                for handle in handles:
                    handle.close()


def _round_robin(handles: Sequence[IO[bytes]]) -> Iterator[bytes]:
    """Lines taken from each handle in turn until one runs out (later shards are never longer)."""
    while True:
        for handle in handles:
            line = handle.readline()
            if not line:
                return
            yield line


class _replacing:
    """Write `target` through a temporary sibling moved into place on success (a crash leaves no half file)."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self.tmp = target.with_name(f".{target.name}.merging")

    def __enter__(self) -> IO[bytes]:
        self.handle = open(self.tmp, "wb")
        return self.handle

    def __exit__(self, exc_type: object, error: object, tb: object) -> None:
        if error is not None:
            self.handle.close()
            self.tmp.unlink(missing_ok=True)
            return
        _fsync(self.handle)
        self.handle.close()
        os.replace(self.tmp, self.target)


register_sink(".jsonl", JsonLinesSink)
register_sink(".ndjson", JsonLinesSink)
