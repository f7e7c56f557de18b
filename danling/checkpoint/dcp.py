"""Checkpoints written collectively with ``torch.distributed.checkpoint`` (DCP).

Every rank takes part in a save: DCP splits the tensors between the ranks (replicated DDP
weights are written once, sharded ones by their owners) into ``__<rank>_<n>.distcp`` files plus a
``.metadata`` index. The layout, manifest, aliases, retention and crash recovery are those of
[`CheckpointManager`][danling.checkpoint.CheckpointManager]: rank 0 picks the temporary
directory, all ranks write into it and hash and sync their own files (the records reach rank 0
with DCP's own gather of the write results), and rank 0 writes the manifest, renames the directory
into place, moves the aliases and prunes before DCP tells every rank how the save went: the save
needs no collective besides DCP's own (see `danling.checkpoint._dcp_save`).

Loading needs no collective, unless `verify_together` asks the ranks of a restore to share the
hashing (see `danling.checkpoint._dcp_shared`).
[`load_into`][danling.checkpoint.CheckpointManager.load_into] reads each
live object's entries straight into its own tensors (a DTensor gets only its local shard), and
the small plain entries next to them; `load` reads the whole checkpoint into CPU
tensors, for tools and inspection. Per-rank entries follow [`danling.checkpoint.ranks`][].
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element

from danling.utils import to_device

from ._dcp_checks import _check_index, _check_keys, _data_domain, _key_names
from ._dcp_io import CheckpointException, SafePlanner, SafeReader, _damaged, _paths, _Plan, _targets
from ._dcp_plain import read_whole
from ._dcp_read import unpack_plain
from ._dcp_save import CollectiveSaves
from ._dcp_shared import load_together
from .base import CheckpointManager, Verified
from .checksums import BackgroundVerification
from .manifest import (
    DEFAULT_CHECKSUM,
    CheckpointError,
    check_checksum,
    parsed_once,
)
from .payload import drop_key, load_template
from .ranks import RANK_LAYOUT_KEY, layout_record, plan_rank_entries, read_layout
from .training import ModelState, OptimizerState, TrainingState, get_training_state, set_training_state
from .unpickling import SAFE_GLOBALS, UnsafePickleError, torch_load

__all__ = [
    "TorchDistributedCheckpointManager",
    "ModelState",
    "OptimizerState",
    "TrainingState",
    "get_training_state",
    "set_training_state",
    "read_dcp_checkpoint",
]

_METADATA = ".metadata"


def read_dcp_checkpoint(
    path: str | os.PathLike, *, rank: int | None = None, map_location: Any = "cpu", **options: Any
) -> dict[str, Any]:
    """Verify and read a whole DCP checkpoint (directory, alias pointer or file inside it) without a manager.

    Meant for tools and inspection. Per-rank entries come back as the copy of data rank `rank`.
    With an explicit `rank`, or in a process without a process group (rank 0), any copy the
    checkpoint holds can be read, whatever data size wrote it. Inside a process group and without
    `rank`, the resize rule of the manager applies (see [`danling.checkpoint.ranks`][]).

    Args:
        path: The checkpoint directory, a ``*.pointer`` alias file, or a file inside the checkpoint.
        rank: Whose copy of the per-rank entries to return.
        map_location: Device to move the loaded tensors to.
        **options: Further options of the manager (``exclude_from_loading``, ``rank_local_keys``, ...).
    """
    path = Path(path)
    manager = TorchDistributedCheckpointManager(path.parent, load_only=True, **options)
    if rank is not None:
        manager._any_size = True
        manager.data_rank = _check_index(rank, "rank")
    return manager.load(path, map_location=map_location)


class TorchDistributedCheckpointManager(CollectiveSaves, CheckpointManager):
    """Checkpoint manager that writes with ``torch.distributed.checkpoint`` from every rank.

    `save` is collective: every rank of the process group must call it with the same name and
    aliases, in the same order. Top-level values may be live objects
    ([`ModelState`][danling.checkpoint.training.ModelState],
    [`OptimizerState`][danling.checkpoint.training.OptimizerState], any
    [`Stateful`][danling.checkpoint.Stateful]); `load_into` restores them in place.

    Entries whose value differs between data-parallel ranks (RNG streams, dataloader positions)
    are listed in `rank_local_keys`: each data rank stores its own copy under
    ``<key>.rank<data_rank>`` and gets it back on load. Everything else is global: identical on
    every rank, or sharded by DCP itself. The manifest records the data size the checkpoint was
    written with; loading it with another size drops the `optional_rank_local_keys` with a warning
    and raises [`CheckpointResizeError`][danling.checkpoint.CheckpointResizeError] on every rank
    for any other per-rank key that is loaded (see [`danling.checkpoint.ranks`][]).

    Mapping keys must be strings, because DCP stores them as strings; a state with other keys is
    refused.

    With ``async_save=True`` the state is copied to CPU (DTensors keep their sharding) and written
    on a background thread. The collectives of that write run on a dedicated process group (gloo by
    default) so they never interleave with the training collectives of the default group. Without a
    process group (a single process) the manager writes and reads DCP checkpoints locally.

    Args:
        directory: Where checkpoints live (shared by all ranks).
        process_group: Group to checkpoint over; ``None`` means the default group, or a new
            dedicated group for asynchronous saves (see below).
        dedicated_async_process_group: With `async_save`, create a separate group for checkpoint
            traffic. Creating it is collective: every rank must build the manager together.
        async_process_group_backend: Backend of that dedicated group.
        rank_local_keys: Top-level keys stored once per data-parallel rank.
        optional_rank_local_keys: Per-rank keys that loading on a different data size drops (with
            a warning) instead of refusing, e.g. ``("rng",)``.
        data_rank: This rank's index in the data-parallel domain (ranks that see the same batches,
            such as tensor-parallel peers, share one). Defaults to the group rank.
        data_size: Number of data-parallel ranks. Defaults to the group size. Outside a process
            group and without `data_rank`/`data_size`, the manager reads checkpoints of any data
            size (data rank 0's copies), as tools do; pass ``data_size=1`` to apply the resize rule.
        verify_together: Make `load` collective: every rank of the group loads the same checkpoint
            at once, each hashes a share of its files, and one exchange tells every rank the verdict,
            so a checkpoint is hashed once per group instead of once per rank. `load` still returns
            (or raises, on every rank) only once every file is verified. Ignored with `trusted`,
            whose unpickler only ever sees bytes this rank verified itself.
        **kwargs: The options of [`CheckpointManager`][danling.checkpoint.CheckpointManager]
            (``interval``, ``keep_latest_k``, ``async_save``, ``load_only``, ...). ``is_main_process``
            is derived from the group rank when a group is active.

    Examples:
        >>> import tempfile
        >>> import torch
        >>> manager = TorchDistributedCheckpointManager(tempfile.mkdtemp(), keep_latest_k=1)
        >>> model = torch.nn.Linear(2, 1)
        >>> _ = manager.save({"model": ModelState(model), "state": {"epoch": 1}}, "epoch-000001")
        >>> _ = manager.save({"model": ModelState(model), "state": {"epoch": 2}}, "epoch-000002")
        >>> [path.name for path in manager.checkpoints()], manager.load("latest")["state"]
        (['epoch-000002'], {'epoch': 2})
        >>> manager.load_into("latest", {"model": ModelState(torch.nn.Linear(2, 1))})
        {'state': {'epoch': 2}}
    """

    backend = "dcp"
    is_collective = True
    required_entries = (_METADATA,)
    """The DCP index, checked before it is unpickled (the data files are hashed while they are read)."""
    pack_plain = True
    """Store each top-level mapping without tensors as one entry (see `danling.checkpoint._dcp_read`)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        process_group: Any = None,
        dedicated_async_process_group: bool = True,
        async_process_group_backend: str = "gloo",
        rank_local_keys: Sequence[str] = ("state", "dataloaders", "rng", "loop"),
        optional_rank_local_keys: Sequence[str] = (),
        data_rank: int | None = None,
        data_size: int | None = None,
        checksum: str = DEFAULT_CHECKSUM,
        verify_together: bool = False,
        **kwargs: Any,
    ) -> None:
        self.checksum = check_checksum(checksum)
        self.verify_together = bool(verify_together)
        self.distributed = dist.is_available() and dist.is_initialized()
        if not self.distributed:
            process_group = None
        elif process_group is None and kwargs.get("async_save") and dedicated_async_process_group:
            process_group = dist.new_group(backend=async_process_group_backend)
        self.process_group = process_group
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self._world_size = world_size = dist.get_world_size(process_group) if self.distributed else 1
        self.data_rank, self.data_size = _data_domain(data_rank, data_size, self.rank, world_size)
        kwargs["is_main_process"] = self.rank == 0
        self.rank_local_keys = _key_names(rank_local_keys, "rank_local_keys")
        self.optional_rank_local_keys = _key_names(optional_rank_local_keys, "optional_rank_local_keys")
        # Without a process group or explicit data coordinates the manager is a reader for tools:
        # it takes whatever data size wrote the checkpoint and returns data rank 0's copies.
        self._any_size = not self.distributed and data_rank is None and data_size is None
        self._announced = False
        super().__init__(directory, **kwargs)

    def _extend_metadata(self, state: Mapping[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
        """Record the checkpoint's layout under ``"rank_layout"`` (data size, keys, per-rank keys).

        `save` is collective here: every rank must call it with the same name and aliases, and every
        rank returns the checkpoint path (``None`` when the manager is load-only).

        Raises:
            ValueError: `metadata` uses the reserved ``"rank_layout"`` key.
        """
        if RANK_LAYOUT_KEY in metadata:
            raise ValueError(f"checkpoint metadata key {RANK_LAYOUT_KEY!r} is reserved for the DCP manager's layout")
        keys = [str(key) for key in state] if isinstance(state, Mapping) else []
        local = [key for key in keys if key in self.rank_local_keys]
        metadata[RANK_LAYOUT_KEY] = layout_record(keys, local, self.data_size)
        return metadata

    def _capture(self, state: Mapping[str, Any]) -> dict[str, Any]:
        state = super()._capture(state)
        _check_keys(state)  # fail in the caller's thread, not later inside an async write
        return state

    def _recover(self) -> None:
        # One process tidies leftovers; the others cannot race it because they learn the next
        # temporary directory from it.
        if self.is_main_process:
            super()._recover()

    def _read_whole(self, path: Path) -> Path:
        # A file inside a DCP checkpoint stands for the whole checkpoint; a torch.save file is read alone.
        directory = path if path.is_dir() else path.parent
        return directory if (directory / _METADATA).is_file() else path

    def _reads_in_place(self, path: Path) -> bool:
        # A DCP checkpoint's entries go straight into live tensors.
        return self._verifies_while_reading(self._read_whole(path))

    def _verifies_while_reading(self, directory: Path) -> bool:
        # A DCP checkpoint is verified while it is read: each entry is read once the bytes it covers
        # matched the manifest, and the read returns once every file did.
        return (directory / _METADATA).is_file()

    def _read_into(self, verified: Verified, objects: Mapping[str, Any], map_location: Any) -> dict[str, Any]:
        """Read each object's entries straight into its tensors, then hand it its state.

        The entries go into the tensors of its `state_dict_to_load()` (or `state_dict()`), so a
        DTensor receives only its local shard and nothing else of the object is materialised; then
        the object gets `load_state_dict(...)`. Entries the object asks for but the checkpoint lacks
        are left out of what it gets (its `load_state_dict` decides:
        [`ModelState`][danling.checkpoint.training.ModelState] with ``strict`` raises). No
        collective is involved. Plain entries come back with per-rank keys resolved to this data
        rank's copy.

        Raises:
            CheckpointError: The checkpoint lacks an entry for one of `objects`.
            CheckpointResizeError: It was written by another data size and a loaded per-rank
                key is not optional.
        """
        directory = verified.path
        plan = self._plan(directory, verified.manifest)
        live = {key: obj for key, obj in objects.items() if key not in self.exclude_from_loading}
        missing = [key for key in live if key not in plan.layout.keys]
        if missing:
            raise CheckpointError(
                f"checkpoint {directory} has no {missing} entries to load into; it holds "
                f"{sorted(plan.layout.keys)}. Add {missing} to exclude_from_loading to keep those objects' "
                "current state"
            )
        live = {key: obj for key, obj in live.items() if key in plan.wanted}  # optional per-rank keys may drop
        templates = {key: load_template(obj) for key, obj in live.items()}
        payload = self._read(directory, plan, templates, verified.background)
        for key, obj in live.items():
            obj.load_state_dict(payload.pop(key))
        return _to_location(payload, map_location)

    def _load_agreed(self, checkpoint: str | os.PathLike, map_location: Any) -> dict[str, Any]:
        # With `verify_together`, the ranks of the group share the hashing and agree on the verdict.
        if self.verify_together and self._world_size > 1 and not self.trusted:
            return load_together(self, checkpoint, map_location)
        return self._load(checkpoint, map_location)

    def _plan(self, directory: Path, manifest: Mapping[str, Any]) -> _Plan:
        """Decide what this rank reads, from the manifest and DCP metadata alone (same on every rank)."""
        try:
            reader = SafeReader(str(directory), trusted=self.trusted)
            metadata = parsed_once(directory / _METADATA, reader.read_metadata)  # once per restore
        except UnsafePickleError:
            raise
        except Exception as err:
            raise CheckpointError(f"DCP checkpoint {directory} cannot be read: {err}") from err
        layout = read_layout(manifest, _paths(metadata).values(), self.rank_local_keys)
        wanted = [key for key in layout.keys if key not in self.exclude_from_loading]
        size = layout.data_size if self._any_size else self.data_size
        per_rank, dropped = plan_rank_entries(
            layout, wanted, data_size=size, optional=self.optional_rank_local_keys, origin=directory
        )
        if dropped:
            self.logger.warning(
                "checkpoint %s was written by %s data-parallel ranks and this run has %d: leaving out its "
                "per-rank entries %s (declared optional), which start afresh",
                directory,
                layout.data_size,
                self.data_size,
                list(dropped),
            )
        if self._any_size and per_rank and self.data_rank >= (layout.data_size or 0):
            raise CheckpointError(
                f"checkpoint {directory} holds per-rank entries {list(per_rank)} for data ranks "
                f"0..{(layout.data_size or 1) - 1}; there is no copy for rank {self.data_rank}"
            )
        return _Plan(layout, metadata, tuple(key for key in wanted if key not in dropped), per_rank)

    def _read(
        self,
        directory: Path,
        plan: _Plan,
        templates: Mapping[str, Any],
        verification: BackgroundVerification | None = None,
    ) -> dict[str, Any]:
        """Read the planned entries: into `templates` for live objects, into new CPU tensors for the rest.

        With a running `verification`, each entry is read once its bytes matched the manifest, and
        the read returns only once every file of the checkpoint did.
        """
        targets, mapping = _targets(plan, templates, self.data_rank, self.exclude_from_loading)
        reader = SafeReader(str(directory), trusted=self.trusted, verification=verification, metadata=plan.metadata)
        planner = SafePlanner(self.trusted, directory)
        try:  # entries stored in one piece directly, the rest (sharded tensors, ...) through DCP

            def counted() -> None:  # one count for both paths: a damage report says what live objects got
                reader.entries_read += 1

            rest = read_whole(directory, plan.metadata, targets, verification, self.trusted, counted)
            if rest:
                with warnings.catch_warnings():  # DCP warns that it runs without a process group: that is the intent
                    warnings.simplefilter("ignore", UserWarning)
                    dcp.load(rest, storage_reader=reader, planner=planner, no_dist=True)
                targets.update(rest)  # DCP replaced the non-tensor entries in `rest`
        except (Exception, CheckpointException) as err:  # DCP wraps errors per rank: raise a refusal as it is
            if verification is not None and verification.failure is not None:
                raise _damaged(verification.failure, reader.entries_read, bool(templates)) from None
            if isinstance(err, UnsafePickleError):
                raise
            if planner.refused is not None:
                raise planner.refused from None
            raise CheckpointError(f"DCP checkpoint {directory} cannot be read: {err}") from err
        if verification is not None:
            try:
                verification.finish()  # files this rank read nothing from are checked too: every rank agrees
            except CheckpointError as err:
                raise _damaged(err, reader.entries_read, bool(templates)) from None
        payload: dict[str, Any] = {}
        for fqn, value in targets.items():
            set_element(payload, mapping[fqn], value)
        for key in plan.wanted:  # DCP stores no empty mappings: a key it dropped held `{}`
            payload.setdefault(key, {})
        unpack_plain(payload, directory, self.trusted, list(SAFE_GLOBALS))
        for key in self.exclude_from_loading:
            if "." in key:
                drop_key(payload, key)
        return payload

    def _read_payload(self, directory: Path, verified: Verified, map_location: Any) -> dict[str, Any]:
        plan = self._plan(directory, verified.manifest)
        payload = self._read(directory, plan, {}, verified.background)
        for key in self.exclude_from_loading:
            drop_key(payload, key)
        return _to_location(payload, map_location)

    def _read_file(self, path: Path, map_location: Any) -> dict[str, Any]:
        return torch_load(path, map_location=map_location, trusted=self.trusted)


def _to_location(payload: dict[str, Any], map_location: Any) -> dict[str, Any]:
    if map_location is None or str(map_location) == "cpu":
        return payload  # DCP reads into CPU memory
    return to_device(payload, map_location)
