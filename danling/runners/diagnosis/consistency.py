"""Replica consistency sentinel: replicas that must hold the same weights are compared, bit for bit.

Every `consistency.interval` optimizer steps each rank checksums the tensors that must be
identical on every replica (the parameters and, when replicated and `consistency.optimizer_state`
is set, the optimizer state): each
tensor's bit pattern read as integers and summed in 64 bits, so any single flipped bit changes
it. The per-tensor sums fold into one number per rank, and one all-gather of two numbers per rank
(the digest and the replica group it belongs to) lets every rank see whether any replica group
disagrees. Only then do the ranks of a disagreeing group gather their per-tensor sums, to name the
first differing tensor. The replica groups are the topology's `replicate` domain: every rank
under DDP (and DeepSpeed ZeRO-1/2), the replicate axis of HSDP; a layout without replicas (plain
FSDP) has nothing to compare and the sentinel stays off.

A mismatch names the ranks whose sums differ from the rest of their group (with two replicas
there is no majority: the ranks differing from the group's first rank are named) and the first
differing tensor, then the policy runs: `warn`, `stop` (a graceful stop through the supervisor),
or `rollback` (a [`RollbackRequest`][danling.runners.update.spikes.RollbackRequest] for the
newest checkpoint saved right after a check that passed).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from danling.distributed import broadcast_object

from ..config_operations import ConsistencyConfig
from ..loop.events import CheckpointContext, EventBus, Events, RunContext, StepContext
from ..update.spikes import RollbackRequest, TrainingDivergedError

__all__ = [
    "POLICIES",
    "ConsistencySentinel",
    "ReplicaMismatch",
    "ReplicaRollback",
    "replica_tensors",
    "tensor_checksum",
]

POLICIES = ("warn", "stop", "rollback")
_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def tensor_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of `tensor`'s bit patterns as integers, in 64 bits (a 0-dim tensor on its device).

    Any single flipped bit changes it; a DTensor is summed over this rank's local shard.

    Examples:
        >>> weights = torch.tensor([1.0, 2.0])
        >>> flipped = weights.clone()
        >>> flipped.view(torch.int32)[0] ^= 1  # the lowest mantissa bit of one element
        >>> bool(tensor_checksum(weights) != tensor_checksum(flipped))
        True
    """
    local = tensor.detach()
    to_local = getattr(local, "to_local", None)
    if to_local is not None:  # a DTensor: replicas hold equal local shards
        local = to_local()
    if local.is_complex():
        local = torch.view_as_real(local)
    if local.is_floating_point():
        local = local.contiguous().view(_BITS[local.element_size()])
    return local.sum(dtype=torch.int64)


