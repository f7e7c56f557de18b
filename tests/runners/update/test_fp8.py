"""`precision: fp8`: which linears torchao's float8 training converts, and who is refused before training."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from danling.runners import RunnerConfig
from danling.runners.update.fp8 import Fp8Mixin, Fp8Policy, convert_to_fp8, fp8_refusal
from tests.runners._torch_toy import TinyRunner

float8 = pytest.importorskip("torchao.float8", reason="fp8 needs torchao (the `fp8` extra)")


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in range(2))
        self.odd = nn.Linear(64, 24)  # 24 is not a multiple of 16
        self.norm = nn.LayerNorm(24)
        self.lm_head = nn.Linear(24, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.lm_head(self.norm(self.odd(x)))


def linear_kinds(model: nn.Module) -> dict[str, str]:
    return {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_eligible_linears_are_converted_and_each_skip_says_why():
    model = Blocks()
    done = convert_to_fp8(model, filter_fqns=["lm_head"], emulate=True)
    assert done.converted == ["embed", "blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2"]
    assert done.skipped == {
        "odd": "64x24 is not divisible by 16",
        "lm_head": "name matches fp8.filter_fqns entry 'lm_head'",
    }
    kinds = linear_kinds(model)
    assert {name for name, kind in kinds.items() if kind == "Float8Linear"} == set(done.converted)
    assert kinds["odd"] == kinds["lm_head"] == "Linear"
    assert isinstance(model.norm, nn.LayerNorm)
    # the converted model trains (emulated float8 on the CPU) under bf16 autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(4, 32)).float().square().mean()
    loss.backward()
    assert torch.isfinite(loss) and model.embed.weight.grad is not None


def test_fsdp_all_gather_follows_the_layout_and_the_recipe():
    policy = Fp8Policy("tensorwise", ["lm_head"], fsdp_all_gather=True, emulate=True)
    plain, sharded = Blocks(), Blocks()
    policy.apply(plain)
    policy.apply(sharded, fsdp=True)
    assert plain.embed.config.enable_fsdp_float8_all_gather is False
    assert sharded.embed.config.enable_fsdp_float8_all_gather is True
    rowwise = Blocks()
    Fp8Policy("rowwise", fsdp_all_gather=True, emulate=True).apply(rowwise, fsdp=True)
    assert rowwise.embed.config.enable_fsdp_float8_all_gather is False  # float8 all-gather is tensorwise only
    with pytest.raises(ValueError, match=r"fp8.recipe='delayed' is not a float8 recipe; accepted: \['tensorwise'"):
        Fp8Policy("delayed")
    with pytest.raises(ValueError, match="fp8.fsdp_all_gather needs fp8.recipe='tensorwise', got 'rowwise'"):
        convert_to_fp8(Blocks(), recipe="rowwise", fsdp_all_gather=True)


def test_devices_without_float8_are_refused_with_the_device_and_its_capability(monkeypatch):
    assert fp8_refusal(torch.device("cpu")).endswith("this run is on cpu")
    assert fp8_refusal(torch.device("cpu"), emulate=True) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert fp8_refusal(torch.device("cuda", 0)) == (
        "precision: fp8 needs a CUDA device of compute capability >= 8.9; "
        "cuda:0 is NVIDIA A100-SXM4-80GB of compute capability 8.0"
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_refusal(torch.device("cuda", 0)) is None
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    assert "needs torchao (pip install 'danling[fp8]')" in fp8_refusal(torch.device("cuda", 0))


def fp8_config(tmp_path, **overrides) -> RunnerConfig:
    values = {
        "epochs": 1,
        "seed": 0,
        "precision": "fp8",
        "workspace_root": str(tmp_path),
        "log": False,
        "optim.type": "sgd",
        "optim.lr": 0.01,
        "dataloader.batch_size": 4,
        "checkpoint.load_only": True,
    }
    values.update(overrides)
    return RunnerConfig(**values)


class WideRunner(TinyRunner):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))


def test_a_cpu_run_is_refused_before_training(tmp_path):
    with pytest.raises(RuntimeError, match=r"^precision: fp8 needs a CUDA device .*this run is on cpu$"):
        WideRunner(fp8_config(tmp_path))


def test_materialize_model_applies_the_policy_and_the_run_trains(tmp_path):
    runner = WideRunner(fp8_config(tmp_path, **{"fp8.emulate": True, "fp8.filter_fqns": ["4"]}))
    assert runner.fp8_enabled and isinstance(runner, Fp8Mixin) and Fp8Mixin not in type(runner).__mro__
    assert runner.precision_policy.dtype is torch.bfloat16
    assert linear_kinds(runner.model) == {"0": "Linear", "2": "Float8Linear", "4": "Linear"}
    assert runner.fp8.conversions[0].skipped == {
        "0": "4x32 is not divisible by 16",
        "4": "name matches fp8.filter_fqns entry '4'",
    }
    runner.train()
    runner.close()
    assert torch.isfinite(torch.tensor(runner.latest_result["train"]["loss"]))
    plain = TinyRunner(fp8_config(tmp_path / "plain", precision="bf16"))
    assert not plain.fp8_enabled and plain.fp8 is None
    plain.close()
