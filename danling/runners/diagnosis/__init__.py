"""Diagnosis plug-ins of the event bus: slow ranks named, replicas checked, OOMs survived, failures replayed.

Each plug-in is off by default and then costs nothing: nothing is subscribed and no batch does
any extra work. [`build_diagnosis`][danling.runners.diagnosis.build_diagnosis] builds the ones the
config turns on and subscribes them; the runner keeps them as `runner.diagnosis`.

- [`StragglerMonitor`][danling.runners.diagnosis.stragglers.StragglerMonitor] (`stragglers.*`):
  per-rank phase times, compared across ranks at the training step logs.
- [`ConsistencySentinel`][danling.runners.diagnosis.consistency.ConsistencySentinel]
  (`consistency.*`): checksums of the replicated tensors compared every `consistency.interval` steps.
- [`OutOfMemoryGuard`][danling.runners.diagnosis.oom.OutOfMemoryGuard] (`oom.*`): a micro-batch
  out of memory on any rank is skipped or split by every rank together.
- [`ReplayRecorder`][danling.runners.diagnosis.replay.ReplayRecorder] (`replay.*`): a bundle of a
  failing (or chosen) update that `danling replay` re-runs on one process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..config_operations import ConsistencyConfig, OomConfig, ReplayConfig, StragglerConfig
from ..loop.events import EventBus
from .consistency import ConsistencySentinel, ReplicaMismatch, ReplicaRollback, replica_tensors, tensor_checksum
from .oom import OutOfMemoryAbort, OutOfMemoryGuard, is_out_of_memory, split_micro_batch
from .replay import ReplayRecorder, ReplaySetup, describe_runner
from .stragglers import PhaseClock, Straggler, StragglerMonitor, name_straggler

__all__ = [
    "ConsistencyConfig",
    "ConsistencySentinel",
    "check_settings",
    "Diagnosis",
    "DiagnosisSetup",
    "OomConfig",
    "OutOfMemoryAbort",
    "OutOfMemoryGuard",
    "PhaseClock",
    "ReplayConfig",
    "ReplayRecorder",
    "ReplaySetup",
    "ReplicaMismatch",
    "ReplicaRollback",
    "Straggler",
    "StragglerConfig",
    "StragglerMonitor",
    "build_diagnosis",
    "build_oom_guard",
    "describe_runner",
    "is_out_of_memory",
    "name_straggler",
    "replica_tensors",
    "split_micro_batch",
    "tensor_checksum",
]


@dataclass
class Diagnosis:
    """The diagnosis plug-ins of one runner (`runner.diagnosis`); each is `None` while its section is off.

    Attributes:
        stragglers: The [`StragglerMonitor`][danling.runners.diagnosis.stragglers.StragglerMonitor]
            (`stragglers.enabled`); `stragglers.latest` is the slowest rank of the latest step log.
        consistency: The [`ConsistencySentinel`][danling.runners.diagnosis.consistency.ConsistencySentinel]
            (`consistency.interval`); `consistency.mismatches` lists what it found.
        oom: The [`OutOfMemoryGuard`][danling.runners.diagnosis.oom.OutOfMemoryGuard] (`oom.policy`);
            `oom.count` is the out-of-memory errors survived so far.
        replay: The [`ReplayRecorder`][danling.runners.diagnosis.replay.ReplayRecorder] (`replay.*`);
            `replay.bundles` lists the bundles written.
    """

    stragglers: StragglerMonitor | None = None
    consistency: ConsistencySentinel | None = None
    oom: OutOfMemoryGuard | None = None
    replay: ReplayRecorder | None = None


@dataclass(frozen=True)
class DiagnosisSetup:
    """What the plug-ins are built from (explicit pieces of the runner, never the runner itself).

    Attributes:
        events: The event bus they subscribe to.
        supervisor: Holds the phase-mark slot (`watchdog`) and `request_stop`.
        update: The update strategy, which reports backward and optimizer steps to its `watch`ed object.
        tensors: The `(name, tensor)` pairs replicas must agree on, in rank-independent order.
        replicas: Global ranks of this rank's replica group; replica_group: its process group.
        rank: This process's global rank; world_size: the number of ranks.
        global_step: The current global step.
        logger: Where the plug-ins report.
        world_group: The group every rank agrees in (the out-of-memory guard's); `None`: the default group.
    """

    events: EventBus
    supervisor: Any
    update: Any
    tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]]
    replicas: list[int]
    replica_group: Any
    rank: int
    world_size: int
    global_step: Callable[[], int]
    logger: logging.Logger
    world_group: Any = None


def check_settings(config: Any) -> None:
    """Refuse diagnosis and update-guard settings that would fail when their part starts, from the config alone.

    Each part checks its section again when it is built, after the model and the data; `RunnerConfig.validate`
    runs these same checks, under the conditions that build each part, so a parse or a new runner refuses a
    bad value before any work. (The OOM guard's check of the update strategy needs the runner: it stays there.)

    Raises:
        ValueError: The first value outside its range, naming it.
    """
    from ..services.watchdog import check_times
    from ..update.spikes import guard_options
    from .consistency import check_section as check_consistency
    from .oom import check_section as check_oom
    from .replay import check_section as check_replay
    from .stragglers import check_section as check_stragglers

    stragglers, consistency = config.get("stragglers"), config.get("consistency")
    oom, replay, watchdog = config.get("oom"), config.get("replay"), config.get("watchdog")
    if stragglers is not None and stragglers.enabled:
        check_stragglers(stragglers)
    if consistency is not None and consistency.interval is not None:
        check_consistency(consistency)
    if oom is not None and oom.policy is not None:
        check_oom(oom)
    if replay is not None:
        check_replay(replay)  # the recorder checks it even when off
    if watchdog is not None:
        check_times(watchdog.timeout_seconds, watchdog.interval_seconds)
    guard_options(config)  # nonfinite.* and spikes.*: the update strategy reads them at every start


def build_diagnosis(stragglers: StragglerConfig, consistency: ConsistencyConfig, setup: DiagnosisSetup) -> Diagnosis:
    """Build and subscribe the plug-ins the two sections turn on; the others stay `None` and cost nothing.

    Raises:
        ValueError: A value of either section outside its range (the message names it).
    """
    diagnosis = Diagnosis()
    if stragglers.enabled:
        monitor = StragglerMonitor(
            stragglers,
            world_size=setup.world_size,
            logger=setup.logger,
            report=setup.rank == 0,
            global_step=setup.global_step,
        )
        monitor.attach(setup.events, setup.supervisor, setup.update)
        diagnosis.stragglers = monitor
    if consistency.interval is not None:
        sentinel = ConsistencySentinel(
            consistency,
            setup.tensors,
            replicas=setup.replicas,
            rank=setup.rank,
            world_size=setup.world_size,
            group=setup.replica_group,
            request_stop=setup.supervisor.request_stop,
            global_step=setup.global_step,
            logger=setup.logger,
        )
        sentinel.attach(setup.events)
        diagnosis.consistency = sentinel
    return diagnosis


def build_oom_guard(config: OomConfig, setup: DiagnosisSetup) -> OutOfMemoryGuard | None:
    """The out-of-memory guard `oom.policy` asks for, subscribed to the event bus; `None` (no cost) while off.

    The caller hands [`OutOfMemoryGuard.guarded`][danling.runners.diagnosis.oom.OutOfMemoryGuard.guarded]
    to the pass engine, which runs every training step through it.

    Raises:
        ValueError: A value of the section outside its range, or a stack the guard cannot make safe.
    """
    if config.policy is None:
        return None
    guard = OutOfMemoryGuard(
        config,
        setup.update,
        rank=setup.rank,
        world_size=setup.world_size,
        group=setup.world_group,
        global_step=setup.global_step,
        logger=setup.logger,
        report=setup.rank == 0,
    )
    guard.attach(setup.events)
    return guard
