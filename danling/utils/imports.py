"""Import helpers for optional dependencies.

danling keeps TensorBoard, W&B, DeepSpeed and pandas out of its import path; features that
need one of them call [`optional_import`][danling.utils.optional_import] at the moment of use,
so a missing package surfaces as an error that says which extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["optional_import"]


def optional_import(module: str, extra: str) -> ModuleType:
    """Import `module` on demand, explaining how to install it when it is missing.

    Args:
        module: Dotted module path, for example `"pandas"` or `"torch.utils.tensorboard"`.
        extra: Name of the danling extra that provides the module, used in the install hint.

    Returns:
        The imported module (cached by Python after the first call, so repeated calls are cheap).

    Raises:
        ImportError: If the module (or one of its own dependencies) cannot be imported. The
            message names the module and suggests `pip install danling[<extra>]`; the original
            error is chained as `__cause__`.
        TypeError: If `module` or `extra` is not a non-empty string.

    Examples:
        >>> optional_import("json", "core").dumps([1])
        '[1]'
        >>> optional_import("surely_not_a_module", "pandas")
        Traceback (most recent call last):
        ImportError: 'surely_not_a_module' is required for this feature but could not be imported
        (No module named 'surely_not_a_module'); install it with `pip install danling[pandas]`
    """
    for label, value in (("module", module), ("extra", extra)):
        if not isinstance(value, str) or not value:
            raise TypeError(f"optional_import() expects {label} to be a non-empty string, got {value!r}")
    try:
        return importlib.import_module(module)
    except ImportError as err:
        message = (
            f"{module!r} is required for this feature but could not be imported ({err}); "
            f"install it with `pip install danling[{extra}]`"
        )
        raise ImportError(message, name=module) from err
