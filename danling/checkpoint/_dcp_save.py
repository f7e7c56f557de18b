"""How a DCP save is coordinated between the ranks: on DCP's own collectives, with no exchange of its own.

A DCP save already makes every rank meet twice: the coordinator (group rank 0) gathers the local
plans and scatters the final ones, then gathers the write results, writes ``.metadata`` and
broadcasts the outcome. [`PublishingWriter`][danling.checkpoint._dcp_save.PublishingWriter] lets
the save ride on both:

- the temporary directory the coordinator picked travels to the other ranks inside their final
  plan, so they need not be told beforehand (the coordinator creates it in its local step, which
  DCP finishes before any rank writes);
- the coordinator seals, publishes, points the aliases and prunes inside DCP's ``finish``, so
  DCP's broadcast of the outcome tells every rank whether the checkpoint is in place, or why not.

The order on disk is that of every other backend (data files synced and recorded, manifest
synced, directory renamed, aliases rewritten), and every rank still returns only once the
checkpoint is published, or raises when the save failed anywhere.

A subclass that writes its payload by other means (overriding `_save`, as the DeepSpeed manager
does) keeps the two explicit broadcasts: directory before the write, outcome after it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StoragePrefix

from ._dcp_io import CheckpointException, RecordingWriter
from ._dcp_read import pack_plain
from .failures import unpicklable_error
from .layout import in_flight
from .manifest import CheckpointError
from .ranks import rank_entry

__all__ = ["PublishingWriter", "CollectiveSaves"]


@dataclasses.dataclass
class _Destination(_StoragePrefix):
    """A rank's file prefix plus the directory the coordinator writes the checkpoint into."""

    directory: str = ""


class PublishFailed(CheckpointError):
    """Completing a save failed on the coordinator; the message is its error (the original stays there)."""


class PublishingWriter(RecordingWriter):
    """DCP's file writer that learns its directory from the coordinator and lets the coordinator publish.

    Args:
        path: The temporary directory on the coordinator; ``None`` on the other ranks, which take the
            directory from their final plan.
        checksum: Checksum algorithm of the records.
        publish: Called on the coordinator with every rank's records once ``.metadata`` is written;
            its error fails the save on every rank (kept in `failure`).
    """

    def __init__(
        self, path: Path | None, checksum: str, publish: Callable[[dict[str, Any]], None] | None = None
    ) -> None:
        super().__init__(str(path or "."), checksum)
        self.follower = path is None
        self.publish = publish
        self.failure: BaseException | None = None

    def prepare_local_plan(self, plan: Any) -> Any:
        # Only the coordinator knows (and creates) the directory; the others write after the scatter.
        return plan if self.follower else super().prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        plans = super().prepare_global_plan(plans)
        return [
            dataclasses.replace(plan, storage_data=_Destination(plan.storage_data.prefix, str(self.path)))
            for plan in plans
        ]

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self.follower:
            self.path = self.fs.init_path(plan.storage_data.directory)
        return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        super().finish(metadata, results)
        if self.publish is None:
            return
        try:
            self.publish(dict(self.records))
        except BaseException as err:
            self.failure = err
            # DCP pickles the error to every rank: send a plain stand-in, the original is raised here
            raise PublishFailed(f"{type(err).__name__}: {err}") from None


def _publish_failure(error: CheckpointException) -> PublishFailed | None:
    """The coordinator's failure to complete a save, when that (and no write) is what failed."""
    failures = getattr(error, "failures", {})
    found = [pair[0] for pair in failures.values() if isinstance(pair, tuple) and pair]
    return found[0] if len(found) == 1 and isinstance(found[0], PublishFailed) else None


