"""Inference into files survives SIGKILL: a restarted `infer(split, output=...)` ends byte-identical to a clean run.

`_infer_child.py` writes every sink's output and SIGKILLs itself at a batch the test picks from a
seed; the test then calls `infer` again with the same paths and compares the files byte for byte
with an uninterrupted run's. The dataset (37 examples) is not divisible by the 2 DDP ranks.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from danling.runners import Events
from tests.dist import free_ports, run_distributed
from tests.runners._infer_child import LENGTH, InferRunner, infer_config, outputs

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
BATCHES = 10  # per rank and pass, at most (19 examples on a rank of 2, 2 per batch)


def _infer_all(root: Path, events: list | None = None, **overrides) -> None:
    with InferRunner(infer_config(root / "workspace", **overrides)) as runner:
        if events is not None:
            runner.events.subscribe(Events.INFERENCE_RESUMED, lambda context: events.append(context.batches))
        for output in outputs(root):
            assert runner.infer("infer", output=output) == output


def _kill_plan(seed: int) -> tuple[int, int]:
    rng = random.Random(seed)
    return seed % len(outputs(Path("."))), rng.randint(1, BATCHES)


def _child_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT", "RANK")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)
    return env


def _assert_same_files(reference: Path, resumed: Path) -> None:
    for ref, out in zip(outputs(reference), outputs(resumed)):
        assert out.read_bytes() == ref.read_bytes(), f"{out.name} differs from the uninterrupted run"


# Seeds 0, 4 and 5 kill JSON Lines, NumPy and Parquet after a few commits; 1 before the first commit.
@pytest.mark.parametrize("seed", [0, 1, 4, 5])
def test_sigkilled_inference_resumes_byte_identical(tmp_path, seed):
    target, kill_at = _kill_plan(seed)
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    _infer_all(reference)
    command = [sys.executable, "-m", "tests.runners._infer_child", str(killed), str(target), str(kill_at)]
    proc = subprocess.run(command, cwd=REPO, env=_child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    events: list[int] = []
    _infer_all(killed, events)
    _assert_same_files(reference, killed)
    committed = (kill_at - 1) // 3 * 3  # batches covered by the last record before the kill
    assert events == ([committed] if committed else [])
    lines = outputs(killed)[0].read_text().splitlines()
    assert len(lines) == LENGTH and np.allclose(np.load(outputs(killed)[1]), [json.loads(x) for x in lines])


def test_a_sigterm_commits_the_batch_in_progress_and_the_rerun_writes_each_row_once(tmp_path):
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    _infer_all(reference)
    command = [sys.executable, "-m", "tests.runners._infer_child", str(stopped), "0", "5", "SIGTERM"]
    proc = subprocess.run(command, cwd=REPO, env=_child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    # inference saves no checkpoint: the log must not promise one
    assert "received SIGTERM; finishing the current step, then stopping" in proc.stderr, proc.stderr[-3000:]
    assert "then saving a checkpoint" not in proc.stderr
    record = json.loads((stopped / "out.jsonl.progress" / "rank-0.json").read_text())
    assert (record["current"]["batches"], record["done"]) == (5, False)  # batch 5 is committed, not lost
    events: list[int] = []
    _infer_all(stopped, events)
    assert events == [5]
    _assert_same_files(reference, stopped)


def test_an_output_of_other_weights_is_kept_aside_and_written_anew_with_one_warning(tmp_path, caplog):
    command = [sys.executable, "-m", "tests.runners._infer_child", str(tmp_path), "0", "5"]
    proc = subprocess.run(command, cwd=REPO, env=_child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    output = outputs(tmp_path)[0]
    partial = output.read_bytes()
    with caplog.at_level(logging.WARNING), InferRunner(infer_config(tmp_path / "workspace")) as runner:
        runner.model[0].weight.data.add_(1e-3)  # what more training does
        runner.infer("infer", output=output)
        assert len(output.read_text().splitlines()) == LENGTH  # a whole output of the current weights
        runner.model[0].weight.data.add_(1e-3)
        runner.infer("infer", output=output)  # a complete output of other weights: the same
    kept = sorted(output.parent.glob(f"{output.name}.weights-*"))
    assert len(kept) == 2 and partial in [(directory / output.name).read_bytes() for directory in kept]
    warnings = [r for r in caplog.records if "was written by other weights" in r.getMessage()]
    assert len(warnings) == 2 and all(r.levelno == logging.WARNING for r in warnings)


def test_changed_data_is_refused_on_resume(tmp_path):
    command = [sys.executable, "-m", "tests.runners._infer_child", str(tmp_path), "0", "5"]
    proc = subprocess.run(command, cwd=REPO, env=_child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    output = outputs(tmp_path)[0]

    class Longer(InferRunner):
        length = LENGTH + 1

    with Longer(infer_config(tmp_path / "workspace")) as runner:
        with pytest.raises(ValueError, match="dataset length changed from 37 to 38"):
            runner.infer("infer", output=output)
        runner.infer("infer", output=output, resume=False)  # starting over is allowed
    assert len(output.read_text().splitlines()) == LENGTH + 1


def test_an_output_written_with_a_step_limit_is_not_taken_for_the_whole_split(tmp_path):
    output = tmp_path / "out.jsonl"
    with InferRunner(infer_config(tmp_path / "workspace")) as runner:
        runner.infer("infer", output=output, steps=2)  # a smoke test: 2 batches of 2
        assert len(output.read_text().splitlines()) == 4
        with pytest.raises(ValueError, match=r"written with steps=2; this call asks for steps=None"):
            runner.infer("infer", output=output)  # not "complete already" with 4 of 37 rows
        runner.infer("infer", output=output, resume=False)
        assert len(output.read_text().splitlines()) == LENGTH
        runner.infer("infer", output=output, steps=100)  # past the end: the same whole output
        with pytest.raises(ValueError, match=r"written with steps=None; this call asks for steps=2"):
            runner.infer("infer", output=output, steps=2)
    assert len(output.read_text().splitlines()) == LENGTH


@pytest.mark.parametrize("suffix", [".jsonl", ".npy"])
def test_an_infer_step_that_returns_no_list_is_named_in_one_line(tmp_path, suffix):
    class Columns(InferRunner):
        def infer_step(self, data):
            return {"score": data[0].sum(-1)}  # one dict per batch, not one output per example

    class Batch(InferRunner):
        def infer_step(self, data):
            return data[0].sum(-1)

    for runner_type, name in ((Columns, "dict"), (Batch, "Tensor")):
        with runner_type(infer_config(tmp_path / "workspace")) as runner:
            message = f"infer_step must return a list with one output per example .*got {name} on batch 0"
            with pytest.raises(TypeError, match=message):
                runner.infer("infer", output=tmp_path / f"{name}{suffix}")


def test_a_completed_output_that_was_deleted_is_written_again(tmp_path, caplog):
    class Fields(InferRunner):
        def infer_step(self, data):
            return [{"score": value, "half": value / 2} for value in super().infer_step(data)]

    with Fields(infer_config(tmp_path / "workspace")) as runner:
        for output, files in (
            (tmp_path / "out.jsonl", [tmp_path / "out.jsonl"]),
            (tmp_path / "out.npy", [tmp_path / "out.score.npy", tmp_path / "out.half.npy"]),
        ):
            runner.infer("infer", output=output)
            written = [path.read_bytes() for path in files]
            for path in files:
                path.unlink()  # to have it written again
            with caplog.at_level(logging.WARNING):
                assert runner.infer("infer", output=output) == output  # was "complete already", and no file
            assert [path.read_bytes() for path in files] == written
            assert any("was complete but is gone" in r.getMessage() for r in caplog.records)
            caplog.clear()
            runner.infer("infer", output=output)  # present and complete: nothing to do, no warning
            assert not any("is gone" in r.getMessage() for r in caplog.records)


def _ddp_resume_worker(rank: int, world_size: int, roots: list[str]) -> dict[str, list[int]]:
    resumed: dict[str, list[int]] = {}
    for root in roots:
        _infer_all(Path(root), resumed.setdefault(root, []))
    return resumed


@pytest.mark.distributed
def test_sigkilled_two_rank_ddp_inference_resumes_byte_identical(tmp_path):
    seeds = [3, 4, 5]  # one per sink; on rank 1 the kill lands inside a commit (see _infer_child)
    for seed in seeds:
        target, kill_at = _kill_plan(seed)
        port = free_ports(1)[0]
        env = _child_env(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE="2")
        command = [sys.executable, "-m", "tests.runners._infer_child", str(tmp_path / f"s{seed}"), str(target)]
        procs = [
            subprocess.Popen(
                [*command, str(kill_at)],
                cwd=REPO,
                env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        errors = [proc.communicate(timeout=180)[1] for proc in procs]
        assert [proc.returncode for proc in procs] == [-signal.SIGKILL] * 2, errors[0][-2000:] + errors[1][-2000:]
    roots = [str(tmp_path / "reference"), *(str(tmp_path / f"s{seed}") for seed in seeds)]
    resumed = run_distributed(_ddp_resume_worker, roots, world_size=2, init_process_group=False)
    # seed 5: rank 0 committed batch 9, rank 1 died inside that commit (holding 6): both go back to 6
    assert [by_rank[str(tmp_path / "s5")] for by_rank in resumed] == [[6], [6]]
    # seeds 3 and 4: rank 1 died inside the first commit, so both start over (no resume event)
    assert all(by_rank[str(tmp_path / f"s{seed}")] == [] for seed in (3, 4) for by_rank in resumed)
    for seed in seeds:
        _assert_same_files(tmp_path / "reference", tmp_path / f"s{seed}")
    # the shards were merged into dataset order, the padding dropped: the single-process values
    single = tmp_path / "single"
    _infer_all(single)
    merged = [json.loads(line) for line in outputs(tmp_path / "reference")[0].read_text().splitlines()]
    alone = [json.loads(line) for line in outputs(single)[0].read_text().splitlines()]
    assert len(merged) == LENGTH and np.allclose(merged, alone)
    assert np.allclose(np.load(outputs(tmp_path / "reference")[1]), alone)
    leftovers = sorted(p.name for p in (tmp_path / "reference" / "out.jsonl.progress").iterdir())
    assert leftovers == ["complete.json", "rank-0.json", "rank-1.json"]


def _pipeline_worker(rank: int, world_size: int, root: str) -> dict:
    from tests.runners._pipeline_runner import PipelinedRunner, runner_config

    options = {
        "parallel.axes.pipeline": 2,
        "parallel.module_fqns_per_model_part": [["inp", "layers.0", "layers.1"], ["layers.2", "layers.3", "head"]],
        "inference.progress_interval": 1,
    }
    with PipelinedRunner(runner_config(root, **options)) as runner:
        expected = runner.infer("infer")  # in memory, the same list on both stages
        path = runner.infer("infer", output=Path(root) / "pipeline.jsonl")
        record = json.loads((Path(root) / "pipeline.jsonl.progress" / f"rank-{rank}.json").read_text())
        return {
            "path": str(path),
            "expected": expected,
            "writes": record["writes"],
            "last": runner.pipeline_has_last_stage,
        }


@pytest.mark.distributed
def test_pipeline_inference_is_written_by_the_last_stage_only(tmp_path):
    results = run_distributed(_pipeline_worker, str(tmp_path), world_size=2, init_process_group=False)
    assert [(r["writes"], r["last"]) for r in results] == [(False, False), (True, True)]
    assert results[0]["path"] == results[1]["path"] == str(tmp_path / "pipeline.jsonl")
    written = [json.loads(line) for line in (tmp_path / "pipeline.jsonl").read_text().splitlines()]
    assert len(written) == 6 and np.allclose(written, results[1]["expected"])
    assert sorted(p.name for p in (tmp_path / "pipeline.jsonl.progress").iterdir()) == [
        "complete.json",
        "rank-0.json",
        "rank-1.json",
    ]


def _deepspeed_worker(rank: int, world_size: int, root: str) -> str:
    from tests.runners._deepspeed_toy import Regression, ds_config

    for stage in (2, 3):
        with Regression(ds_config(root, f"s{stage}", stage=stage, **{"inference.progress_interval": 1})) as runner:
            expected = runner.infer("val")
            output = runner.infer("val", output=Path(root) / f"zero{stage}.jsonl")
            written = [json.loads(line) for line in output.read_text().splitlines()]
            assert len(written) == 8 and np.allclose(written, expected, rtol=1e-6), (written, expected)
    return "ok"


@pytest.mark.distributed
def test_deepspeed_inference_writes_the_merged_file(tmp_path):
    pytest.importorskip("deepspeed")
    results = run_distributed(_deepspeed_worker, str(tmp_path), world_size=2, init_process_group=False)
    assert results == ["ok", "ok"]


def test_a_stop_request_commits_then_exits_and_the_rerun_completes(tmp_path):
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    _infer_all(reference)
    output = outputs(stopped)[0]
    with InferRunner(infer_config(stopped / "workspace")) as runner:
        original = runner.infer_step

        def stop_at_five(data):
            if runner.calls == 4:
                runner.supervisor.request_stop()  # as SIGTERM's handler does; batch 5 still completes
            runner.calls += 1
            return original(data)

        runner.calls = 0
        runner.infer_step = stop_at_five
        with pytest.raises(SystemExit) as stop:
            runner.infer("infer", output=output)
    assert stop.value.code == 0
    record = json.loads((stopped / "out.jsonl.progress" / "rank-0.json").read_text())
    assert (record["current"]["batches"], record["current"]["rows"], record["done"]) == (5, 10, False)
    events: list[int] = []
    _infer_all(stopped, events)
    assert events == [5]
    _assert_same_files(reference, stopped)
