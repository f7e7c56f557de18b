"""One pass over a split: the per-batch loop every training, evaluation and inference loop runs.

[`PassEngine`][danling.runners.loop.passes.PassEngine] (the `passes` of a
[`Loop`][danling.runners.loop.loops.Loop]) iterates a loader, calls the step hook of the mode,
records losses on the device, paces logging, checkpoints, heartbeats and garbage collection,
and stops gracefully at an accumulation-window boundary when asked to. Optional services cost
nothing per batch when they are off: the pass looks them up once when it starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from itertools import islice
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from danling.distributed import all_reduce_any, is_distributed
from danling.distributed.collectives import _on_backend_device
from danling.metrics import AverageMeter
from danling.utils import RoundDict

from ..services.step_window import StepWindow
from ..services.watchdog import watch_runner
from ..update.spikes import LossSpike, RollbackRequest, TrainingDivergedError
from .budget import length_of
from .events import (
    EvaluationContext,
    EventBus,
    Events,
    FailureContext,
    PassContext,
    RunContext,
    StepContext,
    StepLogContext,
    StopContext,
)
from .host import LoopHost
from .mode import RunnerMode

__all__ = ["PassEngine"]

_FLOAT32_OVERFLOW = 2.0**128 - 2.0**103  # the float64 values from here up round to an infinite float32
_STOP_POLL_EVERY = 8  # batches between the cross-rank agreements on a stop request while training


class PassEngine:
    """The pass engine and the graceful-stop machinery of one runner.

    Built by [`Loop`][danling.runners.loop.loops.Loop] with the runner it drives (through the
    [`LoopHost`][danling.runners.loop.host.LoopHost] protocol), the event bus the passes are
    announced on, and `on_optimizer_step`: the loop's check for a periodic evaluation, called
    after each applied optimizer step of a step-mode training pass.
    """

    def __init__(self, host: LoopHost, events: EventBus, on_optimizer_step: Callable[[int], None]) -> None:
        self.host, self.events, self._on_optimizer_step = host, events, on_optimizer_step
        self.loop_depth = 0  # nesting of the loops under way (0: none); the outermost owns the run scope
        # A training pass is iterating its batches (its periodic evaluations included): `evaluate()`
        # and `infer()` called from a step hook then would reset its meters and leave eval mode on.
        self.in_training_batches = False
        self.training = False  # whether the outermost loop under way trains
        # A stop request was seen; the loop exits at the next accumulation-window boundary.
        self.stop_latched = False
        self._stop_polls = 0
        self._agrees = False  # whether the loop under way trains on several processes (ranks agree on stops)
        # A periodic evaluation ran out of `patience`: the step-mode training pass ends at this step.
        self.stopping_early = False
        self._seen_step = 0
        self.step_window = StepWindow()
        # Whether the last training pass called the backend's plain default step instead of `train_step`.
        self.fused_step = False
        # Wraps each training pass's step (`oom.policy`: the out-of-memory guard); None costs nothing per batch.
        self.step_guard: Callable[[Callable], Callable] | None = None
        # Inference batches done in this process: the progress the hang watchdogs see while `infer` runs.
        self.infer_batches = 0

    def run_split(
        self, split: str, mode: RunnerMode, *, budget: int | None = None, max_batches: int | None = None
    ) -> tuple[RoundDict, int]:
        """Iterate one split in `mode`; return its result and the number of batches consumed.

        The pass is announced with `PASS_START`/`PASS_END` (and `EVALUATION_START`/`EVALUATION_END`
        for evaluation passes); the end events fire even when the pass fails.
        """
        events = self.events
        length = length_of(self.host.dataloaders[split])
        if max_batches is not None:
            length = max_batches if length is None else min(length, max_batches)
        with events.pair(
            Events.PASS_START, Events.PASS_END, PassContext(self.host, split, mode.value, length)
        ) as context:
            if mode is RunnerMode.evaluate:
                with events.pair(
                    Events.EVALUATION_START, Events.EVALUATION_END, EvaluationContext(self.host, split)
                ) as evaluation:
                    result, batches = self._iterate_split(split, mode, budget=budget, max_batches=max_batches)
                    evaluation.result = result
            else:
                result, batches = self._iterate_split(split, mode, budget=budget, max_batches=max_batches)
            context.batches = batches
        return result, batches

    def _iterate_split(
        self, split: str, mode: RunnerMode, *, budget: int | None = None, max_batches: int | None = None
    ) -> tuple[RoundDict, int]:
        loader = self.host.dataloaders[split]
        length = length_of(loader)
        training = mode is RunnerMode.train
        self._open_pass(split, mode, training, length)
        if max_batches is not None:
            length = max_batches if length is None else min(length, max_batches)
        # Like the per-batch subscribers below, the readers of step logs are looked up once per pass:
        # when nobody reads them, the pass does not pace them at all.
        interval = self.host._log_interval_for(length) if self._step_logs_read(training) else 0
        state = self.host.train_state
        self._seen_step = state.global_step
        supervisor = self.host.supervisor
        # Per-batch subscribers (progress bar, heartbeat, yours) are looked up once per pass: with
        # none, a batch costs no event at all.
        observed = self.events.has_subscribers(Events.STEP_START) or self.events.has_subscribers(Events.STEP_END)
        track_progress = training and (budget is not None or supervisor.gc_interval is not None)
        # Inside a training loop (its evaluation passes included) ranks agree on a stop, so they stop
        # at the same batch; otherwise (evaluate() or infer() alone) the local flag answers.
        # The runner's check (`_stop_requested`, which a subclass may override) is asked after every batch.
        agree = self._agrees
        stop_poll = self.host._stop_requested
        # Batches that spiked before a rollback (empty and falsy without a spike guard), and the
        # watchdog (multi-process runs), told the phase of every batch.
        skipped, watchdog = self._spiked_batches() if training else None, supervisor.watchdog
        # A training pass nobody watches batch by batch may call the backend's plain default step instead
        # of `train_step` (the same work without the hook calls); the loop around it is the same.
        plain = self.host._plain_train_step() if training and not (observed or skipped or watchdog) else None
        if training:
            self.fused_step = plain is not None
        # The sampler's padding repeats (see `_repeated_tail`): on this rank, the index of the pass's last
        # batch, how many samples at its end are repeats and how many it holds; the metrics and the
        # loss leave the repeats out.
        repeated = None if training else _repeated_tail(loader)
        pace = (split, length, interval, track_progress, budget, stop_poll, agree, repeated)
        # An evaluation pass runs in one inference context (entering it per batch costs more than
        # some small models' forward passes); it is left before a stop saves its checkpoint.
        with nullcontext() if training else self.host.inference_context(), self._spike_scope(split):
            batches_in = islice(loader, max_batches)
            batches, ran_out = self._hooked_batches(batches_in, pace, training, observed, skipped, plain)
            if ran_out:
                self._pass_ran_out(agree and length is None, training)
        self._close_pass(training, budget)
        return self.host.collect_result(split), batches

    def _hooked_batches(
        self, batches_in: Iterable, pace: tuple, training: bool, observed: bool, skipped: Any, plain: Any = None
    ) -> tuple[int, bool]:
        """Run each batch through the step hook (`train_step`/`evaluate_step`) and pace the pass after it.

        Returns the number of batches run and whether the loader ran out (rather than a stop or the budget).
        """
        # Nothing reads a training step's output unless a subscriber watches the steps: the default step
        # may then let it go before its backward pass (see `TorchRunner.train_step`).
        self.host._step_output_unused = training and not observed
        inside, self.in_training_batches = self.in_training_batches, self.in_training_batches or training
        try:
            return self._run_hooked_batches(batches_in, pace, training, observed, skipped, plain)
        finally:
            self.host._step_output_unused = False
            self.in_training_batches = inside

    def _run_hooked_batches(
        self, batches_in: Iterable, pace: tuple, training: bool, observed: bool, skipped: Any, plain: Any
    ) -> tuple[int, bool]:
        split, length, interval, track_progress, budget, stop_poll, agree, repeated = pace
        last, tail, rows = repeated or (-1, 0, 0)
        # Looked up once per pass rather than once per batch; none of them is rebound by a step.
        meters, supervisor, update = self.host.meters, self.host.supervisor, self.host.update
        weigh = self.host.loss_weight
        state, position, watchdog = self.host.train_state, self.host.loop_state, supervisor.watchdog
        step = plain or (self.host.train_step if training else self.host.evaluate_step)
        if training and self.step_guard is not None:
            step = self.step_guard(step)
        phase = "forward" if training else "evaluation"
        batches, loss_meter = 0, None
        # A training pass resumed mid-way runs only the batches after its restored position: its end
        # (the pass's last step log, the stop agreement of its last batch) comes that many batches earlier.
        done = position.batch if training else 0
        end = None if length is None else length - done
        for data in batches_in:
            if watchdog is not None:
                watchdog.enter(phase, state.global_step)
            if batches == last:  # `update_metrics` drops the repeats at the end of this batch
                self.host._repeated_tail = tail
            if skipped and (split, state.epoch, position.batch) in skipped:
                loss = self._skip_spiked_batch(split, position.batch)
            elif observed:
                loss = self._observed_step(step, data, split, batches)
            else:
                _, loss = step(data)
            if batches == last:
                self.host._repeated_tail = 0
            if loss is not None:
                # Weighted by its samples, the pass's loss is the mean per sample, not per batch
                # (a short last batch would weigh as much as a full one).
                n = weigh(data) if batches != last else _own_weight(weigh, data, rows, tail)
                if loss_meter is None:
                    loss_meter = _loss_meter(meters)  # then updated directly: this runs every batch
                loss_meter.update(loss, n)
            batches += 1
            if watchdog is not None:
                watchdog.enter("data loading", state.global_step)  # until the next batch arrives
            if interval and (batches % interval == 0 or batches == end):
                self._log_step(split, done + batches, length, training)
            if training:
                position.batch += 1
                if track_progress and state.global_step != self._seen_step:
                    self._after_optimizer_progress(budget)  # may evaluate: after the step log
            # Without a poll the flag is read in place: one call less per batch.
            if self.stop_latched or (
                supervisor.stop_requested if stop_poll is None else self._stop_now(stop_poll, agree and batches == end)
            ):
                # Stop only at a window boundary: applying a partial window (or dropping its
                # gradients) would make the resumed run diverge from an uninterrupted one.
                self.stop_latched = True
                if not (training and update.pending):
                    return batches, False  # the stop after the pass shuts down
            if budget is not None and (state.global_step >= budget or self.stopping_early):
                return batches, False
        return batches, True

    def _open_pass(self, split: str, mode: RunnerMode, training: bool, length: int | None) -> None:
        """Reset the pass's meters and metrics; a training pass also sets the loop position and the windows.

        A training pass that continues a restored position (`loop_state.batch > 0`) takes back the
        running meters and train metrics its mid-pass checkpoint saved.
        """
        self.host.mode, self.host.split = mode, split
        self.host.meters.reset()
        self.step_window = StepWindow()  # step logs average the steps since the previous log of this pass
        if training:
            position = self.host.loop_state
            if position.split != split:
                position.batch = 0
            position.split = split
            self.host.update.start_pass(length)
        self.host._start_metrics(mode)
        if training:  # a pass a mid-pass checkpoint interrupted continues its averages; the rest start afresh
            self.host._continue_pass_meters(split)
        watchdog = self.host.supervisor.watchdog
        if watchdog is not None:
            watchdog.enter("data loading", self.host.train_state.global_step)

    def _close_pass(self, training: bool, budget: int | None) -> None:
        """Apply a window the pass left open, shut down on a latched stop, check the loss (`nonfinite.check`)."""
        if training and self.host._close_window():
            self._after_optimizer_progress(budget)
        if self.stop_latched:  # at a window boundary (the break above) or at the end of the pass
            self.shutdown()
        if training and self.host.update.watch_nonfinite_loss:
            self._check_pass_loss()  # before the pass's result (and the epoch's checkpoint) is kept

    def _check_pass_loss(self) -> None:
        """Stop the run when the pass's loss so far is not finite (`nonfinite.check=log`), agreed across ranks.

        Made at the end of a training pass and before a mid-pass checkpoint (one read of the running
        sum; the steps between stay free of host synchronisations). Weights that took a NaN update
        keep producing NaN losses, so a later check catches an earlier NaN too.
        """
        # Every rank takes part in the agreement, with or without a loss (a pipeline's first stages have none).
        meter = self.host.meters["loss"] if "loss" in self.host.meters else None  # noqa: SIM401 (no dict get)
        bad: Any = False
        if meter is not None:
            total = meter._sum
            if type(total) is torch.Tensor and not total.ndim and total.dtype is torch.float64:
                # The usual sum: one read, and the float32 check in Python (a float64 below
                # 2**128 - 2**103 rounds to a finite float32); five tensor ops cost more than a step.
                bad = not abs(total.item()) < _FLOAT32_OVERFLOW
            else:
                bad = ~torch.isfinite(torch.as_tensor(total, dtype=torch.float32)).all()
        if self._agrees:
            bad = all_reduce_any(torch.as_tensor(bad), group=self.host.topology.group("world"))
        if not bool(bad):
            return
        step = self.host.train_state.global_step
        raise TrainingDivergedError(
            f"the training loss of the {self.host.split} pass is not finite (global step {step}): updates "
            "with non-finite gradients reached the weights; stopping. Set skip_nonfinite_grad=True to skip such "
            "updates, or nonfinite.check=update to drop every non-finite update before it is applied"
        )

    def watch_phase(self, phase: str) -> None:
        """Tell the watchdog (when there is one) that this rank enters `phase`."""
        watchdog = self.host.supervisor.watchdog
        if watchdog is not None:
            watchdog.enter(phase, self.host.train_state.global_step)

    def inference_progress(self) -> None:
        """Count one inference batch done: inference moves no step, position or meter, so without this
        a watchdog that training started would end an `infer` that outlasts its timeout as hung."""
        self.infer_batches += 1
        self.watch_phase("inference")

    def _spiked_batches(self) -> set[tuple[str, int, int]] | None:
        guard = getattr(self.host.update, "spike_guard", None)
        return None if guard is None else guard.skipped_batches

    def _skip_spiked_batch(self, split: str, index: int) -> None:
        """Leave out a batch that spiked before a rollback: its micro-step adds no gradient."""
        epoch = self.host.train_state.epoch
        self.host.logger.warning(
            "skipping batch %d of %s in epoch %d: it spiked before a rollback", index, split, epoch
        )
        self.host.step()  # the window closes (and the schedule advances) where it would have

    @contextmanager
    def _spike_scope(self, split: str) -> Iterator[None]:
        """Name the batches of a spiking window on the [`LossSpike`][danling.runners.update.spikes.LossSpike]
        that leaves the pass (the current batch and those before it in the window)."""
        try:
            yield
        except LossSpike as spike:
            last, epoch = self.host.loop_state.batch, self.host.train_state.epoch
            spike.batches = [(split, epoch, index) for index in range(last - spike.micro_steps + 1, last + 1)]
            spike.step = self.host.train_state.global_step
            raise

    def _observed_step(self, step: Any, data: Any, split: str, index: int) -> Any:
        """Run one step between `STEP_START` and `STEP_END` (which fires with the error if the step fails)."""
        context = StepContext(self.host, split, index, self.host.train_state.global_step, data=data)
        with self.events.pair(Events.STEP_START, Events.STEP_END, context):
            _, loss = step(data)
            context.loss, context.global_step = loss, self.host.train_state.global_step
        return loss

    def _after_optimizer_progress(self, budget: int | None) -> None:
        """GC pacing and step-cadence checkpoints, once per applied optimizer step."""
        global_step = self.host.train_state.global_step
        if global_step == self._seen_step:
            return
        self._seen_step = global_step
        self.host.supervisor.gc_step(global_step)
        # The final step-mode evaluation and checkpoint are train_steps' own. An evaluation due
        # now runs first, so this step's checkpoint holds the weights its row scores.
        if budget is not None and global_step < budget:
            if self.host.update.watch_nonfinite_loss and self.host.checkpoint_manager.should_save(global_step):
                self._check_pass_loss()  # a checkpoint never holds weights a NaN loss went into
            self._on_optimizer_step(global_step)
            self.watch_phase("checkpoint save")
            self.host.save_checkpoint()

    def _step_logs_read(self, training: bool) -> bool:
        """Whether anyone reads step logs: an INFO log, a tracker or `LOG` subscriber (training), or
        the other ranks (under several processes the read is a collective every rank joins)."""
        return (
            self.host.logger.isEnabledFor(logging.INFO) or (training and self._log_listened()) or self.host.distributed
        )

    def _log_step(self, split: str, iteration: int, length: int | None, training: bool) -> None:
        to_log, to_track = self.host.logger.isEnabledFor(logging.INFO), training and self._log_listened()
        if not (to_log or to_track or self.host.distributed):
            # Nobody reads the values: skip the read, which synchronises with the device.
            return
        # The one place step values are read back: the mean over the steps since the previous log,
        # shown on the terminal and sent to the trackers alike.
        values = self.step_window.read(self.host.meters)
        if Events.STEP_LOG in self.events.subscribed:  # the straggler monitor (a collective); no call when off
            mode = "train" if training else "evaluate"
            context = StepLogContext(self.host, split, mode, values, self.host.train_state.global_step)
            self.events.emit(Events.STEP_LOG, context)
        if training and self.host.update.skipped_steps:  # every update dropped so far, NaN/inf or spike
            values["skipped"] = self.host.update.skipped_steps
        if training and self.host.ft is not None:  # TorchFT: replica groups in the latest quorum
            values["replicas"] = self.host.ft.replicas
        if to_log:
            self.host.logger.info(self.host.bookkeeping.format_step_result(values, split, iteration, length))
        if to_track and values:
            self.host.log_values({f"{split}_step": values.dict()})

    def _log_listened(self) -> bool:
        """Whether anyone records logged values: a tracker, or a `LOG` subscriber of the user's."""
        return len(self.host.trackers) > 0 or len(self.events.handlers(Events.LOG)) > 1

    def stop_requested(self) -> bool:
        """A stop request, agreed across ranks while training so that all of them stop at the same batch.

        The agreement is a collective, made every few batches to keep the hot path free of host
        synchronisations; outside training (evaluation or inference possibly run on one rank
        only) the local flag is used.
        """
        if not self._agrees:
            return self.host.supervisor.stop_requested
        self._stop_polls += 1
        if self._stop_polls % _STOP_POLL_EVERY:
            return False
        return self._agree_on_stop()

    def _pass_ran_out(self, ask: bool, training: bool) -> None:
        """The loader is exhausted: latch a stop the ranks agree on (`ask`: an unsized pass, whose
        end is only known here), else record that the training pass ran to its end."""
        if ask and not self.stop_latched and self._agree_on_stop():
            self.stop_latched = True
        elif training:
            self.host.loop_state.split, self.host.loop_state.batch = None, 0

    def _stop_now(self, stop_poll: Callable[[], bool] | None, at_end: bool) -> bool:
        """Whether a stop is requested after this batch (agreed across ranks while training).

        The last batch of a pass (`at_end`) always asks every rank, so a stop requested fewer
        than `_STOP_POLL_EVERY` batches before the end of a short pass is neither carried past
        it nor lost when the run ends first.
        """
        if stop_poll is None:
            return self.host.supervisor.stop_requested
        return stop_poll() or (at_end and self._agree_on_stop())

    def _agree_on_stop(self) -> bool:
        """Whether any rank has a stop request: a collective every rank of the world enters.

        A signal one rank received is adopted by the others, so every rank saves the same
        shutdown checkpoint and exits with the same status (143 after a SIGTERM to any of them).
        """
        supervisor = self.host.supervisor
        local = supervisor.exit_code if supervisor.signum is not None else int(supervisor.stop_requested)
        code = _max_across_ranks(local, self.host.topology.group("world"))
        if code and not supervisor.stop_requested:
            supervisor.request_stop(code - 128 if code > 128 else None)
            self.host.logger.warning("another rank asked to stop (exit code %d); stopping at the same step", code)
        return code > 0

    def refuse_inside_training(self, call: str) -> None:
        """Refuse `call` (`"evaluate()"`, `"infer()"`) from within a training pass's batches.

        Raises:
            RuntimeError: A training pass is under way (the call came from a step hook or event).
        """
        if self.in_training_batches:
            raise RuntimeError(
                f"{call} was called while a training pass runs (from a step hook or event?): it would reset "
                "the pass's meters and leave the model in evaluation mode for the rest of the pass; evaluate "
                "during training with evaluate_interval, or call it from an EPOCH_END handler or after train()"
            )

    @contextmanager
    def scope(self, *, training: bool, mode: RunnerMode | None = None) -> Iterator[None]:
        """Keep stop-signal handlers installed while a loop runs (outermost loop only).

        The outermost loop is announced with `RUN_START`/`RUN_END`; an exception leaving it is
        announced with `FAILURE` first.
        """
        depth = self.loop_depth
        if depth:
            yield
            return
        self.loop_depth = 1
        self.training = training
        # Settled once per loop (the process group does not change inside one): the stop check
        # after every batch then costs no query of the distributed state.
        self._agrees = training and is_distributed()
        self.host.supervisor.install_signal_handlers()
        watchdog = watch_runner(self.host) if training else self.host.supervisor.watchdog
        if watchdog is not None:
            watchdog.active = True
            self.host.update.watch(watchdog)
        mode = mode or (RunnerMode.train if training else RunnerMode.evaluate)
        try:
            with self.events.pair(Events.RUN_START, Events.RUN_END, RunContext(self.host, mode.value)):
                try:
                    if self.host._stop_requested():
                        self.shutdown()
                    yield
                    if training:
                        # the run's last checkpoint is on disk before it returns
                        self.host.checkpointing.finish_checkpoints()
                    self.host.bookkeeping.flush()  # a finished loop leaves its result files complete on disk
                except RollbackRequest:
                    raise  # not a failure: `train` rolls back and goes on
                except Exception as error:
                    self.events.emit(Events.FAILURE, FailureContext(self.host, error))
                    if training:
                        self.host.checkpointing.finish_checkpoints(failing=True)
                    raise
        finally:
            self.loop_depth = 0
            self.training = self._agrees = False
            if watchdog is not None:
                watchdog.active = False  # outside loops a rank is never judged stalled
                watchdog.enter("idle", self.host.train_state.global_step)
            if not getattr(self.host, "_closed", False):
                self.host.supervisor.restore_signal_handlers()

    def shutdown(self) -> NoReturn:
        """Save a `shutdown` checkpoint (when training), close the runner and exit.

        The training loops call it only at an accumulation-window boundary (a stop request that
        arrives inside a window lets the window finish first), with the loop position describing
        where the round stood, so a run resumed from the checkpoint ends exactly as an
        uninterrupted one. The exit status is 128 + the signal number, or 0 when the stop was
        requested in code (`supervisor.request_stop()`) rather than by a signal.
        """
        code = self.host.supervisor.exit_code
        reason = "signal" if code > 128 else "request"
        self.events.emit(Events.STOP_REQUESTED, StopContext(self.host, reason, code - 128 if code > 128 else None))
        state = self.host.train_state
        self.host.logger.warning(
            "stopping on request at epoch %d, global step %d (exit code %d)", state.epoch, state.global_step, code
        )
        if self.training:
            self.host.prepare_for_shutdown_checkpoint()
            self.watch_phase("checkpoint save")
            self.host.save_checkpoint(name="shutdown", force=True, save_best=False)
        self.host.supervisor.exiting_code = code  # from here on signals are ignored while it leaves with `code`
        self.host.close()
        raise SystemExit(code)


