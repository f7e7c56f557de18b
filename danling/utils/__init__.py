"""General-purpose helpers used across danling and usable on their own.

- [`load`][danling.utils.load], [`save`][danling.utils.save],
  [`load_pandas`][danling.utils.load_pandas]: file I/O chosen by extension, with atomic writes.
- [`is_json_serializable`][danling.utils.is_json_serializable]: check before writing JSON.
- [`catch`][danling.utils.catch], [`flexible_decorator`][danling.utils.flexible_decorator],
  [`method_cache`][danling.utils.method_cache]: decorators.
- [`debug`][danling.utils.debug]: open a debugger when a block raises.
- [`ensure_dir`][danling.utils.ensure_dir]: a property whose directory is created on access.
- [`RoundDict`][danling.utils.RoundDict]: result mapping with rounding and formatting.
- [`to_device`][danling.utils.to_device]: move nested batches between devices.
- [`optional_import`][danling.utils.optional_import]: lazy import of optional extras.
- [`BackgroundWriter`][danling.utils.BackgroundWriter]: `save` on a helper thread for often-rewritten files.
"""

from .contextmanagers import debug
from .decorators import catch, flexible_decorator, method_cache
from .descriptors import ensure_dir
from .device import to_device
from .imports import optional_import
from .io import is_json_serializable, load, load_pandas, save
from .registry import Registry
from .rounding import RoundDict
from .writer import BackgroundWriter

__all__ = [
    "BackgroundWriter",
    "RoundDict",
    "catch",
    "debug",
    "ensure_dir",
    "flexible_decorator",
    "is_json_serializable",
    "load",
    "load_pandas",
    "method_cache",
    "optional_import",
    "Registry",
    "save",
    "to_device",
]
