"""Context managers."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from .decorators import Exceptions, _check_exceptions

__all__ = ["debug"]


@contextmanager
def debug(
    enable: bool = True,
    error: Exceptions = Exception,
    exclude: Exceptions | None = None,
) -> Iterator[None]:
    """Open a post-mortem debugger when the wrapped block raises.

    When an exception matching `error` (and not `exclude`) escapes the block, its summary is
    printed to stderr and `pdb.post_mortem` starts at the frame that
    raised, so local variables can be inspected. After you leave the debugger the exception
    continues to propagate: the program does not resume in a broken state. Other exceptions
    pass through untouched. Because this is a development aid, `enable=False` turns the context
    manager into a no-op, which makes it easy to wire to a command-line flag.

    It can also decorate a function (`@debug()`), courtesy of `contextlib.contextmanager`.

    Args:
        enable: Whether to start the debugger at all.
        error: Exception class(es) that trigger the debugger.
        exclude: Exception class(es) that never trigger it, even if they match `error`.

    Yields:
        Nothing.

    Raises:
        TypeError: If `error` or `exclude` is not an exception class or tuple of them.

    Examples:
        >>> with debug(enable=False):
        ...     1 / 0
        Traceback (most recent call last):
        ZeroDivisionError: division by zero
        >>> with debug(exclude=KeyError):
        ...     {}["missing"]
        Traceback (most recent call last):
        KeyError: 'missing'
    """
    _check_exceptions(error, "error", "debug")
    _check_exceptions(exclude, "exclude", "debug", optional=True)
    if not enable:
        yield
        return
    try:
        yield
    except error as exc:
        if exclude is not None and isinstance(exc, exclude):
            raise
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        import pdb  # here, not at the top: pdb pulls in cmd, code and bdb, which `import danling` need not pay for

        pdb.post_mortem(exc.__traceback__)
        raise
