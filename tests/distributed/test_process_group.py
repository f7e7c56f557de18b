import pytest
import torch
from torch import nn

from danling.distributed import (
    all_reduce_any,
    all_reduce_gradients,
    all_reduce_mean,
    barrier,
    broadcast_object,
    get_local_rank,
    get_rank,
    get_world_size,
    init_process_group_from_env,
    is_distributed,
    is_main_process,
    unwrap_model,
    wrap_ddp,
)


def test_rank_queries_fall_back_to_environment(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert (get_rank(), get_world_size(), get_local_rank(), is_main_process(), is_distributed()) == (
        0,
        1,
        0,
        True,
        False,
    )
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (get_rank(), get_world_size(), get_local_rank(), is_main_process(), is_distributed()) == (
        3,
        4,
        1,
        False,
        False,
    )
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        get_rank()


def test_collectives_are_local_without_a_group():
    barrier()
    value = torch.tensor([1, 3])
    mean = all_reduce_mean(value)
    assert mean.dtype == torch.float32 and mean.tolist() == [1.0, 3.0]
    weights = torch.ones(2)
    assert all_reduce_mean(weights) is not weights
    assert all_reduce_any(torch.tensor(True)).item() is True
    obj = {"a": [1]}
    assert broadcast_object(obj) is obj
    param = nn.Parameter(torch.ones(2))
    param.grad = torch.full((2,), 2.0)
    all_reduce_gradients([param])
    assert param.grad.tolist() == [2.0, 2.0]


def test_init_from_env_validates(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_process_group_from_env() is False
    with pytest.raises(ValueError, match="timeout must be a positive"):
        init_process_group_from_env(timeout=0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match=r"RANK must be set to a value in \[0, 2\)"):
        init_process_group_from_env()


def test_wrap_needs_a_group_and_unwrap_strips_wrappers():
    net = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="initialised process group"):
        wrap_ddp(net)
    compiled = nn.Module()  # stands in for torch.compile's wrapper, which keeps the module as `_orig_mod`
    compiled._orig_mod = nn.DataParallel(net)
    assert unwrap_model(compiled) is net
    assert unwrap_model(net) is net
