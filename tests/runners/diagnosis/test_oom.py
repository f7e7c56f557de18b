"""`oom.policy` in one process: off costs nothing, both policies, where the error lands, limits and bad settings."""

from __future__ import annotations

import logging
from collections import namedtuple

import pytest
import torch

from danling.runners import Events, RunnerConfig
from danling.runners.diagnosis import OutOfMemoryAbort, OutOfMemoryGuard, is_out_of_memory, split_micro_batch
from danling.runners.update import UpdateStrategy
from danling.runners.update.strategy import TorchUpdateStrategy
from tests.runners._torch_toy import model_state, tiny_config
from tests.runners.diagnosis._oom_toy import OomRunner


def _train(root, *, fail=(), fail_backward=(), fits=2, optimizer_fails=(), **settings) -> dict:
    config = tiny_config(root, epochs=1, log_interval=1, **settings)
    out: dict = {}
    with OomRunner(config, fail=set(fail), fits=fits, rank_out=0, fail_backward=set(fail_backward)) as runner:
        runner.logger.setLevel(logging.ERROR)
        seen, logs = [], []
        runner.events.subscribe(Events.OUT_OF_MEMORY, lambda c: seen.append((c.phase, c.action, c.pieces, c.count)))
        runner.events.subscribe(Events.LOG, lambda c: logs.append(dict(c.values.get("train_step", {}))))
        if optimizer_fails:
            _fail_optimizer(runner.optimizer, set(optimizer_fails))
        try:
            runner.train()
        except (OutOfMemoryAbort, torch.OutOfMemoryError) as error:
            out["error"] = error
        out.update(
            weights=model_state(runner),
            step=runner.train_state.global_step,
            skipped=runner.update.skipped_steps,
            seen=seen,
            logs=logs,
        )
    return out


def _fail_optimizer(optimizer, calls: set[int]) -> None:
    step, count = optimizer.step, [0]

    def failing_step(*args, **kwargs):
        count[0] += 1
        if count[0] in calls:
            raise torch.OutOfMemoryError("CUDA out of memory (injected in the optimizer step)")
        return step(*args, **kwargs)

    optimizer.step = failing_step


def _same(first: dict, second: dict) -> bool:
    return all(torch.allclose(first[name], second[name], atol=1e-6) for name in first)


def test_off_by_default_subscribes_and_wraps_nothing(tmp_path):
    with OomRunner(tiny_config(tmp_path)) as runner:
        assert runner.diagnosis.oom is None and runner.loop.passes.step_guard is None
        assert not runner.events.has_subscribers(Events.OUT_OF_MEMORY)
        assert not runner.events.has_subscribers(Events.STEP_LOG)


def test_both_policies_survive_a_forward_out_of_memory(tmp_path):
    plain = _train(tmp_path / "plain")
    assert plain["step"] == 8  # 32 samples, batch 4

    split = _train(tmp_path / "split", fail={3}, **{"oom.policy": "split"})
    assert split["step"] == 8 and split["seen"] == [("forward", "split", 2, 1)] and "error" not in split
    assert _same(split["weights"], plain["weights"])  # the losses of the halves weigh half each
    assert split["logs"][2]["oom"] == 1 and "oom" not in split["logs"][1]  # the step log carries the count

    skip = _train(tmp_path / "skip", fail={3}, **{"oom.policy": "skip"})
    assert skip["step"] == 7 and skip["skipped"] == 1 and skip["seen"] == [("forward", "skipped", 0, 1)]


def test_a_backward_out_of_memory_is_split_when_it_opened_its_window_else_its_update_is_dropped(tmp_path):
    plain = _train(tmp_path / "plain", accum_steps=2)
    # Micro-batch 3 opens the second window: its partial gradients are all the window holds, so it runs again.
    opened = _train(tmp_path / "opened", fail_backward={3}, accum_steps=2, **{"oom.policy": "split"})
    assert opened["seen"] == [("backward", "split", 2, 1)] and _same(opened["weights"], plain["weights"])
    # Micro-batch 4 closes it: the partial backward spoilt micro-batch 3's gradients too.
    spoilt = _train(tmp_path / "spoilt", fail_backward={4}, accum_steps=2, **{"oom.policy": "split"})
    assert spoilt["seen"] == [("backward", "skipped", 0, 1)] and spoilt["step"] == 3 and spoilt["skipped"] == 1


