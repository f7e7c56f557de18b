"""DCP with sharded (FSDP2) models, live objects loaded in place, and per-rank state across a resize.

Two launches: a 2-rank one (asynchronous FSDP2 round trip, per-rank copies, and the checkpoint the
3-rank launch reads) and a 3-rank one (the resize rule on a 2-rank checkpoint).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from danling.checkpoint import CheckpointError, CheckpointResizeError, _dcp_shared
from danling.checkpoint._dcp_shared import shares
from danling.checkpoint.checksums import BackgroundVerification
from danling.checkpoint.dcp import ModelState, OptimizerState, TorchDistributedCheckpointManager
from danling.checkpoint.manifest import read_manifest, verification_scope
from tests.checkpoint._files import flip_byte
from tests.dist import run_distributed


def _sharded_model(world_size: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    inputs = torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))
    model(inputs).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _local_shards(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    shards = {f"param.{name}": param.to_local().detach().clone() for name, param in model.named_parameters()}
    for index, param in enumerate(model.parameters()):
        for key, value in optimizer.state[param].items():
            local = value.to_local() if hasattr(value, "to_local") else value
            shards[f"optim.{index}.{key}"] = local.detach().clone()
    return shards


def _sharded_async_round_trip(rank: int, world_size: int, directory: str) -> dict:
    model = _sharded_model(world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    manager = TorchDistributedCheckpointManager(
        directory, async_save=True, rank_local_keys=("dataloaders", "rng"), optional_rank_local_keys=("rng",)
    )
    _step(model, optimizer, seed=1)
    state = {
        "model": ModelState(model),
        "optimizer": OptimizerState(model, optimizer),
        "state": {"step": 12},
        "dataloaders": {"train": {"yielded": 100 + rank}},
        "rng": {"torch": torch.get_rng_state()},
    }
    manager.save(state, "step-000012")
    saved = _local_shards(model, optimizer)
    full = {name: param.full_tensor() for name, param in model.named_parameters()}
    _step(model, optimizer, seed=2)  # the background write must not see these updates
    manager.wait()
    changed = _local_shards(model, optimizer)
    rest = manager.load_into("latest", {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer)})
    loaded = _local_shards(model, optimizer)
    manager.close()
    return {
        "types": sorted({type(p).__name__ for p in model.parameters()}),
        "moved": all(not torch.equal(saved[k], changed[k]) for k in saved if k.startswith("param.")),
        "restored": {key: torch.equal(saved[key], loaded[key]) for key in saved},
        "rest": {key: rest[key] for key in ("state", "dataloaders")},
        "rest_keys": sorted(rest),
        "full": full,
    }


class _Counted:
    """Record the files each background verification hashes and the calls of `dcp.load` inside the block."""

    def __enter__(self):
        self.hashed, self.dcp_loads, self.fallback = [], 0, []
        self.saved = (BackgroundVerification._check, dcp.load, _dcp_shared.verify_directory)
        check, load, verify = self.saved

        def counting_verify(directory, files=None, **kwargs):
            self.fallback.extend(files or [])
            return verify(directory, files, **kwargs)

        def counting_check(verification, key, path, entry):
            self.hashed.append(key)
            return check(verification, key, path, entry)

        def counting_load(*args, **kwargs):
            self.dcp_loads += 1
            return load(*args, **kwargs)

        BackgroundVerification._check, dcp.load = counting_check, counting_load
        _dcp_shared.verify_directory = counting_verify
        return self

    def __exit__(self, *exc):
        BackgroundVerification._check, dcp.load, _dcp_shared.verify_directory = self.saved


def _verified_together(rank: int, world_size: int, directory: str) -> dict:
    model = _sharded_model(world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    _step(model, optimizer, seed=1)
    objects = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer)}
    manager = TorchDistributedCheckpointManager(directory, rank_local_keys=("dataloaders",))
    manager.save({**objects, "state": {"step": 3}, "dataloaders": {"yielded": rank}}, "step-000003")
    saved = _local_shards(model, optimizer)
    _step(model, optimizer, seed=2)
    options = {"load_only": True, "rank_local_keys": ("dataloaders",), "exclude_from_loading": ["model", "optimizer"]}
    reader = TorchDistributedCheckpointManager(directory, verify_together=True, **options)
    with verification_scope():  # as a runner restore: the plain entries first, then the live objects
        with _Counted() as first:
            payload = reader.load("latest")
        with _Counted() as second:
            manager.load_into("latest", objects)
    restored = _local_shards(model, optimizer)
    manager.save({**objects, "state": {"step": 4}, "dataloaders": {"yielded": rank}}, "step-000004")
    with verification_scope(), _Counted() as apart:  # each rank another checkpoint: nothing to share
        step = reader.load(f"step-00000{3 + rank}")["state"]["step"]
    checkpoint = directory + "/step-000003"
    files = read_manifest(checkpoint)["files"]
    share = sorted(shares(files, world_size, skip=(".metadata",))[1])
    dist.barrier()
    if rank == 0:
        flip_byte(Path(checkpoint) / share[0], 1000)  # a file rank 1 checks for both ranks
    dist.barrier()
    with _Counted() as damaged:
        try:
            reader.load("step-000003")
            error = None
        except CheckpointError as err:
            error = str(err)
    manager.close()
    return {
        "payload": {key: payload[key] for key in ("state", "dataloaders")},
        "hashed": sorted(first.hashed),
        "again": second.hashed,
        "dcp_loads": (first.dcp_loads, second.dcp_loads),
        "restored": all(torch.equal(saved[key], restored[key]) for key in saved),
        "share": share,
        "data_files": sorted(name for name in files if name != ".metadata"),
        "damaged": (error, damaged.hashed),
        "apart": (step, sorted(apart.hashed + apart.fallback)),
    }


def _two_rank_checks(rank: int, world_size: int, root: str) -> dict:
    return {
        "sharded": _sharded_async_round_trip(rank, world_size, os.path.join(root, "sharded")),
        "together": _verified_together(rank, world_size, os.path.join(root, "together")),
    }


def _resized_load(rank: int, world_size: int, directory: str) -> dict:
    model = _sharded_model(world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    objects = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer)}
    options = {"rank_local_keys": ("dataloaders", "rng"), "optional_rank_local_keys": ("rng",)}
    strict = TorchDistributedCheckpointManager(directory, **options)
    try:
        strict.load_into("latest", objects)
        error = None
    except CheckpointResizeError as err:
        error = str(err)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger(f"resize-{rank}")
    logger.addHandler(handler)
    lenient = TorchDistributedCheckpointManager(
        directory, exclude_from_loading=["dataloaders"], logger=logger, **options
    )
    rest = lenient.load_into("latest", objects)
    # Every rank restored the global counter, so this collective agrees instead of hanging.
    step = torch.tensor([rest["state"]["step"]])
    dist.all_reduce(step)
    full = {name: param.full_tensor() for name, param in model.named_parameters()}
    return {"error": error, "rest": rest, "step_sum": int(step), "warnings": records, "full": full}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    two = run_distributed(_two_rank_checks, str(root))
    three = run_distributed(_resized_load, str(root / "sharded"), world_size=3)
    return two, three


@pytest.mark.distributed
def test_fsdp2_async_save_then_load_into_restores_each_shard(launches):
    two, _ = launches
    for rank, result in enumerate(two):
        sharded = result["sharded"]
        assert sharded["types"] == ["DTensor"]
        assert sharded["moved"]
        assert sharded["restored"] and all(sharded["restored"].values()), sharded["restored"]
        assert any(key.endswith("exp_avg") for key in sharded["restored"])
        assert sharded["rest"] == {"state": {"step": 12}, "dataloaders": {"train": {"yielded": 100 + rank}}}
        assert sharded["rest_keys"] == ["dataloaders", "rng", "state"]


@pytest.mark.distributed
def test_ranks_that_load_together_each_verify_a_share_and_agree_on_damage(launches):
    two, _ = launches
    shares_hashed = [result["together"]["hashed"] for result in two]
    data_files = two[0]["together"]["data_files"]
    for rank, result in enumerate(two):
        together = result["together"]
        assert together["payload"] == {"state": {"step": 3}, "dataloaders": {"yielded": rank}}
        assert together["again"] == []  # the live objects' read found every file verified (by some rank)
        assert together["dcp_loads"] == (0, 0)  # plain entries and same-sharding shards are read directly
        assert together["restored"]
    assert shares_hashed[1] == two[1]["together"]["share"]
    assert not set(shares_hashed[0]) & set(shares_hashed[1])  # each file is hashed by one rank only
    assert sorted(shares_hashed[0] + shares_hashed[1]) == data_files
    (name,) = two[1]["together"]["share"]
    for rank, result in enumerate(two):
        error, hashed = result["together"]["damaged"]
        assert error is not None and name in error and "corrupt" in error  # every rank refuses alike
        assert (name in hashed) == (rank == 1)
    assert "rank 1 checked that file" in two[0]["together"]["damaged"][0]
    for rank, result in enumerate(two):  # ranks that loaded different checkpoints hashed every file themselves
        assert result["together"]["apart"] == (3 + rank, data_files)


@pytest.mark.distributed
def test_three_ranks_on_two_rank_checkpoint_fail_alike_or_restore_global_state(launches):
    two, three = launches
    errors = {result["error"] for result in three}
    assert len(errors) == 1 and None not in errors  # the same error on every rank
    (message,) = errors
    assert "2 data-parallel ranks" in message and "this run has 3" in message
    assert "['dataloaders']" in message and "exclude_from_loading" in message
    for result in three:
        assert result["rest"] == {"state": {"step": 12}}  # rng dropped, dataloaders excluded
        assert result["step_sum"] == 36
        assert any("per-rank entries ['rng']" in message for message in result["warnings"])
    # The 2-rank shards were resharded onto 3 ranks: every rank holds its part of the saved weights.
    saved = two[0]["sharded"]["full"]
    for result in three:
        assert sorted(result["full"]) == sorted(saved)
        assert all(torch.equal(result["full"][name], saved[name]) for name in saved)
