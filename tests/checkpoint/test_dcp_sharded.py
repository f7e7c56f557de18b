"""DCP with sharded (FSDP2) models, live objects loaded in place, and per-rank state across a resize.

Two launches: a 2-rank one (asynchronous FSDP2 round trip, per-rank copies, and the checkpoint the
3-rank launch reads) and a 3-rank one (the resize rule on a 2-rank checkpoint).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from danling.checkpoint import CheckpointResizeError
from danling.checkpoint.dcp import ModelState, OptimizerState, TorchDistributedCheckpointManager
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


def _two_rank_checks(rank: int, world_size: int, root: str) -> dict:
    return {"sharded": _sharded_async_round_trip(rank, world_size, os.path.join(root, "sharded"))}


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
