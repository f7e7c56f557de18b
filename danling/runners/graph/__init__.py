"""The graph backend: the whole training step compiled with `torch.compile`.

- [`GraphRunner`][danling.runners.graph.runner.GraphRunner] (`runner.py`): registered for the stack `graph`;
- [`CompiledStep`][danling.runners.graph.step.CompiledStep] (`step.py`): forward, loss and backward as
  compiled graphs (the optimizer step stays eager), graph breaks reported by name;
- [`CompileArtifacts`][danling.runners.graph.artifacts.CompileArtifacts] (`artifacts.py`): the
  compiler's cache artifacts saved after the first update and loaded at the next start.
"""

from .artifacts import CompileArtifacts
from .runner import GraphRunner
from .step import CompiledStep

__all__ = ["CompileArtifacts", "CompiledStep", "GraphRunner"]
