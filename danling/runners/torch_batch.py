"""The default batch contract of [`TorchRunner`][danling.runners.TorchRunner]: one batch to prediction and loss.

[`TorchBatchMixin`][danling.runners.torch_batch.TorchBatchMixin] implements the step hooks the
loops call once per batch (`train_step`, `evaluate_step`, `infer_step`) for batches shaped as
mappings (`input`, `target`), sequences (items 0 and 1) or a bare input, plus the contexts they
run in. Gradients, accumulation and the update itself belong to the runner's update strategy
(`self.update`), reached through `backward` and `step`. Nothing here reads a tensor back to the
host: losses and metrics stay on the device until a log step or the end of a split reads them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler

from danling.data import split_batch
from danling.distributed import all_gather_strided, all_reduce_mean, is_distributed
from danling.utils import to_device

from .loop import RunnerMode
from .torch_fused_step import fused_train_pass

__all__ = ["TorchBatchMixin"]


class TorchBatchMixin:
    """Default step hooks and their contexts; mixed into `TorchRunner` ahead of `BaseRunner`."""

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
        update = self.update
        fixed = update.fixed_context
        return fixed if fixed is not None else update.forward_context()

    def train_context(self) -> AbstractContextManager:
        """Context of one training forward pass: autocast, plus gradient sync switched off for a
        micro-step that does not close its accumulation window (see the update strategy's
        [`train_context`][danling.runners.update.strategy.TorchUpdateStrategy.train_context]).

        The backward pass may run after the block.
        """
        update = self.update
        fixed = update.fixed_context
        return fixed if fixed is not None else update.train_context()

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
            The model output and the detached loss. Inside a training pass whose loop discards the
            output (no step subscriber), this default step returns `None` for it and drops it
            before `backward`, so the output does not sit in memory through the backward pass; an
            override that calls `super().train_step` still gets the output.

        Raises:
            ValueError: `self.model` or `self.criterion` is not set, or the criterion returned None.
        """
        model = self.model
        if model is None:
            raise ValueError("train_step() needs self.model; set it in __init__")
        data = self.to_device(data)
        input, target = split_batch(data)
        context = self.train_context()
        if type(context) is nullcontext:  # full precision, no sync suppression: entering it does nothing
            pred = model(input)
            loss = self._criterion_loss(pred, target, required=True)
        else:
            with context:
                pred = model(input)
                loss = self._criterion_loss(pred, target, required=True)
        self.update_metrics(pred, target)
        if self._step_output_unused and type(self).train_step is TorchBatchMixin.train_step:
            # The loop discards the output and no override of this step reads it: holding it through the
            # backward pass kept one more output-sized tensor (a language model's logits) alive at the
            # memory peak, 12% of GPT-2 small's peak on an H200 (docs/gpu.md).
            pred = None
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
        self.update_metrics(pred, target)
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
        self,
        split: str = "infer",
        *,
        steps: int | None = None,
        stream: bool | None = None,
        output: str | os.PathLike[str] | None = None,
        resume: bool | None = None,
    ) -> list[Any] | Iterator[list[Any]] | Path:
        """Predict on `split` like [`LoopMixin.infer`][danling.runners.loop.loops.LoopMixin.infer]; under DDP a
        list result covers the whole split, in dataset order, on every rank.

        The split's sampler shards the data over the ranks (rank `r` gets items `r, r + W, ...`
        when it does not shuffle), so each rank predicts its shard and the lists are then merged
        back in order and cut to the dataset's length (dropping the sampler's padding). This is
        a collective: call it on every rank. Streams, and loaders whose sampler shuffles or is not
        a `DistributedSampler`, return this rank's own predictions. With `output`, the file is
        written and merged as described in the Inference guide, and its path returned on every rank.
        """
        outputs = super().infer(split, steps=steps, stream=stream, output=output, resume=resume)
        if not isinstance(outputs, list) or not is_distributed():
            return outputs
        sampler = getattr(self.dataloaders[split], "sampler", None)
        if not isinstance(sampler, DistributedSampler) or sampler.shuffle:
            return outputs
        total = None if sampler.drop_last else len(sampler.dataset)
        return all_gather_strided(outputs, total, group=self.topology.group("data"))

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
        try:
            loss = self.criterion(pred, target)
        except (IndexError, RuntimeError) as err:
            self._criterion_failed(pred, target, err)
            raise
        if loss is None and required:
            raise ValueError(f"criterion {self.criterion!r} returned None; train_step needs a loss tensor")
        if required and getattr(loss, "ndim", 0) and loss.numel() != 1:  # shape reads: no device synchronisation
            raise self._non_scalar_loss(loss)
        return loss

    def _non_scalar_loss(self, loss: Any) -> ValueError:
        """The error for a criterion that returned one loss per sample instead of one per batch."""
        return ValueError(
            f"criterion {self.criterion!r} returned a loss of shape {tuple(loss.shape)}, not one number: "
            "training needs a scalar loss per batch; reduce it (reduction='mean' for torch losses, or "
            ".mean() in your criterion), or override train_step"
        )

    def _criterion_failed(self, pred: Any, target: Any, err: Exception) -> None:
        """Turn a criterion's refusal of a class label into a `ValueError` naming the split and the range.

        Returns (the caller re-raises `err`) when the error is about something else.
        """
        if "out of bounds" in str(err) or "out of range" in str(err):
            raise ValueError(_label_range_message(self, pred, target, err)) from err

    def _fused_train_pass(self) -> Any:
        """The fused default training pass when this pass needs nothing else (see `fused_train_pass`)."""
        return fused_train_pass(self)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, *, op: Any = dist.ReduceOp.SUM, group: Any = None) -> torch.Tensor:
        """`tensor` reduced with `op` over `group` (default: all ranks); a copy, or the input itself alone."""
        if not is_distributed(group):
            return tensor
        out = tensor.detach().clone()
        dist.all_reduce(out, op=op, group=group)
        return out

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mean of `tensor` over the metrics domain (all ranks under plain DDP)."""
        return all_reduce_mean(tensor, group=self.topology.group("metrics"))

    def reduce_loss_for_logging(self, loss: torch.Tensor | None, loss_n: int | None) -> torch.Tensor | None:
        """Detached loss averaged over ranks, weighted by each rank's `loss_n` samples when given."""
        if loss is None:
            return None
        loss = loss.detach()
        if not is_distributed():
            return loss
        if loss_n is None:
            return self.reduce(loss)
        weighted = self.all_reduce(loss.float() * loss_n)
        total = self.all_reduce(torch.tensor(float(loss_n), device=loss.device))
        return weighted / total


def _label_range_message(runner: Any, pred: Any, target: Any, err: Exception) -> str:
    """Say which split and which range, when the criterion refused a class label (checked on error only)."""
    split = getattr(runner, "split", None)
    if not (isinstance(pred, torch.Tensor) and isinstance(target, torch.Tensor) and pred.ndim >= 2):
        return f"criterion {runner.criterion!r} failed on split {split!r}: {err}"
    classes = pred.shape[1]
    found = f"targets range from {int(target.min())} to {int(target.max())}" if target.numel() else "no targets"
    return (
        f"labels out of range on split {split!r}: the criterion {type(runner.criterion).__name__} accepts class "
        f"indices in [0, {classes - 1}] for predictions of {classes} classes, and the batch's {found} ({err})"
    )
