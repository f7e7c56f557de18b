"""Every public method of a runner states its contract, or is one that callers use and do not override.

A method a user or a backend may override (a hook) needs, after its one-line summary, the four
labelled lines of the hook contract, each at the start of a docstring line and in this order:

    Called when: ...
    Holds on entry: ...
    Side effects: ...
    Overrides must not: ...

The API reference (docs/api/runners.md) is generated from these docstrings, so this test is what
keeps the reference complete. Methods that callers invoke but are not meant to override are listed
in `CALLED`; they need a docstring of at least one line. Properties and nested classes are not
methods here; classmethods (`from_checkpoint`, `from_pretrained`) are constructors and are skipped.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from danling.runners import BaseRunner, DeepSpeedRunner, GraphRunner, ParallelRunner, TorchRunner

RUNNERS = (BaseRunner, TorchRunner, ParallelRunner, DeepSpeedRunner, GraphRunner)
LABELS = ("Called when:", "Holds on entry:", "Side effects:", "Overrides must not:")

# Entry points and utilities that callers use; the extension points are the hooks they call.
CALLED = frozenset(
    {
        "train",  # user entry point; customise the passes through train_epoch / the step hooks
        "train_epochs",  # reached from train() in epoch mode
        "train_steps",  # reached from train() in step mode
        "evaluate",  # user entry point; customise through evaluate_epoch / evaluate_step
        "evaluate_steps",  # user entry point for a partial evaluation
        "infer",  # user entry point; customise through infer_step
        "step",  # the accumulation state machine that train_step calls once per micro-batch
        "log_values",  # sends user values to the trackers
        "save",  # writes a file on the main process
        "set_checkpoint_manager",  # called by init_checkpoint_manager (and tests) to bind a manager
        "iter_optimizer_parameters",  # convenience over the iter_optimizer_named_parameters hook
    }
)


def public_methods(cls: type) -> dict[str, type]:
    """Public methods of `cls` (no properties, classes or classmethods), each with the class defining it."""
    methods = {}
    for name in dir(cls):
        if name.startswith("_"):
            continue
        raw = inspect.getattr_static(cls, name)
        if isinstance(raw, (property, type, classmethod)) or not callable(raw):
            continue
        methods[name] = next(klass for klass in cls.__mro__ if name in vars(klass))
    return methods


def has_contract(doc: str | None) -> bool:
    """Whether `doc` has the four labels, each starting a line, in order."""
    lines = [line.strip() for line in inspect.cleandoc(doc or "").splitlines()]
    found = [next((i for i, line in enumerate(lines) if line.startswith(label)), None) for label in LABELS]
    return None not in found and found == sorted(found)


def gaps(cls: type) -> tuple[list[str], list[str]]:
    """(hooks without the full contract, called methods without a docstring) of `cls`."""
    no_contract, no_doc = [], []
    for name, owner in sorted(public_methods(cls).items()):
        label = f"{owner.__name__}.{name}"
        doc = vars(owner)[name].__doc__  # the defining class's own docstring, not an inherited one
        if name in CALLED:
            if not (doc or "").strip():
                no_doc.append(label)
        elif not has_contract(doc):
            no_contract.append(label)
    return no_contract, no_doc


def test_labels_are_recognised_only_at_line_starts_and_in_order():
    assert has_contract("S.\n\nCalled when: a\nHolds on entry: b\nSide effects: c\nOverrides must not: d\n")
    assert not has_contract("S.\n\nHolds on entry: b\nCalled when: a\nSide effects: c\nOverrides must not: d\n")
    assert not has_contract("S. Called when: a, Holds on entry: b, Side effects: c, Overrides must not: d")
    assert not has_contract(None)


@pytest.mark.parametrize("cls", RUNNERS, ids=lambda cls: cls.__name__)
def test_every_public_method_states_its_contract(cls):
    no_contract, no_doc = gaps(cls)
    message = []
    if no_contract:
        message.append(f"{cls.__name__}: hooks without the four-line contract ({', '.join(LABELS)}): {no_contract}")
    if no_doc:
        message.append(f"{cls.__name__}: called methods without a docstring: {no_doc}")
    assert not message, "\n".join(message)


def test_called_methods_exist():
    """A name in CALLED that no runner has any more is stale: remove it."""
    names = set().union(*(public_methods(cls) for cls in RUNNERS))
    assert not CALLED - names, sorted(CALLED - names)


def test_deepspeed_runner_imports_without_deepspeed():
    """The runners package (DeepSpeedRunner included) imports where DeepSpeed is not installed."""
    code = (
        "import sys\n"
        "sys.modules['deepspeed'] = None  # importing it now raises ImportError\n"
        "from danling.runners import BaseRunner, DeepSpeedRunner, ParallelRunner, TorchRunner\n"
        "print(DeepSpeedRunner.__name__)\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "DeepSpeedRunner"


def test_every_public_loop_method_states_its_contract():
    """The loop component's methods carry the contract too: the runner's loop methods delegate to them."""
    from danling.runners.loop.loops import Loop

    methods = sorted(public_methods(Loop).items())
    missing = [name for name, owner in methods if not has_contract(vars(owner)[name].__doc__)]
    assert not missing, f"Loop: methods without the four-line contract: {missing}"
