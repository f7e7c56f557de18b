"""DeepSpeedRunner against real DeepSpeed: CPU accelerator, gloo, two processes, a client AdamW.

DeepSpeed compiles its shared-memory comm op on first use (about a minute); the build is kept in
`.torch_extensions/` at the project root so later runs reuse it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from danling.runners import Runner
from tests.dist import run_distributed
from tests.runners._torch_toy import make_data, make_model

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]  # a fresh machine compiles the comm op

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))


class Regression(Runner):
    """Dropout-free MLP regression (16 training samples) that records every micro-step loss."""

    def __init__(self, config):
        super().__init__(config)
        self.model = make_model(0.0)
        self.criterion = nn.MSELoss()
        self.datasets.train = make_data(16, seed=0)
        self.datasets.val = make_data(8, seed=1)
        self.losses = []

    def train_step(self, data):
        pred, loss = super().train_step(data)
        self.losses.append(loss.item())
        return pred, loss


def _config(root, name, stack="deepspeed", stage=None, **overrides):
    config = {
        "stack": stack,
        "workspace_root": os.path.join(root, name),
        "epochs": 2,
        "seed": 0,
        "log": False,
        # SGD with momentum: Adam divides by the gradient's magnitude, which turns the last-bit
        # differences of another reduction order into visible ones for near-zero gradients.
        "optim.type": "sgd",
        "optim.lr": 0.01,
        "optim.momentum": 0.9,
        "dataloader.batch_size": 4,
        "checkpoint.async_enabled": False,
    }
    if stage is not None:
        config["deepspeed"] = {"zero_optimization": {"stage": stage}}
    config.update(overrides)
    return config


def _weights(runner):
    return {key: value.detach().cpu().clone() for key, value in runner.unwrap(runner.model).state_dict().items()}


def _train(config):
    with Regression(config) as runner:
        runner.train()
        return type(runner).__name__, runner.losses, _weights(runner), runner.train_state.global_step


def _training_scenarios(rank, world_size, root):
    out = {"ddp": _train(_config(root, "ddp", stack="ddp"))}
    for stage in (1, 2, 3):
        out[f"zero{stage}"] = _train(_config(root, f"zero{stage}", stage=stage))
    out["accum"] = _train(_config(root, "accum", stage=2, accum_steps=2, **{"dataloader.batch_size": 2}))
    return out


def test_zero_stages_match_ddp_and_accumulation_matches_one_big_batch(tmp_path):
    ranks = run_distributed(_training_scenarios, str(tmp_path), world_size=2, timeout=600, init_process_group=False)
    for out in ranks:
        name, ddp_losses, ddp_weights, ddp_steps = out["ddp"]
        assert name == "Regression" and ddp_steps == 4
        for stage in (1, 2, 3):
            _, losses, weights, steps = out[f"zero{stage}"]
            assert steps == ddp_steps
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp_losses), rtol=1e-5, atol=1e-6)
            for key in ddp_weights:
                torch.testing.assert_close(weights[key], ddp_weights[key], rtol=1e-5, atol=1e-6)
        _, _, accum_weights, accum_steps = out["accum"]
        assert accum_steps == ddp_steps  # 4 micro-batches of 2 per rank and epoch, windows of 2
        for key in ddp_weights:
            torch.testing.assert_close(accum_weights[key], out["zero2"][2][key], rtol=1e-5, atol=1e-6)


def test_import_danling_does_not_import_deepspeed():
    code = "import sys, danling, danling.runners; assert 'deepspeed' not in sys.modules, 'deepspeed imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _checkpoint_scenarios(rank, world_size, root):
    from danling.checkpoint import detect_format

    out = {}
    for stage in (2, 3):
        with Regression(_config(root, f"full{stage}", stage=stage)) as runner:
            runner.train()
            manager = runner.checkpoint_manager
            first = manager.directory / "epoch-000000"
            final, aliases = _weights(runner), sorted(manager.aliases())
            latest = manager.latest.name
            fmt = detect_format(manager.directory / "latest.pointer")
        resumed_config = _config(root, f"resumed{stage}", stage=stage, resume=str(first))
        with Regression(resumed_config) as runner:
            restored_step = runner.train_state.global_step
            runner.train()
            out[stage] = {
                "aliases": aliases,
                "latest": latest,
                "format": fmt,
                "restored_step": restored_step,
                "resumed_losses": runner.losses,
                "equal": all(torch.equal(final[key], value) for key, value in _weights(runner).items()),
            }
    # The consolidated export loads into a plain module; then a torn newest tag makes
    # auto_resume fall back to the previous good one.
    with Regression(_config(root, "full2", stage=2, auto_resume=True)) as runner:
        export = runner.export_consolidated("latest", os.path.join(root, "export.pt"))
        plain = make_model(0.0)
        plain.load_state_dict(torch.load(export))
        out["export_equal"] = all(torch.equal(v, _weights(runner)[k]) for k, v in plain.state_dict().items())
        if rank == 0:
            torn = runner.checkpoint_manager.directory / "epoch-000001" / "mp_rank_00_model_states.pt"
            torn.write_bytes(torn.read_bytes()[:100])
        torch.distributed.barrier()
    with Regression(_config(root, "full2", stage=2, auto_resume=True)) as runner:
        out["auto_step"] = runner.train_state.global_step
    return out


def test_checkpoints_resume_exactly_and_publish_aliases(tmp_path):
    ranks = run_distributed(_checkpoint_scenarios, str(tmp_path), world_size=2, timeout=600, init_process_group=False)
    for out in ranks:
        for stage in (2, 3):
            result = out[stage]
            assert result["format"] == "deepspeed"
            assert result["latest"] == "epoch-000001" and "best" in result["aliases"]
            assert result["restored_step"] == 2  # epoch 0 done: 2 updates
            assert len(result["resumed_losses"]) == 2  # only the second epoch ran again
            assert result["equal"], f"stage {stage}: resumed weights differ from the uninterrupted run"
        assert out["export_equal"]
        assert out["auto_step"] == 2  # epoch-000001 is torn: resumed from epoch-000000
