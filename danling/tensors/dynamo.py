"""Make NestedTensor opaque to ``torch.compile``: its ops run eagerly between compiled regions.

Dynamo cannot build a NestedTensor inside a graph (construction goes through
``Tensor._make_wrapper_subclass``), and when it tries to trace into the op code it warns about
every C function it does not know; under ``-W error`` those warnings abort compilation. Marking
every NestedTensor method, property and handler entry point with ``torch._dynamo.disable`` makes
Dynamo stop at the NestedTensor op instead (a silent graph break): dense code around it is still
compiled, and the op itself runs exactly as in eager mode.

Importing ``torch._dynamo`` costs seconds, so the marks are applied only once it is imported (by
``torch.compile`` or anything else); until then NestedTensor has no dependency on it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import sys
from typing import Any

_PENDING: list[type] = []
_SKIP = {"__dict__", "__weakref__", "__module__", "__doc__", "__annotations__", "__slots__", "__init_subclass__"}


def opaque_to_dynamo(*classes: type) -> None:
    """Mark the methods of ``classes`` as not traceable by Dynamo, now or once it is imported."""
    _PENDING.extend(classes)
    if "torch._dynamo" in sys.modules:
        _apply()
    elif not any(isinstance(f, _DynamoImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _DynamoImportHook())


def _apply() -> None:
    import torch._dynamo

    disable = torch._dynamo.disable
    while _PENDING:
        klass = _PENDING.pop()
        for name, attr in list(vars(klass).items()):
            if name in _SKIP:
                continue
            if isinstance(attr, property):
                accessors = (disable(f) if f is not None else None for f in (attr.fget, attr.fset, attr.fdel))
                setattr(klass, name, property(*accessors, attr.__doc__))
            elif isinstance(attr, (classmethod, staticmethod)):
                setattr(klass, name, type(attr)(disable(attr.__func__)))
            elif inspect.isfunction(attr):
                setattr(klass, name, disable(attr))


class _DynamoImportHook(importlib.abc.MetaPathFinder):
    """Runs `_apply` right after ``torch._dynamo`` finishes importing, then removes itself."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenApply(spec.loader)
        return spec


class _ThenApply(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        _apply()
