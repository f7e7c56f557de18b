"""Out-of-memory errors survived together (`oom.policy`): every rank skips, or splits, the same micro-batch.

A training micro-batch that runs out of memory on one rank would leave the other ranks waiting
in the next collective (the gradient all-reduce) while that rank dies. With `oom.policy` set,
[`OutOfMemoryGuard`][danling.runners.diagnosis.oom.OutOfMemoryGuard] runs each training step under
a guard, and the ranks agree on every micro-batch at fixed points, with the agreement the
non-finite skip uses (an all-reduce of one flag over the world, MAX across ranks):

- **A**, before each backward (the update strategy's `backward` phase mark);
- **B**, before each optimizer update (its `optimizer step` mark), unless the backward before it
  all-reduced gradients (DDP): no error since A can be survived there;
- **E**, at the end of each micro-batch, in the guard around the step.

A rank that runs out of memory leaves its step and calls the agreement with its phase; the other
ranks reach their next point (A, B or E) and learn it there, before any other collective. Then
every rank exchanges what happened (phase, whether it counted the micro-batch, its batch size),
frees what the failed attempt held (the error and its frames, the window's gradients when they
are dropped, `torch.cuda.empty_cache()` on CUDA), emits `Events.OUT_OF_MEMORY`, and goes on:

- an error in the **forward** pass (or a backward whose micro-batch opened its window, while no
  rank counted it yet) is survived by the policy: `skip` drops the update the micro-batch belongs
  to (the rest of its window is passed over), `split` runs the micro-batch again as two halves,
  each half halved again if it runs out in turn (`oom.max_splits`), each piece's loss weighted by
  its share of the micro-batch, so the update is the whole micro-batch's;
- an error in a **backward** that others already finished (gradients of earlier micro-batches of
  the window are spoilt by the partial one) drops the window's update under either policy;
- an error inside the **optimizer step** stops the run on every rank: the update may be partly
  applied, so the replicas cannot be trusted to match.

`oom.max_consecutive` errors in a row stop the run with an error naming the counts.

**What cannot be made safe.** An error inside a backward that all-reduces gradients (DDP's
bucketed all-reduce, the micro-step that closes an accumulation window) leaves the other ranks in
that all-reduce: the failing rank cannot join it with a partial backward, and DDP's reducer is
not reusable after one. That rank's error is re-raised; the other ranks stay in the all-reduce
until the hang watchdog (`watchdog.*`) or the process group's timeout ends them. The same holds
for collectives inside the forward pass (FSDP's all-gathers, pipelines), which is why the guard
refuses those stacks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from danling.distributed import is_distributed
from danling.distributed.collectives import _on_backend_device

from ..config_operations import OomConfig
from ..loop.events import EventBus, Events, OutOfMemoryContext, RunContext, StepLogContext
from ..update.gradient_sync import _FlagSync, _PartsSync
from ..update.strategy import TorchUpdateStrategy

__all__ = ["OutOfMemoryAbort", "OutOfMemoryGuard", "is_out_of_memory", "split_micro_batch"]

POLICIES = ("skip", "split")
FORWARD, BACKWARD, UPDATE = 1, 2, 3
_Rows = list[list[int]]  # per rank: [phase code, counted the micro-batch, batch size]
PHASES = {FORWARD: "forward", BACKWARD: "backward", UPDATE: "optimizer step"}
# What a RuntimeError says when an allocator gave up (CPU, CUDA, HIP and MPS; cuBLAS/cuDNN workspaces).
_MARKERS = ("out of memory", "can't allocate memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocator's out-of-memory error (`torch.OutOfMemoryError` or its RuntimeError forms).

    Examples:
        >>> is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory")), is_out_of_memory(ValueError("x"))
        (True, False)
        >>> is_out_of_memory(RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory"))
        True
    """
    if isinstance(error, torch.OutOfMemoryError):  # torch.cuda.OutOfMemoryError is the same class
        return True
    return isinstance(error, RuntimeError) and any(marker in str(error) for marker in _MARKERS)


class OutOfMemoryAbort(RuntimeError):
    """The run stops on every rank: too many out-of-memory errors, or one that cannot be survived."""


