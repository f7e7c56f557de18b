"""Per-batch hooks of [`TorchRunner`][danling.runners.TorchRunner]: default steps, backward, the update.

[`TorchStepMixin`][danling.runners.torch_steps.TorchStepMixin] implements the hooks the loops of
[`LoopMixin`][danling.runners.loop.loops.LoopMixin] call once per batch: the default batch contract
(`train_step`, `evaluate_step`, `infer_step`), the precision and DDP contexts, the accumulation
state machine (`backward`, `step`, `optimizer_step`), metric updates and per-split results,
scheduler stepping and the collectives used for logging. Nothing here reads a tensor back to the
host: losses and metrics stay on the device until a log step or the end of a split reads them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler

from danling.data import split_batch
from danling.distributed import (
    all_gather_strided,
    all_reduce_any,
    all_reduce_gradients,
    all_reduce_mean,
    is_distributed,
)
from danling.optim import is_metric_scheduler
from danling.utils import RoundDict, to_device

from .loop import RunnerMode
from .update import EMA

__all__ = ["TorchStepMixin"]

_STOP_POLL_EVERY = 8  # batches between the cross-rank agreements on a stop request while training
# The hooks each fused default step stands for: a pass uses the fused step only when none of
# them is overridden (by the class or on the instance); otherwise it calls the hooks as usual.
# The fused steps still call `_criterion_loss`, `_update_metrics`, `_inference_model` and
# `_apply_update`, so overrides of those apply to both paths.
_TRAIN_HOOKS = (
    "train_step",
    "to_device",
    "train_context",
    "forward_context",
    "backward",
    "step",
    "optimizer_step",
    "_optimizer_container",
)
_EVALUATE_HOOKS = ("evaluate_step", "to_device", "forward_context")
_PREFERRED_MONITOR_SPLITS = ("val", "validate", "validation")


class TorchStepMixin:
    """Batch-level hooks of the torch runner; mixed into `TorchRunner` ahead of `BaseRunner`."""

    train_metrics: Any = None
    evaluate_metrics: Any = None
    optimizer_container: Any = None
    scheduler_interval: str = "step"
    scheduler_monitor: str | None = None
    _grad_multiplier: float | None = None
    _active_metrics: Any = None
    _stop_polls: int = 0
    # `is_distributed()` read once when a pass starts (None outside a pass): the stop poll runs every batch.
    _pass_distributed: bool | None = None
    _train_timeout_applied: bool = False

    # ------------------------------------------------------------------ mode and contexts
    @property
    def mode(self) -> RunnerMode:
        """Current [`RunnerMode`][danling.runners.loop.loops.RunnerMode]; setting it switches `model` between
        `train()` and `eval()` (the EMA copy always stays in evaluation mode)."""
        return self._mode

    @mode.setter
    def mode(self, mode: RunnerMode | str) -> None:
        self._mode = RunnerMode(mode)
        if isinstance(self.model, nn.Module):
            self.model.train(self._mode is RunnerMode.train)
        if isinstance(self.ema, nn.Module):
            self.ema.eval()

    def to_device(self, data: Any) -> Any:
        """Move one batch (any nesting of tensors) to `self.device`."""
        device = self.device
        return to_device(data, device, non_blocking=device.type == "cuda")

    def forward_context(self) -> AbstractContextManager:
        """Autocast context of the configured precision, entered around every forward pass."""
        return self.precision_policy.autocast()

    def train_context(self) -> AbstractContextManager:
        """Context for one training forward pass: autocast plus DDP `no_sync` inside an accumulation window.

        DDP decides during the forward pass whether the following backward all-reduces, so only the
        forward needs to run inside; `backward` may be called after the block.
        """
        accumulator = self.accumulator
        if accumulator.accum_steps == 1:  # every micro-step closes its window: DDP always synchronises
            return self.forward_context()
        no_sync = accumulator.no_sync(self.model)
        if type(no_sync) is nullcontext:  # not DDP, or the step that closes its window
            return self.forward_context()
        return _entered_together(no_sync, self.forward_context())

    def inference_context(self) -> AbstractContextManager:
        """`torch.inference_mode()`: evaluation passes and inference steps build no autograd graph."""
        return torch.inference_mode()

    # ------------------------------------------------------------------ step hooks
    def train_step(self, data: Any) -> tuple[Any, torch.Tensor | None]:
        """Forward, loss, metrics, backward and accumulation for one training micro-batch.

        Called once per batch by the training loops with `self.mode == "train"`. The batch is moved
        to `self.device` and split by [`split_batch`][danling.data.split_batch] (`input`/`target` of a
        mapping, items 0/1 of a sequence, otherwise input only). The forward pass and the loss run
        in `train_context()`; the training metrics are updated; then `backward(loss)` and `step()`.
        Override it when batches or losses look different, keeping the `backward` and `step` calls;
        do not zero gradients, step the optimizer or touch the counters here.

        Returns:
            The model output and the detached loss.

        Raises:
            ValueError: `self.model` or `self.criterion` is not set, or the criterion returned None.
        """
        if self.model is None:
            raise ValueError("train_step() needs self.model; set it in __init__")
        data = self.to_device(data)
        input, target = split_batch(data)
        with self.train_context():
            pred = self.model(input)
            loss = self._criterion_loss(pred, target, required=True)
        self._update_metrics(pred, target)
        self.backward(loss)
        self.step()
        return pred, loss.detach()

    def evaluate_step(self, data: Any) -> tuple[Any, torch.Tensor | None]:
        """Forward (through the EMA copy when there is one), optional loss and metrics for one batch.

        Called by the evaluation loops inside `inference_context()`. The loss is computed only when
        `self.criterion` is set and the batch has a target. Never call `backward`/`step` or change
        counters here.

        Raises:
            ValueError: neither `self.ema` nor `self.model` is set.
        """
        model = self._inference_model()
        data = self.to_device(data)
        input, target = split_batch(data)
        with self.forward_context():
            pred = model(input)
            loss = None if target is None else self._criterion_loss(pred, target, required=False)
        self._update_metrics(pred, target)
        return pred, None if loss is None else loss.detach()

    def infer_step(self, data: Any) -> list[Any]:
        """Predictions for one batch as a Python list (one number per example by default).

        The input is taken as in `evaluate_step` (the target, if any, is ignored), run through the
        EMA copy or the model under `forward_context()`, and converted with
        `pred.squeeze(-1).cpu().tolist()`. Override it for outputs that are not one number per
        example; return a list, never a tensor, and leave metrics alone.

        Raises:
            ValueError: neither `self.ema` nor `self.model` is set.
        """
        model = self._inference_model()
        input, _ = split_batch(data)
        input = self.to_device(input)
        with self.forward_context():
            pred = model(input)
        values = pred.detach().squeeze(-1).cpu().tolist()
        return values if isinstance(values, list) else [values]

    def infer(
        self, split: str = "infer", *, steps: int | None = None, stream: bool | None = None
    ) -> list[Any] | Iterator[list[Any]]:
        """Predict on `split` like [`LoopMixin.infer`][danling.runners.loop.loops.LoopMixin.infer]; under DDP a
        list result covers the whole split, in dataset order, on every rank.

        The split's sampler shards the data over the ranks (rank `r` gets items `r, r + W, ...`
        when it does not shuffle), so each rank predicts its shard and the lists are then merged
        back in order and cut to the dataset's length (dropping the sampler's padding). This is
        a collective: call it on every rank. Streams, and loaders whose sampler shuffles or is not
        a `DistributedSampler`, return this rank's own predictions.
        """
        outputs = super().infer(split, steps=steps, stream=stream)
        if not isinstance(outputs, list) or not is_distributed():
            return outputs
        sampler = getattr(self.dataloaders[split], "sampler", None)
        if not isinstance(sampler, DistributedSampler) or sampler.shuffle:
            return outputs
        return all_gather_strided(outputs, None if sampler.drop_last else len(sampler.dataset))

    def _inference_model(self) -> Any:
        model = self.ema if self.ema is not None else self.model
        if model is None:
            raise ValueError(f"{type(self).__name__} needs self.model (or self.ema) to evaluate or infer")
        return model

    def _criterion_loss(self, pred: Any, target: Any, *, required: bool) -> torch.Tensor | None:
        if self.criterion is None:
            if required:
                raise ValueError("the default train_step needs self.criterion; set it or override train_step")
            return None
        loss = self.criterion(pred, target)
        if loss is None and required:
            raise ValueError(f"criterion {self.criterion!r} returned None; train_step needs a loss tensor")
        return loss

    # ------------------------------------------------------------------ accumulation and update
    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate one micro-step loss.

        The loss is divided by the size of its accumulation window (a shorter final window of a
        pass divides by its own size) and multiplied by the fp16 gradient scale when one is in use.
        Do not step the optimizer or change counters here.
        """
        if self.accumulator.accum_steps == 1 and self.precision_policy.scaler is None:
            loss.backward()  # nothing to divide or scale
            return
        loss = self.accumulator.normalize(loss)
        self.precision_policy.scale(loss).backward()

    def step(self) -> None:
        """Count one micro-step and apply the update when it closes its accumulation window.

        Call exactly once per micro-batch, after `backward`; never together with `optimizer_step`.
        """
        state = self.state.train
        # The counters are validated ints; an increment keeps them so, so it bypasses the check.
        state.__dict__["micro_step"] = state.micro_step + 1
        if self.accumulator.advance():
            self._pending_micro_steps = 0
            self.optimizer_step()
        else:
            self._pending_micro_steps += 1

    def optimizer_step(self) -> bool:
        """Apply one update from the accumulated gradients; return whether it was applied.

        Waits until a pending asynchronous checkpoint no longer reads the parameters, then lets the
        [`OptimizerContainer`][danling.runners.update.optimizer.OptimizerContainer] unscale, skip
        non-finite gradients (all ranks agree), clip, step optimizer and step-interval scheduler and
        zero the gradients. An applied update increments `train_state.global_step` and refreshes
        the EMA copy; a skipped one changes neither.

        Raises:
            RuntimeError: no optimizer is bound (set `config.optim.type` or `self.optimizer`).
        """
        container = self._optimizer_container()
        multiplier, self._grad_multiplier = self._grad_multiplier, None
        return self._apply_update(container, multiplier)

    def _apply_update(self, container: Any, multiplier: float | None) -> bool:
        """What every update does, whichever step path asked for it (see `optimizer_step`)."""
        self.checkpoint_manager.maybe_wait_for_staging()
        applied = container.step(multiplier)
        if applied:
            state = self.state.train
            state.__dict__["global_step"] = state.global_step + 1  # a validated int stays one
            if isinstance(self.ema, EMA):
                self.ema.update(self.model)
            if not self._train_timeout_applied:
                self._apply_train_timeout()
        return applied

    def _flush_pending_optimizer_step(self) -> bool:
        """Apply an open accumulation window (a pass of unknown length ended, or a shutdown).

        Its micro-steps ran without gradient synchronisation, so gradients are averaged over ranks
        here and rescaled from the window's nominal size to the micro-steps actually taken.
        """
        pending = self._pending_micro_steps
        if not pending:
            return False
        self._pending_micro_steps = 0
        window = self.accumulator.window_size
        self.accumulator.finish()
        container = self._optimizer_container()
        if is_distributed():
            all_reduce_gradients(container.parameters())
        self._grad_multiplier = window / pending
        return self.optimizer_step()

    def _optimizer_container(self) -> Any:
        container = self.optimizer_container
        if container is None or container.optimizer is not self.optimizer or container.scheduler is not self.scheduler:
            self._bind_optimizer_container()
            container = self.optimizer_container
        if container is None:
            raise RuntimeError(
                f"{type(self).__name__} has no optimizer to step: set config.optim.type or assign self.optimizer"
            )
        return container

    def _apply_train_timeout(self) -> None:
        """Switch the default group to `comm.train_timeout_seconds` once the first update went through."""
        self._train_timeout_applied = True
        seconds = self.config.comm.train_timeout_seconds
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if seconds and is_distributed() and set_timeout is not None:
            set_timeout(timedelta(seconds=seconds), None)

    # ------------------------------------------------------------------ metrics and results
    def _metrics_for(self, mode: RunnerMode) -> Any:
        if mode is RunnerMode.train:
            return self.train_metrics if self.train_metrics is not None else self.metrics
        if mode is RunnerMode.evaluate:
            return self.evaluate_metrics if self.evaluate_metrics is not None else self.metrics
        return None

    def _update_metrics(self, pred: Any, target: Any) -> None:
        if target is None:
            return
        # In a pass, the container `_start_split` chose; outside one (a direct call), by mode.
        metrics = self._active_metrics if self._pass_distributed is not None else self._metrics_for(self.mode)
        if metrics is not None:
            metrics.update(pred.detach() if isinstance(pred, torch.Tensor) and pred.requires_grad else pred, target)

    def _start_split(self, split: str, mode: RunnerMode, length: int | None) -> None:
        """Reset the split's metrics and, for training, open the accumulation pass."""
        metrics = self._metrics_for(mode)
        self._active_metrics = metrics
        self._pass_distributed = is_distributed()
        if metrics is not None:
            metrics.reset()
        if mode is RunnerMode.train:
            self.accumulator.start(length)

    # ------------------------------------------------------------------ fused default steps
    def _batch_step(self, mode: RunnerMode) -> Any:
        """The fused default step of `mode` when the pass allows it, else the hook itself.

        A fused step does what the default `train_step` / `evaluate_step` and the hooks they call
        do, in one function: in a model small enough for the per-batch Python to matter, the
        calls through the contexts, `backward`, `step`, `optimizer_step` and the metric update
        cost a few percent of the step. It is used in full precision (no autocast context to
        enter), with one micro-step per update (no accumulation window), and only when none of
        the hooks it stands for is overridden; any other pass calls the hooks.
        """
        step = super()._batch_step(mode)
        if mode is RunnerMode.infer or self.precision_policy.dtype is not None:
            return step
        if mode is RunnerMode.train:
            eligible = (
                self.accumulator.accum_steps == 1
                and self.model is not None
                and self.criterion is not None
                and self._uses_default_hooks(_TRAIN_HOOKS)
                and self._grad_multiplier is None
            )
            if eligible and self._optimizer_container_or_none() is not None:
                return self._fused_train_step
            return step
        if self._uses_default_hooks(_EVALUATE_HOOKS):
            return self._fused_evaluate_step
        return step

    def _uses_default_hooks(self, names: tuple[str, ...]) -> bool:
        instance, cls = self.__dict__, type(self)
        return all(name not in instance and getattr(cls, name) is getattr(TorchStepMixin, name) for name in names)

    def _optimizer_container_or_none(self) -> Any:
        try:
            return self._optimizer_container()
        except RuntimeError:  # no optimizer: the hooks raise at the first update, as they always did
            return None

    def _fused_train_step(self, data: Any) -> tuple[Any, torch.Tensor]:
        """`train_step` -> `backward` -> `step` -> `optimizer_step` of one full-precision micro-step
        that closes its window, in one call (see `_batch_step`)."""
        device = self.device
        input, target = split_batch(to_device(data, device, non_blocking=device.type == "cuda"))
        pred = self.model(input)
        loss = self._criterion_loss(pred, target, required=True)
        self._update_metrics(pred, target)
        loss.backward()
        state = self.state.train
        state.__dict__["micro_step"] = state.micro_step + 1  # a validated int stays one
        self.accumulator.advance()  # one micro-step per window: always closes it
        self._apply_update(self.optimizer_container, None)
        return pred, loss.detach()

    def _fused_evaluate_step(self, data: Any) -> tuple[Any, torch.Tensor | None]:
        """`evaluate_step` in full precision, in one call (see `_batch_step`)."""
        model = self._inference_model()
        device = self.device
        input, target = split_batch(to_device(data, device, non_blocking=device.type == "cuda"))
        pred = model(input)
        loss = None if target is None else self._criterion_loss(pred, target, required=False)
        self._update_metrics(pred, target)
        return pred, None if loss is None else loss.detach()

    def collect_result(self, split: str) -> RoundDict:
        """The split's averaged loss plus the values of its metrics, reduced over all ranks.

        Reading the meters and metrics synchronises ranks, so every rank calls this together (the
        loops do, at the end of each split).
        """
        self._pass_distributed = None  # the pass is over
        result = dict(self.meters.avg)
        metrics = self._active_metrics
        if metrics is not None:
            result.update(metrics.avg)
        return RoundDict.from_flat(result)  # flat results skip chanfig's generic constructor

    # ------------------------------------------------------------------ schedulers
    def advance_schedulers(self, result: Mapping[str, Any]) -> None:
        """Step an epoch-interval scheduler once per epoch; metric schedulers get the monitored value."""
        scheduler = self.scheduler
        if scheduler is None or self.scheduler_interval == "step":
            return
        if is_metric_scheduler(scheduler):
            scheduler.step(self._monitor_value(result))
        else:
            scheduler.step()

    def _monitor_value(self, result: Mapping[str, Any]) -> float:
        """The value a metric scheduler watches: `scheduler.monitor` (dotted), else the score metric."""
        monitor = self.scheduler_monitor
        if monitor:
            node: Any = result
            for part in monitor.split("."):
                if not isinstance(node, Mapping) or part not in node:
                    raise ValueError(f"scheduler.monitor={monitor!r} is not in the epoch result {_keys(result)}")
                node = node[part]
            return float(node)
        name = self.score_name
        splits = [key for key, value in result.items() if isinstance(value, Mapping) and name in value]
        configured = self.config.get("score_split")
        preferred = [configured] if configured else [*_PREFERRED_MONITOR_SPLITS, *self.evaluate_splits]
        for split in [*preferred, *splits]:
            if split in splits:
                return float(result[split][name])
        if name in result:
            return float(result[name])
        raise ValueError(
            f"cannot find {name!r} for the metric scheduler in the epoch result {_keys(result)}; set scheduler.monitor"
        )

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, *, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """`tensor` reduced with `op` over all ranks (a copy; the input itself when there is one rank)."""
        if not is_distributed():
            return tensor
        out = tensor.detach().clone()
        dist.all_reduce(out, op=op)
        return out

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mean of `tensor` over all ranks."""
        return all_reduce_mean(tensor)

    def reduce_loss_for_logging(self, loss: torch.Tensor | None, loss_n: int | None) -> torch.Tensor | None:
        """Detached loss averaged over ranks, weighted by each rank's `loss_n` samples when given."""
        if loss is None:
            return None
        loss = loss.detach()
        if not is_distributed():
            return loss
        if loss_n is None:
            return all_reduce_mean(loss)
        weighted = self.all_reduce(loss.float() * loss_n)
        total = self.all_reduce(torch.tensor(float(loss_n), device=loss.device))
        return weighted / total

    def _stop_poll(self) -> Any:
        """None (the local flag answers) unless this pass must agree on stop requests across ranks."""
        if type(self)._stop_requested is not TorchStepMixin._stop_requested:
            return self._stop_requested
        return self._stop_requested if self._training and self._pass_distributed else None

    def _stop_requested(self) -> bool:
        """A stop request, agreed across ranks while training so that all of them stop at the same batch.

        The agreement is a collective, made every few batches to keep the hot path free of host
        synchronisations; outside training (evaluation or inference possibly run on one rank
        only) the local flag is used.
        """
        local = self.supervisor.stop_requested
        if not self._training:
            return local
        distributed = self._pass_distributed
        if not (is_distributed() if distributed is None else distributed):
            return local
        self._stop_polls += 1
        if self._stop_polls % _STOP_POLL_EVERY:
            return False
        return bool(all_reduce_any(torch.tensor(local)))


@contextmanager
def _entered_together(outer: AbstractContextManager, inner: AbstractContextManager) -> Iterator[None]:
    with outer, inner:
        yield


def _keys(result: Mapping[str, Any]) -> list[str]:
    keys = []
    for key, value in result.items():
        if isinstance(value, Mapping):
            keys.extend(f"{key}.{sub}" for sub in value)
        else:
            keys.append(key)
    return keys
