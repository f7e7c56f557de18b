"""DeepSpeedRunner against real DeepSpeed: CPU accelerator, gloo, two processes, a client optimizer.

DeepSpeed compiles its shared-memory comm op on first use (about a minute); the build is kept in
`.torch_extensions/` at the project root so later runs reuse it. ZeRO-3 runs partition every
parameter (`stage3_param_persistence_threshold: 0`), so gathering is exercised for real.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from danling.runners.deepspeed.checkpoint import DeepSpeedCheckpointing
from tests.dist import process_group, run_distributed
from tests.runners._deepspeed_toy import ROOT, Regression, ds_config, weights
from tests.runners._torch_toy import make_model

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]  # a fresh machine compiles the comm op


class Weighted(Regression):
    weighted = True


class Poisoned(Regression):
    poison = (1, 2)  # rank 1's second micro-step: the second update of the first epoch


class FailingPayload(DeepSpeedCheckpointing):
    """The payload of a `FailingSave` runner: its rank `fail_rank` cannot pickle its per-rank entries."""

    def checkpoint_payload(self, *, last_step):
        payload = dict(super().checkpoint_payload(last_step=last_step))
        if self.host.rank == self.host.fail_rank:
            payload["rng"] = {"unpicklable": lambda: None}
        return payload


class FailingSave(Regression):
    """Its rank `fail_rank` cannot pickle its per-rank checkpoint entries."""

    fail_rank = None
    checkpointing_class = FailingPayload


def _train(config, cls=Regression):
    with cls(config) as runner:
        runner.train()
        return type(runner).__name__, runner.losses, weights(runner), runner.train_state.global_step


def _training_scenarios(rank, world_size, root):
    out = {"ddp": _train(ds_config(root, "ddp", stack="ddp"))}
    for stage in (1, 2, 3):
        out[f"zero{stage}"] = _train(ds_config(root, f"zero{stage}", stage=stage))
    out["accum"] = _train(ds_config(root, "accum", stage=2, accum_steps=2, **{"dataloader.batch_size": 2}))
    # Token weights: windows of two micro-batches with a data-dependent number of kept samples.
    windows = {"accum_steps": 2, "dataloader.batch_size": 2}
    out["weighted-ddp"] = _train(ds_config(root, "wddp", stack="ddp", **windows), Weighted)
    for stage in (2, 3):
        out[f"weighted{stage}"] = _train(ds_config(root, f"w{stage}", stage=stage, **windows), Weighted)
    # bf16, and a non-finite micro-step on rank 1 only: the update is skipped on both ranks.
    for name, stage, precision in (("bf16-2", 2, "bf16"), ("bf16-3", 3, "bf16"), ("fp32-2", 2, None)):
        config = ds_config(
            root, name, stage=stage, skip_nonfinite_grad=True, **({"precision": precision} if precision else {})
        )
        with Poisoned(config) as runner:
            runner.train()
            out[name] = {
                "steps": runner.train_state.global_step,
                "skipped": runner.update.skipped_steps,
                "weights": weights(runner),
                "finite": all(math.isfinite(loss) for loss in runner.losses),
            }
    return out


def test_zero_stages_match_ddp_weights_and_skip_nonfinite_updates(tmp_path):
    ranks = run_distributed(_training_scenarios, str(tmp_path), world_size=2, timeout=900, init_process_group=False)
    for out in ranks:
        name, ddp_losses, ddp_weights, ddp_steps = out["ddp"]
        assert name == "Regression" and ddp_steps == 4
        for stage in (1, 2, 3):
            _, losses, got, steps = out[f"zero{stage}"]
            assert steps == ddp_steps
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp_losses), rtol=1e-5, atol=1e-6)
            for key in ddp_weights:
                torch.testing.assert_close(got[key], ddp_weights[key], rtol=1e-5, atol=1e-6)
        _, _, accum_weights, accum_steps = out["accum"]
        assert accum_steps == ddp_steps  # 4 micro-batches of 2 per rank and epoch, windows of 2
        for key in ddp_weights:
            torch.testing.assert_close(accum_weights[key], out["zero2"][2][key], rtol=1e-5, atol=1e-6)
        _, _, weighted_ddp, _ = out["weighted-ddp"]
        for stage in (2, 3):
            _, _, got, steps = out[f"weighted{stage}"]
            assert steps == ddp_steps
            for key in weighted_ddp:
                torch.testing.assert_close(got[key], weighted_ddp[key], rtol=1e-5, atol=1e-6)
        assert any(not torch.allclose(weighted_ddp[key], accum_weights[key]) for key in weighted_ddp)
        for name in ("bf16-2", "bf16-3", "fp32-2"):
            result = out[name]
            assert result["steps"] == ddp_steps - 1 and result["skipped"] == 1, name
            assert result["finite"] and all(torch.isfinite(v).all() for v in result["weights"].values()), name
    for name in ("bf16-2", "bf16-3", "fp32-2"):  # both ranks skipped the same update
        for key, value in ranks[0][name]["weights"].items():
            assert torch.equal(value, ranks[1][name]["weights"][key]), name


def test_import_danling_does_not_import_deepspeed():
    code = "import sys, danling, danling.runners; assert 'deepspeed' not in sys.modules, 'deepspeed imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _base_state(runner):
    """The ZeRO optimizer's inner torch optimizer state (momentum buffers of its fp32 partitions)."""
    inner = runner.optimizer.optimizer
    return [{k: v.clone() for k, v in state.items()} for state in inner.state.values()]


