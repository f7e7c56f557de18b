"""Move nested data structures between devices."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

__all__ = ["to_device"]


def to_device(data: Any, device: torch.device | str | int, non_blocking: bool = False) -> Any:
    """Move every tensor inside `data` to `device`, keeping the structure and container types.

    `data` is walked recursively through mappings, lists, tuples, named tuples and dataclass
    instances. Leaves that are `torch.Tensor`s are moved with `.to(device)`; so is any other
    object that has both a `to` method and a `__torch_function__` attribute (tensor-like
    wrappers such as `NestedTensor`). Everything else (numbers, strings, arrays, modules) is
    returned as it is.

    Containers are rebuilt with their own class: a named tuple stays that named tuple, a
    `defaultdict` keeps its factory, and mapping subclasses are shallow-copied and then updated,
    so their extra attributes survive. A mapping class that cannot be copied or rebuilt from a
    dict falls back to a plain `dict`. Dataclass instances are shallow-copied and their fields
    replaced without calling `__init__` again. The input is never modified.

    Args:
        data: A tensor, tensor-like object or (nested) container of them.
        device: Target device, as accepted by `torch.device` (`"cpu"`, `"cuda:0"`, `0`, ...).
        non_blocking: Request asynchronous copies (useful from pinned memory to CUDA).

    Returns:
        `data` with every tensor on `device`.

    Raises:
        ValueError: If `device` is not a valid device specification.

    Examples:
        >>> import torch
        >>> from collections import namedtuple
        >>> Batch = namedtuple("Batch", ["inputs", "labels"])
        >>> batch = {"x": Batch(torch.zeros(2), [torch.ones(1)]), "name": "sample", "size": 2}
        >>> moved = to_device(batch, "cpu")
        >>> type(moved["x"]).__name__, moved["x"].inputs.device, moved["name"], moved["size"]
        ('Batch', device(type='cpu'), 'sample', 2)
        >>> to_device(torch.ones(1), "gpu")
        Traceback (most recent call last):
        ValueError: to_device() got an invalid device 'gpu': ...
    """
    if not isinstance(device, torch.device):
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"to_device() got an invalid device {device!r}: {err}") from err
    return _move(data, device, non_blocking)


def _move(data: Any, device: torch.device, non_blocking: bool) -> Any:
    if type(data) is torch.Tensor and data.device == device:
        return data  # what `.to()` returns too, without the dispatcher round trip of a per-batch call
    if type(data) in (list, tuple):
        for item in data:  # a plain loop: cheaper per batch than all() over a generator
            if type(item) is not torch.Tensor or item.device != device:
                break
        else:
            return list(data) if type(data) is list else data  # the usual batch: a fresh list, a tuple as is
    if isinstance(data, torch.Tensor) or _is_tensor_like(data):
        # Tensor-likes may not accept `non_blocking`, so it is only passed when requested.
        return data.to(device, non_blocking=True) if non_blocking else data.to(device)
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, Mapping):
        return _move_mapping(data, device, non_blocking)
    if isinstance(data, tuple):
        items = [_move(item, device, non_blocking) for item in data]
        if hasattr(data, "_fields"):  # named tuple: rebuilt from positional fields
            return type(data)(*items)
        return _items_as(data, items, tuple)
    if isinstance(data, list):
        return _items_as(data, [_move(item, device, non_blocking) for item in data], list)
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        moved = copy.copy(data)
        for field in dataclasses.fields(data):
            # object.__setattr__ also works for frozen dataclasses.
            object.__setattr__(moved, field.name, _move(getattr(data, field.name), device, non_blocking))
        return moved
    return data


def _is_tensor_like(data: Any) -> bool:
    """Objects that behave like tensors (e.g. NestedTensor): a `to` method plus `__torch_function__`."""
    return not isinstance(data, type) and hasattr(data, "__torch_function__") and callable(getattr(data, "to", None))


def _items_as(original: Any, items: list, fallback: type) -> Any:
    """Rebuild a list/tuple of `original`'s class, or `fallback` if the class cannot be built."""
    if type(original) is fallback:
        return fallback(items)
    try:
        return type(original)(items)
    except Exception:  # subclasses with custom constructors
        return fallback(items)


def _move_mapping(data: Mapping, device: torch.device, non_blocking: bool) -> Mapping:
    moved = {key: _move(value, device, non_blocking) for key, value in data.items()}
    if type(data) is dict:
        return moved
    if isinstance(data, MutableMapping):
        # A shallow copy keeps the class, defaultdict factories and instance attributes.
        try:
            result = copy.copy(data)
            for key, value in moved.items():
                result[key] = value
            return result
        except Exception:  # copy or item assignment unsupported: try the constructor below
            pass
    try:
        return type(data)(moved)
    except Exception:  # classes whose constructor does not take a dict
        return moved
