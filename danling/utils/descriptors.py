"""Descriptors."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["ensure_dir"]


class ensure_dir(property):  # lower-case on purpose: it is used like the builtin `property`
    """A `property` whose value is a directory path that is created when read.

    Use it exactly like `property`. Each read calls the getter and then makes sure the returned
    directory exists (`os.makedirs(..., exist_ok=True)`), so code that writes into the
    directory never has to create it first. A getter returning `None` (no directory configured)
    is passed through. Setters and deleters work as with `property`.

    Raises:
        TypeError: When read, if the getter returns something other than a path or `None`.
        FileExistsError: When read, if the path exists but is not a directory.

    Examples:
        >>> @ensure_dir
        ... def dir(self) -> str:
        ...     return os.path.join("path", "to", "dir")

        >>> import tempfile
        >>> class Workspace:
        ...     def __init__(self, root):
        ...         self.root = root
        ...     @ensure_dir
        ...     def logs(self) -> str:
        ...         return os.path.join(self.root, "logs")
        >>> workspace = Workspace(tempfile.mkdtemp())
        >>> os.path.isdir(workspace.logs)
        True
    """

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        path = super().__get__(instance, owner)
        if path is None:
            return None
        if not isinstance(path, (str, os.PathLike)):
            name = getattr(self.fget, "__qualname__", "ensure_dir")
            raise TypeError(f"{name} must return a path (str or os.PathLike) or None, got {path!r}")
        os.makedirs(path, exist_ok=True)
        return path
