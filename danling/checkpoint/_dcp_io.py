"""DCP's reader and load planner with every pickle read by the restricted unpickler, what a load reads, and a
writer that hashes its files as it writes them.

DCP unpickles its `.metadata` index with plain `pickle` and the non-tensor entries of a
checkpoint with `torch.load(weights_only=False)`: either can run code planted in the files.
These subclasses route both through [`danling.checkpoint.unpickling`][] unless `trusted`.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

from ._dcp_read import read_entry, read_into
from ._writeback import WritebackWriter
from .checksums import BackgroundVerification, file_record
from .manifest import CheckpointError
from .ranks import RankLayout, rank_entry
from .unpickling import UnsafePickleError, read_dcp_metadata

__all__ = ["SafeReader", "SafePlanner", "RecordingWriter", "CheckpointException"]


class _Plan(NamedTuple):
    layout: RankLayout
    metadata: Metadata
    wanted: tuple[str, ...]  # top-level keys to read
    per_rank: tuple[str, ...]  # of those, the ones stored per data rank


class _Records:
    """Manifest records of the files one rank wrote, passed along with its DCP write results."""

    def __init__(self, files: dict[str, Any]) -> None:
        self.files = files


class _HashedFile(WritebackWriter):
    """A DCP data file being written: hashed on the way, and noting anything but appending.

    DCP only writes, asks `tell` and closes; a `seek` elsewhere than the end means the digest of
    the writes may not describe the file, so its record is then taken by reading it back. Its
    writeback starts while it is written (see `WritebackWriter`).
    """

    def __init__(self, raw: Any, checksum: str) -> None:
        super().__init__(raw, checksum, chunked=True)
        self.appended = True

    def tell(self) -> int:
        return self.raw.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        position = self.raw.seek(offset, whence)
        self.appended = self.appended and position == self.size
        return position

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:  # the file itself closes with `create_stream`, once it is synced
        self.raw.flush()


class _HashingFileSystem(FileSystem):
    """DCP's local file system, with every data file hashed while written and synced once complete."""

    def __init__(self, checksum: str) -> None:
        super().__init__()
        self.checksum = checksum
        self.written: dict[str, dict[str, Any]] = {}  # file name -> record, since the last `take`
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        path = Path(path)
        if mode != "wb" or path.suffix != ".distcp":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with path.open("wb") as raw:
            stream = _HashedFile(raw, self.checksum)
            yield stream
            raw.flush()
            os.fsync(raw.fileno())
            intact = stream.appended and os.fstat(raw.fileno()).st_size == stream.size
        record = stream.record() if intact else file_record(path, checksum=self.checksum, chunked=True)
        with self._lock:
            self.written[path.name] = record

    def take(self) -> dict[str, dict[str, Any]]:
        """The records of the files written since the last call."""
        with self._lock:
            written, self.written = self.written, {}
        return written


