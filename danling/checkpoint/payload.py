"""Payload helpers shared by checkpoint backends: async snapshots and key exclusion."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import MutableMapping, Sequence
from typing import Any

import torch

__all__ = ["snapshot_state", "normalize_excludes", "drop_key"]

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

    Examples:
        >>> state = {"model": {"head.weight": 1, "body.weight": 2}, "optimizer": {}}
        >>> drop_key(state, "model.head.weight"), state
        (True, {'model': {'body.weight': 2}, 'optimizer': {}})
        >>> drop_key(state, "scheduler")
        False
    """
    if key in mapping:
        del mapping[key]
        return True
    parts = key.split(".")
    for cut in range(1, len(parts)):
        child = mapping.get(".".join(parts[:cut]))
        if isinstance(child, MutableMapping) and drop_key(child, ".".join(parts[cut:])):
            return True
    return False


def snapshot_state(state: Any) -> Any:
    """Deep-copy `state` with every tensor copied to CPU, so later in-place updates do not leak in.

    Each tensor storage is copied once and views are rebuilt on the copy, so tensors that
    share memory (tied weights, views) still share it afterwards, just as `torch.save` keeps them.

    Examples:
        >>> import torch
        >>> weight = torch.zeros(4)
        >>> copy_ = snapshot_state({"a": weight, "b": weight.view(2, 2), "n": [1, "x"]})
        >>> _ = weight.add_(1)
        >>> copy_["a"], copy_["b"].untyped_storage().data_ptr() == copy_["a"].untyped_storage().data_ptr()
        (tensor([0., 0., 0., 0.]), True)
    """
    storages: dict[tuple[Any, int], Any] = {}

    def copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested and other storage-less layouts
            return tensor.to("cpu", copy=True)
        key = (storage.device, storage.data_ptr())
        if key not in storages:
            storages[key] = storage.cpu() if storage.device.type != "cpu" else storage.clone()
        view = torch.empty(0, dtype=tensor.dtype)
        return view.set_(storages[key], tensor.storage_offset(), tensor.shape, tensor.stride())

    def copy_tree(obj: Any) -> Any:
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
