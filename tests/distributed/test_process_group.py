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


def test_default_group_is_read_where_torch_keeps_it_through_init_and_destroy(tmp_path):
    # The queries read torch's holder of the default group directly (see `_world_holder`): on
    # this torch that holder must be found, and what it says must follow a real init and destroy.
    import torch.distributed as dist

    from danling.distributed import process_group

    assert process_group._WORLD is not None
    assert process_group._initialized() is dist.is_initialized() is False
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert process_group._initialized() is dist.is_initialized() is True
        assert is_distributed() is False  # one rank: collectives are the identity
    finally:
        dist.destroy_process_group()
    assert process_group._initialized() is dist.is_initialized() is False


def test_an_unknown_holder_of_the_default_group_turns_the_direct_read_off(monkeypatch):
    from torch.distributed import distributed_c10d

    from danling.distributed import process_group

    class Holder:  # a layout a later torch might have: no `_default_pg` behind a property
        pass

    with monkeypatch.context() as patch:
        patch.setattr(distributed_c10d, "_world", Holder())
        assert process_group._world_holder() is None
    monkeypatch.setattr(process_group, "_WORLD", None)  # then torch's own query answers
    assert process_group._initialized() is False and is_distributed() is False
