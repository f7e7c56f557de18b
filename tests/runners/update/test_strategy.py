"""The update strategy: token-weighted windows, gradient-sync suppression (DDP, FSDP2), no host syncs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from danling.runners.update import Precision, TorchUpdateStrategy, UpdateStrategy, gradient_sync_for
from tests.dist import process_group, run_distributed
from tests.metrics.test_no_host_sync import ForbidHostSync
from tests.runners._torch_toy import TinyRunner, tiny_config

# Micro-batches of padded "sequences": 6 positions each, with very different numbers of real tokens.
_VALID = [6, 1, 4, 2]


def _tokens(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(_VALID), 6, 3, generator=g)
    y = torch.randn(len(_VALID), 6, 1, generator=g)
    mask = torch.stack([torch.arange(6) < n for n in _VALID])
    return x, y, mask


def _token_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean squared error over the real tokens only (padding excluded), without boolean indexing."""
    errors = ((model(x) - y) ** 2).squeeze(-1) * mask
    return errors.sum() / mask.sum()


def _big_batch_step(model: nn.Module, batches: list[tuple[torch.Tensor, ...]]) -> nn.Module:
    """One SGD(lr=1) step on the loss of every real token at once."""
    reference = copy.deepcopy(model)
    x, y, mask = (torch.cat(parts) for parts in zip(*batches))
    _token_loss(reference, x, y, mask).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= p.grad
    return reference


def _window(model: nn.Module, batches, *, weighted: bool, sync_model: nn.Module | None = None) -> None:
    """One accumulation window over `batches` through the strategy, then its update."""
    update = TorchUpdateStrategy(len(batches), gradient_sync=gradient_sync_for(sync_model or model))
    update.bind(torch.optim.SGD(model.parameters(), lr=1.0))
    update.start_pass(len(batches))
    for x, y, mask in batches:
        with update.train_context():
            loss = _token_loss(sync_model or model, x, y, mask)
        update.backward(loss, weight=mask.sum() if weighted else None)
        closed = update.advance()
    assert closed and update.apply()


def test_weighted_window_equals_one_big_batch():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x, y, mask = _tokens()
    batches = [(x[i : i + 1], y[i : i + 1], mask[i : i + 1]) for i in range(len(_VALID))]
    expected = _big_batch_step(model, batches)
    weighted, plain = copy.deepcopy(model), copy.deepcopy(model)
    _window(weighted, batches, weighted=True)
    _window(plain, batches, weighted=False)
    for got, want, unweighted in zip(weighted.parameters(), expected.parameters(), plain.parameters()):
        torch.testing.assert_close(got, want)
        assert not torch.allclose(unweighted, want)  # a plain mean of micro-step means is skewed by padding


def test_a_window_cannot_mix_weighted_and_plain_micro_steps():
    model = nn.Linear(3, 1)
    update = TorchUpdateStrategy(2)
    update.bind(torch.optim.SGD(model.parameters(), lr=0.1))
    update.start_pass(2)
    update.backward(model(torch.ones(1, 3)).sum())
    update.advance()
    with pytest.raises(ValueError, match="mixes weighted and unweighted"):
        update.backward(model(torch.ones(1, 3)).sum(), weight=3)


def test_the_base_strategy_counts_windows_and_refuses_weights():
    update = UpdateStrategy(accum_steps=3)
    update.start_pass(None)
    assert [update.advance() for _ in range(4)] == [False, False, True, False]
    assert update.pending == 1 and update.close_window() and update.pending == 0
    with pytest.raises(ValueError, match="weighted"):
        update.backward(torch.ones((), requires_grad=True), weight=2)


