"""Turning gradient synchronisation off inside an accumulation window, whatever wraps the model.

Backends expose this capability differently: DDP through a `no_sync()` context that must be
open during the forward pass, FSDP2 through a `set_requires_gradient_sync(flag)` setter that must
hold through the backward pass, and engines that own their accumulation boundary (DeepSpeed)
through `set_gradient_accumulation_boundary(flag)`. Each is a typed protocol here, and
[`gradient_sync_for`][danling.runners.update.gradient_sync.gradient_sync_for] turns a model into
one [`GradientSync`][danling.runners.update.gradient_sync.GradientSync] the update strategy
drives once per micro-step, without asking which backend it is.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "GradientSync",
    "NoSyncContext",
    "OwnsAccumulationBoundary",
    "RequiresGradientSyncToggle",
    "gradient_sync_for",
]

_NO_CONTEXT = contextlib.nullcontext()


@runtime_checkable
class NoSyncContext(Protocol):
    """A model whose `no_sync()` context, open during the forward pass, skips the next gradient reduction (DDP)."""

    def no_sync(self) -> AbstractContextManager: ...


@runtime_checkable
class RequiresGradientSyncToggle(Protocol):
    """A model that keeps a gradient-sync flag until it is set again (FSDP2's `FSDPModule`)."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None: ...


@runtime_checkable
class OwnsAccumulationBoundary(Protocol):
    """An engine that reduces gradients only on micro-steps marked as a window boundary (DeepSpeed)."""

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None: ...


class GradientSync:
    """Gradient synchronisation control of one model; the default does nothing (one process, or no reducer).

    `context(sync)` is entered around the forward pass of every micro-step that does not run
    with `sync=True` implied; it returns the context that makes the following backward reduce
    gradients (`sync=True`) or keep them local (`sync=False`).
    """

    suppresses = False  # whether this control can keep gradients local at all

    def context(self, sync: bool) -> AbstractContextManager:
        return _NO_CONTEXT


class _ContextSync(GradientSync):
    suppresses = True

    def __init__(self, model: NoSyncContext) -> None:
        self.model = model

    def context(self, sync: bool) -> AbstractContextManager:
        return _NO_CONTEXT if sync else self.model.no_sync()


class _FlagSync(GradientSync):
    """Setter-style controls: the flag is written only when it changes, and persists through backward."""

    suppresses = True

    def __init__(self, setter: Any) -> None:
        self.setter = setter
        self.current = True

    def context(self, sync: bool) -> AbstractContextManager:
        if sync is not self.current:
            self.setter(sync)
            self.current = sync
        return _NO_CONTEXT


class _PartsSync(GradientSync):
    """Several model parts (e.g. the local stages of a pipeline), each with its own control, switched together."""

    def __init__(self, syncs: list[GradientSync]) -> None:
        self.syncs = syncs
        self.suppresses = all(sync.suppresses for sync in syncs)

    def context(self, sync: bool) -> AbstractContextManager:
        stack = contextlib.ExitStack()
        for part in self.syncs:
            stack.enter_context(part.context(sync))
        return stack


def gradient_sync_for(model: Any) -> GradientSync:
    """The [`GradientSync`][danling.runners.update.gradient_sync.GradientSync] of `model`, by its protocol.

    A list or tuple of models (the local parts of a split model) gets one control that switches
    them all; it can keep gradients local only when every part can.

    Examples:
        >>> from torch import nn
        >>> gradient_sync_for(nn.Linear(2, 2)).suppresses
        False
    """
    if isinstance(model, (list, tuple)):
        syncs = [gradient_sync_for(part) for part in model]
        return syncs[0] if len(syncs) == 1 else _PartsSync(syncs)
    if isinstance(model, OwnsAccumulationBoundary):
        return _FlagSync(model.set_gradient_accumulation_boundary)
    if isinstance(model, RequiresGradientSyncToggle):
        return _FlagSync(model.set_requires_gradient_sync)
    if isinstance(model, NoSyncContext):
        return _ContextSync(model)
    return GradientSync()
