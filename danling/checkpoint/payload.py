"""Payload helpers shared by checkpoint backends: live objects, async snapshots and key exclusion."""

from __future__ import annotations

import copy
import sys
from collections import OrderedDict
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from .manifest import CheckpointError

__all__ = [
    "Stateful",
    "is_stateful",
    "capture_state",
    "check_objects",
    "restore_objects",
    "missing_entry",
    "load_template",
    "snapshot_state",
    "normalize_excludes",
    "drop_key",
]


@runtime_checkable
class Stateful(Protocol):
    """Anything a checkpoint can save by value and restore in place: modules, optimizers, schedulers, loaders.

    Managers call `state_dict()` when saving (in the caller's thread, before any background
    write starts) and `load_state_dict(state)` from
    [`load_into`][danling.checkpoint.CheckpointManager.load_into]. An object may also define
    `state_dict_to_load()`, returning the structure to load into when it differs from what
    `state_dict()` saves (an optimizer that has not stepped yet has no state to load into; see
    [`OptimizerState`][danling.checkpoint.training.OptimizerState]).
    """

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


def is_stateful(obj: Any) -> bool:
    """Whether `obj` is a live object (not a mapping or tensor) with `state_dict` and `load_state_dict`.

    Examples:
        >>> import torch
        >>> is_stateful(torch.nn.Linear(1, 1)), is_stateful({"step": 1}), is_stateful(torch.zeros(1))
        (True, False, False)
    """
    if isinstance(obj, (Mapping, torch.Tensor, type)):
        return False
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def capture_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """Replace every top-level live object of `state` by its `state_dict()`; plain values pass through.

    Examples:
        >>> import torch
        >>> payload = capture_state({"model": torch.nn.Linear(1, 1, bias=False), "epoch": 3})
        >>> sorted(payload["model"]), payload["epoch"]
        (['weight'], 3)
    """
    return {key: value.state_dict() if is_stateful(value) else value for key, value in state.items()}


def check_objects(objects: Any) -> dict[str, Any]:
    """Validate the `objects` argument of `load_into`: a mapping of string keys to live objects."""
    if not isinstance(objects, Mapping):
        raise TypeError(f"objects must be a mapping of checkpoint keys to live objects, got {type(objects).__name__}")
    for key, obj in objects.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"objects keys must be non-empty strings (top-level checkpoint keys), got {key!r}")
        if not is_stateful(obj):
            raise TypeError(
                f"objects[{key!r}] is a {type(obj).__name__}, which has no state_dict()/load_state_dict(); "
                "pass live objects here and read plain entries from the returned payload"
            )
    return dict(objects)


def restore_objects(
    payload: MutableMapping[str, Any], objects: Mapping[str, Any], excluded: Sequence[str], origin: Any
) -> MutableMapping[str, Any]:
    """Load `payload[key]` into each live object in place and return what is left of `payload`.

    Objects whose key is in `excluded` keep their current state. A key the checkpoint lacks is an
    error: the caller asked for that object to be restored.
    """
    for key, obj in objects.items():
        if key in excluded:
            continue
        if key not in payload:
            raise missing_entry(origin, key, obj, payload)
        obj.load_state_dict(payload.pop(key))
    return payload


def missing_entry(origin: Any, key: str, obj: Any, payload: Mapping[str, Any]) -> CheckpointError:
    """The error for a live object `obj` whose `key` the checkpoint `payload` lacks."""
    return CheckpointError(
        f"checkpoint {origin} has no {key!r} entry to load into the {type(obj).__name__}; it holds "
        f"{sorted(payload)}. Add {key!r} to exclude_from_loading to keep the object's current state"
    )


def load_template(obj: Any) -> Any:
    """What a live object's checkpoint entries are read into: its `state_dict_to_load()`, else its `state_dict()`."""
    to_load = getattr(obj, "state_dict_to_load", None)
    return to_load() if callable(to_load) else obj.state_dict()


_KEY_ALIASES = {"data_loader": "dataloaders", "dataloader": "dataloaders", "lr_scheduler": "scheduler"}
_SCALARS = (str, bytes, int, float, complex, bool, type(None))


def normalize_excludes(keys: Sequence[str] | str | None) -> tuple[str, ...]:
    """Normalise `exclude_from_loading`: accept one comma-separated string and common key spellings.

    Examples:
        >>> normalize_excludes("optimizer, lr_scheduler")
        ('optimizer', 'scheduler')
        >>> normalize_excludes(["dataloader.train", "model.head"])
        ('dataloaders.train', 'model.head')
    """
    if keys is None:
        return ()
    if isinstance(keys, str):
        keys = [part.strip() for part in keys.split(",")]
    out = []
    for key in keys:
        if not isinstance(key, str):
            raise ValueError(f"exclude_from_loading entries must be strings, got {key!r}")
        if key:
            head, dot, rest = key.partition(".")
            out.append(_KEY_ALIASES.get(head, head) + dot + rest)
    return tuple(out)


