import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from danling.checkpoint import CheckpointError
from danling.checkpoint.dcp import (
    TorchDistributedCheckpointManager,
    get_training_state,
    read_dcp_checkpoint,
    set_training_state,
)
from danling.distributed import wrap_ddp
from tests.dist import run_distributed


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    model(torch.randn(6, 4, generator=generator)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _payload(model, optimizer, rank: int, step: int) -> dict:
    return {
        **get_training_state(model, optimizer),
        "runner": {"config": {"lr": 0.1, "name": "run"}},
        "state": {"step": step, "rank": rank, "rng": torch.get_rng_state()},
        "dataloaders": {"train": {"yielded": 10 * rank + step}},
    }


def _ddp_save_and_load(rank: int, world_size: int, directory: str, async_save: bool) -> dict:
    model = wrap_ddp(_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    manager = TorchDistributedCheckpointManager(directory, keep_latest_k=1, async_save=async_save)
    for step in (1, 2):
        _train_step(model, optimizer, seed=step)
        path = manager.save(_payload(model, optimizer, rank, step), f"step-{step:06d}")
    saved = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    _train_step(model, optimizer, seed=3)  # keeps mutating while an async write may still run
    manager.wait()
    dist.barrier()
    loaded = manager.load("latest")
    fresh = wrap_ddp(_model(seed=1))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    set_training_state(fresh, fresh_optimizer, loaded)
    # One more identical step from the restored state must match the original run.
    _train_step(fresh, fresh_optimizer, seed=3)
    manager.close()
    return {
        "path": str(path),
        "weights_match": all(torch.equal(saved[k], loaded["model"][k]) for k in saved),
        "continues": all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters())),
        "state": {k: loaded["state"][k] for k in ("step", "rank")},
        "dataloaders": loaded["dataloaders"],
        "config": loaded["runner"]["config"],
    }