def _pretrained(root, name, stage, source, **overrides):
    """A run with lr 0 trains, loads `source`'s weights, trains on: the loaded weights must survive the steps."""
    config = ds_config(root, name, stage=stage, **{"optim.lr": 0.0}, **overrides)
    with Regression(config) as runner:
        runner.train()
        step, state = runner.train_state.global_step, _base_state(runner)
        runner.load_pretrained(source)
        loaded = weights(runner)
        untouched = runner.train_state.global_step == step and all(
            torch.equal(a[k], b[k]) for a, b in zip(state, _base_state(runner)) for k in a
        )
        runner.config.epochs = 3
        runner.train()
        kept = all(torch.equal(loaded[k], v) for k, v in weights(runner).items())
        first = str(runner.checkpoint_manager.directory / "epoch-000000")
        return {"loaded": loaded, "untouched": untouched and bool(state), "kept": kept, "first": first}


def _older_tag(root, rank, first3):
    # ZeRO-3 without optimizer states: DeepSpeed would read the weights of the directory's `latest`
    # tag (here written as a plain DeepSpeed script would); the requested older tag must load.
    if rank == 0:
        with open(os.path.join(os.path.dirname(first3), "latest"), "w") as file:
            file.write("epoch-000001")
    with process_group():  # between runners: each starts (and destroys) a group of its own
        torch.distributed.barrier()
    no_optimizer = {"ema.enabled": True, "optim": "adamw", "checkpoint.exclude_from_loading": ["optimizer"]}
    no_optimizer["resume"] = first3
    with Regression(ds_config(root, "full3", stage=3, **no_optimizer)) as runner:
        return {"step": runner.train_state.global_step, "weights": weights(runner)}


def _failing_saves(root):
    # A save that fails on one rank fails on every rank (no hang), publishes nothing, and the
    # next save works.
    with FailingSave(ds_config(root, "failing", stage=2, epochs=1)) as runner:
        runner.train()
        manager, errors = runner.checkpoint_manager, []
        for fail_rank in (1, 0):
            runner.fail_rank = fail_rank
            runner.train_state.global_step += 1  # a new checkpoint name
            try:
                runner.save_checkpoint(force=True)
            except Exception as error:
                errors.append(f"{type(error).__name__}: {error}")
            errors.append(manager.latest.name)
        runner.fail_rank = None
        runner.save_checkpoint(force=True)
        return errors + [manager.latest.name]


