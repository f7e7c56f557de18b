"""`GraphRunner`: `TorchRunner` with the whole training step compiled, registered for the stack `graph`."""

from __future__ import annotations

from typing import Any

import torch

from danling.data import split_batch

from ..runner import register_runner
from ..torch_runner import TorchRunner
from .artifacts import CompileArtifacts
from .step import CompiledStep

__all__ = ["GraphRunner"]


class GraphRunner(TorchRunner):
    """`TorchRunner` whose training step runs as compiled graphs: forward, loss and backward.

    Each training micro-batch runs `criterion(model(input), target)` through one `torch.compile`d
    function ([`CompiledStep`][danling.runners.graph.step.CompiledStep]); AOTAutograd compiles the
    backward graph with it, so `loss.backward()` runs compiled code. The optimizer step stays eager
    (see [`CompiledStep`][danling.runners.graph.step.CompiledStep] for why). `compile.backend`, `mode`,
    `fullgraph`, `dynamic` and `options` are passed to `torch.compile`; `compile.enable` is not
    needed. Graph breaks are logged once each as a WARNING naming the reason and the source line,
    and are an error with `compile.fullgraph: true`.

    Between the compiled pieces everything is `TorchRunner`'s: the step hooks `train_context`
    (autocast, DDP's `no_sync`), `update_metrics`, `backward` and `step`, so accumulation,
    clipping, gradient scaling, the non-finite skip, EMA, metrics, checkpoints and exact resume
    behave the same. Evaluation and inference run the model eagerly, as `TorchRunner` does.
    A subclass that overrides `train_step` keeps its step eager and gets the model compiled
    (`torch.compile(model)`) instead; an INFO line says so once.

    `compile.precompile_artifact_dir` keeps the compiler's cache artifacts: the main process
    writes them after the first update, and every process loads them at start, so a second launch
    finds its kernels compiled ([`CompileArtifacts`][danling.runners.graph.artifacts.CompileArtifacts]).
    `compile.memory_policy` accepts `None` or `"default"`.

    Attributes:
        compiled_step: The [`CompiledStep`][danling.runners.graph.step.CompiledStep] of this run (its
            `breaks` lists the graph breaks seen).
        compile_artifacts: The [`CompileArtifacts`][danling.runners.graph.artifacts.CompileArtifacts] of
            `compile.precompile_artifact_dir`, or `None` when unset.

    Examples:
        >>> import tempfile
        >>> from torch import nn
        >>> from danling.runners import Runner
        >>> class Regression(GraphRunner):
        ...     def __init__(self, config):
        ...         super().__init__(config)
        ...         self.model = nn.Linear(2, 1)
        ...         self.criterion = nn.MSELoss()
        ...         x = torch.randn(16, 2)
        ...         self.datasets.train = list(zip(x, x.sum(dim=1, keepdim=True)))
        >>> config = {"stack": "graph", "epochs": 1, "optim.type": "sgd", "optim.lr": 0.1, "log": False,
        ...           "compile.backend": "eager", "dataloader.batch_size": 8, "workspace_root": tempfile.mkdtemp()}
        >>> with Regression(config) as runner:
        ...     _ = runner.train()
        >>> runner.train_state.global_step, runner.compiled_step.breaks
        (2, [])
    """

    supported_features = ("graph",)
    compiled_step: CompiledStep | None = None  # set by materialize_model
    compile_artifacts: CompileArtifacts | None = None
    _artifacts_due: bool = False

    def materialize_model(self) -> None:
        """Load the compile artifacts, set up the compiled step, then materialize the model as `TorchRunner` does.

        Called when: once, by `__post_init__` during construction, on every rank; first of the components.
        Holds on entry: the process group, topology, precision policy and compiler are set up; `self.model`
            is the user's module; nothing has been compiled in this runner yet.
        Side effects: loads `compile.precompile_artifact_dir` into this process's compiler caches, sets
            `compiled_step` and `compile_artifacts`, and runs `TorchRunner.materialize_model` with the
            model left uncompiled (the step compiles it), or compiled when `train_step` is overridden.
        Overrides must not: compile the model themselves when `train_step` is not overridden (the step
            would trace a compiled module inside its own graph), or skip `super()`.
        """
        section = self.config.compile
        directory = section.precompile_artifact_dir
        if directory:
            self.compile_artifacts = CompileArtifacts(directory, self.logger)
            self.compile_artifacts.load()  # before anything compiles, so the compilation finds them
            self._artifacts_due = self.is_main_process
        self.compiled_step = CompiledStep(section.dict(), distributed=self.distributed, logger=self.logger)
        eager = self._eager_step_reason()
        self.compiler.enabled = eager is not None  # the module itself is compiled only around an eager step
        if eager is not None:
            self.logger.info(
                "GraphRunner: %s, so that step runs eagerly around the compiled model (torch.compile(model))", eager
            )
        super().materialize_model()

    def train_step(self, data: Any) -> tuple[Any, torch.Tensor | None]:
        """Forward and loss through the compiled graph, then metrics, backward and `step()` as `TorchRunner`.

        The batch is moved and split as in `TorchRunner.train_step`; `criterion(model(input),
        target)` runs compiled inside `train_context()`; the backward pass runs the graph
        AOTAutograd compiled with it. After the first update the main process saves the compile
        artifacts when `compile.precompile_artifact_dir` is set.

        Called when: by the training loops, once per micro-batch of each train split.
        Holds on entry: `self.mode == "train"`, the split's pass is open (meters and metrics reset).
        Side effects: compiles on the first call (and on a recompilation), updates the training
            metrics, back-propagates, and calls `step()` (which may apply an optimizer update and
            increment `train_state.global_step`); may write the compile artifacts once.
        Overrides must not: skip `step()`, call `optimizer_step()` themselves, zero gradients or change
            `train_state` (an override also runs eagerly: the model is compiled instead).

        Raises:
            ValueError: `self.model` or `self.criterion` is not set, or the loss is not one number.
            RuntimeError: `compile.fullgraph` is set and the step breaks the graph.
        """
        model, criterion = self.model, self.criterion
        if model is None or criterion is None:
            raise ValueError(
                "GraphRunner.train_step compiles criterion(model(input), target): set self.model and self.criterion, "
                "or override train_step (it then runs eagerly around the compiled model)"
            )
        input, target = split_batch(self.to_device(data))
        with self.train_context():
            if self.compiler.enabled:  # reached through super() from an eager override: the model is compiled
                pred = model(input)
                loss = criterion(pred, target)
            else:
                pred, loss = self.compiled_step(model, criterion, input, target)  # type: ignore[misc]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"criterion {criterion!r} returned {shape}, not one number: training needs a scalar loss per batch; "
                "reduce it (reduction='mean', or .mean() in your criterion), or override train_step"
            )
        self.update_metrics(pred, target)
        self.backward(loss)
        self.step()
        if self._artifacts_due and self.update.pending == 0:  # an update happened: every graph was compiled
            self._artifacts_due = False
            self.compile_artifacts.save()  # type: ignore[union-attr]
        return pred, loss.detach()

    def _eager_step_reason(self) -> str | None:
        """Why the training step cannot run compiled (a subclass's own `train_step`), or `None`."""
        mro = type(self).__mro__
        owner = next((klass for klass in mro[: mro.index(GraphRunner)] if "train_step" in vars(klass)), None)
        return None if owner is None else f"{owner.__name__} overrides train_step"


register_runner("graph", GraphRunner)
