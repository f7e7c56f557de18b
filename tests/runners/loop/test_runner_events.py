"""The events a runner emits while it trains, evaluates and checkpoints, in order and when steps fail."""

from __future__ import annotations

import pytest
import torch

from danling.runners.loop import Events, on
from tests.runners._torch_toy import TinyRunner, tiny_config

_ALL = [value for name, value in vars(Events).items() if name.isupper()]


class Recording(TinyRunner):
    """Records every event it sees as `(name, detail)`."""

    n_train = 8

    def __init__(self, config):
        super().__init__(config)
        self.seen = []
        for event in _ALL:
            self.events.subscribe(event, lambda context, event=event: self.seen.append((event.name, _detail(context))))


def _detail(context):
    for field in ("split", "epoch", "mode", "name", "reason"):
        value = getattr(context, field, None)
        if value is not None:
            return value
    return None


def test_train_emits_nested_pairs_in_order(tmp_path):
    with Recording(tiny_config(tmp_path, epochs=1, **{"dataloader.batch_size": 4})) as runner:
        runner.train()
        names = [name for name, _ in runner.seen]
    assert names[0] == "run_start" and names[-1] == "run_end"
    epoch = names.index("epoch_start")
    assert names[epoch : epoch + 2] == ["epoch_start", "pass_start"]
    train_steps = [i for i, (name, detail) in enumerate(runner.seen) if name == "step_end" and detail == "train"]
    assert len(train_steps) == 2  # 8 samples, batches of 4
    evaluation = names.index("evaluation_start")
    assert names[evaluation - 1] == "pass_start" and names.index("evaluation_end") < names.index("epoch_end")
    assert names.index("log") < names.index("epoch_end")  # the epoch row goes to the trackers
    assert names.index("epoch_end") < names.index("checkpoint_saved") < names.index("run_end")
    for start, end in (("pass_start", "pass_end"), ("step_start", "step_end")):
        assert names.count(start) == names.count(end)


def test_a_failing_step_closes_every_open_pair_with_its_error(tmp_path):
    class Failing(Recording):
        def train_step(self, data):
            if self.train_state.micro_step == 1:
                raise RuntimeError("boom")
            return super().train_step(data)

    errors = {}

    with Failing(tiny_config(tmp_path, epochs=1)) as runner:
        for event in (Events.STEP_END, Events.PASS_END, Events.EPOCH_END, Events.RUN_END, Events.FAILURE):
            runner.events.subscribe(event, lambda context, event=event: errors.__setitem__(event.name, context.error))
        with pytest.raises(RuntimeError, match="boom"):
            runner.train()
    assert set(errors) == {"step_end", "pass_end", "epoch_end", "run_end", "failure"}
    assert all(isinstance(error, RuntimeError) and str(error) == "boom" for error in errors.values())
    names = [name for name, _ in runner.seen]
    assert names[-5:] == ["step_end", "pass_end", "epoch_end", "failure", "run_end"]


def test_marked_methods_subscribe_and_skipped_updates_are_announced(tmp_path):
    class Watching(TinyRunner):
        def __init__(self, config):
            super().__init__(config)
            self.skipped, self.epochs_seen = [], []
            criterion = self.criterion
            self.criterion = lambda pred, target: (
                criterion(pred, target)
                * (float("nan") if self.model.training and self.train_state.micro_step == 2 else 1.0)
            )

        @on(Events.OPTIMIZER_STEP_SKIPPED)
        def note_skip(self, context):
            self.skipped.append((context.global_step, context.skipped_steps))

        @on(Events.EPOCH_END)
        def note_epoch(self, context):
            self.epochs_seen.append((context.epoch, sorted(context.result)))

    with Watching(tiny_config(tmp_path, skip_nonfinite_grad=True)) as runner:
        runner.train()
    assert runner.skipped == [(2, 1)]
    assert runner.epochs_seen == [(0, ["train", "val"]), (1, ["train", "val"])]


def test_heartbeat_and_trackers_are_subscribers(tmp_path):
    with TinyRunner(tiny_config(tmp_path, **{"heartbeat.enabled": True})) as runner:
        assert runner.events.has_subscribers(Events.STEP_END)  # the heartbeat beats per batch
    with TinyRunner(tiny_config(tmp_path / "quiet")) as runner:
        assert not runner.events.has_subscribers(Events.STEP_END)  # no TTY in tests: no progress bar either
        assert runner.events.has_subscribers(Events.LOG)
        logged = []
        runner.events.subscribe(Events.LOG, lambda context: logged.append((context.step, sorted(context.values))))
        runner.train()
    assert (runner.train_state.global_step, ["epoch", "train", "val"]) in logged
    assert torch.is_tensor(runner.meters["loss"].avg) or runner.meters["loss"].avg is not None


def test_evaluate_or_infer_from_a_step_hook_is_refused_and_from_an_epoch_end_handler_runs(tmp_path):
    # From a step hook, evaluate() reset the pass's running meters and left the model in eval mode
    # (dropout off) for the rest of the training pass, silently.
    for call in ("evaluate", "infer"):
        with TinyRunner(tiny_config(tmp_path / call, epochs=1)) as runner:
            runner.events.subscribe(Events.STEP_END, lambda context, runner=runner, call=call: getattr(runner, call)())
            with pytest.raises(RuntimeError, match=rf"{call}\(\) was called while a training pass runs"):
                runner.train()
    scores = []
    with TinyRunner(tiny_config(tmp_path / "epoch-end", epochs=2)) as runner:
        runner.events.subscribe(
            Events.EPOCH_END, lambda context: scores.append(runner.evaluate(["val"])["val"]["loss"])
        )
        runner.train()
        assert len(scores) == 2 and all(score > 0 for score in scores)