def _checkpoint_scenarios(rank, world_size, root):
    from danling.checkpoint import detect_format

    out = {}
    for stage in (2, 3):
        ema = {"ema.enabled": stage == 3, "optim": "adamw"}
        with Regression(ds_config(root, f"full{stage}", stage=stage, **ema)) as runner:
            runner.train()
            manager = runner.checkpoint_manager
            first = manager.directory / "epoch-000000"
            final, aliases = weights(runner), sorted(manager.aliases())
            latest = manager.latest.name
            fmt = detect_format(manager.directory / "latest.pointer")
            out[f"ema{stage}"] = (
                {k: v.clone() for k, v in runner.ema.module.state_dict().items()} if stage == 3 else None
            )
            out[f"export{stage}"] = runner.export_consolidated(first, os.path.join(root, f"export{stage}.pt"))
        with Regression(ds_config(root, f"resumed{stage}", stage=stage, resume=str(first), **ema)) as runner:
            restored_step = runner.train_state.global_step
            runner.train()
            out[stage] = {
                "aliases": aliases,
                "latest": latest,
                "format": fmt,
                "restored_step": restored_step,
                "resumed_losses": runner.losses,
                "equal": all(torch.equal(final[key], value) for key, value in weights(runner).items()),
                "first": str(first),
                "final": final,
            }
    out["older_tag"] = _older_tag(root, rank, out[3]["first"])
    out["pretrained3"] = _pretrained(
        root,
        "pre3",
        3,
        os.path.dirname(os.path.dirname(out[3]["first"])),
        **{"ema.enabled": True},  # the run directory
    )
    out["pretrained2"] = _pretrained(root, "pre2", 2, out[2]["first"].replace("000000", "000001"))
    # The consolidated export loads into a plain module; then a torn newest tag makes
    # auto_resume fall back to the previous good one.
    with Regression(ds_config(root, "full2", stage=2, optim="adamw", auto_resume=True)) as runner:
        export = runner.export_consolidated("latest", os.path.join(root, "export.pt"))
        plain = make_model(0.0)
        plain.load_state_dict(torch.load(export))
        out["export_equal"] = all(torch.equal(v, weights(runner)[k]) for k, v in plain.state_dict().items())
        if rank == 0:
            torn = runner.checkpoint_manager.directory / "epoch-000001" / "mp_rank_00_model_states.pt"
            torn.write_bytes(torn.read_bytes()[:100])
        torch.distributed.barrier()
    with Regression(ds_config(root, "full2", stage=2, optim="adamw", auto_resume=True)) as runner:
        out["auto_step"] = runner.train_state.global_step
    out["failing"] = _failing_saves(root)
    out["rank"] = rank
    return out


def _resume_on_one_rank(rank, world_size, root, first2, first3, sgd):
    """Resume two-rank ZeRO checkpoints on one rank: converted to the universal format and loaded."""
    import logging

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("danling").addHandler(handler)
    out = {}
    resize = {"checkpoint.exclude_from_loading": ["dataloaders"]}
    for stage, first in ((2, first2), (3, first3)):
        overrides = {"resume": first, "ema.enabled": stage == 3, **resize}
        with Regression(ds_config(root, f"one{stage}", stage=stage, optim="adamw", **overrides)) as runner:
            restored = runner.train_state.global_step
            loaded, state = weights(runner), _base_state(runner)
            runner.train()
            out[stage] = {
                "restored": restored,
                "loaded": loaded,
                "adam_state": state,
                "final": runner.train_state.global_step,
                "finite": all(math.isfinite(loss) for loss in runner.losses),
                "converted_dir_removed": not (runner.checkpoint_manager.directory / ".universal").exists(),
            }
    out["log"] = [m for m in messages if "universal" in m]
    refused = {  # SGD's momentum has no place in the universal format: refused before any step
        "sgd": ds_config(root, "one-sgd", stage=2, resume=sgd, **{"optim.lr": 0.0}, **resize),
        # the non-finite skip needs the engine's own check
        "stage0": ds_config(root, "bad", stage=0, skip_nonfinite_grad=True),
        "bf16": ds_config(
            root,
            "bad",
            skip_nonfinite_grad=True,
            precision="bf16",
            deepspeed={"bf16": {"check_grad_overflow": False}, "zero_optimization": {"stage": 2}},
        ),
    }
    for name, config in refused.items():
        try:
            Regression(config).close()
        except Exception as error:
            out[name] = f"{type(error).__name__}: {error}"
    return out


