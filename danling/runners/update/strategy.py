"""Update strategies: the one component that turns micro-step losses into parameter updates.

A runner holds one strategy (`runner.update`, built by the `build_update_strategy` hook). The
loops and the step hooks only ask it questions and hand it work:

- `start_pass(total)` opens a pass of `total` micro-batches (accumulation windows follow it);
- `train_context()` is entered around a training forward pass: precision, and gradient sync
  switched off for micro-steps that do not close their window;
- `backward(loss, weight)` back-propagates one micro-step loss, normalised for its window;
- `advance()` records a finished micro-step and says whether its window is now closed;
- `close_window()` prepares a window a pass left open (synchronising the gradients it kept local);
- `apply()` applies the window's update and says whether it was applied.

[`UpdateStrategy`][danling.runners.update.strategy.UpdateStrategy] is backend-free (windows only);
[`TorchUpdateStrategy`][danling.runners.update.strategy.TorchUpdateStrategy] is PyTorch's:
autocast and fp16 scaling, DDP/FSDP2 gradient-sync suppression, clipping, the non-finite skip,
optimizer and scheduler. Other backends (an engine that owns its own step) subclass it.

**Weighted micro-steps.** `backward(loss, weight=n)` declares that `loss` is a mean over `n`
units (valid tokens, say). The window's gradient is then the `n`-weighted mean over its
micro-steps and over the ranks of the gradient domain, exactly the gradient of one big batch
holding all of them, however the padding fell. The weights are summed on the device and
all-reduced once per update; nothing is read back on the host.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from danling.distributed import all_reduce_gradients, is_distributed
from danling.distributed.expert_parallel import ExpertGradients

from .accumulation import GradientAccumulator
from .gradient_sync import GradientSync
from .optimizer import OptimizerContainer
from .precision import Precision
from .spikes import LossSpike, SpikeGuard, TrainingDivergedError

__all__ = ["TorchUpdateStrategy", "UpdateStrategy"]

_NO_CONTEXT = nullcontext()


class UpdateStrategy:
    """Accumulation windows without any parameters: every closed window is one (counted) update.

    Args:
        accum_steps: Micro-steps per window.

    Examples:
        >>> update = UpdateStrategy(accum_steps=2)
        >>> update.start_pass(total=3)
        >>> [update.advance() for _ in range(3)], update.apply()
        ([False, True, True], True)
    """

    # A full-precision context that every forward pass of this strategy enters, when there is one
    # (no autocast, no sync suppression); hooks may return it without asking the strategy.
    fixed_context: AbstractContextManager | None = _NO_CONTEXT
    # True while `loss.backward()` alone is the whole of `backward(loss)` (nothing to divide,
    # scale or weigh): the runner's `backward` hook then calls it without going through here.
    plain_backward: bool = False
    # Whether the loops stop the run on a non-finite training loss they read (see TorchUpdateStrategy).
    watch_nonfinite_loss: bool = False
    spike_guard: SpikeGuard | None = None
    # The hang watchdog, told when backward and the optimizer step start (see `watch`).
    watchdog: Any = None

    # Whether `bind` makes the strategy step an optimizer it is given (see `TorchUpdateStrategy`).
    steps_bound_optimizer = False

    def __init__(self, accum_steps: int = 1) -> None:
        self.accumulator = GradientAccumulator(accum_steps)
        if type(self).advance is UpdateStrategy.advance:  # a subclass's own advance is kept
            # The accumulator answers directly: `advance` runs once per micro-step.
            self.advance = self.accumulator.advance  # type: ignore[method-assign]

    @property
    def accum_steps(self) -> int:
        return self.accumulator.accum_steps

    @property
    def pending(self) -> int:
        """Micro-steps of the open window (0 at a window boundary)."""
        return self.accumulator.pending

    @property
    def skipped_steps(self) -> int:
        """Updates dropped because their gradients were not finite."""
        return 0

    def set_accum_steps(self, accum_steps: int) -> None:
        """Use windows of `accum_steps` micro-steps from the next pass on.

        An elastic resume calls it to keep the global batch on another number of ranks; it must
        happen between windows (no gradients pending).

        Raises:
            ValueError: `accum_steps` is not a positive integer, or a window is open.
        """
        self.accumulator.set_accum_steps(accum_steps)

    def watch(self, watchdog: Any) -> None:
        """Report backward passes and optimizer steps to `watchdog` (its `enter(phase, step)`) from now on."""
        self.watchdog = watchdog
        self.plain_backward = False  # backward goes through `backward`, which reports it

    def start_pass(self, total: int | None) -> None:
        """Open a training pass of `total` micro-batches (`None` when unknown), or continue a restored one."""
        self.accumulator.start(total)

    def forward_context(self) -> AbstractContextManager:
        """Context of every forward pass (evaluation and inference included)."""
        return _NO_CONTEXT

    def train_context(self) -> AbstractContextManager:
        """Context of one training forward pass."""
        return self.forward_context()

    def backward(self, loss: Any, weight: Any = None) -> None:
        """Back-propagate `loss` divided by the size of its window (weights are a torch feature)."""
        if weight is not None:
            raise ValueError(f"{type(self).__name__} does not support weighted micro-steps (weight={weight!r})")
        if not callable(getattr(loss, "backward", None)):
            raise TypeError(f"backward() needs a loss with a backward() method, got {type(loss).__name__}")
        self.accumulator.normalize(loss).backward()

    def plain_update_reason(self, optimizer: Any, scheduler: Any) -> str | None:
        """Why an update is more than `loss.backward()` plus the optimizer's plain step, or `None` when it is not.

        Asked once per training pass by a backend that can run the plain default step without its
        hooks (the torch runner): `None` means every micro-step closes its window, nothing
        divides, scales, weighs, clips, checks or lowers the gradients, no window is open, and
        `container.step_plain()` applies the update of `optimizer` and `scheduler` exactly as
        `apply()` would. This strategy applies no update of its own, so it always gives a reason.
        """
        return f"update strategy {type(self).__name__}"

    def advance(self) -> bool:
        """Record one finished micro-step; `True` when it closed its window (apply the update now)."""
        return self.accumulator.advance()

    def close_window(self) -> bool:
        """Close a window the pass left open; `True` when there was one (apply the update next)."""
        return self.accumulator.finish() is not None

    def apply(self) -> bool:
        """Apply the closed window's update; `True` when it was applied."""
        return True

    def drop_window(self, *, count: bool = True) -> None:
        """Drop the open window's gradients without an update (`count`: as a skipped update)."""

    def state_dict(self) -> dict[str, Any]:
        """State of the update machinery; the window position is checkpointed with the loop's
        [`LoopState`][danling.runners.checkpointing.resume.LoopState]."""
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned."""


class TorchUpdateStrategy(UpdateStrategy):
    """PyTorch updates: autocast, gradient-sync suppression, clipping, non-finite skip, optimizer and scheduler.

    Args:
        accum_steps: Micro-steps per window.
        precision: The [`Precision`][danling.runners.update.precision.Precision] of the run.
        gradient_sync: How the (wrapped) model keeps gradients local inside a window; see
            [`gradient_sync_for`][danling.runners.update.gradient_sync.gradient_sync_for].
        group: Process group of the gradient domain (`None`: the default group).
        skip_group: Ranks that agree on skipping a non-finite update (`None`: every rank, so all
            of them take the same branch).
        max_grad_norm: Clip the global gradient norm to this value.
        max_grad_value: Clip each gradient element to this magnitude.
        skip_nonfinite_grad: Skip updates whose gradients hold inf/NaN (all ranks agree).
        norm_group: Ranks holding disjoint parameters (pipeline stages) whose gradients are clipped
            by one global norm (`None`: this rank's parameters only).
        check_nonfinite: Check every update for inf/NaN gradients even with the skip off, and drop
            such an update instead of writing NaN into the weights.
        max_nonfinite_updates: Non-finite updates in a row that stop the run with
            [`TrainingDivergedError`][danling.runners.update.spikes.TrainingDivergedError] (see
            [`OptimizerContainer`][danling.runners.update.optimizer.OptimizerContainer]).
        watch_nonfinite_loss: Ask the loops to stop the run when the training loss they read (step
            logs, pass ends, before mid-pass checkpoints) is not finite; costs nothing per update.
        spike_guard: Loss-spike detection and its policy
            ([`SpikeGuard`][danling.runners.update.spikes.SpikeGuard]); `None` is off.
        logger: Where skipped updates and spikes are reported.
        expert_gradients: Expert parameters no wrapper reduces, reduced before every step (see
            [`ExpertGradients`][danling.distributed.expert_parallel.ExpertGradients]); `None` without experts.

    Call [`bind`][danling.runners.update.strategy.TorchUpdateStrategy.bind] with the optimizer
    and scheduler before the first update.
    """

    # Whether `bind` makes this strategy step the given optimizer (an engine that owns its step says no).
    steps_bound_optimizer = True

    def __init__(
        self,
        accum_steps: int = 1,
        *,
        precision: Precision | None = None,
        gradient_sync: GradientSync | None = None,
        group: Any = None,
        max_grad_norm: float | None = None,
        max_grad_value: float | None = None,
        skip_nonfinite_grad: bool = False,
        skip_group: Any = None,
        norm_group: Any = None,
        check_nonfinite: bool = False,
        max_nonfinite_updates: int | None = None,
        spike_guard: SpikeGuard | None = None,
        logger: logging.Logger | None = None,
        watch_nonfinite_loss: bool = False,
        expert_gradients: ExpertGradients | None = None,
    ) -> None:
        super().__init__(accum_steps)
        self.expert_gradients = expert_gradients
        self.check_nonfinite = check_nonfinite
        self.watch_nonfinite_loss = watch_nonfinite_loss
        self.max_nonfinite_updates = max_nonfinite_updates
        self.spike_guard = spike_guard
        self.logger = logger or logging.getLogger("danling.runners")
        self._window_loss: Any = None  # sum of the open window's losses, kept while a spike guard watches
        self._window_count = 0
        self.skip_group = skip_group
        self.norm_group = norm_group
        self.precision = precision if precision is not None else Precision()
        self.gradient_sync = gradient_sync if gradient_sync is not None else GradientSync()
        self.group = group
        self.max_grad_norm = max_grad_norm
        self.max_grad_value = max_grad_value
        self.skip_nonfinite_grad = skip_nonfinite_grad
        self.container: OptimizerContainer | None = None
        self.outside_parameters: dict[str, torch.Tensor] = {}  # see `bind`
        self._multiplier: float | None = None  # rescales a window a pass left open
        self._weight: Any = None  # sum of the open window's micro-step weights, when weighted
        self._settle_fast_paths()

    def plain_update_reason(self, optimizer: Any, scheduler: Any) -> str | None:
        """Why an update is more than `loss.backward()` plus the container's plain step, or `None`.

        See [`UpdateStrategy.plain_update_reason`][danling.runners.update.strategy.UpdateStrategy.plain_update_reason].
        """
        if type(self) is not TorchUpdateStrategy or type(self.accumulator) is not GradientAccumulator:
            return f"update strategy {type(self).__name__}"  # a subclass may change any step of the update
        if self.accum_steps != 1 or not self.plain_backward or self.fixed_context is None:
            return "gradient accumulation, mixed precision, a spike guard or a multi-process watchdog"
        if self._multiplier is not None or self._weight is not None or self.spike_guard is not None:
            return "an open window"
        container = self.container
        if type(container) is not OptimizerContainer or container.optimizer is not optimizer:
            return "no optimizer bound yet"
        if container.scheduler is not scheduler or container.scaler is not None:
            return "a scheduler to bind or a gradient scaler"
        if container.max_grad_norm is not None or container.max_grad_value is not None or container.lr_scale != 1.0:
            return "gradient clipping or a lowered learning rate"
        if container.skip_nonfinite_grad or container.check_nonfinite:
            return "non-finite gradient checks"
        if self.outside_parameters and is_distributed(self.group):
            return "parameters outside the model to average over the ranks"
        if self.expert_gradients is not None:
            return "expert gradients to reduce over the expert_data domain"
        return None

    def _settle_fast_paths(self) -> None:
        # Settled once (window size, wrapper and precision do not change during a pass), so the
        # per-micro-step calls skip what cannot apply.
        self._sync_free = self.accumulator.accum_steps == 1 or not self.gradient_sync.suppresses
        # A subclass with its own backward (an engine's) is never bypassed.
        own_backward = type(self).backward is TorchUpdateStrategy.backward
        self._plain_backward = (
            own_backward
            and self.accumulator.accum_steps == 1
            and self.precision.scaler is None
            and self.spike_guard is None
        )
        self.plain_backward = self._plain_backward and self.watchdog is None
        # Full precision without sync suppression: every forward pass runs in the same no-op context.
        own_contexts = type(self).train_context is TorchUpdateStrategy.train_context
        plain = own_contexts and self._sync_free and self.precision.dtype is None
        self.fixed_context = _NO_CONTEXT if plain else None

    def set_accum_steps(self, accum_steps: int) -> None:
        """Use windows of `accum_steps` micro-steps from the next pass on (see `UpdateStrategy.set_accum_steps`)."""
        super().set_accum_steps(accum_steps)
        self._settle_fast_paths()

    def bind(
        self,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any = None,
        interval: str = "step",
        outside: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Step `optimizer` (and `scheduler` when `interval == "step"`) from now on; counters carry over.

        `outside` names the optimizer's parameters that are not in the (wrapped) model, such as a
        learnable temperature in the criterion: no wrapper synchronises their gradients, so every
        update averages them over the gradient domain first (each rank holds a replica), and
        checkpoints store their state under these names (`outside_parameters`).
        """
        self.outside_parameters = dict(outside or {})
        previous = self.container
        if optimizer is None:
            self.container = None
            return
        self.container = OptimizerContainer(
            optimizer,
            scheduler,
            precision=self.precision,
            max_grad_norm=self.max_grad_norm,
            max_grad_value=self.max_grad_value,
            skip_nonfinite_grad=self.skip_nonfinite_grad,
            scheduler_interval=interval,
            skip_group=self.skip_group,
            norm_group=self.norm_group,
            check_nonfinite=self.check_nonfinite,
            max_nonfinite_updates=self.max_nonfinite_updates,
            logger=self.logger,
        )
        if previous is not None:
            self.container.skipped_steps = previous.skipped_steps
            self.container.consecutive_nonfinite = previous.consecutive_nonfinite

    @property
    def skipped_steps(self) -> int:
        return 0 if self.container is None else self.container.skipped_steps

    def forward_context(self) -> AbstractContextManager:
        fixed = self.fixed_context
        return fixed if fixed is not None else self.precision.autocast()

    def train_context(self) -> AbstractContextManager:
        """Autocast, plus gradient sync switched off when this micro-step does not close its window.

        DDP decides during the forward pass whether the following backward reduces, so the
        context must be open around the forward; the backward may run after the block.
        """
        fixed = self.fixed_context
        if fixed is not None:
            return fixed
        autocast = self.precision.autocast()
        if self._sync_free:
            return autocast
        sync = self.gradient_sync.context(self.accumulator.is_boundary)
        if type(sync) is nullcontext:
            return autocast
        return sync if type(autocast) is nullcontext else _entered_together(sync, autocast)

    def backward(self, loss: torch.Tensor, weight: Any = None) -> None:
        """Back-propagate one micro-step loss: divided by its window size, or scaled by `weight`.

        Raises:
            ValueError: a window mixes weighted and unweighted micro-steps.
        """
        if weight is None and self.plain_backward:  # false while a weighted window is open
            loss.backward()  # nothing to divide or scale
            return
        if self.watchdog is not None:
            self.watchdog.enter("backward", self.watchdog.step)
        scaler = self.precision.scaler
        if self.spike_guard is not None:
            detached = loss.detach().float()
            self._window_loss = detached if self._window_loss is None else self._window_loss + detached
            self._window_count += 1
        if weight is not None:
            if self._weight is None and self.accumulator.pending:
                raise ValueError("a window mixes weighted and unweighted micro-steps; pass weight= to every backward")
            self._weight = weight if self._weight is None else self._weight + weight
            self.plain_backward = False  # until this weighted window is applied
            loss = loss * weight
        elif self._weight is not None:
            raise ValueError("a window mixes weighted and unweighted micro-steps; pass weight= to every backward")
        else:
            loss = self.accumulator.normalize(loss)
        (loss if scaler is None else scaler.scale(loss)).backward()

    def close_window(self) -> bool:
        """Close a window the pass left open: reduce its local gradients and rescale them to its real size."""
        accumulator = self.accumulator
        pending = accumulator.pending
        if not pending:
            return False
        window = accumulator.window_size
        accumulator.finish()
        if self.gradient_sync.suppresses and is_distributed() and self.container is not None:
            experts = self.expert_gradients.ids if self.expert_gradients is not None else ()
            dense = [param for param in self.container.parameters() if id(param) not in experts]
            all_reduce_gradients(dense, group=self.group)  # experts: reduced in `apply` over their own domain
        if self._weight is None:
            self._multiplier = window / pending
        return True

    def apply(self) -> bool:
        """Apply the update of the closed window through the optimizer container.

        Raises:
            RuntimeError: no optimizer is bound.
        """
        container = self.container
        if container is None:
            raise RuntimeError("no optimizer to step: set config.optim.type or assign runner.optimizer")
        if self.watchdog is not None:
            self.watchdog.enter("optimizer step", self.watchdog.step)
        if self.outside_parameters and is_distributed(self.group):
            _average_replicas(self.outside_parameters.values(), self.group)
        if self.expert_gradients is not None:
            self.expert_gradients.reduce()
        multiplier, self._multiplier = self._multiplier, None
        if self._weight is not None:
            multiplier, self._weight = self._weight_factor(self._weight), None
            self.plain_backward = self._plain_backward and self.watchdog is None
        guard = self.spike_guard
        if guard is None:
            return container.step(multiplier)
        if self._window_loss is not None and self._spiked(guard, container):
            return False
        container.lr_scale = guard.lr_scale
        applied = container.step(multiplier)
        if applied:
            guard.applied()
        return applied

    def drop_window(self, *, count: bool = True) -> None:
        """Drop the open window's gradients, weights and losses without an update (`oom.policy`).

        With `count` the drop is counted in `skipped_steps` (the window's update is skipped);
        without, the gradients are only zeroed (the window goes on, e.g. to run a micro-batch again).
        """
        self._multiplier, self._weight, self._window_loss, self._window_count = None, None, None, 0
        self.plain_backward = self._plain_backward and self.watchdog is None
        container = self.container
        if container is None:
            return
        if count:
            container.drop()
        else:
            container.optimizer.zero_grad(set_to_none=True)

    def _spiked(self, guard: SpikeGuard, container: OptimizerContainer) -> bool:
        """Check the window loss (mean over its micro-steps and the ranks); handle a spike by the policy.

        Raises:
            LossSpike: policy `rollback`, for the training loop to roll back.
            TrainingDivergedError: a spike after `max_rollbacks` rollbacks.
        """
        total, count = self._window_loss, self._window_count
        self._window_loss, self._window_count = None, 0
        value = total / count
        if is_distributed(self.skip_group):
            dist.all_reduce(value, group=self.skip_group)  # every rank takes the same decision
            value = value / dist.get_world_size(self.skip_group)
        loss, median = float(value), guard.detector.median
        if not guard.detector.observe(loss):
            return False
        guard.spikes += 1
        container.drop()
        if guard.policy == "skip":
            self.logger.warning(
                "loss spike: %.6g > %g x running median %.6g; update skipped (%d spikes so far)",
                loss,
                guard.detector.factor,
                median,
                guard.spikes,
            )
            return True
        if guard.rollbacks >= guard.max_rollbacks:
            raise TrainingDivergedError(
                f"loss spike ({loss:.6g} > {guard.detector.factor:g} x running median {median:.6g}) after "
                f"{guard.rollbacks} rollback(s), the most spikes.max_rollbacks={guard.max_rollbacks} allows; stopping"
            )
        raise LossSpike(loss, median, micro_steps=count)

    def _weight_factor(self, weight: Any) -> Any:
        """`ranks / total weight`: turns rank-averaged weighted sums into the weighted mean."""
        if not is_distributed():
            return 1.0 / weight
        device = next(iter(self.container.parameters())).device  # type: ignore[union-attr]
        total = torch.as_tensor(weight, dtype=torch.float32, device=device).detach().clone()
        dist.all_reduce(total, group=self.group)
        return dist.get_world_size(self.group) / total

    def state_dict(self) -> dict[str, Any]:
        """Skipped updates, gradient-scaler state and the spike guard's state (batches to skip included)."""
        state: dict[str, Any] = {"optimizer_container": None if self.container is None else self.container.state_dict()}
        if self.spike_guard is not None:
            state["spikes"] = self.spike_guard.state_dict()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        container_state = state_dict.get("optimizer_container")
        if container_state and self.container is not None:
            self.container.load_state_dict(container_state)
        if self.spike_guard is not None and state_dict.get("spikes"):
            self.spike_guard.load_state_dict(state_dict["spikes"])


def _average_replicas(parameters: Iterable[torch.Tensor], group: Any) -> None:
    """Average the gradients of replicated parameters over `group`; a rank whose replica got no
    gradient in this window contributes zeros (as a rank whose batch did not use it)."""
    replicas = list(parameters)
    for param in replicas:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    all_reduce_gradients(replicas, group=group)


@contextlib.contextmanager
def _entered_together(outer: AbstractContextManager, inner: AbstractContextManager) -> Iterator[None]:
    with outer, inner:
        yield
