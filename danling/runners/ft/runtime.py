"""The TorchFT runtime of one replica group: quorum per step, cross-group gradient average, commit gate, recovery.

A replica group is an ordinary run (one process, or a `torchrun` job whose ranks share a default
process group). Several groups train the same model on disjoint shards of the data; a TorchFT
`Manager` per group asks the lighthouse for a quorum before every update, averages the gradients
over the groups in the quorum, and commits the update only when every group agrees. A group that
dies is dropped from the next quorum and the others carry on; a group that starts (or restarts)
receives the live runner payload of a healthy peer over TorchFT's checkpoint transport and
continues at the quorum's step.

`FaultTolerance` knows no runner: it calls back through [`ReplicaHost`][danling.runners.ft.runtime.ReplicaHost]
(the payload hooks and the step counter) and announces what happens on the event bus it is given.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..checkpointing.resume import loader_fingerprint
from ..config_sections import FaultToleranceConfig
from ..loop.events import EventBus, Events, QuorumContext, RecoveryContext
from .data import ReplicaPositions, data_position, with_own_position

__all__ = ["LIGHTHOUSE_ENV", "FaultTolerance", "RecoveryError", "ReplicaHost", "check_fault_tolerance"]

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # TorchFT's own variable: the lighthouse every group reports to
_WAIT_REPORT_SECONDS = 10.0  # how often a group waiting for replicas says so


class ReplicaHost(Protocol):
    """What the fault-tolerance runtime calls back into: the runner's payload hooks, step counter, mode and logger."""

    logger: logging.Logger
    dataloaders: Mapping[str, Any]
    train_splits: list[str]
    loop_state: Any

    def state_dict(self) -> Mapping[str, Any]: ...
    def load_checkpoint(self, checkpoint: Any) -> None: ...
    @property
    def train_state(self) -> Any: ...
    @property
    def mode(self) -> Any: ...