def _loss_meter(meters: Any) -> AverageMeter:
    """The `loss` meter of `meters`, created when the pass has none yet (a resumed pass has its own back)."""
    if "loss" not in meters:
        meters["loss"] = AverageMeter(device=meters.device)  # the collection gives it its group
    return meters["loss"]


def _own_weight(weigh: Callable[[Any], Any], data: Any, rows: int, tail: int) -> Any:
    """The loss weight of the last batch of a padded evaluation shard, whose last `tail` of `rows` samples are repeats.

    The repeats were counted with the samples themselves, so they add no weight: a batch of repeats
    only goes in with weight 0 (the meter still exists on every rank: reading it is collective). A
    weight that counts samples loses the repeats exactly; another one (tokens, say) their share.
    """
    if rows <= tail:
        return 0
    n = weigh(data)
    return n - tail if n == rows else n * (rows - tail) / rows


def _repeated_tail(loader: Any) -> tuple[int, int, int] | None:
    """Where an evaluation pass over `loader` meets samples its sampler repeated; `None` if it does not.

    A `DistributedSampler` without `drop_last` pads the dataset to a multiple of the ranks by
    repeating its first samples, so that every rank runs as many batches (the ranks of a sharded or
    pipelined model must run each forward pass together). Those repeats come last in a rank's share
    and the pass runs them, but counting them would weigh some samples twice in the metrics and the
    loss, so two ranks would report other values than one process. Returns the index of this rank's
    last batch, the number of repeats at its end, and the number of samples that batch holds.
    """
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last or getattr(sampler, "origin", None):
        return None
    dataset = length_of(sampler.dataset)
    if dataset is None:
        return None
    # This rank takes positions rank, rank + W, ... of the padded order; those from `dataset` on are repeats.
    own = len(range(sampler.rank, dataset, sampler.num_replicas))
    tail = sampler.num_samples - own
    batch_sampler = getattr(loader, "batch_sampler", None)
    batches, size = length_of(loader), getattr(batch_sampler, "batch_size", None)
    if tail <= 0 or not batches or not size:
        return None
    if getattr(batch_sampler, "drop_last", False) and sampler.num_samples % size:
        return None  # the partial last batch, repeats and all, is dropped
    return batches - 1, tail, sampler.num_samples - (batches - 1) * size


def _max_across_ranks(value: int, group: Any) -> int:
    """The largest `value` of the ranks of `group` (a collective when distributed)."""
    if not is_distributed(group):
        return value
    reduced = _on_backend_device(torch.tensor(value, dtype=torch.int32), group)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    return int(reduced)