@pytest.mark.parametrize(
    "overrides",
    [{"accum_steps": 3}, {"accum_steps": 2, "precision": "bf16", "max_grad_norm": 1.0, "ema.enabled": True}],
    ids=["accumulation", "bf16-clip-ema"],
)
def test_training_steps_between_log_steps_never_sync_with_the_host(tmp_path, overrides):
    # SGD: torch's Adam family reads its step counter with .item(); that counter lives on the CPU
    # (no device sync on an accelerator), but the guard cannot tell the two apart here.
    overrides = {**overrides, "optim.type": "sgd", "optim.momentum": 0.9}
    with TinyRunner(tiny_config(tmp_path, **overrides)) as runner:
        batches = list(runner.dataloaders["train"])
        runner.mode = "train"
        runner.update.start_pass(len(batches))
        start = runner.train_state.global_step
        with ForbidHostSync():
            for batch in batches:
                _, loss = runner.train_step(batch)
                runner.meters.update(loss=loss)  # what the loop does with every loss
        assert runner.train_state.global_step - start == -(-len(batches) // runner.accum_steps)


# ---------------------------------------------------------------------------------------- distributed


class SixteenRunner(TinyRunner):
    n_train = 16


def _count_allreduces(counter: dict, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    counter["allreduce"] += 1
    return default_hooks.allreduce_hook(None, bucket)


def _fsdp_windows() -> tuple[int, list[bool]]:
    """Two windows of 3 micro-steps on an FSDP2 model: how many reduce-scatters, and whether grads existed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    calls = []

    class Counting(DefaultReduceScatter):
        def __call__(self, *args, **kwargs):
            calls.append(1)
            return super().__call__(*args, **kwargs)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    model.set_custom_reduce_scatter(Counting())
    update = TorchUpdateStrategy(3, gradient_sync=gradient_sync_for(model))
    update.bind(torch.optim.SGD(model.parameters(), lr=0.1))
    update.start_pass(6)
    reduced_at = []
    for _ in range(6):
        before = len(calls)
        with update.train_context():
            loss = model(torch.randn(2, 3)).sum()
        update.backward(loss)
        reduced_at.append(len(calls) > before)
        if update.advance():
            update.apply()
    return len(calls), reduced_at


def _distributed_updates(rank: int, world_size: int, root: str) -> dict:
    torch.set_num_threads(1)
    out = {}
    # DDP inside a runner: 8 micro-steps in windows of 4 all-reduce twice, not 8 times.
    config = tiny_config(f"{root}/ddp", epochs=1, accum_steps=4, **{"dataloader.batch_size": 1})
    with SixteenRunner(dict(config, **{"dataloader.train.shuffle": False})) as runner:
        counter = {"allreduce": 0}
        runner.model.register_comm_hook(counter, _count_allreduces)
        runner.train()
        out["ddp"] = (len(runner.dataloaders["train"]), counter["allreduce"], runner.train_state.global_step)
    with process_group():  # the runner destroyed the group it started
        out.update(_raw_updates(rank, world_size))
    return out


def _raw_updates(rank: int, world_size: int) -> dict:
    out = {}
    # Token-weighted windows under DDP: every rank holds different padding; the update must equal
    # one SGD step on all real tokens of all ranks together.
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x, y, mask = _tokens()
    mine = [(x[i : i + 1], y[i : i + 1], mask[i : i + 1]) for i in range(rank, len(_VALID), world_size)]
    everyone = [(x[i : i + 1], y[i : i + 1], mask[i : i + 1]) for i in range(len(_VALID))]
    expected = _big_batch_step(model, everyone)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    _window(ddp.module, mine, weighted=True, sync_model=ddp)
    out["weighted"] = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ddp.parameters(), expected.parameters()))
    out["fsdp"] = _fsdp_windows()
    return out


@pytest.mark.distributed
def test_gradient_sync_is_suppressed_inside_windows_and_weights_span_ranks(tmp_path):
    for out in run_distributed(_distributed_updates, str(tmp_path), world_size=2, init_process_group=False):
        batches, allreduces, steps = out["ddp"]
        assert batches == 8 and steps == 2
        assert allreduces == 2  # one bucket per window boundary; none inside a window
        assert out["weighted"]
        reduce_scatters, reduced_at = out["fsdp"]
        assert reduced_at == [False, False, True, False, False, True]
        assert reduce_scatters == 2


def test_a_strategy_with_its_own_backward_is_never_bypassed(tmp_path):
    calls = []

    class Engine(TorchUpdateStrategy):
        def backward(self, loss, weight=None):
            calls.append(weight)
            super().backward(loss, weight)

    class EngineRunner(TinyRunner):
        def build_update_strategy(self):
            return Engine(precision=self.precision_policy)

    with EngineRunner(tiny_config(tmp_path, epochs=1)) as runner:
        assert not runner.update.plain_backward
        runner.train()
    assert len(calls) == runner.train_state.micro_step > 0


def test_a_subclass_advance_is_not_shadowed_by_the_accumulators():
    class Counting(UpdateStrategy):
        calls = 0

        def advance(self):
            self.calls += 1
            return super().advance()

    update = Counting(accum_steps=2)
    update.start_pass(2)
    assert [update.advance(), update.advance()] == [False, True] and update.calls == 2


def test_mixed_precision_windows_under_ddp_enter_autocast_and_no_sync_together(tmp_path):
    # bf16 autocast plus DDP's no_sync inside a window: both contexts must be entered as one
    # (a 1-rank gloo group is enough for DDP to offer no_sync).
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(3, 1))
        update = TorchUpdateStrategy(2, precision=Precision("bf16"), gradient_sync=gradient_sync_for(ddp))
        update.bind(torch.optim.SGD(ddp.parameters(), lr=0.1))
        update.start_pass(2)
        dtypes, syncs = [], []
        for _ in range(2):
            with update.train_context():
                out = ddp(torch.randn(4, 3))
                syncs.append(ddp.require_backward_grad_sync)
            dtypes.append(out.dtype)
            update.backward(out.float().sum())
            closed = update.advance()
        assert closed and update.apply()
    finally:
        dist.destroy_process_group()
    assert dtypes == [torch.bfloat16, torch.bfloat16]
    assert syncs == [False, True]  # the first micro-step keeps its gradients local
