import torch
import torch.distributed as dist

from tests.dist import run_distributed


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
