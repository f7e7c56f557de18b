"""Checkpoints written collectively with ``torch.distributed.checkpoint`` (DCP).

Every rank takes part in a save: DCP splits the tensors between the ranks (replicated DDP
weights are written once, sharded ones by their owners) into ``__<rank>_<n>.distcp`` files plus a
``.metadata`` index. The layout, manifest, aliases, retention and crash recovery are those of
[`CheckpointManager`][danling.checkpoint.CheckpointManager]: rank 0 picks the temporary
directory, all ranks write into it, and rank 0 hashes the files, writes the manifest, renames the
directory into place, moves the aliases and prunes, then tells the other ranks how it went.

Loading needs no collective: each rank reads the whole checkpoint back as a nested dict.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.utils._pytree import tree_map

from danling.utils import to_device

from .base import CheckpointManager
from .manifest import CheckpointError, verify_directory

__all__ = ["TorchDistributedCheckpointManager", "get_training_state", "read_dcp_checkpoint", "set_training_state"]

_METADATA = ".metadata"
_RANK_PREFIX = "rank"


def get_training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Model (and optimizer) state keyed by parameter names, ready for any checkpoint backend.

    Uses DCP's ``get_state_dict``: wrapper prefixes (DDP ``module.``, ``torch.compile``) are
    dropped and the optimizer state is keyed by parameter name instead of by position, so the
    payload survives a change of wrapping and, unlike ``optimizer.state_dict()``, a round trip
    through DCP (which stores every mapping key as a string).

    Returns:
        ``{"model": ...}`` plus ``"optimizer"`` when an optimizer is given.

    Examples:
        >>> model = nn.Linear(2, 1)
        >>> state = get_training_state(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> sorted(state["model"]), state["optimizer"]["param_groups"][0]["params"]
        (['bias', 'weight'], ['weight', 'bias'])
    """
    if optimizer is None:
        model_state, _ = get_state_dict(model, [])
        return {"model": model_state}
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def set_training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, state: Mapping[str, Any], *, strict: bool = True
) -> None:
    """Load what [`get_training_state`][danling.checkpoint.dcp.get_training_state] produced into live objects.

    Args:
        model: The (possibly wrapped) model to load ``state["model"]`` into.
        optimizer: The optimizer to load ``state["optimizer"]`` into, or ``None`` to skip it.
        state: A mapping with ``"model"`` and optionally ``"optimizer"``.
        strict: Require the model keys to match exactly.
    """
    options = StateDictOptions(strict=strict)
    # set_state_dict consumes the mappings it is given; rebuild the containers so `state` stays intact.
    model_state = tree_map(lambda leaf: leaf, state["model"])
    if optimizer is None or "optimizer" not in state:
        set_state_dict(model, [], model_state_dict=model_state, optim_state_dict={}, options=options)
    else:
        optimizer_state = tree_map(lambda leaf: leaf, state["optimizer"])
        set_state_dict(
            model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state, options=options
        )


def _check_keys(obj: Any, path: str = "") -> None:
    """DCP turns mapping keys into strings; refuse other keys instead of silently renaming them."""
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            if not isinstance(key, str):
                where = f"{path}.{key!r}" if path else repr(key)
                raise TypeError(
                    f"DCP checkpoints need string keys, but the state has key {where} ({type(key).__name__}); "
                    "it would come back as a string. Use danling.checkpoint.dcp.get_training_state for "
                    "optimizer state, or convert the keys"
                )
            _check_keys(value, f"{path}.{key}" if path else key)


def _read_dcp_directory(directory: Path) -> dict[str, Any]:
    payload: dict[str, Any] = {}
    try:
        with warnings.catch_warnings():  # DCP warns that it runs without a process group: that is the intent
            warnings.simplefilter("ignore", UserWarning)
            _load_state_dict(
                payload,
                storage_reader=dcp.FileSystemReader(str(directory)),
                planner=_EmptyStateDictLoadPlanner(),
                no_dist=True,
            )
    except Exception as err:
        raise CheckpointError(f"DCP checkpoint {directory} cannot be read: {err}") from err
    return payload


def read_dcp_checkpoint(
    path: str | os.PathLike, *, rank: int | None = None, map_location: Any = "cpu"
) -> dict[str, Any]:
    """Verify and load a DCP checkpoint (directory, alias pointer or file inside it) without keeping a manager.

    Args:
        path: The checkpoint directory, a ``*.pointer`` alias file, or a file inside the checkpoint.
        rank: Whose copy of the rank-local entries to return; defaults to this process's rank.
        map_location: Device to move the loaded tensors to.
    """
    path = Path(path)
    manager = TorchDistributedCheckpointManager(path.parent, load_only=True)
    if rank is not None:
        manager.rank = rank
    return manager.load(path, map_location=map_location)


