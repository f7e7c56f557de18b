"""Backends build on public hooks only: no private name of another class or module.

The DeepSpeed, graph and parallel backends (`danling/runners/deepspeed/`, `danling/runners/graph/`,
`parallel_runner.py`, the pipeline component in `danling/runners/parallel/` and the FSDP /
tensor-parallel / pipeline functions in `danling/distributed/`) are read as ASTs. A backend
module may use its own private names (what it defines: functions, classes, methods, class
attributes, and any `x._name = ...` it assigns); it may not

- read `x._name` that it does not define itself (a base class's private method or attribute),
- `from m import _name` (another module's private helper),
- define a method `_name` that a base class already defines (overriding a private hook).

A private attribute a module assigns counts as its own when it is assigned on `self`/`cls`, or
carries danling's `_danling_` prefix (a tag the module puts on a foreign object, such as a loss
tensor): assigning `obj._name` on someone else's object is using their private name.

What a backend needs from the runner must be a public, documented hook, or an explicit argument.
The only exceptions are private names of third-party objects that have no public counterpart,
listed in `FOREIGN` with the reason.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BACKEND_GLOBS = (
    "danling/runners/deepspeed/*.py",
    "danling/runners/graph/*.py",
    "danling/runners/parallel_runner.py",
    "danling/runners/parallel/*.py",
    "danling/distributed/fsdp.py",
    "danling/distributed/layout.py",
    "danling/distributed/parts.py",
    "danling/distributed/tensor_parallel.py",
    "danling/distributed/pipeline*.py",
)

# (module path, expression) -> why a third-party private is used.
FOREIGN: dict[tuple[str, str], str] = {
    ("danling/runners/deepspeed/checkpoint.py", "engine._config"): (
        "DeepSpeed reads `load_universal_checkpoint` from the engine's config; there is no per-call argument"
    ),
    ("danling/runners/deepspeed/runner.py", "groups._WORLD_GROUP"): (
        "DeepSpeed caches a clone of the world group for the life of the process and has no reset"
    ),
    ("danling/runners/deepspeed/update.py", "torch._foreach_div_"): "torch's fused in-place division of many tensors",
    ("danling/runners/graph/step.py", "torch._dynamo"): (
        "dynamo's graph-break records, its Unsupported error and its DDP graph-splitting setting have no public API"
    ),
    ("danling/distributed/pipeline_runtime.py", "main._n_microbatches"): (
        "torch's pipeline schedules expose their microbatch count only privately"
    ),
    ("danling/distributed/pipeline.py", "schedule._n_microbatches"): (
        "torch's pipeline schedules expose their microbatch count only privately"
    ),
    ("danling/distributed/pipeline_runtime.py", "schedule._loss_fn"): (
        "torch's schedules compute a loss whenever they hold one; detaching it is the only way to run without"
    ),
    ("danling/distributed/pipeline_parts.py", "node._modules"): "nn.Module's child registry (no public lookup by name)",
    ("danling/distributed/parts.py", "target._modules"): "nn.Module's child registry (no public replace by name)",
    ("danling/distributed/fsdp.py", "mesh[dims]._flatten"): (
        "DeviceMesh names a group over several dimensions only through `_flatten` (no public API in torch 2.13)"
    ),
    ("danling/distributed/fsdp.py", "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model"): (
        "DDP's only way to leave some parameters (the experts, reduced over expert_data) out of its all-reduce"
    ),
}


def backend_files() -> list[Path]:
    return sorted({path for pattern in BACKEND_GLOBS for path in ROOT.glob(pattern)})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names(tree: ast.Module) -> set[str]:
    """Every name the module defines: functions, classes, methods, (class) attributes, `self._name` it assigns."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            target = node.value
            if (isinstance(target, ast.Name) and target.id in ("self", "cls")) or node.attr.startswith("_danling_"):
                names.add(node.attr)
    return names


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _overrides(path: Path, tree: ast.Module) -> list[str]:
    """Private methods of the module's classes that a base class (defined elsewhere) already has."""
    module = importlib.import_module(_module_name(path))
    found = []
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        cls = getattr(module, node.name, None)
        if not inspect.isclass(cls):
            continue
        defined = [item.name for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for name in defined:  # what the class body defines (not what a metaclass adds, e.g. Protocol's)
            if not _private(name):
                continue
            for base in cls.__mro__[1:]:
                if base is object or base.__module__ == module.__name__:
                    continue
                if name in vars(base):
                    found.append(f"{node.name}.{name} overrides the private {base.__qualname__}.{name}")
                    break
    return found


def violations(path: Path) -> list[str]:
    relative = path.relative_to(ROOT).as_posix()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own = _own_names(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            expression = ast.unparse(node)
            if (relative, expression) not in FOREIGN:
                found.append(f"{relative}:{node.lineno}: uses {expression}")
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{relative}:{node.lineno}: imports {alias.name} from {node.module or '.'}")
    found += [f"{relative}: {message}" for message in _overrides(path, tree)]
    return found


def test_backend_modules_exist():
    names = {path.relative_to(ROOT).as_posix() for path in backend_files()}
    assert "danling/runners/deepspeed/runner.py" in names
    assert "danling/runners/parallel_runner.py" in names
    assert "danling/distributed/fsdp.py" in names


@pytest.mark.parametrize("path", backend_files(), ids=lambda path: path.relative_to(ROOT).as_posix())
def test_backend_uses_no_foreign_private_name(path):
    found = violations(path)
    assert not found, "backends must use public hooks:\n" + "\n".join(found)


def test_foreign_exceptions_are_still_needed():
    """An exception whose expression no longer occurs is removed, so the list stays the real one."""
    used = set()
    for path in backend_files():
        relative = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        used |= {(relative, ast.unparse(node)) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert set(FOREIGN) <= used, sorted(set(FOREIGN) - used)
