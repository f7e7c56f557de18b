"""The stack registry: which runner class each `config.stack` names.

[`register_runner`][danling.runners.runner.register_runner] fills it; the config (which stacks a
runner class may run), `BaseRunner` (the backend `stack: auto` ran on) and `Runner` (the class to
build) read it. It imports nothing of the runners, so that all of them can import it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RUNNERS", "runner_stacks"]

RUNNERS: dict[str, Any] = {}
"""Registered backend runner classes by stack name (lower case)."""


def runner_stacks(runner: type) -> tuple[str, ...]:
    """Stacks `runner` implements: `"auto"` and every name registered for it or one of its bases.

    `"auto"` always counts: it asks for no particular backend, so a runner class used directly
    (even one outside the registry) runs it as itself.

    Examples:
        >>> from danling.runners import TorchRunner
        >>> runner_stacks(TorchRunner)
        ('auto', 'ddp', 'torch')
        >>> from danling.runners import BaseRunner
        >>> runner_stacks(BaseRunner)
        ('auto',)
    """
    names = {name for name, backend in RUNNERS.items() if isinstance(runner, type) and issubclass(runner, backend)}
    return tuple(sorted(names | {"auto"}))
