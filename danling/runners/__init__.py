"""Runners: configuration, state, workspace and the training/evaluation/inference loops.

- [`RunnerConfig`][danling.runners.config.RunnerConfig]: every setting of a run, parseable from files
  and the command line.
- [`BaseRunner`][danling.runners.base_runner.BaseRunner]: the backend-free lifecycle, result bookkeeping,
  checkpoint API and loops.
- [`TorchRunner`][danling.runners.torch_runner.TorchRunner]: the PyTorch backend (single process or
  DDP), registered for the stacks `auto`, `torch` and `ddp`.
- [`Runner`][danling.runners.runner.Runner]: builds the backend runner named by `config.stack`
  (backends join through [`register_runner`][danling.runners.runner.register_runner]).
- [`Precision`][danling.runners.torch_components.Precision],
  [`GradientAccumulator`][danling.runners.torch_components.GradientAccumulator],
  [`OptimizerContainer`][danling.runners.torch_components.OptimizerContainer],
  [`EMA`][danling.runners.torch_components.EMA]: the pieces of the torch training step, usable alone.
- [`RunnerState`][danling.runners.state.RunnerState], [`RunnerWorkspace`][danling.runners.workspace.RunnerWorkspace],
  [`RunnerSupervisor`][danling.runners.supervisor.RunnerSupervisor] and the trackers: the services a runner
  is built from, usable on their own.
"""

from .base_runner import BaseRunner, MetaRunner
from .config import RunnerConfig
from .loops import RunnerMode
from .runner import RUNNERS, Runner, register_runner, resolve_runner
from .state import RunnerElasticState, RunnerRNGState, RunnerState, RunnerTrainState
from .supervisor import RunnerSupervisor
from .torch_components import EMA, GradientAccumulator, OptimizerContainer, Precision
from .torch_runner import TorchRunner
from .trackers import TensorBoardTracker, Tracker, Trackers, WandbTracker, flatten_result
from .workspace import RunnerWorkspace

__all__ = [
    "BaseRunner",
    "MetaRunner",
    "TorchRunner",
    "Precision",
    "GradientAccumulator",
    "OptimizerContainer",
    "EMA",
    "Runner",
    "RUNNERS",
    "register_runner",
    "resolve_runner",
    "RunnerMode",
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
]