class _PeerOutOfMemory(BaseException):
    """Raised at an agreement point when another rank ran out of memory: this rank leaves its step too.

    A `BaseException`, so that a step's own `except Exception` does not keep this rank going into
    a collective the others will not join.
    """


class OutOfMemoryGuard:
    """Runs training steps so that an out-of-memory error on any rank is survived by all of them (`oom.policy`).

    Args:
        config: The `oom` section.
        update: The update strategy; its phase marks are the agreement points A and B.
        rank: This process's rank.
        world_size: The number of ranks.
        group: The group that agrees (the world: every rank takes the same branch).
        global_step: The current global step.
        logger: Where events are reported.
        report: Whether this rank reports them (the main process).

    Attributes:
        count: Out-of-memory errors so far (every rank's, each agreed once).
        consecutive: Those since the last micro-batch that ran without one.
        splits: Micro-batches run again in pieces; skipped: updates dropped.
        latest: The `OutOfMemoryContext` of the latest error.

    Raises:
        ValueError: A value of the section outside its range, or an update strategy the guard
            cannot make safe (the message names it).
    """

    def __init__(
        self,
        config: OomConfig,
        update: Any,
        *,
        rank: int = 0,
        world_size: int = 1,
        group: Any = None,
        global_step: Callable[[], int] = lambda: 0,
        logger: logging.Logger | None = None,
        report: bool = True,
    ) -> None:
        _check(config, update)
        self.policy, self.max_consecutive, self.max_splits = config.policy, config.max_consecutive, config.max_splits
        self.update, self.rank, self.world_size, self.group = update, rank, world_size, group
        self.global_step, self.report = global_step, report
        self.logger = logger or logging.getLogger("danling.runners")
        self.count = self.consecutive = self.splits = self.skipped = 0
        self.latest: OutOfMemoryContext | None = None
        self.inner: Any = None  # the phase marks passed on (watchdog, straggler clock)
        self._step = 0
        self._flag: torch.Tensor | None = None  # the agreement's one number, on the group's device
        self._events: EventBus | None = None
        self._runner: Any = None
        self._at = 0  # the phase code of the micro-batch under way (0: outside a guarded step)
        self._poisoned = False  # the open window's update is dropped: its remaining micro-batches are passed over
        self._syncing = False  # the backward of the micro-batch under way all-reduces gradients as it goes (DDP)
        self._agrees = world_size > 1 and is_distributed(group)

    def attach(self, events: EventBus) -> None:
        """Guard the training runs from now on: take the update's phase marks while one is under way."""
        self._events = events
        events.subscribe(Events.RUN_START, self._start)
        events.subscribe(Events.RUN_END, self._end)
        events.subscribe(Events.STEP_LOG, self._log)

    def guarded(self, step: Callable[[Any], tuple[Any, Any]]) -> Callable[[Any], tuple[Any, Any]]:
        """`step` (the pass's training step) under the guard: what the pass engine calls per micro-batch."""

        def guarded_step(data: Any) -> tuple[Any, Any]:
            if self._poisoned:
                return self._pass_over()
            return self._micro_batch(step, data)

        return guarded_step

    # ------------------------------------------------------------------ phase marks (points A and B)
    @property
    def step(self) -> int:
        """The global step of the latest phase mark (the watchdog's, which also hears the loop's marks)."""
        return self._step if self.inner is None else self.inner.step

    def enter(self, phase: str, step: int) -> None:
        """A phase mark of the update strategy: agree before a backward (A) and before an update (B)."""
        if self.inner is not None:
            self.inner.enter(phase, step)
        self._step = step
        if not self._at:
            return  # outside a guarded step (a window the pass closes at its end): every rank is here alike
        if phase == "backward":
            self._agree_or_leave(0)
            self._at = BACKWARD
            # Under DDP the backward that closes a window all-reduces gradients bucket by bucket.
            update = self.update
            self._syncing = self._agrees and update.gradient_sync.suppresses and update.accumulator.is_boundary
        elif phase == "optimizer step":
            # After a backward that all-reduced (DDP) no rank can be out of memory since A: nothing to agree.
            if not self._syncing:
                self._agree_or_leave(0)
            self._at = UPDATE

    def _agree_or_leave(self, code: int) -> None:
        if self._agrees and self._any(code):
            raise _PeerOutOfMemory

    def _any(self, code: int) -> bool:
        """Whether some rank ran out of memory (`code`: this rank's phase code, 0 when fine): a collective."""
        flag = self._flag
        if flag is None:
            flag = self._flag = _on_backend_device(torch.zeros((), dtype=torch.int32), self.group)
        flag.fill_(code)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag)

    # ------------------------------------------------------------------ one micro-batch
    def _micro_batch(self, step: Callable[[Any], tuple[Any, Any]], data: Any) -> tuple[Any, Any]:
        accumulator = self.update.accumulator
        start, opened = accumulator.position, self.update.pending == 0
        result, failed = self._attempt(step, data)
        if failed is None:
            self.consecutive = 0
            return result
        rows = self._exchange(failed, accumulator.position != start, _batch_size(data))
        phase = max(row[0] for row in rows)
        counted = any(row[1] for row in rows)
        retry = phase == FORWARD or (phase == BACKWARD and opened and not counted)
        if phase == UPDATE or not retry or self.policy == "skip":
            return self._drop(rows, phase, counted_here=accumulator.position != start)
        if phase == BACKWARD:  # its micro-batch opened the window: the partial gradients are all there is
            self.update.drop_window(count=False)
        return self._split(step, data, rows, phase, start)

    def _attempt(self, step: Callable[[Any], tuple[Any, Any]], data: Any) -> tuple[Any, int | None]:
        """Run `step(data)` and agree on its outcome: `(result, None)`, or `(None, this rank's phase code)`."""
        self._at, self._syncing = FORWARD, False
        failed = 0
        try:
            result = step(data)
        except _PeerOutOfMemory:
            failed = -1  # another rank ran out; agreed already at A or B
        except BaseException as error:
            if not is_out_of_memory(error):
                self._at = 0
                raise
            failed = self._at
            if failed == BACKWARD and self._syncing:
                self._at = 0
                self._unsafe(error)
                raise
            # The error's frames hold the step's activations: they go with it when this block ends.
        finally:
            self._at = 0
        if failed == 0:
            if not (self._agrees and self._any(0)):  # point E
                return result, None
            return None, 0
        if failed > 0 and self._agrees:
            self._any(failed)  # the others learn it at their next point (A, B or E)
        return None, max(failed, 0)

    def _unsafe(self, error: BaseException) -> None:
        """An error inside a backward that all-reduces gradients: the others are inside that all-reduce."""
        message = (
            f"out of memory on rank {self.rank} inside a backward pass that all-reduces gradients (DDP) at "
            f"global step {self.global_step()}: the other ranks are waiting in that all-reduce, which this rank "
            "cannot join with a partial backward, so oom.policy cannot survive it and the run stops; the hang "
            "watchdog (watchdog.timeout_seconds) or the process group's timeout ends the other ranks"
        )
        self.logger.error(message)
        if hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(message)

    def _exchange(self, failed: int, counted: bool, size: int) -> list[list[int]]:
        """Every rank's `[phase code, counted the micro-batch, batch size]` (after an agreed error: a collective)."""
        row = torch.tensor([failed, int(counted), size], dtype=torch.int64)
        if not self._agrees:
            return [row.tolist()]
        row = _on_backend_device(row, self.group)
        rows = [torch.zeros_like(row) for _ in range(self.world_size)]
        dist.all_gather(rows, row, group=self.group)
        return [r.tolist() for r in rows]

    # ------------------------------------------------------------------ policies
    def _drop(self, rows: list[list[int]], phase: int, counted_here: bool) -> tuple[None, None]:
        """Drop the update of the window the failed micro-batch belongs to, on every rank alike."""
        if phase == UPDATE:
            self._report(rows, phase, "stopped", 0)
            raise self._abort(rows, phase, "the update may be partly applied on those ranks")
        self.update.drop_window(count=False)
        # A rank that finished its backward counted the micro-batch; the others count it now.
        closed = self.update.advance() if not counted_here else self.update.pending == 0
        self._free()
        if closed:
            self._skip_update()
        else:
            self._poisoned = True
        self._report(rows, phase, "skipped", 0)
        return None, None

    def _pass_over(self) -> tuple[None, None]:
        """A micro-batch of a window whose update is dropped: counted, not run."""
        if self.update.advance():
            self._poisoned = False
            self._skip_update()
        return None, None

    def _skip_update(self) -> None:
        self.update.drop_window(count=True)
        self.skipped += 1

    def _split(self, step: Callable, data: Any, rows: _Rows | None, phase: int, start: int) -> tuple[None, Any]:
        """Run the micro-batch again in pieces (halved again where one runs out), as one micro-step."""
        self._free()
        queue: list[tuple[Any, float, int]] = [(data, 1.0, 0)]
        total: Any = 0.0
        accumulator = self.update.accumulator
        while queue:
            piece, fraction, depth = queue.pop(0)
            if rows is not None:  # this piece ran out of memory (on some rank): halve it
                if depth >= self.max_splits or min(row[2] for row in rows) < 2:
                    self._report(rows, phase, "stopped", 0)
                    raise self._abort(rows, phase, f"it cannot be split further (oom.max_splits={self.max_splits})")
                halves = split_micro_batch(piece, 2)
                self.splits += 1
                self._report(rows, phase, "split", len(queue) + len(halves))
                queue[0:0] = [(half, fraction * share, depth + 1) for half, share in halves]
                rows = None
                continue
            with self._as_piece(fraction, last=not queue):
                result, failed = self._attempt(step, piece)
            if failed is None:
                loss = result[1]
                total = total + (loss.detach() * fraction if loss is not None else 0.0)
                continue
            counted = accumulator.position != start
            rows = self._exchange(failed, counted, _batch_size(piece))
            phase = max(row[0] for row in rows)
            if phase != FORWARD:  # the pieces' partial gradients cannot be told apart: drop the window
                return self._drop(rows, phase, counted_here=counted)
            self._free()
            queue.insert(0, (piece, fraction, depth))
        return None, total  # `consecutive` goes on: only a micro-batch that runs whole resets it

    @contextmanager
    def _as_piece(self, fraction: float, last: bool) -> Iterator[None]:
        """The update strategy sees a piece: its loss weighs `fraction`; only the last piece counts the micro-step."""
        update = self.update
        accumulator, advance = update.accumulator, update.__dict__.get("advance")
        piece = _Piece(accumulator, fraction, last)
        update.accumulator, update.advance = piece, piece.advance
        try:
            yield
        finally:
            update.accumulator = accumulator
            if advance is None:
                del update.advance
            else:
                update.advance = advance

    # ------------------------------------------------------------------ reporting
    def _report(self, rows: list[list[int]], phase: int, action: str, pieces: int) -> None:
        ranks = [rank for rank, row in enumerate(rows) if row[0] > 0] or [self.rank]
        self.count += 1
        self.consecutive += 1
        context = OutOfMemoryContext(
            self._runner, self.global_step(), ranks, PHASES[phase], action, pieces, self.count, self.consecutive
        )
        self.latest = context
        if self.report:
            what = f"split into {pieces} pieces" if action == "split" else action
            self.logger.warning(
                "out of memory on rank(s) %s in %s at global step %d: %s on every rank "
                "(%d out-of-memory errors so far, %d in a row)",
                ranks,
                context.phase,
                context.global_step,
                what,
                self.count,
                self.consecutive,
            )
        if self._events is not None and Events.OUT_OF_MEMORY in self._events.subscribed:
            self._events.emit(Events.OUT_OF_MEMORY, context)
        if action != "stopped" and self.consecutive > self.max_consecutive:
            raise self._abort(rows, phase, f"{self.consecutive} in a row (oom.max_consecutive={self.max_consecutive})")

    def _abort(self, rows: list[list[int]], phase: int, why: str) -> OutOfMemoryAbort:
        ranks = [rank for rank, row in enumerate(rows) if row[0] > 0] or [self.rank]
        return OutOfMemoryAbort(
            f"out of memory on rank(s) {ranks} in the {PHASES[phase]} at global step {self.global_step()}: {why}; "
            f"stopping (policy {self.policy!r}, {self.count} out-of-memory errors in this run, {self.skipped} "
            f"updates skipped, {self.splits} micro-batches split). Lower the batch size, or raise oom.max_consecutive"
        )

    def _free(self) -> None:
        """Give the memory of the failed attempt back to the device (its tensors are unreferenced by now)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def _log(self, context: StepLogContext) -> None:
        if context.mode == "train" and self.count:
            context.values["oom"] = self.count

    def _start(self, context: RunContext) -> None:
        if context.mode != "train":
            return
        self._runner = context.runner
        self.inner = self.update.watchdog
        self.update.watch(self)

    def _end(self, context: RunContext) -> None:
        self._poisoned = False
        if context.mode == "train" and self.update.watchdog is self:
            self.update.watch(self.inner)


class _Piece:
    """The accumulator as one piece of a split micro-batch sees it: the rest is the real one's."""

    def __init__(self, inner: Any, fraction: float, last: bool) -> None:
        self.inner, self.fraction, self.last = inner, fraction, last

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def normalize(self, loss: torch.Tensor) -> torch.Tensor:
        return self.inner.normalize(loss) * self.fraction

    def advance(self) -> bool:
        return self.inner.advance() if self.last else False