class FaultTolerance:
    """One replica group's TorchFT `Manager`, driven once per optimizer update.

    Per update: [`begin_step`][danling.runners.ft.runtime.FaultTolerance.begin_step] joins the
    quorum before the first forward of the window (a group behind the others loads a peer's
    live state there), [`commit`][danling.runners.ft.runtime.FaultTolerance.commit] averages the
    gradients over the groups in the quorum and says whether the update may be applied.

    Args:
        config: The `ft` section.
        host: The runner, as the payload hooks and the step counter the runtime calls back into.
        events: Where quorum changes, recoveries and uncommitted steps are announced.
        group_rank: Rank of this process inside its replica group.
        group_world_size: Processes in the replica group.
        lighthouse: Lighthouse address (`http://host:port`); defaults to `$TORCHFT_LIGHTHOUSE`.
        positions: Where the group keeps its own data position
            (`checkpoint.enable_ft_dataloader_checkpoints`): saved before every update, and put in
            place of the peer's when the group recovers; `None` takes the peer's batch count.

    Raises:
        ValueError: No lighthouse address, or `ft.process_group` names a backend TorchFT cannot use here.
        ImportError: `torchft` is not installed (`pip install danling[ft]`).
    """

    def __init__(
        self,
        config: FaultToleranceConfig,
        host: ReplicaHost,
        events: EventBus,
        *,
        group_rank: int = 0,
        group_world_size: int = 1,
        lighthouse: str | None = None,
        positions: ReplicaPositions | None = None,
    ) -> None:
        lighthouse = lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not lighthouse:
            raise ValueError(
                f"ft.enabled=True needs the lighthouse address in ${LIGHTHOUSE_ENV} (e.g. http://host:29510); "
                "start one with `torchft_lighthouse --min_replicas 1` (see docs/fault-tolerance.md)"
            )
        try:
            import torchft
        except ImportError as error:
            raise ImportError("ft.enabled=True needs torchft: pip install 'danling[ft]'") from error
        self.config = config
        self.host = host
        self.positions = positions
        self.events = events
        self.replica_id = int(config.replica_id)
        self.group_size = int(config.group_size)
        self.min_replica_size = int(config.min_replica_size)
        self.replicas = 0  # replica groups in the latest quorum
        self.uncommitted = 0  # updates the groups did not agree to commit
        self.recovered_steps = 0  # updates this group missed and took over from a peer
        self._shard_hooks = False  # FSDP2 averages each gradient shard over the groups itself (see `reduce_shards`)
        self._open = False  # a quorum is joined for the update under way
        self._own_store = None
        timeout = timedelta(milliseconds=int(config.process_group_timeout_ms))
        store_addr, store_port = self._store(group_rank, group_world_size)
        self.manager = torchft.Manager(
            pg=_process_group(torchft, config.process_group, timeout),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=self.min_replica_size,
            use_async_quorum=False,  # a recovering group loads the peer's state before its forward pass
            timeout=timeout,
            rank=group_rank,
            world_size=group_world_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=lighthouse,
            replica_id=str(self.replica_id),
        )
        self.manager.register_state_dict_fn("runner", self._load_peer_state, self._peer_state)
        # A training run joins the quorum as it starts (a recovering group then resumes at the peer's
        # loop position, before its loop reads it), and again before each update's first batch.
        events.subscribe(Events.RUN_START, self._on_run_start)
        events.subscribe(Events.STEP_START, self._on_step_start)
        # A quorum opened at STEP_START comes after the loop drew the update's first batch, when the loop
        # has not counted it yet: a peer recovering then gets the loader states of before that draw.
        self._undrawn: dict[str, Any] = {}  # split: loader state before the next update's batches were drawn
        self._drawn = False  # the quorum under way follows the draw of its update's first batch
        events.subscribe(Events.PASS_START, self._on_pass_start)
        events.subscribe(Events.STEP_END, self._on_step_end)
        self._saved_step: int | None = None  # the step of the group's newest saved data position

    @property
    def logger(self) -> logging.Logger:
        return self.host.logger

    def _on_run_start(self, context: Any) -> None:
        if context.mode == "train":
            self.begin_step()
            self._saved_step = int(self.host.train_state.global_step)

    def _on_step_start(self, context: Any) -> None:
        if self.host.mode == "train":
            self._drawn = True
            try:
                self.begin_step()
            finally:
                self._drawn = False

    def _on_pass_start(self, context: Any) -> None:
        if context.mode == "train":  # before the pass draws its first batch
            self._keep_undrawn(context.split)

    def _keep_undrawn(self, split: str) -> None:
        loader = self.host.dataloaders.get(split)
        if callable(getattr(loader, "state_dict", None)):
            self._undrawn[split] = loader.state_dict()

    def _store(self, group_rank: int, group_world_size: int) -> tuple[str, int]:
        """The replica group's TCP store: the launcher's (torchrun, a running process group), else a private one."""
        launched = (dist.is_available() and dist.is_initialized()) or os.environ.get("TORCHELASTIC_RUN_ID")
        if launched and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
            return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if group_world_size != 1:
            raise ValueError(
                f"a replica group of {group_world_size} processes needs MASTER_ADDR/MASTER_PORT: start it with torchrun"
            )
        self._own_store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        return "localhost", self._own_store.port

    # ------------------------------------------------------------------ per update
    def begin_step(self) -> None:
        """Join the quorum of the next update, waiting while fewer than `min_replica_size` groups are live.

        A group behind the quorum's step loads a peer's live state here (runner payload through
        `ReplicaHost.load_checkpoint`), before its forward pass. Idempotent within one update.
        """
        if self._open:
            return
        manager = self.manager
        step = int(self.host.train_state.global_step)
        # The manager counts committed updates; the runner's counter is the one checkpoints and
        # recoveries carry, so every quorum starts from it.
        manager.load_state_dict({"step": step, "batches_committed": manager.batches_committed()})
        reported = None  # when this group last said it is waiting
        while True:
            try:
                manager.start_quorum()
                replicas = manager.num_participants()
            except RecoveryError:
                raise
            except Exception as error:  # a quorum that timed out or failed is asked again
                self.logger.warning("TorchFT quorum failed at step %d (%s); asking again", step, error)
                # The manager re-raises a failed quorum's error at the next start; the failure is handled here.
                manager._quorum_future = None
                continue
            if replicas != self.replicas:
                self._announce_quorum(step, replicas, self.replicas)
                self.replicas = replicas
            if replicas >= self.min_replica_size:
                break
            if reported is None or time.monotonic() - reported >= _WAIT_REPORT_SECONDS:
                reported = time.monotonic()
                self.logger.warning(
                    "training waits at step %d: %d live replica group(s), ft.min_replica_size=%d",
                    step,
                    replicas,
                    self.min_replica_size,
                )
        self._open = True

    def commit(self, parameters: Iterable[torch.Tensor]) -> bool:
        """Average the gradients of `parameters` over the quorum's groups; whether the update may be applied.

        Every group must call it once per update with the same parameters (a missing gradient
        counts as zeros, as under DDP). `False` (a peer failed during the step, or too few groups)
        means the caller drops the gradients: no group applied this update.
        """
        if not self._open:
            self.begin_step()
        params = [] if self._shard_hooks else [p for p in parameters if p.requires_grad]
        if params:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.detach().reshape(-1).float() for g in grads])
            self.manager.allreduce(flat).wait()
            offset = 0
            for param, grad in zip(params, grads):
                count = grad.numel()
                param.grad = flat[offset : offset + count].view_as(grad).to(grad.dtype)
                offset += count
        committed = self.manager.should_commit()
        self._open = False
        if not committed:
            self.uncommitted += 1
            step = int(self.host.train_state.global_step)
            reason = "a replica group failed during the step, or fewer than ft.min_replica_size took part"
            self.events.emit(
                Events.REPLICA_UNCOMMITTED, QuorumContext(self.host, step, self.replicas, self.replicas, reason)
            )
        return committed

    def reduce_shards(self, modules: Iterable[torch.nn.Module]) -> int:
        """HSDP across replica groups: FSDP2 averages each reduce-scattered gradient shard over the groups.

        Every FSDP2 unit in `modules` gets an all-reduce hook that averages its gradient shard with
        the same shard of the other groups (through the group-crossing TorchFT process group of this
        rank), right after FSDP2's reduce-scatter inside the group. `commit` then only asks whether
        the update may be applied. Call it once the model is sharded, before the first update.

        Returns:
            The number of FSDP2 units hooked (0: none, and `commit` averages the gradients itself).
        """
        from torch.distributed.fsdp import FSDPModule

        units = [unit for module in modules for unit in module.modules() if isinstance(unit, FSDPModule)]
        for unit in units:
            unit.set_all_reduce_hook(self._reduce_shard)
        self._shard_hooks = self._shard_hooks or bool(units)
        return len(units)

    def _reduce_shard(self, shard: torch.Tensor) -> None:
        self.manager.allreduce(shard).wait()  # in place, averaged over the groups in the quorum

    def data_shard(self, size: int, rank: int) -> tuple[int, int]:
        """`(shards, shard)` of this rank over all replica groups: group `r` reads shards `r*size` on."""
        return size * self.group_size, self.replica_id * size + rank

    def close(self) -> None:
        """Leave the quorum and stop the manager's servers."""
        self.manager.shutdown(wait=False)
        # torchft 0.2.0's non-blocking shutdown leaves its checkpoint server's thread serving (the flag
        # it sets is one the server never reads); stopping that server itself ends the thread.
        transport = getattr(self.manager, "_checkpoint_transport", None)
        if callable(getattr(transport, "shutdown", None)):
            transport.shutdown(wait=True)
        self._own_store = None

    # ------------------------------------------------------------------ recovery
    def _peer_state(self) -> Mapping[str, Any]:
        """The live runner payload a recovering peer receives (called on TorchFT's quorum thread).

        Its loader states are those the loop position stands at: when the quorum follows the draw of
        the update's first batch (not yet counted by the loop), the training loaders' states from
        before that draw, so the recovering group draws that batch of its own share itself.
        """
        payload = self.host.state_dict()
        loaders = payload.get("dataloaders")
        if not (self._drawn and loaders):
            return payload
        payload = dict(payload)
        payload["dataloaders"] = {split: self._undrawn.get(split, state) for split, state in loaders.items()}
        return payload

    def _load_peer_state(self, payload: Mapping[str, Any]) -> None:
        """Load a healthy peer's payload: model, optimizer, scheduler, loop position, RNG and results.

        The peer's loader positions count batches of its own shard; the same count continues this
        group's shard, so they are taken as they are, and the next-batch fingerprints the peer
        recorded (of its shard) are replaced by this group's.
        """
        before = int(self.host.train_state.global_step)
        payload = self._with_data_position(payload)
        try:
            self.host.load_checkpoint(payload)
        except Exception as error:
            raise RecoveryError(f"could not load the live state a peer sent at step {before}: {error}") from error
        step = int(self.host.train_state.global_step)
        self.recovered_steps += step - before
        self.logger.info("recovered from a peer at step %d (this group was at step %d)", step, before)
        self.events.emit(Events.REPLICA_RECOVERED, RecoveryContext(self.host, step, before, step - before))

    def _with_data_position(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """The peer's payload with this group's data position: its own saved one, else the peer's batch count."""
        own = None if self.positions is None else self.positions.load_dataloaders()
        if own is not None:
            position = own.get("position") or {}
            self.logger.info(
                "resuming this group's own data position: split %s, batch %s (saved at step %s)",
                position.get("split"),
                position.get("batch"),
                position.get("step"),
            )
            return with_own_position(payload, own, self.host.dataloaders)
        if self.positions is not None:
            self.logger.info("no dataloader checkpoint of this group yet: it continues at the peer's batch count")
        payload = dict(payload)
        loaders = payload.get("dataloaders") or {}
        payload["fingerprints"] = {
            split: loader_fingerprint(self.host.dataloaders.get(split), state) for split, state in loaders.items()
        }
        return payload

    def _on_step_end(self, context: Any) -> None:
        """Once an update's window closed: keep the loader state the next update starts from and, with
        per-replica dataloader checkpoints, save the group's data position (not after a failure)."""
        host = self.host
        if host.mode != "train" or getattr(context, "error", None) is not None or self._open:
            return
        self._keep_undrawn(context.split)
        step = int(host.train_state.global_step)
        if self.positions is None or step == self._saved_step:
            return
        self._saved_step, loop = step, host.loop_state
        # STEP_END comes before the loop counts the batch it closes: that batch is trained.
        state = data_position(host.dataloaders, list(host.train_splits), loop.split, loop.batch + 1, step)
        self.positions.save_dataloaders(state, step)

    def _announce_quorum(self, step: int, replicas: int, previous: int) -> None:
        context = QuorumContext(self.host, step, replicas, previous)
        self.logger.info("TorchFT quorum at step %d: %d live replica group(s), was %d", step, replicas, previous)
        self.events.emit(Events.QUORUM_CHANGED, context)
        if previous and replicas < previous:
            self.events.emit(Events.REPLICA_LEFT, context)
        elif previous and replicas > previous:
            self.events.emit(Events.REPLICA_JOINED, context)


class RecoveryError(RuntimeError):
    """A peer's live state could not be loaded (not retried: the group would diverge)."""


def _process_group(torchft: Any, backend: str, timeout: timedelta) -> Any:
    """TorchFT's reconfigurable process group for `ft.process_group`."""
    if backend == "gloo":
        return torchft.ProcessGroupGloo(timeout=timeout)
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("ft.process_group='nccl' needs CUDA; use 'gloo' on this machine")
        return torchft.ProcessGroupNCCL(timeout=timeout)
    raise ValueError(f"ft.process_group={backend!r} is not supported; use 'gloo' or 'nccl'")


def check_fault_tolerance(config: FaultToleranceConfig, degrees: Mapping[str, int], *, sharded: bool = False) -> None:
    """Refuse, before training, an `ft` section or a layout the TorchFT runtime does not cover.

    Args:
        config: The `ft` section (`enabled` is set).
        degrees: The parallel degree of each topology axis of this replica group.
        sharded: The runner shards with FSDP2 (`ParallelRunner`): a group may shard its model
            (`parallel.axes.shard`), and the groups are the replicate dimension of HSDP.

    Raises:
        ValueError: One line naming the key, its value and what is accepted.
    """
    # The config checks each value's type and sign; these are the relations between them.
    group_size, replica_id, min_size = int(config.group_size), int(config.replica_id), int(config.min_replica_size)
    if not 0 <= replica_id < group_size:
        raise ValueError(f"ft.replica_id={replica_id} must be in [0, ft.group_size={group_size})")
    if not 1 <= min_size <= group_size:
        raise ValueError(f"ft.min_replica_size={min_size} must be in [1, ft.group_size={group_size}]")
    covered = ("replicate", "shard") if sharded else ("replicate",)
    others = {axis: degree for axis, degree in degrees.items() if axis not in covered and degree > 1}
    if sharded and degrees.get("shard", 1) > 1 and degrees.get("replicate", 1) > 1:
        others["replicate"] = degrees["replicate"]  # the groups are HSDP's replicate dimension
    if others:
        what = (
            "FSDP2 sharding (parallel.axes.shard, the groups replicating it) or DDP (parallel.axes.replicate)"
            if sharded
            else "DDP (parallel.axes.replicate)"
        )
        raise ValueError(
            f"ft.enabled=True covers replica groups of {what} only; this layout has {others}: "
            + (
                "replication inside a sharded group, tensor, pipeline, context and expert parallelism are not covered"
                if sharded
                else "HSDP/FSDP2 sharding (ParallelRunner), tensor, pipeline, context and expert parallelism are not "
                "covered"
            )
        )