class RecordingWriter(dcp.FileSystemWriter):
    """DCP's file writer, with each rank's data files hashed while written and synced before DCP gathers the results.

    The records travel to the coordinator inside that gather, so recording them costs no
    collective of its own; the coordinator finds them all in `records` once the save returns.
    The bytes are hashed on their way to the file (no second read), and each data file is
    fsynced as DCP would; DCP's own sync is off, so its `.metadata` is left to the caller.
    """

    def __init__(self, path: str, checksum: str) -> None:
        super().__init__(path, sync_files=False)
        self.checksum = checksum
        self.fs = _HashingFileSystem(checksum)
        self.records: dict[str, Any] = {}

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.fs.take()  # what an earlier, failed write left
        written = super().write_data(plan, planner)
        written.wait()
        done: torch.futures.Future = torch.futures.Future()
        done.set_result([*written.value(), _Records(self.fs.take())])
        return done

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        for item in (item for part in results for item in part if isinstance(item, _Records)):
            self.records.update(item.files)
        super().finish(metadata, [[item for item in part if not isinstance(item, _Records)] for part in results])


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, with its `.metadata` pickle read by the restricted unpickler.

    It reads each file front to back, and a plain tensor entry straight into its destination
    (one copy instead of DCP's two, see `danling.checkpoint._dcp_read`). Given a running
    `verification`, it touches an entry's bytes only once the verification has checked them (see
    [`BackgroundVerification`][danling.checkpoint.checksums.BackgroundVerification]): the files
    are hashed on helper threads just ahead of the read instead of in a pass before it.
    `entries_read` counts the entries read so far.
    """

    def __init__(
        self,
        path: str,
        *,
        trusted: bool = False,
        verification: BackgroundVerification | None = None,
        metadata: Metadata | None = None,
    ) -> None:
        super().__init__(path)
        self.trusted = trusted
        self.metadata = metadata  # already read (and planned from) by the caller: not unpickled again
        self.verification = verification
        self.entries_read = 0

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.metadata is not None and kwargs.get("rank") is None:
            metadata = self.metadata
        elif self.trusted:
            return super().read_metadata(*args, **kwargs)
        else:
            metadata = read_dcp_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: Any) -> Any:
        # Each file front to back (the order it is verified in); plain tensor entries are read
        # straight into their destination, the others by DCP's reader.
        items = sorted(plan.items, key=self._position)
        rest, handle, opened = [], None, None
        try:
            for item in items:
                info = self.storage_data[item.storage_index]
                if item.type != LoadItemType.TENSOR or info.transform_descriptors:
                    rest.append(item)
                    continue
                if opened != info.relative_path:
                    if handle is not None:
                        handle.close()
                    handle = open(self.fs.concat_path(self.path, info.relative_path), "rb", buffering=0)  # noqa: SIM115
                    opened = info.relative_path
                self._wait(info)
                target = planner.resolve_tensor(item).detach()
                if read_into(handle, info.offset, info.length, target):
                    planner.commit_tensor(item, target)
                    self.entries_read += 1
                else:
                    rest.append(item)
        finally:
            if handle is not None:
                handle.close()
        return super().read_data(dataclasses.replace(plan, items=rest), planner)

    def _position(self, item: Any) -> tuple[str, int]:
        info = self.storage_data[item.storage_index]
        return info.relative_path, info.offset

    def _wait(self, info: Any) -> None:
        if self.verification is not None:
            self.verification.wait(info.relative_path, info.offset + info.length)

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        self._wait(sinfo)
        self.entries_read += 1
        return super()._slice_file(file, sinfo)


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, unpickling plain (non-tensor) entries weights-only unless trusted."""

    def __init__(self, trusted: bool, directory: Path) -> None:
        super().__init__()
        self.trusted, self.directory = trusted, directory
        self.refused: UnsafePickleError | None = None
        self._plain: dict[bytes, Any] = {}  # unpickled scalars by pickle (see `_dcp_read.read_plain`)

    def load_bytes(self, read_item: Any, value: Any) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = read_entry(value, f"{self.directory} (entry {fqn})", self.trusted, self._plain)
        except UnsafePickleError as err:
            self.refused = err
            raise
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _damaged(error: BaseException, entries_read: int, live: bool) -> BaseException:
    """The verification's failure, saying what the live objects already received."""
    if not isinstance(error, CheckpointError) or not entries_read or not live:
        return error
    return CheckpointError(
        f"{error}. The {entries_read} entries read before the damage was found came from bytes that matched, "
        "so the live objects may already hold part of this checkpoint; load another checkpoint into them"
    )


def _paths(metadata: Metadata) -> dict[str, tuple]:
    """Nested key path of every stored leaf (DCP's planner data; dotted keys split for other planners)."""
    planner_data = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
    return {fqn: tuple(planner_data.get(fqn) or fqn.split(".")) for fqn in metadata.state_dict_metadata}


def _excluded(path: Sequence[Any], excludes: Sequence[str]) -> bool:
    dotted = ".".join(map(str, path))
    return any(dotted == key or dotted.startswith(key + ".") for key in excludes if "." in key)


def _targets(
    plan: _Plan, templates: Mapping[str, Any], data_rank: int, excludes: Sequence[str]
) -> tuple[dict[str, Any], dict[str, tuple]]:
    """Flat DCP load targets and the logical path (per-rank level removed) each one lands at.

    Stored leaves of live objects load into the object's own tensors; leaves the object does not
    have are read too when they are plain values (a hyperparameter a newer optimizer lacks) and
    skipped when they are tensors. Other entries get new CPU tensors (or `None` for plain values).
    """
    metadata, wanted, per_rank = plan.metadata, plan.wanted, plan.per_rank
    mine = rank_entry(data_rank)
    flat_templates: dict[str, Any] = {}
    for key, template in templates.items():
        nested = {key: {mine: template} if key in per_rank else template}
        flat_templates.update(flatten_state_dict(nested)[0])
    targets: dict[str, Any] = {}
    mapping: dict[str, tuple] = {}
    for fqn, path in _paths(metadata).items():
        key = str(path[0])
        if key not in wanted or (key in per_rank and (len(path) < 2 or path[1] != mine)):
            continue
        logical = (key, *path[2:]) if key in per_rank else path
        if _excluded(logical, excludes):
            continue
        stored = metadata.state_dict_metadata[fqn]
        if fqn in flat_templates:
            targets[fqn] = flat_templates[fqn]
        elif isinstance(stored, TensorStorageMetadata):
            if key in templates:
                continue  # a tensor the live object has no place for
            targets[fqn] = torch.empty(stored.size, dtype=stored.properties.dtype)
        else:
            targets[fqn] = None
        mapping[fqn] = logical
    return targets, mapping
