"""`CompiledStep`: the forward pass, the loss and (through AOTAutograd) the backward pass as one compiled graph.

`torch.compile` traces `criterion(model(input), target)` once; AOTAutograd derives the backward
graph of that forward graph ahead of time and inductor compiles both, so `loss.backward()` runs
compiled code too. The optimizer step stays eager: dynamo cannot trace `loss.backward()` and an
optimizer step in one frame without compiled autograd, which on torch 2.13 recompiles per
gradient layout and gives up the eager hooks (clipping, non-finite checks, gradient scaling)
between backward and step that the runner keeps; and an optimizer step compiled on its own
diverged after a resume from a checkpoint (non-finite losses two updates later, on torch 2.13's
CPU inductor), so it is not offered until that is understood.

Graph breaks are reported once each, by reason and source location, from dynamo's own record of
them; with `fullgraph` a break is an error naming the same.
"""

from __future__ import annotations

import itertools
import logging
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["CompiledStep"]

_STEP_KEYS = ("backend", "mode", "fullgraph", "dynamic", "options")
_STEPS = itertools.count()


def _break_reasons() -> list[Any]:
    """Dynamo's list of graph-break records (`reason`, `user_stack`); every compile appends to it."""
    return torch._dynamo.utils.graph_break_reasons


def _where(record: Any) -> str:
    stack = getattr(record, "user_stack", None) or []
    if not stack:
        return "an unknown location"
    frame = stack[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


def _own_code(function: Callable) -> Callable:
    """`function` with a code object of its own.

    Dynamo caches compiled frames per code object and runs any entry whose guards pass, whatever
    the options of the `torch.compile` call that reaches it: with its own code object, a runner
    never runs graphs another runner compiled (with other options, or for another optimizer).
    """
    code = function.__code__.replace(co_name=f"{function.__name__}_{next(_STEPS)}")
    return types.FunctionType(code, function.__globals__, code.co_name, None, function.__closure__)


def _first_line(text: Any) -> str:
    """The headline of a dynamo message, with its `Explanation:` line when it has one (it names the call)."""
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    if not lines:
        return repr(text)
    explanation = next((line for line in lines[1:] if line.startswith("Explanation:")), None)
    return lines[0] if explanation is None else f"{lines[0]} ({explanation})"


class CompiledStep:
    """`criterion(model(input), target)` compiled with `torch.compile`, with its graph breaks reported.

    Args:
        section: The `compile` config section; `backend`, `mode`, `fullgraph`, `dynamic` and `options`
            are passed to `torch.compile` (keys left `None` keep torch's defaults), `optimize_ddp`
            sets dynamo's DDP graph splitting when `distributed`.
        distributed: The model is wrapped in DDP (graphs then break at its bucket boundaries).
        logger: Where graph breaks are reported.

    Examples:
        >>> step = CompiledStep({"backend": "eager"})
        >>> model, criterion = nn.Linear(2, 1), nn.MSELoss()
        >>> pred, loss = step(model, criterion, torch.ones(4, 2), torch.zeros(4, 1))
        >>> pred.shape, loss.ndim, step.breaks
        (torch.Size([4, 1]), 0, [])
    """

    def __init__(
        self,
        section: Mapping[str, Any] | None = None,
        *,
        distributed: bool = False,
        logger: logging.Logger | None = None,
    ) -> None:
        section = dict(section or {})
        self.kwargs = {key: section[key] for key in _STEP_KEYS if section.get(key) is not None}
        if "options" in self.kwargs:
            self.kwargs["options"] = dict(self.kwargs["options"])
        self.fullgraph = bool(section.get("fullgraph"))
        self.optimize_ddp = section.get("optimize_ddp")
        self.distributed = distributed
        self.logger = logger or logging.getLogger("danling.runners")
        self.breaks: list[str] = []  # "reason at file:line in function", each once
        self._compiled: Callable[[Any, Any], tuple[Any, Tensor]] | None = None
        self._bound: tuple[Any, Any] = (None, None)

    def __repr__(self) -> str:
        return f"CompiledStep(kwargs={self.kwargs}, breaks={len(self.breaks)})"

    def __call__(self, model: nn.Module, criterion: Callable, input: Any, target: Any) -> tuple[Any, Tensor]:
        """`(pred, loss)` of one batch through the compiled graph (compiled on the first call).

        Raises:
            RuntimeError: `fullgraph` is set and the step breaks the graph (the message names the
                reason and where).
        """
        if self._bound[0] is not model or self._bound[1] is not criterion:
            self._compiled = self._compile(model, criterion)  # a rebound model or criterion
            self._bound = (model, criterion)
        records = _break_reasons()
        seen = len(records)
        try:
            return self._compiled(input, target)  # type: ignore[misc]
        except torch._dynamo.exc.Unsupported as err:
            if not self.fullgraph:
                raise
            raise RuntimeError(
                f"compile.fullgraph=True, and the training step breaks the graph: {_first_line(err)}; "
                "remove the break (a print, a data-dependent branch, a .item() ...) or set compile.fullgraph=False"
            ) from err
        finally:
            if len(records) > seen:
                self._report(records[seen:])

    def _compile(self, model: nn.Module, criterion: Callable) -> Callable[[Any, Any], tuple[Any, Tensor]]:
        if self.distributed:
            torch._dynamo.config.optimize_ddp = self.optimize_ddp or "ddp_optimizer"

        def forward_loss(input: Any, target: Any) -> tuple[Any, Tensor]:
            pred = model(input)
            return pred, criterion(pred, target)

        return torch.compile(_own_code(forward_loss), **self.kwargs)

    def _report(self, records: list[Any]) -> None:
        for record in records:
            entry = f"{_first_line(record.reason)} at {_where(record)}"
            if entry in self.breaks:
                continue
            self.breaks.append(entry)
            self.logger.warning(
                "graph break in the compiled training step: %s; the step runs as several graphs with Python "
                "between them (set compile.fullgraph=True to make a break an error)",
                entry,
            )