def split_micro_batch(data: Any, pieces: int) -> list[tuple[Any, float]]:
    """Cut a batch into `pieces` pieces along its leading dimension, each with its share of the batch.

    Every tensor whose leading size is the batch size (that of the first tensor found) is cut;
    everything else (scalars, strings, tensors of another size) goes whole into every piece.
    Mappings, lists, tuples and named tuples keep their type.

    Raises:
        ValueError: The batch holds fewer samples than `pieces`.

    Examples:
        >>> parts = split_micro_batch({"input": torch.arange(5), "scale": 2.0}, 2)
        >>> [(part["input"].tolist(), part["scale"], share) for part, share in parts]
        [([0, 1, 2], 2.0, 0.6), ([3, 4], 2.0, 0.4)]
    """
    size = _batch_size(data)
    if size < pieces:
        raise ValueError(f"a batch of {size} sample(s) cannot be split into {pieces} pieces")
    sizes = [len(chunk) for chunk in torch.tensor_split(torch.arange(size), pieces)]
    parts, start = [], 0
    for length in sizes:
        parts.append((_cut(data, size, start, start + length), length / size))
        start += length
    return parts


def _cut(value: Any, size: int, start: int, stop: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[start:stop] if value.ndim and value.shape[0] == size else value
    if isinstance(value, Mapping):
        items = {key: _cut(item, size, start, stop) for key, item in value.items()}
        try:
            return type(value)(items)
        except TypeError:
            return items
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_cut(item, size, start, stop) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_cut(item, size, start, stop) for item in value)
    return value