def drop_key(mapping: MutableMapping, key: str) -> bool:
    """Delete `key` from `mapping`, reading dots as nesting when no literal key matches.

    A key that prefixes dotted keys (a submodule's name in a flat state dict) deletes all of them,
    as DCP's reader leaves out every entry under it.

    Examples:
        >>> state = {"model": {"head.weight": 1, "head.bias": 0, "body.weight": 2}, "optimizer": {}}
        >>> drop_key(state, "model.head"), state
        (True, {'model': {'body.weight': 2}, 'optimizer': {}})
        >>> drop_key(state, "scheduler")
        False
    """
    if key in mapping:
        del mapping[key]
        return True
    under = [name for name in mapping if isinstance(name, str) and name.startswith(key + ".")]
    for name in under:
        del mapping[name]
    if under:
        return True
    parts = key.split(".")
    for cut in range(1, len(parts)):
        child = mapping.get(".".join(parts[:cut]))
        if isinstance(child, MutableMapping) and drop_key(child, ".".join(parts[cut:])):
            return True
    return False


def snapshot_state(state: Any, buffers: dict[tuple[Any, int, int], Any] | None = None) -> Any:
    """Deep-copy `state` with every tensor copied to CPU, so later in-place updates do not leak in.

    Each tensor storage is copied once and views are rebuilt on the copy, so tensors that
    share memory (tied weights, views) still share it afterwards, just as `torch.save` keeps them.
    A `DTensor` (FSDP2, tensor parallel) keeps its mesh, placements and global shape; only its
    local shard is copied.

    With `buffers` (a dict kept by the caller between calls), the CPU copy of a storage is kept
    there, keyed by the source storage's device, address and size, and the next call copies into
    it instead of allocating: a state of fixed layout (parameters, optimizer moments) is then
    staged with one memory copy per storage and no fresh pages to fault in. The caller must not
    pass `buffers` while an earlier copy made with it is still being read (e.g. written to disk).

    Examples:
        >>> import torch
        >>> weight = torch.zeros(4)
        >>> copy_ = snapshot_state({"a": weight, "b": weight.view(2, 2), "n": [1, "x"]})
        >>> _ = weight.add_(1)
        >>> copy_["a"], copy_["b"].untyped_storage().data_ptr() == copy_["a"].untyped_storage().data_ptr()
        (tensor([0., 0., 0., 0.]), True)
    """
    storages: dict[tuple[Any, int], Any] = {}
    previous = dict(buffers) if buffers is not None else {}
    if buffers is not None:
        buffers.clear()  # refilled with this call's copies: storages gone since the last call are let go
    # DTensors can only exist once torch.distributed.tensor is imported; do not import it here.
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    dtensor_type = getattr(dtensor_module, "DTensor", None)

    def copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        try:
            storage = tensor.untyped_storage()
            key = (storage.device, storage.data_ptr())
        except (RuntimeError, NotImplementedError):  # sparse, nested and other storage-less layouts
            return tensor.to("cpu", copy=True)
        if key not in storages:
            storages[key] = _stage(storage, key, previous, buffers)
        view = torch.empty(0, dtype=tensor.dtype)
        return view.set_(storages[key], tensor.storage_offset(), tensor.shape, tensor.stride())

    def copy_dtensor(tensor: Any) -> Any:
        # A DTensor's storage is its local shard, but its shape is the global one: copy the shard
        # and wrap it in the same spec (mesh, placements, global shape and stride), so DCP still
        # writes it as that shard of the global tensor. The public `DTensor.from_local` would move
        # the copy back to the mesh's device, which would defeat staging on the CPU.
        local = copy_tensor(tensor.to_local())
        return dtensor_type(local, tensor._spec, requires_grad=False)

    def copy_tree(obj: Any) -> Any:
        if dtensor_type is not None and isinstance(obj, dtensor_type):
            return copy_dtensor(obj)
        if isinstance(obj, torch.Tensor):
            return copy_tensor(obj)
        if type(obj) in (dict, OrderedDict):
            return type(obj)((key, copy_tree(value)) for key, value in obj.items())
        if type(obj) in (list, tuple):
            return type(obj)(copy_tree(value) for value in obj)
        if isinstance(obj, _SCALARS):
            return obj
        return copy.deepcopy(obj)

    return copy_tree(state)


def _stage(storage: Any, key: tuple[Any, int], previous: dict, buffers: dict | None) -> Any:
    """A CPU copy of `storage`: into the buffer the previous snapshot used for it when there is one."""
    slot = (*key, storage.nbytes())
    staged = previous.get(slot)
    if staged is not None:
        staged.copy_(storage)
    else:
        staged = storage.cpu() if storage.device.type != "cpu" else storage.clone()
    if buffers is not None:
        buffers[slot] = staged
    return staged
