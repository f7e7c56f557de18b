"""Everything that needs two real processes, run in a single launch (spawning dominates the cost)."""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from danling.distributed import (
    all_reduce_any,
    all_reduce_gradients,
    all_reduce_mean,
    barrier,
    broadcast_object,
    get_rank,
    get_world_size,
    init_process_group_from_env,
    is_distributed,
    unwrap_model,
    wrap_ddp,
)
from danling.runners.update import GradientAccumulator, OptimizerContainer, has_nonfinite_gradients
from tests.dist import run_distributed

GLOBAL_BATCH = 12


def _data():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(GLOBAL_BATCH, 3, generator=generator), torch.randn(GLOBAL_BATCH, 1, generator=generator)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))


def _reference_gradients(micro_batches: int, window: list[int]) -> list[torch.Tensor]:
    """Single process: gradient of the mean loss over the global samples of the micro-steps in `window`."""
    x, y = _data()
    model = _model()
    per_micro = GLOBAL_BATCH // micro_batches
    rows = torch.cat([torch.arange(m * per_micro, (m + 1) * per_micro) for m in window])
    nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
    return [p.grad.clone() for p in model.parameters()]


def _rank_rows(rank: int, world_size: int, micro: int, micro_batches: int) -> torch.Tensor:
    # Micro-batch `micro` of the global batch, split evenly between the ranks.
    per_micro = GLOBAL_BATCH // micro_batches
    per_rank = per_micro // world_size
    start = micro * per_micro + rank * per_rank
    return torch.arange(start, start + per_rank)


def _ddp_accumulation(rank: int, world_size: int, total: int | None) -> list[list[list[torch.Tensor]]]:
    """Accumulate 3 micro-batches with accum_steps=2 under DDP; return the gradients of each window."""
    x, y = _data()
    model = wrap_ddp(_model())
    accumulator = GradientAccumulator(accum_steps=2)
    accumulator.start(total)
    windows = []
    for micro in range(3):
        rows = _rank_rows(rank, world_size, micro, micro_batches=3)
        with accumulator.no_sync(model):
            loss = nn.functional.mse_loss(model(x[rows]), y[rows])
            accumulator.normalize(loss).backward()
        if accumulator.advance():
            windows.append([p.grad.clone() for p in model.parameters()])
            model.zero_grad()
    factor = accumulator.finish()
    if factor is not None:  # unknown pass length: the open window never synchronised
        all_reduce_gradients(model.parameters())
        for p in model.parameters():
            p.grad.mul_(factor)
        windows.append([p.grad.clone() for p in model.parameters()])
    return windows


def _nonfinite(rank: int) -> dict:
    # A plain (non-DDP) model, so the ranks really hold different gradients.
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    scale = float("nan") if rank == 1 else 1.0
    (model(torch.ones(1, 2)).sum() * scale).backward()
    flag = has_nonfinite_gradients(model.parameters())
    applied = OptimizerContainer(optimizer, skip_nonfinite_grad=True).step()
    return {"flag": flag, "applied": applied, "unchanged": torch.equal(before, model.weight)}


def _collectives(rank: int, world_size: int) -> dict:
    barrier()
    param = nn.Parameter(torch.zeros(3))
    param.grad = torch.full((3,), float(rank))
    all_reduce_gradients([param])
    return {
        "rank": (get_rank(), get_world_size(), is_distributed()),
        "mean": all_reduce_mean(torch.tensor([float(rank), 2.0 * rank])).tolist(),
        "any": all_reduce_any(torch.tensor(rank == 1)).item(),
        "broadcast": broadcast_object({"from": rank}),
        "grad": param.grad.tolist(),
    }


def _init_from_env(rank: int, world_size: int, store: str) -> dict:
    assert init_process_group_from_env(allow_existing=True) is False
    try:
        init_process_group_from_env()
    except RuntimeError as err:
        already = str(err)
    dist.destroy_process_group()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    started = init_process_group_from_env(init_method=f"file://{store}", timeout=60)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return {"already": already, "started": started, "backend": dist.get_backend(), "total": total.item()}


def _scenarios(rank: int, world_size: int, store: str) -> dict:
    model = wrap_ddp(_model())
    return {
        "wrapped": isinstance(model, DistributedDataParallel) and wrap_ddp(model) is model,
        "unwrapped": type(unwrap_model(model)).__name__,
        "collectives": _collectives(rank, world_size),
        "known_total": _ddp_accumulation(rank, world_size, total=3),
        "unknown_total": _ddp_accumulation(rank, world_size, total=None),
        "nonfinite": _nonfinite(rank),
        "init": _init_from_env(rank, world_size, store),  # last: it replaces the process group
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    store = tmp_path_factory.mktemp("store") / "rendezvous"
    return run_distributed(_scenarios, str(store))


@pytest.mark.distributed
def test_collectives_agree(results):
    for rank, result in enumerate(results):
        assert result["wrapped"] and result["unwrapped"] == "Sequential"
        collectives = result["collectives"]
        assert collectives["rank"] == (rank, 2, True)
        assert collectives["mean"] == [0.5, 1.0]
        assert collectives["any"] is True
        assert collectives["broadcast"] == {"from": 0}
        assert collectives["grad"] == [0.5, 0.5, 0.5]


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["known_total", "unknown_total"])
def test_ddp_accumulation_matches_single_process_gradient(results, mode):
    # Windows: micro-steps {0, 1} then the partial window {2}; each update must see the mean
    # gradient over exactly the global samples of its window.
    expected = [_reference_gradients(3, [0, 1]), _reference_gradients(3, [2])]
    for result in results:
        windows = result[mode]
        assert len(windows) == 2
        for got, want in zip(windows, expected):
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_nonfinite_skip_is_agreed_by_all_ranks(results):
    for result in results:
        assert result["nonfinite"] == {"flag": True, "applied": False, "unchanged": True}


@pytest.mark.distributed
def test_init_process_group_from_env(results):
    for result in results:
        assert "already initialised" in result["init"]["already"]
        assert result["init"]["started"] is True
        assert result["init"]["backend"] == "gloo"
        assert result["init"]["total"] == 3.0
