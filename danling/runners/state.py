"""Checkpointable runner state: progress counters, restart bookkeeping and RNG snapshots.

Every `state_dict()` here returns plain Python containers plus CPU `torch.ByteTensor`s, so the
payload pickles, survives `torch.load(weights_only=True)` and carries no NumPy objects.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

__all__ = ["RunnerTrainState", "RunnerElasticState", "RunnerRNGState", "RunnerState"]


def _require_mapping(value: Any, what: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise TypeError(f"{what} must be a mapping, got {type(value).__name__}: {value!r}")
    return value


class _StatefulBase:
    """Dataclass mixin: `state_dict()` exports the fields, `load_state_dict()` reads them back."""

    def state_dict(self) -> dict[str, Any]:
        """Field values as a plain dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Set the fields present in `state_dict`; absent fields keep their value, unknown keys are ignored."""
        state_dict = _require_mapping(state_dict, f"{type(self).__name__} state")
        for f in fields(self):  # type: ignore[arg-type]
            if f.name in state_dict:
                setattr(self, f.name, state_dict[f.name])


def _counter(owner: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{owner}.{name} must be a non-negative integer, got {value!r}")
    return int(value)


@dataclass
class RunnerTrainState(_StatefulBase):
    """Training progress.

    Attributes:
        epoch: Completed epochs (the index of the next epoch to run).
        global_step: Optimizer steps taken so far.
        micro_step: Micro-batches (forward/backward passes) seen so far; with gradient
            accumulation it advances `accum_steps` times per `global_step`.

    Examples:
        >>> state = RunnerTrainState(epoch=1, global_step=10)
        >>> state.state_dict()
        {'epoch': 1, 'global_step': 10, 'micro_step': 0}
        >>> RunnerTrainState(global_step=-1)
        Traceback (most recent call last):
        ValueError: RunnerTrainState.global_step must be a non-negative integer, got -1
    """

    epoch: int = 0
    global_step: int = 0
    micro_step: int = 0

    def __setattr__(self, name: str, value: Any) -> None:
        # Plain non-negative ints (every increment of the loop) skip the full validation.
        if name in ("epoch", "global_step", "micro_step") and not (type(value) is int and value >= 0):
            value = _counter(type(self).__name__, name, value)
        object.__setattr__(self, name, value)


@dataclass
class RunnerElasticState(_StatefulBase):
    """Restart bookkeeping under torchelastic.

    Attributes:
        restart_count: How many times the job was restarted (`TORCHELASTIC_RESTART_COUNT`).
    """

    restart_count: int = 0

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "restart_count":
            value = _counter(type(self).__name__, name, value)
        super().__setattr__(name, value)


@dataclass
class RunnerRNGState(_StatefulBase):
    """Snapshots of the process's random generators.

    Attributes:
        python: `random.getstate()` as `[version, [internal state], gauss_next]`.
        numpy: NumPy's legacy global generator as `{"algorithm", "key", "pos", "has_gauss", "cached_gaussian"}`.
        torch: `torch.get_rng_state()` (CPU `ByteTensor`).
        cuda: One `ByteTensor` per CUDA device, captured only when CUDA is already initialised.

    Examples:
        >>> import random
        >>> state = RunnerRNGState().capture()
        >>> first = random.random()
        >>> state.restore()
        >>> random.random() == first
        True
    """

    python: list | None = None
    numpy: dict[str, Any] | None = None
    torch: torch.Tensor | None = None
    cuda: list[torch.Tensor] | None = None

    def capture(self) -> RunnerRNGState:
        """Snapshot the current Python, NumPy, torch (and initialised CUDA) generators; returns self."""
        version, internal, gauss = random.getstate()
        self.python = [version, list(internal), gauss]
        algorithm, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
        self.numpy = {
            "algorithm": str(algorithm),
            "key": key.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
        self.torch = torch.get_rng_state()
        # querying CUDA must not initialise it (that would pin a device in every process)
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return self

    def restore(self) -> None:
        """Put every captured generator back; parts that were never captured are left alone.

        CUDA states are restored for as many devices as both the snapshot and this process have.
        """
        if self.python is not None:
            version, internal, gauss = self.python
            random.setstate((version, tuple(internal), gauss))
        if self.numpy is not None:
            state = self.numpy
            key = np.asarray(state["key"], dtype=np.uint32)
            np.random.set_state((state["algorithm"], key, state["pos"], state["has_gauss"], state["cached_gaussian"]))
        if self.torch is not None:
            torch.set_rng_state(self.torch.cpu())
        if self.cuda is not None and torch.cuda.is_available():
            for device, cuda_state in enumerate(self.cuda[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(cuda_state.cpu(), device)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Read snapshots produced by `state_dict()`; raises `ValueError` on malformed parts."""
        state_dict = _require_mapping(state_dict, "RunnerRNGState state")
        python, numpy_state = state_dict.get("python"), state_dict.get("numpy")
        if python is not None and not (isinstance(python, (list, tuple)) and len(python) == 3):
            raise ValueError(f"rng.python must be [version, internal_state, gauss_next], got {python!r:.80}")
        if numpy_state is not None and not (isinstance(numpy_state, Mapping) and "key" in numpy_state):
            raise ValueError(f"rng.numpy must be a mapping with a 'key' entry, got {numpy_state!r:.80}")
        torch_state, cuda = state_dict.get("torch"), state_dict.get("cuda")
        if torch_state is not None and not isinstance(torch_state, torch.Tensor):
            raise ValueError(f"rng.torch must be a ByteTensor, got {type(torch_state).__name__}")
        if cuda is not None and not all(isinstance(item, torch.Tensor) for item in cuda):
            raise ValueError("rng.cuda must be a list of ByteTensors, one per device")
        super().load_state_dict(state_dict)


