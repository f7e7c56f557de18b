"""What the checkpointing component needs from the runner: the `CheckpointHost` protocols.

The component ([`RunnerCheckpointing`][danling.runners.checkpointing.component.RunnerCheckpointing]
and its subclasses) is built with explicit arguments (config, state, loop state, results,
workspace, event bus) and reaches the runner only through these names: the hooks a user may
override (so every save and restore honours the overrides), the live components and the few
services the runner binds during construction.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from danling.checkpoint import CheckpointManager
    from danling.checkpoint.failures import CheckpointSaveError
    from danling.distributed import Topology
    from danling.metrics import AverageMeters

    from ..loop.mode import RunnerMode
    from ..update import UpdateStrategy

__all__ = ["CheckpointHost", "CheckpointSource", "TorchCheckpointHost"]

CheckpointSource = Mapping[str, Any] | bytes | str | os.PathLike


class CheckpointHost(Protocol):
    """The runner as its checkpointing sees it: the hooks it calls back and the live state it saves.

    The manager, topology, logger, loaders and components are read when used, not copied: the
    runner binds them during construction (and `set_checkpoint_manager` may swap the manager).
    """

    checkpoint_manager: CheckpointManager
    topology: Topology
    logger: Any
    dataloaders: MutableMapping[str, Any]
    meters: AverageMeters
    model: Any
    ema: Any
    optimizer: Any
    scheduler: Any
    mode: RunnerMode
    split: str | None
    # The metric container of the pass under way (`StepHooks` keeps it; None outside a pass).
    _active_metrics: Any

    @property
    def id(self) -> str: ...
    @property
    def is_step_mode(self) -> bool: ...
    @property
    def world_size(self) -> int: ...
    @property
    def is_main_process(self) -> bool: ...

    # ------------------------------------------------------------------ the hooks a user may override
    def state_dict(self, cls: type = ...) -> Mapping: ...
    def load_state_dict(self, checkpoint: Mapping[str, Any]) -> None: ...
    def save_checkpoint(self, *args: Any, **kwargs: Any) -> Path | None: ...
    def checkpoint_save_failed(self, error: CheckpointSaveError) -> None: ...
    def read_checkpoint(self, checkpoint: CheckpointSource, *args: Any, **kwargs: Any) -> Mapping[str, Any]: ...
    def load_checkpoint(self, checkpoint: CheckpointSource, *args: Any, **kwargs: Any) -> None: ...
    def load_model(self, state_dict: Mapping[str, Any], *args: Any, **kwargs: Any) -> None: ...
    def load_ema(self, state_dict: Mapping[str, Any] | None, *args: Any, **kwargs: Any) -> None: ...
    def load_optimizer(self, state_dict: Mapping[str, Any] | None, *args: Any, **kwargs: Any) -> None: ...
    def load_scheduler(self, state_dict: Mapping[str, Any] | None, *args: Any, **kwargs: Any) -> None: ...
    def load_dataloaders(self, state_dict: Mapping[str, Any] | None) -> None: ...
    def load_pretrained(self, checkpoint: CheckpointSource, *args: Any, **kwargs: Any) -> None: ...
    def unwrap(self, model: Any) -> Any: ...


class TorchCheckpointHost(CheckpointHost, Protocol):
    """What [`TorchCheckpointing`][danling.runners.checkpointing.torch_state.TorchCheckpointing] needs on top of
    [`CheckpointHost`][danling.runners.checkpointing.host.CheckpointHost]: the update strategy, the
    training splits and the accumulation it may rescale on another data-parallel size."""

    update: UpdateStrategy

    @property
    def train_splits(self) -> list[str]: ...
    @property
    def accum_steps(self) -> int: ...
    @property
    def distributed(self) -> bool: ...
    @property
    def scheduler_interval(self) -> str: ...
    def _rescale_accumulation(self, accum_steps: int) -> None: ...
