"""Verifying a DCP checkpoint together: each rank of a group hashes a share of its files.

When every rank of a group loads the same checkpoint at once (a runner restoring itself), each
rank hashing every file does the same work once per rank. With
``TorchDistributedCheckpointManager(verify_together=True)``, `load` instead gives each rank a
share of the data files (balanced by size, the same split on every rank); a rank hashes its share
while it reads, reads the entries it needs from the other files without waiting for them, and
then one all-gather tells every rank what every other rank found. `load` returns only once every
file of the checkpoint verified on some rank, and raises on every rank when any rank found a
damaged file or failed otherwise, so no rank goes on alone. The files the others checked count as
verified in the current [`verification_scope`][danling.checkpoint.manifest.verification_scope],
so reading the live objects afterwards hashes nothing again.

The entries read from other ranks' files before the verdict are parsed by the restricted
unpickler only (never with `trusted`) and are thrown away when the verdict says a file is damaged.
Ranks that turn out to have loaded different checkpoints (the exchange carries which one) hash
the rest themselves.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from danling.distributed.collectives import _on_backend_device

from .manifest import CheckpointError, read_manifest, verify_directory, vouch_for

__all__ = ["load_together", "shares"]

_METADATA = ".metadata"
_OK, _DAMAGED, _FAILED = 0, 1, 2


def shares(files: Mapping[str, Mapping[str, Any]], world_size: int, skip: tuple[str, ...] = ()) -> list[set[str]]:
    """Split the manifest entries `files` (but `skip`) into `world_size` shares of about equal bytes.

    Largest first, each to the share with the fewest bytes so far (ties: the lowest rank); the same
    manifest gives the same split on every rank.

    Examples:
        >>> files = {"a": {"size": 5}, "b": {"size": 3}, "c": {"size": 3}, ".m": {"size": 1}}
        >>> [sorted(share) for share in shares(files, 2, skip=(".m",))]
        [['a'], ['b', 'c']]
    """
    parts: list[set[str]] = [set() for _ in range(world_size)]
    loads = [0] * world_size
    for key, entry in sorted(files.items(), key=lambda item: (-int(item[1]["size"]), item[0])):
        if key in skip:
            continue
        rank = loads.index(min(loads))
        parts[rank].add(key)
        loads[rank] += int(entry["size"])
    return parts


def load_together(manager: Any, checkpoint: str | os.PathLike, map_location: Any) -> dict[str, Any]:
    """`manager.load(checkpoint)` with the verification split over the ranks of its group (see the module).

    The share of each rank is verified through the manager's one verification path (`_verified`)."""
    group, rank = manager.process_group, manager.rank
    world_size = dist.get_world_size(group)
    payload: dict[str, Any] | None = None
    error: BaseException | None = None
    status, identity, directory, manifest, others = _OK, "", None, None, set()
    try:
        manager.wait()
        path = manager.resolve(checkpoint)
        directory = path if path.is_dir() else path.parent
        if not (directory / _METADATA).is_file():  # not a DCP checkpoint: read (and verified) whole, here
            payload = manager._load(checkpoint, map_location)
        else:
            manifest = read_manifest(directory)
            parts = shares(manifest["files"], world_size, skip=(_METADATA,))
            others = set().union(*parts) - parts[rank]
            identity = f"{os.path.realpath(directory)}|{manifest.get('name')}|{manifest.get('created_ns')}"
            verification = None
            try:  # the manager's one verification path, hashing this rank's share only
                with manager._verified(directory, share=parts[rank]) as verified:
                    verification = verified.background
                    payload = manager._read_payload(directory, verified, map_location)
            finally:
                status = _DAMAGED if verification is not None and verification.failure is not None else _OK
    except BaseException as err:  # every rank must reach the exchange, whatever happened here
        error, status = err, status if status == _DAMAGED else _FAILED
    verdicts = _exchange(group, world_size, identity, status, error)
    _raise_failures(verdicts, rank, status, error)
    if others:  # every rank verified its share, and nothing failed anywhere
        if all(verdict[0] == verdicts[rank][0] for verdict in verdicts):
            vouch_for(directory, manifest, others)
        else:  # another rank loaded another checkpoint: check the rest here
            verify_directory(directory, sorted(others))
    return payload


def _exchange(group: Any, world_size: int, identity: str, status: int, error: BaseException | None) -> list[tuple]:
    """Every rank's (checkpoint identity, status, message): one all-gather, a second one only to carry messages."""
    digest = hashlib.blake2b(identity.encode(), digest_size=7).digest() if identity else b""
    mine = _on_backend_device(torch.tensor([int.from_bytes(digest, "little"), status], dtype=torch.int64), group)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=group)
    messages: list[Any] = [""] * world_size
    if any(int(found[1]) != _OK for found in gathered):  # every rank sees this: all of them gather the messages
        message = "" if error is None else str(error) if status == _DAMAGED else f"{type(error).__name__}: {error}"
        dist.all_gather_object(messages, message, group=group)
    return [(int(found[0]), int(found[1]), text) for found, text in zip(gathered, messages)]


def _raise_failures(verdicts: list[Any], rank: int, status: int, error: BaseException | None) -> None:
    """Raise on every rank when any rank failed: damage found anywhere first, then this rank's own error."""
    if error is not None and status == _DAMAGED:
        raise error
    mine = verdicts[rank][0]
    for other, (identity, found, message) in enumerate(verdicts):
        if other != rank and found == _DAMAGED and identity == mine:
            raise CheckpointError(f"{message} (rank {other} checked that file for every rank)")
    if error is not None:
        raise error
    for other, (_, found, message) in enumerate(verdicts):
        if other != rank and found != _OK:
            raise CheckpointError(f"loading the checkpoint failed on rank {other}, so no rank goes on: {message}")