@dataclass
class RunnerState(_StatefulBase):
    """Everything about a run's progress that a checkpoint must restore.

    `state_dict()` nests the parts as `{"train": ..., "elastic": ..., "rng": ...}`;
    `load_state_dict()` restores the values but does not reseed the process; call
    `state.rng.restore()` for that.

    Attributes:
        train: Progress counters.
        elastic: Restart bookkeeping.
        rng: Random generator snapshots.
        config: The runner configuration this state belongs to (not part of `state_dict()`).

    Examples:
        >>> state = RunnerState()
        >>> state.global_step += 3
        >>> state.train.global_step
        3
        >>> restored = RunnerState()
        >>> restored.load_state_dict(state.state_dict())
        >>> restored.global_step, restored.epoch
        (3, 0)
    """

    train: RunnerTrainState = field(default_factory=RunnerTrainState)
    elastic: RunnerElasticState = field(default_factory=RunnerElasticState)
    rng: RunnerRNGState = field(default_factory=RunnerRNGState)
    config: Any = field(default=None, repr=False, compare=False)

    _PARTS = ("train", "elastic", "rng")

    def state_dict(self) -> dict[str, Any]:
        """Nested plain dicts of the three parts."""
        return {name: getattr(self, name).state_dict() for name in self._PARTS}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the parts present in `state_dict` (missing parts keep their current value)."""
        state_dict = _require_mapping(state_dict, "RunnerState state")
        for name in self._PARTS:
            if state_dict.get(name) is not None:
                getattr(self, name).load_state_dict(state_dict[name])

    @property
    def epoch(self) -> int:
        """Shortcut for `train.epoch`."""
        return self.train.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.train.epoch = value

    @property
    def global_step(self) -> int:
        """Shortcut for `train.global_step`."""
        return self.train.global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.train.global_step = value

    @property
    def micro_step(self) -> int:
        """Shortcut for `train.micro_step`."""
        return self.train.micro_step

    @micro_step.setter
    def micro_step(self, value: int) -> None:
        self.train.micro_step = value
