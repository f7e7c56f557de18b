"""Replayable failures: the update that went wrong, written down so that one process can run it again.

A [`ReplayRecorder`][danling.runners.diagnosis.replay.ReplayRecorder] watches the training steps
while `replay.*` asks for it and writes a **bundle** when an update fails (a non-finite loss, an
update the non-finite check drops, a loss-spike rollback) or reaches a chosen global step
(`replay.capture_steps`). A bundle is a directory:

| File | Holds |
| --- | --- |
| `manifest.json` | reason, global step, rank, runner class, code version, SHA-256 of the other files |
| `config.json` | the run's config |
| `state.pt` | model and optimizer state before the update (copy mode only) |
| `windows.pt` | the micro-batches of each update to run, with the RNG states at its start and the losses the run saw |

**Copy mode** (model and optimizer state up to `replay.max_copy_bytes`): the state is copied at
the start of every update, and the bundle holds that copy and the one update. **Checkpoint
mode** (larger state): the bundle names the newest checkpoint and holds every update since, whose
micro-batches are kept by reference until the next checkpoint; the replay loads the checkpoint and
runs them all. A chosen step (`capture_steps`) is always copied, and only that update pays for it.

Off (the default), nothing is subscribed and no batch does any extra work. On, every batch passes
through `STEP_START`/`STEP_END` (so the loop's plain fast path is off); `on_nonfinite` adds one
host synchronisation per micro-batch (the loss is read). `danling replay BUNDLE` (see
[`replay_bundle`][danling.runners.diagnosis.replaying.replay_bundle]) re-runs the last update.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config_operations import ReplayConfig
from ..loop.events import CheckpointContext, EventBus, Events, PassContext, SkippedStepContext, StepContext
from ..update.spikes import RollbackRequest, TrainingDivergedError

__all__ = [
    "BUNDLE_FORMAT",
    "ReplayRecorder",
    "ReplaySetup",
    "Window",
    "capture_rng",
    "describe_runner",
    "restore_rng",
]

BUNDLE_FORMAT = 1


@dataclass
class Window:
    """One update: its micro-batches (references, as the loader gave them), the RNG states at its start,
    the losses the run saw, and the global step it brings the run to."""

    step: int
    rng: dict[str, Any]
    batches: list[Any] = field(default_factory=list)
    losses: list[Any] = field(default_factory=list)

    def payload(self) -> dict[str, Any]:
        losses = [None if loss is None else torch.as_tensor(loss).detach().cpu() for loss in self.losses]
        return {"step": self.step, "rng": self.rng, "batches": self.batches, "losses": losses}


@dataclass(frozen=True)
class ReplaySetup:
    """What the recorder is built from (explicit pieces of the runner, never the runner itself).

    Attributes:
        events: The event bus it subscribes to.
        pending: Micro-steps of the open accumulation window (0: the next batch opens a window).
        state: The model (`model`) and optimizer (`optimizer`) state dicts, as live references.
        describe: The runner class (`runner`: `module:qualname`, `script` when it is `__main__`),
            the config (`config`) and the code version (`code`), as JSON-ready values.
        directory: The run directory (bundles go to its `replay.dir_name` subdirectory).
        rank: This process's global rank; world_size: the number of ranks.
        logger: Where written bundles are reported.
    """

    events: EventBus
    pending: Callable[[], int]
    state: Callable[[], Mapping[str, Any]]
    describe: Callable[[], Mapping[str, Any]]
    directory: Callable[[], Path]
    rank: int
    world_size: int
    logger: logging.Logger


class ReplayRecorder:
    """Writes a replay bundle for failing updates (`replay.on_nonfinite`, `replay.on_rollback`) and chosen ones.

    Args:
        section: The `replay.*` config.
        setup: The runner's pieces it uses (see [`ReplaySetup`][danling.runners.diagnosis.replay.ReplaySetup]).

    Attributes:
        bundles: Paths of the bundles written so far; failures: how many of them a failure wrote
            (at most `replay.max_bundles`; chosen steps do not count).

    Raises:
        ValueError: A `replay.*` value outside its range (the message names it).
    """

    def __init__(self, section: ReplayConfig, setup: ReplaySetup) -> None:
        check_section(section)
        self.on_nonfinite, self.on_rollback = bool(section.on_nonfinite), bool(section.on_rollback)
        self.capture_steps = frozenset(int(step) for step in section.capture_steps)
        self.max_copy_bytes, self.max_bundles = int(section.max_copy_bytes), int(section.max_bundles)
        self.dir_name = str(section.dir_name)
        self.setup = setup
        self.bundles: list[Path] = []
        self.failures = 0
        self._watch_all = self.on_nonfinite or self.on_rollback  # every update, not only chosen ones
        self._copy: bool | None = None  # copy mode; settled at the first update (the state's size)
        self._state: dict[str, Any] | None = None  # copy before the open window
        self._window: Window | None = None
        self._since: list[Window] = []  # checkpoint mode: the updates since `_checkpoint`
        self._checkpoint: str | None = None
        self._dropped = False  # the open window's update was dropped as non-finite
        self._training = False  # a training pass is under way (evaluation passes emit steps too)
        self._passes: list[bool] = []  # whether each pass under way trains (evaluations nest in step mode)
        self._subscriptions: list[Any] = []

    @property
    def active(self) -> bool:
        """Whether any trigger is on (`on_nonfinite`, `on_rollback` or a `capture_steps` entry)."""
        return self._watch_all or bool(self.capture_steps)

    def attach(self, events: EventBus) -> None:
        """Watch the training steps from now on (nothing when no trigger is on)."""
        if not self.active:
            return
        handlers = [
            (Events.PASS_START, self._pass_started),
            (Events.PASS_END, self._pass_ended),
            (Events.STEP_START, self._step_started),
            (Events.STEP_END, self._step_ended),
        ]
        if self.on_nonfinite:
            handlers.append((Events.OPTIMIZER_STEP_SKIPPED, self._skipped))
        if self._watch_all:
            handlers += [(Events.CHECKPOINT_SAVED, self._checkpointed), (Events.CHECKPOINT_LOADED, self._checkpointed)]
        self._subscriptions = [events.subscribe(event, handler) for event, handler in handlers]

    def detach(self) -> None:
        """Stop watching (after `max_bundles` bundles): the steps cost nothing again."""
        for subscription in self._subscriptions:
            subscription.unsubscribe()
        self._subscriptions = []
        self._window, self._state, self._since = None, None, []

    # ------------------------------------------------------------------ the steps
    def _pass_started(self, context: PassContext) -> None:
        self._passes.append(context.mode == "train")
        self._training = context.mode == "train"

    def _pass_ended(self, context: PassContext) -> None:
        # A step-mode training pass goes on after the evaluation passes nested in it.
        if self._passes:
            self._passes.pop()
        self._training = bool(self._passes) and self._passes[-1]

    def _step_started(self, context: StepContext) -> None:
        if not self._training:
            return
        if self.setup.pending() == 0:
            self._open(context.global_step + 1)
        if self._window is not None:
            self._window.batches.append(context.data)

    def _open(self, step: int) -> None:
        """A window opens: keep what the update starts from (a copy, or the windows since a checkpoint)."""
        chosen = step in self.capture_steps
        self._dropped = False
        if not (chosen or self._watch_all):
            self._window, self._state = None, None
            return
        if self._copy is None:
            self._copy = _state_bytes(self.setup.state()) <= self.max_copy_bytes
        self._window = Window(step, capture_rng())
        if self._copy or chosen:
            # A chosen step larger than `max_copy_bytes` is copied to host memory, not the device's.
            self._state = _clone(self.setup.state(), to_cpu=not self._copy)
        else:
            self._state = None
            self._since.append(self._window)

    def _skipped(self, context: SkippedStepContext) -> None:
        self._dropped = True

    def _step_ended(self, context: StepContext) -> None:
        window = self._window
        if window is None or not self._training:
            return
        window.losses.append(context.loss)
        reason = self._reason(context)
        if reason is None:
            return
        try:
            self.write(reason, context.error)
        except Exception:  # a bundle that cannot be written must not end the run a second way
            self.setup.logger.exception("replay: could not write the bundle of global step %d", window.step)
        if reason != "capture":
            self.failures += 1
        if self.failures >= self.max_bundles and self._watch_all:
            # Enough failures bundled: only the chosen steps still to come cost anything.
            self.on_nonfinite = self.on_rollback = self._watch_all = False
            self._since = []
        if not self._watch_all and not any(step > window.step for step in self.capture_steps):
            self.detach()

    def _reason(self, context: StepContext) -> str | None:
        error = context.error
        if self.on_rollback and isinstance(error, RollbackRequest):
            return "rollback"
        if self.on_nonfinite:
            if self._dropped or isinstance(error, TrainingDivergedError):
                return "nonfinite"
            loss = context.loss
            if isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss).all()):
                return "nonfinite"
        window = self._window
        closed = error is None and self.setup.pending() == 0
        return "capture" if closed and window is not None and window.step in self.capture_steps else None

    def _checkpointed(self, context: CheckpointContext) -> None:
        """A checkpoint was saved or loaded: checkpoint mode starts its list of updates afresh from it."""
        self._checkpoint = os.fspath(context.path)
        self._since = [self._window] if self._window is not None and self.setup.pending() else []

    # ------------------------------------------------------------------ the bundle
    def write(self, reason: str, error: BaseException | None = None) -> Path:
        """Write the bundle of the open window to `<run dir>/<dir_name>/step-<N>-rank<R>-<reason>/`; its path."""
        window = self._window
        if window is None:
            raise RuntimeError("replay: no update is open to bundle")
        setup = self.setup
        path = setup.directory() / self.dir_name / f"step-{window.step:08d}-rank{setup.rank}-{reason}"
        path.mkdir(parents=True, exist_ok=True)
        copied = self._state is not None
        windows = [window] if copied else list(self._since)
        files = {"windows.pt": {"windows": [w.payload() for w in windows]}}
        if copied:
            files["state.pt"] = self._state
        described = dict(setup.describe())
        digests = {}
        for name, payload in files.items():
            torch.save(payload, path / name)
            digests[name] = _sha256(path / name)
        (path / "config.json").write_text(json.dumps(described.pop("config"), indent=2, default=repr))
        digests["config.json"] = _sha256(path / "config.json")
        manifest = {
            "format": BUNDLE_FORMAT,
            "reason": reason,
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "step": window.step,
            "rank": setup.rank,
            "world_size": setup.world_size,
            "mode": "copy" if copied else "checkpoint",
            "checkpoint": None if copied else self._checkpoint,
            "torch": torch.__version__,
            **described,
            "files": digests,
        }
        (path / "manifest.json").write_text(json.dumps(manifest, indent=2, default=repr))
        self.bundles.append(path)
        setup.logger.warning(
            "replay: wrote the bundle of global step %d (%s) to %s; re-run it with `danling replay %s`",
            window.step,
            reason,
            path,
            path,
        )
        return path


def describe_runner(runner_class: type, config: Mapping[str, Any], code_id: str | None) -> dict[str, Any]:
    """What a replay rebuilds the runner from: its class (`module:qualname`; `script`, the file that
    defines it, when that is `__main__`), the config, and the code version (`code_id` and git state)."""
    from ..services.git_info import git_info

    module = runner_class.__module__
    script = getattr(sys.modules.get("__main__"), "__file__", None) if module == "__main__" else None
    return {
        "runner": f"{module}:{runner_class.__qualname__}",
        "script": None if script is None else os.path.abspath(script),
        "config": dict(config),
        "code": {"code_id": code_id, "git": git_info()},
    }


def capture_rng() -> dict[str, Any]:
    """The RNG states a step draws from: torch (CPU and every initialised CUDA device), Python, NumPy."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy"] = numpy.random.get_state()
    return states