def replica_tensors(model: Any, optimizer: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors replicas must agree on: `model.<name>` for each parameter, then
    `optimizer.<name>.<key>` for each tensor of its optimizer state (when `optimizer` is given)."""
    named = list(model.named_parameters()) if hasattr(model, "named_parameters") else []
    for name, parameter in named:
        yield f"model.{name}", parameter
    state = getattr(optimizer, "state", None)
    if not state:
        return
    for name, parameter in named:
        for key, value in sorted(state.get(parameter, {}).items()):
            if isinstance(value, torch.Tensor):
                yield f"optimizer.{name}.{key}", value


@dataclass(frozen=True)
class ReplicaMismatch:
    """Replicas found to differ at global step `step`.

    Attributes:
        step: The global step of the check.
        ranks: Global ranks whose tensors differ from the rest of their replica group.
        tensor: The first differing tensor (`None` when it is named in another rank's log only).
        differing: How many tensors differ (0 when not known here).
    """

    step: int
    ranks: tuple[int, ...]
    tensor: str | None
    differing: int

    def __str__(self) -> str:
        where = (
            f"first in {self.tensor} ({self.differing} tensor(s) differ)"
            if self.tensor is not None
            else "the differing tensor is named in the log of the ranks' group"
        )
        ranks = list(self.ranks)
        return f"replica mismatch at global step {self.step}: rank(s) {ranks} differ from their replicas, {where}"


class ReplicaRollback(RollbackRequest):
    """`consistency.policy=rollback`: reload `path`, the newest checkpoint saved after a passing check."""

    def __init__(self, mismatch: ReplicaMismatch, path: str) -> None:
        super().__init__(str(mismatch))
        self.mismatch, self.path = mismatch, path


class ConsistencySentinel:
    """Checks every `consistency.interval` optimizer steps that the replicas hold the same tensors.

    Args:
        section: The `consistency.*` config.
        tensors: Called at each check: the `(name, tensor)` pairs that must agree, in the same order on
            every rank (see [`replica_tensors`][danling.runners.diagnosis.consistency.replica_tensors]).
        replicas: Global ranks of this rank's replica group (the topology's `replicate` domain).
        rank: This process's global rank.
        world_size: Ranks in the run.
        group: Process group of this rank's replica group (`None`: every rank).
        request_stop: Asks for a graceful stop (`stop` policy): the supervisor's `request_stop`.
        global_step: The current global step (to tell which checkpoints a passing check covers).
        logger: Where mismatches are reported.

    Attributes:
        checks: Checks made so far; mismatches: the mismatches found; rollbacks: rollbacks done.
        verified: The newest checkpoint saved at the step of a check that passed (`None`: none yet).

    Raises:
        ValueError: A `consistency.*` value outside its range (the message names it).
    """

    def __init__(
        self,
        section: ConsistencyConfig,
        tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        *,
        replicas: Sequence[int],
        rank: int,
        world_size: int,
        group: Any = None,
        request_stop: Callable[[], None] | None = None,
        global_step: Callable[[], int] = lambda: 0,
        logger: logging.Logger | None = None,
    ) -> None:
        check_section(section)
        self.interval, self.policy = int(section.interval), section.policy  # type: ignore[arg-type]
        self.max_rollbacks = int(section.max_rollbacks)
        self.tensors, self.replicas, self.rank, self.world_size = tensors, list(replicas), rank, world_size
        self.group, self.request_stop, self.global_step = group, request_stop, global_step
        self.logger = logger or logging.getLogger("danling.runners")
        self.checks, self.rollbacks = 0, 0
        self.mismatches: list[ReplicaMismatch] = []
        self.verified: str | None = None
        self._checked: tuple[int, bool] = (-1, False)  # (global step, passed) of the latest check
        self._training = False

    @property
    def active(self) -> bool:
        """Whether there is anything to compare: this rank has replicas (every layout's groups are the same size)."""
        return len(self.replicas) > 1

    def attach(self, events: EventBus) -> None:
        """Check after the steps due, and record verified checkpoints, from now on (nothing without replicas)."""
        if not self.active:
            self.logger.info("consistency: no replicas to compare in this layout; the sentinel stays off")
            return
        events.subscribe(Events.RUN_START, self._run_started)
        events.subscribe(Events.RUN_END, self._run_ended)
        events.subscribe(Events.STEP_END, self._after_step)
        events.subscribe(Events.CHECKPOINT_SAVED, self._saved)

    def _run_started(self, context: RunContext) -> None:
        # Only training runs check: `evaluate()` or `infer()` alone may run on some ranks only.
        self._training = context.mode == "train"

    def _run_ended(self, context: RunContext) -> None:
        self._training = False

    def _after_step(self, context: StepContext) -> None:
        step = context.global_step
        due = step and step % self.interval == 0 and step != self._checked[0]
        if due and self._training and context.error is None:
            mismatch = self.check(step)
            if mismatch is not None:
                self._respond(mismatch)

    def _saved(self, context: CheckpointContext) -> None:
        step, passed = self._checked
        if passed and step == self.global_step():
            self.verified = str(context.path)

    def check(self, step: int) -> ReplicaMismatch | None:
        """Compare this rank's checksums with its replicas' (a collective of every rank); the mismatch, or `None`."""
        names, sums = [], []
        for name, tensor in self.tensors():
            names.append(name)
            sums.append(tensor_checksum(tensor))
        if not sums and not self.checks:
            self.logger.info("consistency: nothing replicated to compare in this layout (e.g. ZeRO-3)")
        device = sums[0].device if sums else torch.device("cpu")
        local = torch.stack([s.to(device) for s in sums]) if sums else torch.zeros(0, dtype=torch.int64)
        # Odd weights keep the position of each sum in the digest (int64 arithmetic wraps).
        weights = torch.arange(1, 2 * len(sums) + 1, 2, dtype=torch.int64, device=device)
        digest = torch.stack([(local * weights).sum(), torch.tensor(min(self.replicas), device=device)])
        rows = _all_gather(digest, self.world_size, None).tolist()
        self.checks += 1
        odd = _odd_ranks(rows)
        self._checked = (step, not odd)
        if not odd:
            return None
        tensor, differing = None, 0
        if any(rank in odd for rank in self.replicas):
            # Only a disagreeing group looks closer: its ranks gather their per-tensor sums.
            table = _all_gather(local, len(self.replicas), self.group).tolist()
            columns = [index for index in range(len(names)) if len({row[index] for row in table}) > 1]
            tensor, differing = (names[columns[0]] if columns else None), len(columns)
        mismatch = ReplicaMismatch(step, tuple(odd), tensor, differing)
        self.mismatches.append(mismatch)
        return mismatch

    def _respond(self, mismatch: ReplicaMismatch) -> None:
        """Run `consistency.policy` on a mismatch every rank has seen."""
        if self.policy == "warn":
            self.logger.warning("%s (consistency.policy=warn: training goes on)", mismatch)
            return
        if self.policy == "stop":
            self.logger.error("%s; stopping (consistency.policy=stop)", mismatch)
            if self.request_stop is not None:
                self.request_stop()
            return
        # Rank 0 writes every checkpoint, so its record names the one every rank reloads.
        path = broadcast_object(self.verified, src=0)
        if path is None or self.rollbacks >= self.max_rollbacks:
            why = (
                "no checkpoint was saved at the step of a check that passed (save at multiples of consistency.interval)"
                if path is None
                else f"after {self.rollbacks} rollback(s), the most consistency.max_rollbacks allows"
            )
            raise TrainingDivergedError(f"{mismatch}; cannot roll back: {why}")
        self.rollbacks += 1
        self._checked = (-1, False)  # the reloaded steps are checked again
        raise ReplicaRollback(mismatch, path)


def _odd_ranks(rows: list[list[int]]) -> list[int]:
    """Ranks whose digest differs from the majority of their replica group (ties: from the group's first rank)."""
    groups: dict[int, list[int]] = {}
    for rank, (_, first) in enumerate(rows):
        groups.setdefault(first, []).append(rank)
    odd: list[int] = []
    for members in groups.values():
        digests = Counter(rows[rank][0] for rank in members)
        if len(digests) < 2:
            continue
        top = digests.most_common()
        majority = rows[members[0]][0] if top[0][1] == top[1][1] else top[0][0]
        odd.extend(rank for rank in members if rows[rank][0] != majority)
    return sorted(odd)


def _all_gather(tensor: torch.Tensor, size: int, group: Any) -> torch.Tensor:
    """Every rank's `tensor` stacked by group rank (on the GPU under NCCL)."""
    local = tensor.to("cuda") if dist.get_backend(group) == "nccl" and not tensor.is_cuda else tensor
    rows = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(rows, local, group=group)
    return torch.stack(rows).cpu()


def check_section(section: ConsistencyConfig) -> None:
    """Refuse a `consistency.*` value outside its range, naming it (when the section is built, and by `validate`)."""
    interval, policy, rollbacks = section.interval, section.policy, section.max_rollbacks
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"consistency.interval must be an integer >= 1 (or None: off), got {interval!r}")
    if policy not in POLICIES:
        raise ValueError(f"consistency.policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if isinstance(rollbacks, bool) or not isinstance(rollbacks, int) or rollbacks < 0:
        raise ValueError(f"consistency.max_rollbacks must be an integer >= 0, got {rollbacks!r}")