class TorchDistributedCheckpointManager(CheckpointManager):
    """Checkpoint manager that writes with ``torch.distributed.checkpoint`` from every rank.

    `save` is collective: every rank of the process group must call it with the same name and
    aliases, in the same order. Entries that differ between ranks (the runner's RNG snapshot in
    ``state``, ``dataloaders`` positions) are listed in `rank_local_keys`; each rank stores its own
    copy under ``<key>.rank<r>`` and gets its own copy back from `load` (the runner's ``loop`` entry,
    which carries each rank's next-batch fingerprints, is rank-local too). Everything else is
    assumed identical (or DCP-sharded) across ranks.

    Mapping keys must be strings, because DCP stores them as strings; a state with other keys is
    refused. Build model and optimizer entries with
    [`get_training_state`][danling.checkpoint.dcp.get_training_state].

    With ``async_save=True`` the state is copied to CPU and written on a background thread. The
    collectives of that write run on a dedicated process group (gloo by default) so they never
    interleave with the training collectives of the default group. Without a process group (a
    single process) the manager writes and reads DCP checkpoints locally.

    Args:
        directory: Where checkpoints live (shared by all ranks).
        process_group: Group to checkpoint over; ``None`` means the default group, or a new
            dedicated group for asynchronous saves (see below).
        dedicated_async_process_group: With `async_save`, create a separate group for checkpoint
            traffic. Creating it is collective: every rank must build the manager together.
        async_process_group_backend: Backend of that dedicated group.
        rank_local_keys: Top-level keys whose values differ between ranks.
        **kwargs: The options of [`CheckpointManager`][danling.checkpoint.CheckpointManager]
            (``interval``, ``keep_latest_k``, ``async_save``, ``load_only``, ...). ``is_main_process``
            is derived from the group rank when a group is active.

    Examples:
        >>> import tempfile
        >>> manager = TorchDistributedCheckpointManager(tempfile.mkdtemp(), keep_latest_k=1)
        >>> model = nn.Linear(2, 1)
        >>> _ = manager.save({**get_training_state(model), "state": {"epoch": 1}}, "epoch-000001")
        >>> _ = manager.save({**get_training_state(model), "state": {"epoch": 2}}, "epoch-000002")
        >>> [path.name for path in manager.checkpoints()], manager.load("latest")["state"]
        (['epoch-000002'], {'epoch': 2})
    """

    backend = "dcp"
    is_collective = True

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        process_group: Any = None,
        dedicated_async_process_group: bool = True,
        async_process_group_backend: str = "gloo",
        rank_local_keys: Sequence[str] = ("state", "dataloaders", "rng", "loop"),
        **kwargs: Any,
    ) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        if not self.distributed:
            process_group = None
        elif process_group is None and kwargs.get("async_save") and dedicated_async_process_group:
            process_group = dist.new_group(backend=async_process_group_backend)
        self.process_group = process_group
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        kwargs["is_main_process"] = self.rank == 0
        self.rank_local_keys = tuple(rank_local_keys)
        self._announced = False
        super().__init__(directory, **kwargs)

    def save(
        self,
        state: Mapping[str, Any],
        name: str,
        *,
        aliases: Sequence[str] = ("latest",),
        history: bool | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Path | None:
        """Collectively write `state` as checkpoint `name`; every rank must call this.

        Arguments are those of [`CheckpointManager.save`][danling.checkpoint.CheckpointManager.save].
        Every rank returns the checkpoint path (``None`` when the manager is load-only).

        Raises:
            TypeError: the state holds a mapping key that is not a string.
        """
        _check_keys(state)  # fail in the caller's thread, not later inside an async write
        return super().save(state, name, aliases=aliases, history=history, metadata=metadata)

    # collective plumbing ---------------------------------------------------------------------

    def _exchange(self, obj: Any) -> Any:
        """Broadcast `obj` from the coordinator (group rank 0) to every rank of the group."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.process_group, group_src=0)
        return box[0]

    def _recover(self) -> None:
        # One process tidies leftovers; the others cannot race it because they learn the next
        # temporary directory from it.
        if self.is_main_process:
            super()._recover()

    def _persist(
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
            raise local_error
        if outcome is not None:
            raise CheckpointError(f"saving checkpoint {name!r} failed on rank 0: {outcome}")
        return self.directory / name

    # backend hooks ---------------------------------------------------------------------------

    def _write_payload(self, state: Mapping[str, Any], directory: Path) -> Mapping[str, Mapping[str, Any]]:
        # Runs on the coordinator inside the base class's write: tell the followers where to write.
        self._exchange(str(directory))
        self._announced = True
        self._save(state, directory)
        return {}  # the base class hashes and fsyncs every file DCP produced

    def _save(self, state: Mapping[str, Any], directory: Path) -> None:
        local = dict(state)
        for key in self.rank_local_keys:
            if key in local:
                local[key] = {f"{_RANK_PREFIX}{self.rank}": local[key]}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(
                local,
                storage_writer=dcp.FileSystemWriter(str(directory), sync_files=True),
                process_group=self.process_group,
                no_dist=not self.distributed,
            )

    def _read_payload(self, directory: Path, manifest: Mapping[str, Any], map_location: Any) -> dict[str, Any]:
        if _METADATA not in manifest["files"]:
            raise CheckpointError(f"checkpoint {directory} has no DCP {_METADATA} in its manifest")
        payload = _read_dcp_directory(directory)
        for key in self.rank_local_keys:
            copies = payload.get(key)
            if not isinstance(copies, Mapping):
                continue
            mine = f"{_RANK_PREFIX}{self.rank}"
            if mine in copies:
                payload[key] = copies[mine]
            else:
                del payload[key]
                self.logger.warning(
                    "checkpoint %s has no %r entry for rank %d (it holds %s); leaving it out",
                    directory,
                    key,
                    self.rank,
                    sorted(copies),
                )
        return _to_location(payload, map_location)

    def _read_file(self, path: Path, map_location: Any) -> dict[str, Any]:
        if (path.parent / _METADATA).is_file():  # a file inside a DCP checkpoint: read the whole checkpoint
            return self._read_payload(path.parent, verify_directory(path.parent), map_location)
        try:
            return torch.load(path, map_location=map_location, weights_only=False)
        except Exception as err:
            raise CheckpointError(f"checkpoint {path} cannot be unpickled: {err}") from err


def _to_location(payload: dict[str, Any], map_location: Any) -> dict[str, Any]:
    if map_location is None or str(map_location) == "cpu":
        return payload  # DCP reads into CPU memory
    return to_device(payload, map_location)
