"""A small name -> callable registry: optimizers, schedulers, schedule curves, metric factories."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

__all__ = ["Registry"]

T = TypeVar("T", bound=Callable[..., Any])


def normalize(name: str) -> str:
    # "ReduceLROnPlateau", "reduce_lr_on_plateau" and "reduce-lr-on-plateau" are the same entry.
    return name.lower().replace("_", "").replace("-", "")


class Registry:
    """Map case-insensitive names to callables and build objects from configuration.

    Lookup ignores case, underscores and hyphens, so `"AdamW"`, `"adamw"` and `"adam_w"` resolve to
    the same entry. Unknown names raise a `ValueError` that lists every registered name.

    Args:
        kind: What the registry holds, used in error messages (e.g. `"optimizer"`).

    Examples:
        >>> from danling.utils import Registry
        >>> ACTIVATIONS = Registry("activation")
        >>> @ACTIVATIONS.register
        ... def relu(x):
        ...     return max(x, 0)
        >>> @ACTIVATIONS.register("identity")
        ... def _identity(x):
        ...     return x
        >>> ACTIVATIONS.build(-2.0, type="ReLU"), ACTIVATIONS.build(-2.0, type="identity")
        (0, -2.0)
        >>> ACTIVATIONS.get("gelu")
        Traceback (most recent call last):
        ...
        ValueError: unknown activation 'gelu'; registered: identity, relu
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Callable[..., Any]] = {}
        self._names: dict[str, str] = {}

    def register(
        self, obj: Callable[..., Any] | str | None = None, name: str | None = None, *, override: bool = False
    ) -> Any:
        """Register `obj` under `name` (default: its `__name__`, lower-cased).

        Works as a plain call (`REG.register(fn, "name")`), a bare decorator (`@REG.register`) or a
        decorator with a name (`@REG.register("name")`).

        Args:
            obj: The callable to register, or the name when used as `@REG.register("name")`.
            name: Name to register under.
            override: Replace an existing entry of the same name instead of raising.

        Returns:
            `obj` itself, or a decorator when `obj` is omitted.

        Raises:
            ValueError: If the name is already taken by a different callable and `override` is False.
        """
        if isinstance(obj, str):
            obj, name = None, obj
        if obj is None:

            def decorator(target: T) -> T:
                self.register(target, name, override=override)
                return target

            return decorator
        display = (name or obj.__name__).lower()
        key = normalize(display)
        existing = self._entries.get(key)
        if existing is not None and existing is not obj and not override:
            raise ValueError(f"{self.kind} {display!r} is already registered as {existing!r}; pass override=True")
        self._entries[key] = obj
        self._names[key] = display
        return obj

    def lookup(self, name: str) -> Callable[..., Any] | None:
        """Return the entry registered as `name`, or `None` when there is none."""
        return self._entries.get(normalize(name))

    def get(self, name: str) -> Callable[..., Any]:
        """Return the entry registered as `name`.

        Raises:
            TypeError: If `name` is not a string.
            ValueError: If nothing is registered under `name`; the message lists the registered names.
        """
        if not isinstance(name, str):
            raise TypeError(f"{self.kind} name must be a string, got {name!r} of type {type(name).__name__}")
        entry = self.lookup(name)
        if entry is None:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}")
        return entry

    def build(self, *args: Any, type: str | None = None, **kwargs: Any) -> Any:
        """Call the entry named `type` with the remaining arguments.

        A configuration mapping may stand in for the keywords: when `type` is not given and the
        last positional argument is a mapping with a `"type"` key, its items become the keywords
        (explicit keywords win), so `registry.build(params, config.optim)` works.

        Arguments are checked against the entry's signature first, so a misspelt option fails with a
        message naming the entry and the arguments it accepts instead of a bare `TypeError`.

        Raises:
            ValueError: If `type` is missing or unknown, or the arguments do not fit the entry.
        """
        if type is None and args and isinstance(args[-1], Mapping) and "type" in args[-1]:
            *rest, config = args
            args, kwargs = tuple(rest), {**config, **kwargs}
            type = kwargs.pop("type")
        if type is None:
            raise ValueError(f"building a {self.kind} needs type=<name>; registered: {', '.join(self.names())}")
        entry = self.get(type)
        check_arguments(entry, args, kwargs, f"{self.kind} {type!r}")
        return entry(*args, **kwargs)

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._names.values())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.lookup(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.kind!r}, names={self.names()})"


def check_arguments(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], what: str) -> None:
    """Raise a `ValueError` naming `what` and its accepted arguments if `fn(*args, **kwargs)` cannot bind."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: let the call itself decide
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        accepted = ", ".join(name for name in signature.parameters if name not in ("self", "args", "kwargs"))
        raise ValueError(f"cannot build {what}: {error}; it accepts: {accepted}") from None
