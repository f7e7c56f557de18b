"""Decorators: optional brackets, error catching and per-instance method caching."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import lru_cache, wraps
from traceback import print_exc
from typing import Any

__all__ = ["Exceptions", "catch", "flexible_decorator", "method_cache"]

Exceptions = type[BaseException] | tuple[type[BaseException], ...]


def _is_decoration_target(args: tuple, kwargs: dict) -> bool:
    """True when a decorator factory was applied directly, as in `@decorator` without brackets."""
    # Classes are excluded so that factories taking an exception class, e.g. `catch(OSError)`,
    # still receive it as an argument.
    return len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], type)


def flexible_decorator(maybe_decorator: Callable | None = None) -> Callable:
    """Let a decorator factory be used both with and without brackets.

    A factory is a function that takes options and returns the real decorator. Wrapped with
    `flexible_decorator`, writing `@factory` behaves like `@factory()`: when the factory is
    called with exactly one positional argument that is a callable (and not a class) and no
    keyword arguments, that callable is decorated using the factory's defaults. Because of
    this rule, a factory cannot take a lone function as its only positional option; pass such
    options by keyword. `flexible_decorator` itself may be written with or without brackets.

    Args:
        maybe_decorator: The decorator factory, or `None` when used as `@flexible_decorator()`.

    Returns:
        The factory wrapped so that brackets are optional.

    Examples:
        For decorator defined as follows:

        >>> @flexible_decorator
        ... def decorator(*args, **kwargs):
        ...     def wrapper(func, *args, **kwargs):
        ...         pass
        ...     return wrapper

        The following two are equivalent:

        >>> @decorator
        ... def func(*args, **kwargs):
        ...     pass

        >>> @decorator()
        ... def func(*args, **kwargs):
        ...     pass

        A factory with options:

        >>> @flexible_decorator
        ... def tag(label="default"):
        ...     def apply(func):
        ...         func.label = label
        ...         return func
        ...     return apply
        >>> @tag
        ... def plain():
        ...     pass
        >>> @tag("custom")
        ... def labelled():
        ...     pass
        >>> plain.label, labelled.label
        ('default', 'custom')
    """

    def make_flexible(factory: Callable) -> Callable:
        if not callable(factory):
            raise TypeError(f"flexible_decorator() expects a callable decorator factory, got {factory!r}")

        @wraps(factory)
        def flexible(*args: Any, **kwargs: Any) -> Any:
            if _is_decoration_target(args, kwargs):
                return factory()(args[0])
            return factory(*args, **kwargs)

        return flexible

    if maybe_decorator is None:
        return make_flexible
    return make_flexible(maybe_decorator)


def _check_exceptions(value: Any, name: str, caller: str, optional: bool = False) -> None:
    """Raise a TypeError unless `value` is an exception class or a tuple of them."""
    if optional and value is None:
        return
    classes = value if isinstance(value, tuple) else (value,)
    if not classes or not all(isinstance(cls, type) and issubclass(cls, BaseException) for cls in classes):
        accepted = "an exception class or a tuple of exception classes" + (" or None" if optional else "")
        raise TypeError(f"{caller}() expects {name} to be {accepted}, got {value!r}")


@flexible_decorator
def catch(
    error: Exceptions = Exception,
    exclude: Exceptions | None = None,
    callback: Callable = print_exc,
    *callback_args: Any,
    **callback_kwargs: Any,
) -> Callable:
    """Decorator that swallows selected exceptions so a non-fatal failure does not stop a run.

    A typical use is a periodic checkpoint save: if the disk is full, the error is reported and
    training carries on instead of dying. When the decorated function raises an instance of
    `error` that is not an instance of `exclude`, `callback` is called and the function returns
    `None`; any other exception propagates unchanged.

    With the default callback, `traceback.print_exc`, the full traceback
    is printed to stderr (`callback_args`/`callback_kwargs` are passed to it, e.g. `limit=2`).
    Any other callback is called as `callback(exc, func, args, kwargs, *callback_args,
    **callback_kwargs)`, where `args`/`kwargs` are those of the failed call.

    `catch` may be used without brackets: `@catch` is the same as `@catch()`.

    Args:
        error: Exception class(es) to catch.
        exclude: Exception class(es) to let through even if they match `error`.
        callback: Called when an exception is caught.
        *callback_args: Extra positional arguments for `callback`.
        **callback_kwargs: Extra keyword arguments for `callback`.

    Returns:
        A decorator.

    Raises:
        TypeError: If `error` or `exclude` is not an exception class or tuple of them, or
            `callback` is not callable.

    Examples:
        >>> def file_not_found(*args, **kwargs):
        ...     raise FileNotFoundError
        >>> func = file_not_found
        >>> func()
        Traceback (most recent call last):
        FileNotFoundError
        >>> func = catch(OSError)(file_not_found)
        >>> func()
        >>> func = catch(IOError)(file_not_found)
        >>> func()
        >>> func = catch(ZeroDivisionError)(file_not_found)
        >>> func()
        Traceback (most recent call last):
        FileNotFoundError
    """
    _check_exceptions(error, "error", "catch")
    _check_exceptions(exclude, "exclude", "catch", optional=True)
    if not callable(callback):
        raise TypeError(f"catch() expects callback to be callable, got {callback!r}")

    def decorator(func: Callable) -> Callable:
        @wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return func(*args, **kwargs)
            except error as exc:
                if exclude is not None and isinstance(exc, exclude):
                    raise
                if callback is print_exc:
                    print_exc(*callback_args, **callback_kwargs)
                else:
                    callback(exc, func, args, kwargs, *callback_args, **callback_kwargs)
                return None

        return wrapper

    return decorator


@flexible_decorator
def method_cache(maxsize: int | None = 128, typed: bool = False) -> Callable:
    """Like `functools.lru_cache`, but for methods and without leaks.

    Decorating a method with `lru_cache` stores `self` inside the cache keys, so every instance
    that ever called the method stays alive as long as the class does. `method_cache` instead
    keeps one LRU cache per instance, reachable only through a weak reference: when the instance
    is garbage-collected its cache goes with it. Each instance gets its own `maxsize` budget.

    Instances must support weak references (ordinary classes do; classes with `__slots__` need
    a `__weakref__` slot); they do not need to be hashable. Arguments must be hashable, as with
    `lru_cache`. The decorated function gains `cache_clear()`, which empties the caches of all
    live instances. `@method_cache` without brackets uses the defaults.

    Args:
        maxsize: Maximum number of results kept per instance; `None` means unbounded.
        typed: Cache arguments of different types separately (`1` vs `1.0`).

    Returns:
        A method decorator.

    Raises:
        TypeError: If `maxsize` is not an int or `None`, or the instance cannot be weakly referenced.

    Examples:
        >>> class Model:
        ...     calls = 0
        ...     @method_cache(maxsize=8)
        ...     def square(self, x):
        ...         Model.calls += 1
        ...         return x * x
        >>> model = Model()
        >>> model.square(3), model.square(3), Model.calls
        (9, 9, 1)
    """
    if maxsize is not None and (isinstance(maxsize, bool) or not isinstance(maxsize, int)):
        raise TypeError(f"method_cache() expects maxsize to be an int or None, got {maxsize!r}")

    def decorator(method: Callable) -> Callable:
        # id(instance) -> that instance's cached callable; a finalizer drops the entry on collection.
        caches: dict[int, Callable] = {}

        def cache_for(instance: Any) -> Callable:
            key = id(instance)
            cached = caches.get(key)
            if cached is None:
                try:
                    ref = weakref.ref(instance)
                except TypeError as err:
                    raise TypeError(
                        f"method_cache needs instances that support weak references; "
                        f"{type(instance).__name__} does not (add '__weakref__' to its __slots__)"
                    ) from err
                cached = lru_cache(maxsize=maxsize, typed=typed)(lambda *a, **k: method(ref(), *a, **k))
                caches[key] = cached
                weakref.finalize(instance, caches.pop, key, None)
            return cached

        @wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            return cache_for(self)(*args, **kwargs)

        def cache_clear() -> None:
            for cached in list(caches.values()):
                cached.cache_clear()

        wrapper.cache_clear = cache_clear  # type: ignore[attr-defined]
        return wrapper

    return decorator