def restore_rng(states: Mapping[str, Any]) -> None:
    """Set the RNG states `capture_rng` returned (CUDA ones only when this process has the devices)."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    cuda = states.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) <= torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    if states.get("numpy") is not None:
        import numpy

        numpy.random.set_state(states["numpy"])


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _nbytes(state: Mapping[str, Any]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in _tensors(state))


def _state_bytes(state: Mapping[str, Any]) -> int:
    """Bytes of the state to copy. Settled at the first update, before the optimizer has any state:
    that is counted as twice the model's (Adam's two moments), so that the mode does not change later."""
    optimizer = state.get("optimizer")
    if optimizer is not None and not optimizer.get("state"):
        return 3 * _nbytes(state.get("model") or {}) + _nbytes({k: v for k, v in state.items() if k != "model"})
    return _nbytes(state)


def _clone(value: Any, *, to_cpu: bool) -> Any:
    """A copy of the tensors of a state dict (its other values are kept: they are not updated in place)."""
    if isinstance(value, torch.Tensor):
        copy = value.detach()
        return copy.to("cpu", copy=True) if to_cpu else copy.clone()
    if isinstance(value, Mapping):
        return {key: _clone(item, to_cpu=to_cpu) for key, item in value.items()}
    if isinstance(value, list):
        return [_clone(item, to_cpu=to_cpu) for item in value]
    if isinstance(value, tuple):
        return tuple(_clone(item, to_cpu=to_cpu) for item in value)
    return value


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_section(section: ReplayConfig) -> None:
    """Refuse a `replay.*` value outside its range, naming it (when the section is built, and by `validate`)."""
    steps, size, bundles = section.capture_steps, section.max_copy_bytes, section.max_bundles
    if not isinstance(steps, (list, tuple)) or any(isinstance(s, bool) or not isinstance(s, int) for s in steps):
        raise ValueError(f"replay.capture_steps must be a list of global steps (integers >= 1), got {steps!r}")
    if any(step < 1 for step in steps):
        raise ValueError(f"replay.capture_steps must hold global steps >= 1, got {list(steps)!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"replay.max_copy_bytes must be an integer >= 0, got {size!r}")
    if isinstance(bundles, bool) or not isinstance(bundles, int) or bundles < 1:
        raise ValueError(f"replay.max_bundles must be an integer >= 1, got {bundles!r}")
