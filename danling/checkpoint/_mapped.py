"""Restoring live objects from a `torch.save` payload through a memory map of the file.

`torch.load` reads every tensor into freshly allocated memory, and `load_state_dict` then copies
it again into the model (an optimizer keeps the fresh tensors and frees its old ones). Mapping the
file instead (`torch.load(mmap=True)`) reads nothing up front: the file is hashed through its own
map on a helper thread while the pickle is parsed, and only once the whole file matched its
manifest entry do the objects get their state, copied from the mapped pages:

- a module copies the mapped tensors into its parameters and buffers (`load_state_dict`);
- an optimizer whose groups match gets its own state tensors back, filled in place, so nothing is
  allocated and nothing freed;
- anything else, and the entries left over, get private copies.

No live object and nothing returned keeps a reference into the map: a mapped checkpoint would
otherwise keep its file's disk space after retention deleted it, for as long as the run lasts.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .checksums import _beside, _corrupt, _digest_file, _entry_checksum, _torn
from .unpickling import torch_load

__all__ = ["read_mapped", "prepare_state", "release_module", "owned"]


def read_mapped(path: Path, entry: Mapping[str, Any] | None, *, map_location: Any, trusted: bool) -> Any:
    """`torch.load(path, mmap=True)`, checked against the manifest `entry` before it returns.

    The file is hashed on a helper thread while the caller's thread parses the pickle; a file that
    fails to parse and also fails its checksum is reported as damaged, not as unreadable.
    """
    if entry is None:  # a file with no manifest beside it loads unverified
        return torch_load(path, map_location=map_location, origin=path, trusted=trusted, mmap=True)
    checksum = _entry_checksum(entry, path)
    hashed = _beside(_digest_file, path, checksum)
    try:
        payload = torch_load(path, map_location=map_location, origin=path, trusted=trusted, mmap=True)
    except BaseException:
        _compare(path, entry, checksum, hashed.result())
        raise
    _compare(path, entry, checksum, hashed.result())
    return payload


def _compare(path: Path, entry: Mapping[str, Any], checksum: str, digest: tuple[int, str, list[str]]) -> None:
    size, actual, _ = digest
    if size != entry["size"]:
        raise _torn(path, size, entry["size"])
    if actual != entry[checksum]:
        raise _corrupt(path, checksum)


def prepare_state(obj: Any, state: Any) -> Any:
    """What `obj.load_state_dict` gets of the mapped `state`: as is for a module (it copies), else owned."""
    if isinstance(obj, torch.nn.Module):
        return state
    if isinstance(obj, torch.optim.Optimizer) and _groups_match(obj, state):
        return _fill_optimizer(obj, state)
    return owned(state)


def release_module(obj: Any, state: Any) -> None:
    """Give `obj` (a module, after `load_state_dict(state)`) its own copy of any tensor it took from the map.

    A module's `load_state_dict` copies into its tensors; one that assigns them instead (a custom
    hook, ``assign=True``) would keep the mapped pages, so those tensors are copied out here.
    """
    if not isinstance(obj, torch.nn.Module):
        return
    mapped = {_address(tensor) for tensor in _tensors(state) if tensor.device.type == "cpu"}
    mapped.discard(None)
    if not mapped:
        return
    for tensor in itertools.chain(obj.parameters(), obj.buffers()):
        if tensor.device.type == "cpu" and _address(tensor) in mapped:
            tensor.data = tensor.data.clone()


def owned(tree: Any) -> Any:
    """`tree` with every CPU tensor moved to memory of its own; tensors sharing a storage still share it."""
    copies: dict[int, Any] = {}

    def copy(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "cpu" or obj.layout != torch.strided:
                return obj if obj.device.type != "cpu" else obj.clone()
            storage = obj.untyped_storage()
            key = storage.data_ptr()
            if key not in copies:
                copies[key] = storage.clone()
            view = torch.empty(0, dtype=obj.dtype)
            return view.set_(copies[key], obj.storage_offset(), obj.shape, obj.stride()).requires_grad_(
                obj.requires_grad
            )
        if isinstance(obj, dict):
            return type(obj)((key, copy(value)) for key, value in obj.items())
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            return type(obj)(copy(value) for value in obj)
        return obj

    return copy(tree)


def _groups_match(optimizer: torch.optim.Optimizer, state: Any) -> bool:
    """Whether `optimizer.load_state_dict(state)` will accept `state`'s groups (then it is filled in place)."""
    if not isinstance(state, Mapping) or not isinstance(state.get("state"), Mapping):
        return False
    saved = state.get("param_groups")
    if not isinstance(saved, list) or len(saved) != len(optimizer.param_groups):
        return False
    return all(
        isinstance(group, Mapping) and len(group.get("params", ())) == len(live["params"])
        for group, live in zip(saved, optimizer.param_groups)
    )


def _fill_optimizer(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> dict[str, Any]:
    """`state` with each tensor that has a live counterpart of the same shape, dtype and device copied into it.

    `optimizer.state_dict()` numbers the parameters as `load_state_dict` will, so entry ``(index,
    key)`` of `state` goes back into the tensor the optimizer holds for that parameter and key, and
    `load_state_dict` then keeps that tensor (it casts to the parameter's dtype and device, which
    it already has). The rest is copied out of the map.
    """
    live = optimizer.state_dict()["state"]
    filled: dict[Any, Any] = {}
    for index, values in state["state"].items():
        current = live.get(index)
        if not isinstance(values, Mapping) or not isinstance(current, Mapping):
            filled[index] = owned(values)
            continue
        filled[index] = {key: _into(current.get(key), value) for key, value in values.items()}
    return {**owned({key: value for key, value in state.items() if key != "state"}), "state": filled}


def _into(target: Any, value: Any) -> Any:
    if (
        isinstance(target, torch.Tensor)
        and isinstance(value, torch.Tensor)
        and target.shape == value.shape
        and target.dtype == value.dtype
        and target.device == value.device
        and target.layout == value.layout == torch.strided
        and not target.requires_grad
    ):
        return target.copy_(value)
    return owned(value)


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        return [tensor for value in tree.values() for tensor in _tensors(value)]
    if isinstance(tree, (list, tuple)):
        return [tensor for value in tree for tensor in _tensors(value)]
    return []


def _address(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
