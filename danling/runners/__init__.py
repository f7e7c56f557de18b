"""Runners: configuration, state, workspace and the training/evaluation/inference loops.

- [`RunnerConfig`][danling.runners.config.RunnerConfig]: every setting of a run, parseable from files
  and the command line.
- [`BaseRunner`][danling.runners.base_runner.BaseRunner]: the backend-free lifecycle, result bookkeeping,
  checkpoint API and loops.
- [`TorchRunner`][danling.runners.torch_runner.TorchRunner]: the PyTorch backend (single process or
  DDP), registered for the stacks `auto`, `torch` and `ddp`.
- [`DeepSpeedRunner`][danling.runners.deepspeed.runner.DeepSpeedRunner]: DeepSpeed ZeRO owning backward and
  step, registered for the stacks `deepspeed` and `ds` (DeepSpeed is imported only when it builds).
- [`ParallelRunner`][danling.runners.parallel_runner.ParallelRunner]: FSDP2, tensor and pipeline
  parallelism over the axes of `config.parallel.axes`, registered for the stack `parallel`.
- [`GraphRunner`][danling.runners.graph.runner.GraphRunner]: the whole training step compiled with
  `torch.compile` (forward, loss, backward, optimizer step), registered for the stack `graph`.
- [`Runner`][danling.runners.runner.Runner]: builds the backend runner named by `config.stack`
  (backends join through [`register_runner`][danling.runners.runner.register_runner]).
- [`Precision`][danling.runners.update.precision.Precision],
  [`GradientAccumulator`][danling.runners.update.accumulation.GradientAccumulator],
  [`OptimizerContainer`][danling.runners.update.optimizer.OptimizerContainer],
  [`EMA`][danling.runners.update.ema.EMA]: the pieces of the torch training step, usable alone.
- [`UpdateStrategy`][danling.runners.update.strategy.UpdateStrategy] /
  [`TorchUpdateStrategy`][danling.runners.update.strategy.TorchUpdateStrategy]: the component that
  turns losses into updates (`runner.update`, built by `build_update_strategy()`).
- [`Events`][danling.runners.loop.events.Events], [`EventBus`][danling.runners.loop.events.EventBus]
  and [`on`][danling.runners.loop.events.on]: what the loops announce (`runner.events`), and
  [`LoopState`][danling.runners.checkpointing.resume.LoopState]: where they stand.
- [`RunnerState`][danling.runners.state.RunnerState],
  [`RunnerWorkspace`][danling.runners.services.workspace.RunnerWorkspace],
  [`RunnerSupervisor`][danling.runners.services.supervisor.RunnerSupervisor] and the trackers: the services a runner
  is built from, usable on their own.
- [`reconcile_run`][danling.runners.reconcile.reconcile_run]: bring a run directory's aliases,
  result files and leftovers in line with its checkpoints after a crash.
"""

from .base_runner import BaseRunner, MetaRunner
from .checkpointing.resume import LoopState
from .config import RunnerConfig
from .deepspeed import DeepSpeedRunner
from .graph import GraphRunner
from .loop import EventBus, Events, RunnerMode, on
from .parallel_runner import ParallelRunner
from .reconcile import reconcile_run
from .runner import RUNNERS, Runner, register_runner, resolve_runner
from .services import (
    RunnerSupervisor,
    RunnerWorkspace,
    TensorBoardTracker,
    Tracker,
    Trackers,
    WandbTracker,
    flatten_result,
)
from .services.run_lock import RunDirectoryLockedError
from .state import RunnerElasticState, RunnerRNGState, RunnerState, RunnerTrainState
from .torch_runner import TorchRunner
from .update import EMA, GradientAccumulator, OptimizerContainer, Precision, TorchUpdateStrategy, UpdateStrategy

__all__ = [
    "BaseRunner",
    "MetaRunner",
    "TorchRunner",
    "DeepSpeedRunner",
    "ParallelRunner",
    "GraphRunner",
    "Precision",
    "GradientAccumulator",
    "OptimizerContainer",
    "EMA",
    "Runner",
    "RUNNERS",
    "register_runner",
    "resolve_runner",
    "RunnerMode",
    "EventBus",
    "Events",
    "on",
    "LoopState",
    "UpdateStrategy",
    "TorchUpdateStrategy",
    "RunnerConfig",
    "RunnerState",
    "RunnerTrainState",
    "RunnerElasticState",
    "RunnerRNGState",
    "RunnerWorkspace",
    "RunnerSupervisor",
    "Tracker",
    "Trackers",
    "TensorBoardTracker",
    "WandbTracker",
    "flatten_result",
    "reconcile_run",
    "RunDirectoryLockedError",
]
