import torch
import torch.distributed as dist

from tests.dist import _ephemeral_low, free_ports, run_distributed


def _all_reduce(rank: int, world_size: int, offset: int) -> float:
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return t.item()


def _fail(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()


def test_launcher_returns_results_by_rank():
    assert run_distributed(_all_reduce, 10) == [21.0, 21.0]


def test_launcher_reports_worker_failure():
    import pytest

    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_distributed(_fail, timeout=60)


def _tensor_result(rank: int, world_size: int) -> torch.Tensor:
    # Large enough that torch's queue would have shared it through shared memory.
    return torch.full((1024, 1024), float(rank))


def test_launcher_returns_tensors_after_workers_exit():
    results = run_distributed(_tensor_result)
    assert [r[0, 0].item() for r in results] == [0.0, 1.0]


def test_free_ports_stay_below_the_ephemeral_range_in_a_block_of_this_worker(monkeypatch):
    # Ports from the ephemeral range can be taken by any gloo connection of another test process,
    # and ports two workers both pick at random collide: each xdist worker has a block of its own.
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    first, second = free_ports(32), free_ports(32)
    assert len(set(first + second)) == 64  # one process does not hand a port out twice in a row
    assert all(15000 <= port < 20000 < _ephemeral_low() for port in first + second)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    assert all(10000 <= port < 15000 for port in free_ports(8))