def test_an_out_of_memory_in_the_optimizer_step_stops_the_run(tmp_path):
    out = _train(tmp_path / "update", optimizer_fails={2}, **{"oom.policy": "skip"})
    assert isinstance(out["error"], OutOfMemoryAbort) and out["step"] == 1
    assert "in the optimizer step at global step 1: the update may be partly applied" in str(out["error"])
    assert out["seen"] == [("optimizer step", "stopped", 0, 1)]


def test_repeated_errors_and_pieces_that_never_fit_stop_the_run_with_the_counts(tmp_path):
    repeated = _train(tmp_path / "repeated", fail=set(range(2, 40)), **{"oom.policy": "skip"})
    message = str(repeated["error"])
    assert "4 in a row (oom.max_consecutive=3)" in message and "4 out-of-memory errors in this run" in message
    assert "4 updates skipped" in message and repeated["step"] == 1

    never = _train(tmp_path / "never", fail=set(range(1, 40)), fits=0, **{"oom.policy": "split", "oom.max_splits": 1})
    assert "cannot be split further (oom.max_splits=1)" in str(never["error"])
    assert [seen[1] for seen in never["seen"]] == ["split", "stopped"] and never["step"] == 0


def test_other_errors_pass_through_the_guard(tmp_path):
    config = tiny_config(tmp_path, epochs=1, **{"oom.policy": "split"})
    with OomRunner(config) as runner:
        runner.criterion = lambda pred, target: (_ for _ in ()).throw(ValueError("not a memory error"))
        with pytest.raises(ValueError, match="not a memory error"):
            runner.train()


def test_out_of_memory_errors_are_told_from_others():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert is_out_of_memory(RuntimeError("MPS backend out of memory (MPS allocated: 8 GB)"))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(MemoryError())


def test_a_batch_is_split_along_its_samples_keeping_its_shape():
    Pair = namedtuple("Pair", "input target")
    batch = [Pair(torch.arange(6).view(3, 2), torch.arange(3)), {"mask": torch.ones(3), "name": "x"}, torch.tensor(7)]
    (first, share), (second, other) = split_micro_batch(batch, 2)
    assert (share, other) == (2 / 3, 1 / 3) and isinstance(first[0], Pair)
    assert first[0].input.tolist() == [[0, 1], [2, 3]] and second[0].target.tolist() == [2]
    assert first[1]["name"] == "x" and second[1]["mask"].shape == (1,) and first[2] is batch[2]
    with pytest.raises(ValueError, match="a batch of 1 sample"):
        split_micro_batch(torch.ones(1, 4), 2)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("policy", "halve", "oom.policy must be one of skip, split (or None: off), got 'halve'"),
        ("max_consecutive", 0, "oom.max_consecutive must be an integer >= 1, got 0"),
        ("max_splits", -2, "oom.max_splits must be an integer >= 1, got -2"),
    ],
)
def test_bad_settings_are_refused_by_name(key, value, message):
    pattern = message.replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(ValueError, match=pattern):
        RunnerConfig(**{"oom.policy": "split", f"oom.{key}": value})  # as the config is validated
    config = RunnerConfig(**{"oom.policy": "split"}).oom
    setattr(config, key, value)  # changed after validation: the guard checks again when built
    with pytest.raises(ValueError, match=pattern):
        OutOfMemoryGuard(config, TorchUpdateStrategy())


def test_an_update_strategy_it_cannot_watch_is_refused():
    config = RunnerConfig(**{"oom.policy": "skip"}).oom
    with pytest.raises(ValueError, match="oom.policy needs the torch update strategy .*, not UpdateStrategy"):
        OutOfMemoryGuard(config, UpdateStrategy())


def test_an_error_in_a_backward_that_all_reduces_is_raised_with_the_reason(caplog):
    # As on two ranks under DDP (the agreement stubbed: every other rank fine so far), on the micro-batch
    # that closes its window: the others are inside the gradient all-reduce, which no agreement can reach.
    guard = OutOfMemoryGuard(RunnerConfig(**{"oom.policy": "split"}).oom, TorchUpdateStrategy(), world_size=2)
    guard._agrees, guard._any = True, lambda code: False

    def step(data):
        guard.enter("backward", 0)
        guard._syncing = True  # what the mark sets when the model's backward all-reduces (DDP)
        raise torch.OutOfMemoryError("CUDA out of memory")

    with caplog.at_level(logging.ERROR, logger="danling.runners"), pytest.raises(torch.OutOfMemoryError):
        guard.guarded(step)(torch.ones(4, 2))
    assert "inside a backward pass that all-reduces gradients (DDP)" in caplog.text
    assert guard.count == 0 and guard._at == 0
