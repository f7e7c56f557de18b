"""Elastic data-parallel resume: a run SIGKILLed mid-epoch on N ranks continues on M ranks.

`_elastic_child.py` trains 2 ranks (and 1 rank with `accum_steps=2`) to step 3 of 6 in the first
epoch, checkpoints, and kills them at step 4; then resumes those checkpoints on 1, 3 and 2 ranks
(file and DCP backends). Every micro-batch's sample indices are recorded, so coverage is exact:
the resumed epoch trains each sample the checkpointed part did not, once, and the next epoch
trains every sample once. Where the global batch can be kept (2 ranks -> 1 rank x accum 2,
1 rank x accum 2 -> 2 ranks) the final weights match the uninterrupted 2-rank run; 2 -> 3 cannot
keep it and says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from danling.data import DataResumeError, ResumableSampler, build_dataloader, loader_global_state
from tests.dist import free_ports
from tests.runners._torch_toy import TinyRunner, tiny_config

_REPO = Path(__file__).resolve().parents[3]
N_TRAIN, SAVE_AT = 24, 3


def _launch(root: Path, phase: str, world_size: int) -> list[dict]:
    ports = ",".join(map(str, free_ports(24)))
    procs = []
    for rank in range(world_size):
        env = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
        env.update(PYTHONPATH=str(_REPO), OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank))
        env["WORLD_SIZE"] = str(world_size)
        command = [sys.executable, "-m", "tests.runners._elastic_child", "--root", str(root), "--phase", phase]
        procs.append(subprocess.Popen([*command, "--ports", ports], cwd=_REPO, env=env))
    for proc in procs:
        assert proc.wait(timeout=240) == 0, f"the elastic child failed; logs are in {root}"
    return [json.loads((root / f"status-{phase}-rank{rank}.json").read_text()) for rank in range(world_size)]


def _samples(root: Path, scenario: str) -> list[tuple[int, int, list[int]]]:
    rows = []
    for path in sorted((root / scenario).glob("samples-rank*.jsonl")):
        rows += [tuple(json.loads(line)) for line in path.read_text().splitlines()]
    return rows


def _final(root: Path, scenario: str, rank: int = 0) -> dict:
    return torch.load(root / scenario / f"final-rank{rank}.pt", weights_only=False)


def _check_coverage(root: Path, killed: str, resumed: str) -> None:
    """Epoch 0: the checkpointed prefix plus the resumed rest is every sample once; epoch 1: every sample once."""
    before = [i for epoch, step, batch in _samples(root, killed) if step < SAVE_AT for i in batch if epoch == 0]
    after = _samples(root, resumed)
    assert all(step >= SAVE_AT for _, step, _ in after)  # nothing before the checkpoint was trained again
    rest = [i for epoch, _, batch in after if epoch == 0 for i in batch]
    assert len(before) == N_TRAIN // 2 and not set(before) & set(rest), (before, rest)
    assert Counter(before + rest) == Counter(range(N_TRAIN)), (before, rest)
    assert Counter(i for epoch, _, batch in after if epoch == 1 for i in batch) == Counter(range(N_TRAIN))


def _assert_close(reference: dict, other: dict) -> None:
    for key, value in reference["model"].items():
        torch.testing.assert_close(other["model"][key], value, rtol=1e-5, atol=1e-6, msg=f"{key} differs")


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_on_another_number_of_ranks_keeps_samples_and_weights(tmp_path):
    for status in _launch(tmp_path, "kill", 2):
        expected = {"clean": "exit 0", "kill-file": "SIGKILL", "kill-dcp": "SIGKILL", "kill-one": "SIGKILL"}
        assert {key: status[key] for key in status} == {key: expected[key] for key in status}, status
    statuses = _launch(tmp_path, "resume", 3)
    assert all(value == "exit 0" for status in statuses for value in status.values()), statuses

    clean = _final(tmp_path, "clean")
    assert clean["global_step"] == 12
    for resumed, killed in [("file-on-1", "kill-file"), ("dcp-on-1", "kill-dcp"), ("one-on-2", "kill-one")]:
        _check_coverage(tmp_path, killed, resumed)
        final = _final(tmp_path, resumed)
        # The global batch is kept: 2 ranks x 1 <-> 1 rank x 2 micro-batches per update.
        assert (final["start"], final["global_step"]) == (SAVE_AT, 12)
        assert final["accum_steps"] == (2 if resumed.endswith("on-1") else 1)
        _assert_close(clean, final)
        assert not [m for m in final["warnings"] if "global batch" in m], final["warnings"]
    for resumed, killed in [("file-on-3", "kill-file"), ("dcp-on-3", "kill-dcp")]:
        _check_coverage(tmp_path, killed, resumed)
        finals = [_final(tmp_path, resumed, rank) for rank in range(3)]
        # 12 samples left: 2 updates of 3 x 2; then 4 updates per epoch of 24.
        assert [(final["start"], final["global_step"], final["accum_steps"]) for final in finals] == [(3, 9, 1)] * 3
        warned = [m for m in finals[0]["warnings"] if "global batch changes from 4 to 6 samples" in m]
        assert len(warned) == 1, finals[0]["warnings"]
        for final in finals[1:]:
            _assert_close(finals[0], final)


class _Indices(torch.utils.data.Dataset):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def _loaders(size: int, world_size: int, config: dict) -> list:
    return [
        build_dataloader(
            _Indices(size), split="train", config=config, seed=7, distributed=True, rank=r, world_size=world_size
        )
        for r in range(world_size)
    ]


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 40),
    before=st.integers(1, 4),
    after=st.integers(1, 4),
    batch=st.integers(1, 4),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    data=st.data(),
)
def test_the_rest_of_a_pass_is_dealt_over_the_new_ranks(size, before, after, batch, shuffle, drop_last, data):
    config = {"batch_size": batch, "shuffle": shuffle, "drop_last": drop_last}
    old = _loaders(size, before, config)
    iterators = [iter(loader) for loader in old]
    steps = data.draw(st.integers(0, max(0, len(old[0]) - 1)))  # mid-pass (the last batch ends it)
    consumed = [i for it in iterators for _ in range(steps) for i in next(it).tolist()]
    states = [loader_global_state(loader) for loader in old]
    assert all(state == states[0] for state in states)  # the same on every rank
    position = states[0]["samples_consumed"]
    order = ResumableSampler(_Indices(size), shuffle=shuffle, seed=7)._global_order()  # seed 7, epoch 0
    assert set(consumed) == set(order[:position])  # the used-up part is a prefix of the global order
    new = _loaders(size, after, config)
    for loader in new:
        loader.sampler.load_global_state(states[0])
    lengths = [len(loader) for loader in new]
    rest = [[b.tolist() for b in loader] for loader in new]
    assert [len(batches) for batches in rest] == lengths and len(set(lengths)) == 1  # ranks stay in lockstep
    if position == 0:  # nothing used up: an ordinary pass of the new layout
        assert rest == [[b.tolist() for b in loader] for loader in _loaders(size, after, config)]
        return
    trained = [i for batches in rest for b in batches for i in b]
    remaining = size - position
    # Dealt round-robin after cutting the < M leftover; drop_last also drops each rank's partial batch.
    per_rank = remaining // after
    kept = after * (per_rank - per_rank % batch if drop_last else per_rank)
    assert sorted(trained) == sorted(order[position : position + kept])
    assert len(set(trained)) == len(trained) and not set(trained) & set(consumed)
    # The pass after is an ordinary one of the new layout.
    fresh = _loaders(size, after, config)
    for loader in fresh:
        loader.sampler.set_epoch(1)
    assert [[b.tolist() for b in loader] for loader in new] == [[b.tolist() for b in loader] for loader in fresh]


def test_a_checkpoint_without_global_positions_resumes_at_its_size_and_is_refused_on_another(tmp_path):
    config = tiny_config(tmp_path, epochs=1, **{"dataloader.batch_size": 2})
    with TinyRunner(config) as runner:
        payload = runner.state_dict()
    assert payload["loop"]["data"] == {"train": {"epoch": 0, "samples_consumed": 0}}
    assert payload["loop"]["micro_batches_per_update"] == 1
    old = dict(
        payload, loop={k: v for k, v in payload["loop"].items() if k not in ("data", "micro_batches_per_update")}
    )
    with TinyRunner(config) as runner:
        runner.load_checkpoint(old)  # the same size: the per-rank positions restore as before
        assert runner.accum_steps == 1
    resized = dict(old, topology=dict(old["topology"], data_size=2))
    with TinyRunner(config) as runner, pytest.raises(ValueError, match="written by 2 data-parallel ranks, but this"):
        runner.load_checkpoint(resized)
    with TinyRunner(config) as runner:  # with the global positions it continues, keeping 2 micro-batches per update
        loop = dict(payload["loop"], micro_batches_per_update=2)  # as 2 ranks x accum_steps 1 record it
        runner.load_checkpoint(dict(payload, loop=loop, topology=dict(old["topology"], data_size=2)))
        assert runner.accum_steps == 2 and runner.checkpointing.micro_batches_per_update == 2


def test_a_pass_with_nothing_left_for_the_new_layout_ends():
    from danling.runners.checkpointing.elastic import restore_positions

    loaders = _loaders(10, 3, {"batch_size": 2})  # training defaults: shuffle, drop_last
    for loader in loaders:  # 4 samples left: 1 per rank after cutting 1, less than a batch
        restore_positions({"train": loader}, {"train": {"epoch": 0, "samples_consumed": 6}}, "train", 7)
    assert [len(loader) for loader in loaders] == [1, 1, 1]  # the ordinary length: the pass just ends
    assert [[b.tolist() for b in loader] for loader in loaders] == [[], [], []]
    fresh = _loaders(10, 3, {"batch_size": 2})
    for loader in fresh:
        loader.sampler.set_epoch(1)
    assert [[b.tolist() for b in loader] for loader in loaders] == [[b.tolist() for b in loader] for loader in fresh]
    with pytest.raises(DataResumeError, match="cannot continue split 'train' mid-pass"):
        restore_positions({"train": loaders[0]}, {}, "train", 7)