def _failing_publish(rank: int, world_size: int, directory: str) -> str:
    model = wrap_ddp(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = TorchDistributedCheckpointManager(directory)
    manager.save(_payload(model, optimizer, rank, 1), "step-000001")
    if rank == 0:

        def broken(tmp: Path, name: str, **_: object) -> Path:
            raise OSError("disk full")

        manager._publish = broken
    try:
        manager.save(_payload(model, optimizer, rank, 2), "step-000002")
    except (OSError, CheckpointError) as err:
        return f"{type(err).__name__}: {err}"
    return "saved"


class _Collectives:
    """Count the collectives called through `torch.distributed` inside the block (DCP calls them so too)."""

    NAMES = ("broadcast_object_list", "gather_object", "scatter_object_list", "all_gather_object", "barrier")
    NAMES += ("broadcast", "all_reduce", "all_gather")

    def __enter__(self):
        self.calls, self.saved = {}, {name: getattr(dist, name) for name in self.NAMES}

        def counting(name, original):
            def wrapper(*args, **kwargs):
                self.calls[name] = self.calls.get(name, 0) + 1
                return original(*args, **kwargs)

            return wrapper

        for name, original in self.saved.items():
            setattr(dist, name, counting(name, original))
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(dist, name, original)


def _save_costs(rank: int, world_size: int, directory: str) -> dict:
    model = wrap_ddp(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = TorchDistributedCheckpointManager(directory, keep_latest_k=1)
    manager.save(_payload(model, optimizer, rank, 1), "step-000001")
    with _Collectives() as save:
        manager.save(_payload(model, optimizer, rank, 2), "step-000002")
    latest = manager.latest  # no barrier: the save returned on this rank only once the alias moved
    manager.close()
    return {"calls": save.calls, "latest": latest.name}


def _scenarios(rank: int, world_size: int, root: str) -> dict:
    # One launch covers every two-rank scenario: spawning ranks dominates the test time.
    return {
        "sync": _ddp_save_and_load(rank, world_size, os.path.join(root, "sync"), False),
        "async": _ddp_save_and_load(rank, world_size, os.path.join(root, "async"), True),
        "failure": _failing_publish(rank, world_size, os.path.join(root, "failure")),
        "resume": _resume_matches(rank, world_size, os.path.join(root, "resume"), stop_at=2),
        "costs": _save_costs(rank, world_size, os.path.join(root, "costs")),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    return root, run_distributed(_scenarios, str(root))


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_rank_save_load_round_trip(two_ranks, mode):
    root, results = two_ranks
    directory = root / mode
    for rank, by_mode in enumerate(results):
        result = by_mode[mode]
        assert result["path"] == str(directory / "step-000002")
        assert result["weights_match"] and result["continues"]
        assert result["state"] == {"step": 2, "rank": rank}  # rank-local entries come back per rank
        assert result["dataloaders"] == {"train": {"yielded": 10 * rank + 2}}
        assert result["config"] == {"lr": 0.1, "name": "run"}
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["latest.pointer", "step-000002"]  # retention pruned step 1, no temp dirs left
    files = sorted(p.name for p in (directory / "step-000002").iterdir())
    assert ".metadata" in files and "manifest.json" in files
    assert any(f.startswith("__1_") for f in files)  # rank 1 wrote part of the payload
    single = read_dcp_checkpoint(directory / "latest.pointer", rank=1)
    assert single["state"]["rank"] == 1


@pytest.mark.distributed
def test_failure_on_rank0_reaches_every_rank_and_keeps_previous(two_ranks):
    root, results = two_ranks
    directory = root / "failure"
    # one clear error naming the checkpoint, the cause and the space (see tests/checkpoint/test_save_failures.py)
    assert results[0]["failure"].startswith("CheckpointSaveError: saving checkpoint step-000002")
    assert "(OSError: disk full)" in results[0]["failure"] and "step-000001 is untouched" in results[0]["failure"]
    assert results[1]["failure"].startswith("CheckpointError") and "disk full" in results[1]["failure"]
    assert sorted(p.name for p in directory.iterdir()) == ["latest.pointer", "step-000001"]
    manager = TorchDistributedCheckpointManager(directory, load_only=True)
    assert manager.load("latest", map_location="cpu")["state"]["step"] == 1


@pytest.mark.distributed
def test_a_save_needs_no_collective_besides_dcps_own(two_ranks):
    _, results = two_ranks
    for result in results:
        # DCP's plan round (gather, scatter) and write round (gather, broadcast of the outcome), nothing
        # more: the directory rides on the plan and publication on DCP's finish, not on broadcasts of their own
        assert result["costs"]["calls"] == {"gather_object": 2, "scatter_object_list": 1, "broadcast_object_list": 1}
        assert result["costs"]["latest"] == "step-000002"  # every rank returns once the checkpoint is published


def test_single_process_corruption_falls_back(tmp_path):
    manager = TorchDistributedCheckpointManager(tmp_path)
    model = _model()
    for step in (1, 2):
        manager.save({**get_training_state(model), "state": {"step": step}}, f"step-{step:06d}")
    shard = next((tmp_path / "step-000002").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        manager.load("latest")
    assert manager.latest_valid() == tmp_path / "step-000001"
    assert manager.load(manager.latest_valid())["state"] == {"step": 1}


def test_rejects_non_string_keys(tmp_path):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train_step(model, optimizer, seed=0)
    manager = TorchDistributedCheckpointManager(tmp_path)
    with pytest.raises(TypeError, match="optimizer.state.0"):
        manager.save({"optimizer": optimizer.state_dict()}, "step-000001")
    assert not os.listdir(tmp_path)


def test_restores_optimizer_state_without_wrappers(tmp_path):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train_step(model, optimizer, seed=0)
    manager = TorchDistributedCheckpointManager(tmp_path, exclude_from_loading=["dataloader"])
    manager.save({**get_training_state(model, optimizer), "dataloaders": {"x": 1}}, "best-model", aliases=["best"])
    payload = manager.load("best")
    assert "dataloaders" not in payload
    fresh = _model(seed=3)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    set_training_state(fresh, fresh_optimizer, payload)
    _train_step(model, optimizer, seed=1)
    _train_step(fresh, fresh_optimizer, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


# Exact resume with every TorchRunner component wired together ---------------------------------


class _Pairs(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(40, 4, generator=generator), torch.randn(40, 2, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


def _train_run(rank: int, world_size: int, directory: str, stop_at: int | None = None, resume: bool = False):
    """Three epochs of 2-step accumulation with dropout, clipping, EMA and a resumable loader."""
    from danling.data import batch_fingerprint, build_dataloader, check_batch_fingerprint, split_batch
    from danling.runners.update import EMA, GradientAccumulator, OptimizerContainer

    distributed = world_size > 1
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 2))
    ema = EMA(model, decay=0.9)
    model = wrap_ddp(model) if distributed else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    container = OptimizerContainer(optimizer, max_grad_norm=1.0, skip_nonfinite_grad=True)
    accumulator = GradientAccumulator(accum_steps=2)
    loader = build_dataloader(
        _Pairs(), split="train", config={"batch_size": 3}, distributed=distributed, rank=rank, world_size=world_size
    )
    manager = TorchDistributedCheckpointManager(directory)
    torch.manual_seed(100 + rank)  # per-rank stream for dropout, as a runner's biased seed would give
    progress = {"epoch": 0, "global_step": 0}
    if resume:
        payload = manager.load("latest")
        set_training_state(model, optimizer, payload)
        ema.module.load_state_dict(payload["ema"])
        loader.load_state_dict(payload["dataloaders"]["train"])
        check_batch_fingerprint(loader, payload["dataloaders"]["train"], payload["dataloaders"]["fingerprint"])
        accumulator.load_state_dict(payload["state"]["accumulator"])
        torch.set_rng_state(payload["state"]["rng"])
        progress = payload["state"]["progress"]
    while progress["epoch"] < 3:
        accumulator.start(len(loader))
        for batch in loader:
            inputs, target = split_batch(batch)
            with accumulator.no_sync(model):
                loss = nn.functional.mse_loss(model(inputs), target)
                accumulator.normalize(loss).backward()
            if accumulator.advance() and container.step():
                progress["global_step"] += 1
                ema.update(model)
                if progress["global_step"] == stop_at:
                    loader_state = loader.state_dict()
                    state = {
                        **get_training_state(model, optimizer),
                        "ema": ema.module.state_dict(),
                        "dataloaders": {"train": loader_state, "fingerprint": batch_fingerprint(loader, loader_state)},
                        "state": {
                            "rng": torch.get_rng_state(),
                            "accumulator": accumulator.state_dict(),
                            "progress": dict(progress),
                        },
                    }
                    manager.save(state, f"step-{stop_at:06d}")
                    return None  # "killed" right after the checkpoint
        progress["epoch"] += 1
    return [p.detach().clone() for p in model.parameters()] + [p.clone() for p in ema.parameters()]


def _resume_matches(rank: int, world_size: int, root: str, stop_at: int) -> bool:
    full = _train_run(rank, world_size, os.path.join(root, "full"))
    assert _train_run(rank, world_size, os.path.join(root, "cut"), stop_at=stop_at) is None
    resumed = _train_run(rank, world_size, os.path.join(root, "cut"), resume=True)
    return len(full) == len(resumed) and all(torch.equal(a, b) for a, b in zip(full, resumed))


@pytest.mark.parametrize("stop_at", [3, 7])  # inside an epoch; the last update of epoch 0 (7 windows/epoch)
def test_single_process_resume_is_bit_identical(tmp_path, stop_at):
    assert _resume_matches(0, 1, str(tmp_path), stop_at)


@pytest.mark.distributed
def test_two_rank_resume_is_bit_identical(two_ranks):
    _, results = two_ranks
    assert [result["resume"] for result in results] == [True, True]
