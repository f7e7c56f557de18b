"""Dispatch table from torch callables to NestedTensor implementations.

Every torch function, ``Tensor`` method or ``torch.nn.functional`` function that reaches
``NestedTensor.__torch_function__`` is looked up here. Anything missing raises one
``TypeError`` that names the op, so an unsupported call can never silently compute on padding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

HANDLERS: dict[Callable, Callable] = {}
"""Maps a torch callable (``torch.add``, ``torch.Tensor.add``, ``F.linear``...) to its handler."""

UNDEFINED: dict[Callable, str] = {}
"""Ops that have no meaning on a NestedTensor, mapped to the reason their error gives."""

GETTERS: dict[str, Callable] = {}
"""Maps ``Tensor`` attribute names reached through ``__get__`` to a handler taking the NestedTensor."""


def register(funcs: Callable | None | tuple[Callable | None, ...], handler: Callable) -> Callable:
    """Register ``handler`` for each callable in ``funcs`` (``None`` entries are skipped)."""
    if not isinstance(funcs, tuple):
        funcs = (funcs,)
    for func in funcs:
        if func is not None:
            HANDLERS[func] = handler
    return handler


def implements(*funcs: Callable | None) -> Callable[[Callable], Callable]:
    """Decorator form of `register`."""

    def decorator(handler: Callable) -> Callable:
        return register(tuple(funcs), handler)

    return decorator


def torch_variants(name: str, inplace: bool = False) -> tuple[Callable | None, ...]:
    """``torch.<name>``, ``Tensor.<name>``, ``torch.special.<name>`` and, if asked, ``Tensor.<name>_``."""
    variants = [getattr(torch, name, None), getattr(torch.Tensor, name, None), getattr(torch.special, name, None)]
    if inplace:
        variants.append(getattr(torch.Tensor, name + "_", None))
    return tuple(variants)


def func_name(func: Callable) -> str:
    """Readable, fully qualified name of a torch callable for error messages."""
    if getattr(func, "__name__", None) == "__get__":
        owner = getattr(func, "__self__", None)
        return f"torch.Tensor.{getattr(owner, '__name__', owner)} (attribute)"
    try:
        return torch.overrides.resolve_name(func) or repr(func)
    except Exception:  # resolve_name walks torch namespaces and may fail on exotic callables
        return getattr(func, "__qualname__", repr(func))


def unsupported(func: Callable, reason: str = "") -> TypeError:
    """The error raised for an op NestedTensor does not implement."""
    detail = f": {reason}" if reason else ""
    return TypeError(
        f"NestedTensor does not support {func_name(func)}{detail}. "
        "Convert explicitly with `.tensor` (padded), `.concat` (packed) or `.unbind()` if you need it."
    )


def dispatch(func: Callable, args: tuple, kwargs: dict[str, Any] | None) -> Any:
    """Run the handler registered for ``func`` or raise ``TypeError`` naming it."""
    handler = HANDLERS.get(func)
    if handler is None and getattr(func, "__name__", None) == "__get__":
        attr = getattr(getattr(func, "__self__", None), "__name__", None)
        getter = GETTERS.get(attr)  # type: ignore[arg-type]
        if getter is not None:
            return getter(args[0])
    if handler is None:
        raise unsupported(func, UNDEFINED.get(func, ""))
    return handler(*args, **(kwargs or {}))