def _batch_size(data: Any) -> int:
    """The leading size of the first tensor in `data` (0 when it holds none)."""
    if isinstance(data, torch.Tensor):
        return int(data.shape[0]) if data.ndim else 0
    values = data.values() if isinstance(data, Mapping) else data if isinstance(data, (list, tuple)) else ()
    for value in values:
        size = _batch_size(value)
        if size:
            return size
    return 0


def check_section(config: OomConfig) -> None:
    """Refuse an `oom.*` value outside its range, naming it (the guard also needs the torch update strategy)."""
    if config.policy not in POLICIES:
        raise ValueError(f"oom.policy must be one of {', '.join(POLICIES)} (or None: off), got {config.policy!r}")
    for key in ("max_consecutive", "max_splits"):
        value = getattr(config, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"oom.{key} must be an integer >= 1, got {value!r}")


def _check(config: OomConfig, update: Any) -> None:
    check_section(config)
    if type(update) is not TorchUpdateStrategy:
        raise ValueError(
            f"oom.policy needs the torch update strategy (TorchRunner), not {type(update).__name__}, "
            "whose backward and update the guard cannot watch; unset oom.policy on this stack"
        )
    if isinstance(update.gradient_sync, (_FlagSync, _PartsSync)):
        raise ValueError(
            "oom.policy cannot be made safe for sharded or pipelined models (FSDP, pipelines): their forward "
            "pass runs collectives that a rank out of memory leaves the others waiting in; unset oom.policy"
        )
