"""The terminal: a progress bar that says where training stands, and log lines that never tear it."""

from __future__ import annotations

import logging
import re
import sys

from danling.runners.loop.events import EventBus, Events, PassContext, StepContext
from danling.runners.services.progress_bar import ProgressBar, describe
from tests.runners._torch_toy import TinyRunner, tiny_config


def test_progress_bar_shows_epoch_loss_and_learning_rate(tmp_path, capsys):
    with TinyRunner(tiny_config(tmp_path, epochs=3)) as runner:
        bus = EventBus()
        bar = ProgressBar(file=sys.stderr, mininterval=0, miniters=1).attach(bus)
        bus.emit(Events.PASS_START, PassContext(runner, "train", "train", length=5))
        for index in range(5):
            bus.emit(Events.STEP_END, StepContext(runner, "train", index, index, loss=0.25))
        text = capsys.readouterr().err
        assert "train epoch 1/3" in text and "loss=0.25" in text and "lr=0.01" in text
        runner.config.steps, runner.config.epochs = 40, None
        bus.emit(Events.PASS_START, PassContext(runner, "train", "train", length=5))
        assert "train step 0/40" in capsys.readouterr().err
        bus.emit(Events.PASS_END, PassContext(runner, "train", "train"))
        assert bar.bar is None


def test_an_evaluation_after_training_is_titled_with_the_last_epoch(tmp_path):
    titles = []
    with TinyRunner(tiny_config(tmp_path, epochs=2)) as runner:
        runner.events.subscribe(Events.PASS_START, lambda context: titles.append(describe(context)))
        runner.train()
        runner.evaluate()
    assert titles == ["train epoch 1/2", "val epoch 1/2", "train epoch 2/2", "val epoch 2/2", "val epoch 2/2"]


def test_log_lines_are_written_above_an_open_bar_and_multi_line_records_prefix_every_line(tmp_path, capsys):
    with TinyRunner(tiny_config(tmp_path, epochs=3)) as runner:
        assert any(type(h).__name__ == "_StderrHandler" for h in runner.logger.handlers)
        bus = EventBus()
        ProgressBar(file=sys.stderr, mininterval=0, miniters=1).attach(bus)
        bus.emit(Events.PASS_START, PassContext(runner, "train", "train", length=5))
        bus.emit(Events.STEP_END, StepContext(runner, "train", 0, 0, loss=0.5))
        runner.logger.setLevel(logging.INFO)
        runner.logger.info("first line\nsecond line")
        text = capsys.readouterr().err
    # every segment between line breaks / carriage returns that holds a message starts with its own header
    segments = [segment.strip() for segment in re.split(r"[\r\n]", text) if "line" in segment]
    header = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \| INFO +\| rank 0 \| danling \| "
    assert [re.sub(header, "", segment) for segment in segments] == ["first line", "second line"]
    assert all(re.match(header, segment) for segment in segments)
