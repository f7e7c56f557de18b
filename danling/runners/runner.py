"""`Runner`: pick the backend runner named by `config.stack`.

Backends register themselves once, next to their class:

```python
register_runner(("torch", "ddp", "auto"), TorchRunner)
```

`Runner(config)` then builds the registered class for `config.stack`. Subclassing works too:
`class MyRunner(Runner)` keeps your hooks and gains the backend's implementation, chosen per run
(`--stack deepspeed` swaps the backend without touching the script).

The registry also says which stacks a runner class implements
([`runner_stacks`][danling.runners.registry.runner_stacks]): a runner built directly, say a
`TorchRunner` subclass, refuses a `config.stack` it does not implement (see
[`RunnerConfig.check_runner`][danling.runners.config.RunnerConfig.check_runner]). A stack that
`RunnerConfig.STACKS` names but no runner is registered for is not built in this version yet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from .base_runner import BaseRunner
from .config import RunnerConfig
from .registry import RUNNERS, runner_stacks

__all__ = ["RUNNERS", "Runner", "register_runner", "resolve_runner", "runner_stacks"]

R = TypeVar("R", bound=type[BaseRunner])


_COMBINED: dict[tuple[type, type], type] = {}


def register_runner(names: str | Iterable[str], runner: R | None = None) -> R | Callable[[R], R]:
    """Register `runner` for one or more stack names; usable as a decorator.

    Names are case-insensitive and also registered as valid `RunnerConfig` stacks. Registering a
    name again replaces the previous class.

    Examples:
        >>> class EchoRunner(BaseRunner):
        ...     pass
        >>> _ = register_runner(("echo", "echo-alias"), EchoRunner)
        >>> resolve_runner("ECHO") is EchoRunner, resolve_runner("echo-alias") is EchoRunner
        (True, True)
        >>> for name in ("echo", "echo-alias"):
        ...     del RUNNERS[name]
    """
    keys = [names] if isinstance(names, str) else list(names)
    if not keys or not all(isinstance(key, str) and key for key in keys):
        raise ValueError(f"register_runner() needs one or more non-empty stack names, got {names!r}")

    def register(cls: R) -> R:
        if not (isinstance(cls, type) and issubclass(cls, BaseRunner)):
            raise TypeError(f"register_runner() expects a BaseRunner subclass, got {cls!r}")
        for key in keys:
            key = key.lower()
            RUNNERS[key] = cls
            if key not in RunnerConfig.STACKS:
                RunnerConfig.register_stack(key)
        return cls

    return register if runner is None else register(runner)


def resolve_runner(stack: str) -> type[BaseRunner]:
    """Return the runner class registered for `stack`.

    Raises:
        ValueError: No runner is registered under that name; the message lists the ones that are
            and says when the name is a known stack that is not built in this version yet.
    """
    key = stack.strip().lower() if isinstance(stack, str) else stack  # as `RunnerConfig.validate` compares it
    if key not in RUNNERS:
        registered = sorted(RUNNERS) or "none"
        if key in RunnerConfig.STACKS:
            raise ValueError(
                f"config.stack={stack!r} is not available yet in this version of danling: no runner is "
                f"registered for it; registered stacks: {registered}"
            )
        raise ValueError(f"no runner is registered for stack {stack!r}; registered stacks: {registered}")
    return RUNNERS[key]


def _stack_of(config: Any) -> str:
    if isinstance(config, Mapping):
        return config.get("stack") or "auto"
    raise TypeError(f"Runner() expects a RunnerConfig or a mapping, got {type(config).__name__}: {config!r}")


class Runner(BaseRunner):
    """Entry point that builds the backend runner named by `config.stack`.

    `Runner(config)` returns an instance of the registered class. For a subclass
    (`class MyRunner(Runner)`), it returns an instance of a class combining `MyRunner` with the
    backend, so the subclass's hooks override the backend's. The result is an instance of both.

    Raises:
        ValueError: `config.stack` has no registered runner.

    Examples:
        >>> import tempfile
        >>> class EchoRunner(BaseRunner):
        ...     pass
        >>> _ = register_runner("echo", EchoRunner)
        >>> runner = Runner({"stack": "echo", "workspace_root": tempfile.mkdtemp(), "log": False})
        >>> type(runner).__name__, runner.close()
        ('EchoRunner', True)
        >>> del RUNNERS["echo"]
    """

    def __new__(cls, config: RunnerConfig | Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        if cls is Runner:
            backend = resolve_runner(_stack_of(config))
            return backend(config, *args, **kwargs)
        if any(issubclass(cls, backend) for backend in RUNNERS.values()):
            return super().__new__(cls)  # already combined with a backend
        backend = resolve_runner(_stack_of(config))
        combined = _COMBINED.get((cls, backend))
        if combined is None:
            combined = type(cls.__name__, (cls, backend), {"__module__": cls.__module__, "__doc__": cls.__doc__})
            _COMBINED[(cls, backend)] = combined
        return super().__new__(combined)