def _saved_adam_state(tag, stage, numels):
    """`exp_avg` and `exp_avg_sq` of a two-rank ZeRO tag, whole and in parameter order (read from its files)."""
    files = [os.path.join(tag, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for r in (0, 1)]
    parts = [torch.load(file, weights_only=False)["optimizer_state_dict"] for file in files]
    parts = [part["base_optimizer_state" if stage < 3 else "optimizer_state_dict"]["state"][0] for part in parts]
    out = {}
    for key in ("exp_avg", "exp_avg_sq"):
        if stage < 3:  # one flat vector of all parameters, cut in two equal halves
            out[key] = torch.cat([part[key] for part in parts])[: sum(numels)]
            continue
        pieces, offset = [], 0  # ZeRO-3 cuts every parameter in two halves of its own
        for numel in numels:
            size = -(-numel // 2)
            pieces.append(torch.cat([part[key][offset : offset + size] for part in parts])[:numel])
            offset += size
        out[key] = torch.cat(pieces)
    return out


def test_checkpoints_resume_exactly_publish_aliases_and_resize(tmp_path):
    ranks = run_distributed(_checkpoint_scenarios, str(tmp_path), world_size=2, timeout=900, init_process_group=False)
    for out in ranks:
        for stage in (2, 3):
            result = out[stage]
            assert result["format"] == "deepspeed"
            assert result["latest"] == "epoch-000001" and "best" in result["aliases"]
            assert result["restored_step"] == 2  # epoch 0 done: 2 updates
            assert len(result["resumed_losses"]) == 2  # only the second epoch ran again
            assert result["equal"], f"stage {stage}: resumed weights differ from the uninterrupted run"
        export3 = torch.load(out["export3"])
        assert out["older_tag"]["step"] == 2
        for key, value in export3.items():  # epoch-000000's weights, not those of `latest`
            assert torch.equal(out["older_tag"]["weights"][key], value), key
        assert any(not torch.equal(out[3]["final"][k], v) for k, v in export3.items())
        for name, expected in (("pretrained3", out["ema3"]), ("pretrained2", out[2]["final"])):
            result = out[name]
            assert result["untouched"], f"{name}: load_pretrained changed the optimizer state or the counters"
            assert result["kept"], f"{name}: training after load_pretrained lost the loaded weights"
            for key, value in expected.items():
                assert torch.equal(result["loaded"][key], value), f"{name}: {key}"
        assert out["export_equal"]
        assert out["auto_step"] == 2  # epoch-000001 is torn: resumed from epoch-000000
        rank_fail, latest1, root_fail, latest0, after = out["failing"]
        assert ("pickle" in rank_fail) == (out["rank"] == 1) and ("another rank" in rank_fail) == (out["rank"] == 0)
        assert ("pickle" in root_fail) == (out["rank"] == 0) and ("another rank" in root_fail) == (out["rank"] == 1)
        assert latest1 == latest0 == "epoch-000000" and after == "step-000004"
    first2, first3, sgd = ranks[0][2]["first"], ranks[0][3]["first"], ranks[0]["pretrained2"]["first"]
    (one,) = run_distributed(
        _resume_on_one_rank, str(tmp_path), first2, first3, sgd, world_size=1, timeout=600, init_process_group=False
    )
    for stage in (2, 3):
        result, export = one[stage], torch.load(ranks[0][f"export{stage}"])
        assert result["restored"] == 2 and result["final"] == 2 + 4  # one rank: 4 updates per epoch
        for key, value in export.items():
            assert torch.equal(result["loaded"][key], value), f"stage {stage}: {key}"
        assert result["finite"] and result["converted_dir_removed"]
        (state,) = result["adam_state"]  # one rank: every parameter's AdamW state, restored exactly
        saved = _saved_adam_state(first2 if stage == 2 else first3, stage, [v.numel() for v in export.values()])
        for key, value in saved.items():
            assert torch.equal(state[key][: value.numel()], value), f"stage {stage}: {key}"
    assert len(one["log"]) == 2 and "2 data-parallel ranks and this run has 1" in one["log"][0]
    assert one["sgd"].startswith("CheckpointError") and "Adam-style optimizer states" in one["sgd"]
    assert one["stage0"].startswith("ValueError") and "needs a ZeRO optimizer" in one["stage0"]
    assert one["bf16"].startswith("ValueError") and "check_grad_overflow=False conflicts" in one["bf16"]