class CollectiveSaves:
    """The collective save of the DCP manager (mixed into
    [`TorchDistributedCheckpointManager`][danling.checkpoint.dcp.TorchDistributedCheckpointManager])."""

    def _persist(
        self, state: Mapping[str, Any], name: str, aliases: tuple[str, ...], history: bool, metadata: dict
    ) -> Path:
        from .dcp import TorchDistributedCheckpointManager

        if type(self)._save is not TorchDistributedCheckpointManager._save:
            return self._persist_announced(state, name, aliases, history, metadata)
        if not self.is_main_process:
            return self._persist_following(state, name)
        tmp, final = self._temp_dir(name), self.directory / name

        def publish(records: dict[str, Any]) -> None:
            self._complete(tmp, final, state, records, aliases, history, metadata)

        writer = PublishingWriter(tmp, self.checksum, publish)
        try:
            with in_flight(tmp):
                self._write(state, writer)
        except BaseException as err:
            if writer.failure is not None:  # `_complete` removed the directory and phrased the error
                raise writer.failure from None
            self._abandon(tmp, final, state, err)
            raise
        finally:
            self._discard.flush()  # after the save's last fsync (see `Discard`)
        return final

    def _persist_following(self, state: Mapping[str, Any], name: str) -> Path:
        try:
            self._write(state, PublishingWriter(None, self.checksum))
        except CheckpointException as err:
            failure = _publish_failure(err)
            if failure is None:
                raise
            raise CheckpointError(f"saving checkpoint {name!r} failed on rank 0: {failure}") from None
        return self.directory / name

    def _write(self, state: Mapping[str, Any], writer: RecordingWriter) -> None:
        """Write this rank's part of `state` with DCP through `writer`."""
        local = {key: pack_plain(value) for key, value in state.items()} if self.pack_plain else dict(state)
        for key in self.rank_local_keys:
            if key in local:
                local[key] = {rank_entry(self.data_rank): local[key]}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(local, storage_writer=writer, process_group=self.process_group, no_dist=not self.distributed)

    def _save(self, state: Mapping[str, Any], directory: Path) -> dict[str, Any]:
        """Write this rank's part of `state` into `directory`; the coordinator gets every rank's data-file records."""
        writer = RecordingWriter(str(directory), self.checksum)
        self._write(state, writer)
        return writer.records

    # Subclasses writing by other means: the directory and the outcome go by broadcast. -------------

    def _exchange(self, obj: Any) -> Any:
        """Broadcast `obj` from the coordinator (group rank 0) to every rank of the group."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.process_group, group_src=0)
        return box[0]

    def _persist_announced(
        self, state: Mapping[str, Any], name: str, aliases: tuple[str, ...], history: bool, metadata: dict
    ) -> Path:
        if not self.is_main_process:
            return self._persist_follower(state, name)
        self._announced = False
        error: BaseException | None = None
        try:
            final = super()._persist(state, name, aliases, history, metadata)
        except BaseException as err:  # the followers must hear about it before we re-raise
            error = err
        if not self._announced:
            self._exchange(None)
        self._exchange(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        return final

    def _persist_follower(self, state: Mapping[str, Any], name: str) -> Path:
        directory = self._exchange(None)
        if directory is None:
            raise CheckpointError(f"saving checkpoint {name!r} failed on rank 0: {self._exchange(None)}")
        local_error: BaseException | None = None
        try:
            self._save(state, Path(directory))
        except BaseException as err:
            local_error = err
        outcome = self._exchange(None)
        if local_error is not None:
            named = unpicklable_error(local_error, name, state)  # as the coordinator's `_abandon` names it
            if named is not None:
                raise named from local_error
            raise local_error
        if outcome is not None:
            raise CheckpointError(f"saving checkpoint {name!r} failed on rank 0: {outcome}")
        return self.directory / name

    def _write_payload(self, state: Mapping[str, Any], directory: Path) -> Mapping[str, Mapping[str, Any]]:
        # Runs on the coordinator inside the base class's write: tell the followers where to write.
        self._exchange(str(directory))
        self._announced = True
        # Collective. DCP raises an error of any rank's write on every rank; on success every rank's
        # data files are written, synced and recorded (the base class hashes the rest: DCP's .metadata).
        return self._save(state, directory)
