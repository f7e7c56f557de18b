"""EMA on FSDP2, tensor and pipeline layouts (gloo, CPU): sharded like the model, against one process.

One launch of 2 ranks trains each layout with `ema.enabled`, evaluates and infers with the
averaged weights, resumes each layout from its first epoch's checkpoint, and loads an FSDP2
checkpoint on tensor parallelism and a pipeline checkpoint on FSDP2; the parent trains the
single-process TorchRunner references and loads the FSDP2 checkpoint in one process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from danling.runners.update import EMA
from tests.dist import run_distributed
from tests.runners._parallel_toy import TENSOR_PLAN, ParallelRegression, ema_weights, full_weights, parallel_config

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

PIPELINE_FQNS = [["inp", "layers.0"], ["layers.1", "head"]]
LAYOUTS = {
    "fsdp": {"parallel.axes.shard": 2, "fsdp.enabled": True},
    "tensor": {"parallel.axes.tensor": 2, "parallel.tensor_plan": TENSOR_PLAN},
    "pipeline": {"parallel.axes.pipeline": 2, "parallel.module_fqns_per_model_part": PIPELINE_FQNS},
}
# Updates per epoch: two data ranks read 8 samples per update (fsdp), one data rank 4 (tensor, pipeline).
STEPS_PER_EPOCH = {"fsdp": 4, "tensor": 8, "pipeline": 8}
EMA_CONFIG = {"ema.enabled": True, "ema.decay": 0.5}
TOL = {"rtol": 1e-5, "atol": 1e-6}


class EmaRegression(ParallelRegression):
    """Keeps the EMA weights after each update listed in `snapshot_steps`."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.ema_snapshots: dict[int, dict[str, torch.Tensor]] = {}

    def optimizer_step(self) -> bool:
        applied = super().optimizer_step()
        if applied and self.train_state.global_step in self.snapshot_steps:
            self.ema_snapshots[self.train_state.global_step] = ema_weights(self)
        return applied


def _train(root: str, name: str, **layout: Any) -> dict:
    """Train two epochs; evaluate and infer with the EMA; check the live weights are back afterwards."""

    class Snapshot(EmaRegression):
        snapshot_steps = (STEPS_PER_EPOCH.get(name, 8),)

    with Snapshot(parallel_config(root, name, **layout, **EMA_CONFIG)) as runner:
        runner.train()
        live = full_weights(runner)
        evaluated = runner.evaluate(["val"])["val"]
        predictions = runner.infer("val")
        after = full_weights(runner)
        return {
            "ema": ema_weights(runner),
            "weights": live,
            "restored": all(torch.equal(after[key], value) for key, value in live.items()),
            "loss": float(evaluated["loss"]) if "loss" in evaluated else None,
            "predictions": predictions,
            "first_epoch": runner.ema_snapshots[STEPS_PER_EPOCH.get(name, 8)],
            "checkpoint": str(runner.workspace.checkpoint_dir / "epoch-000000"),
            "weights_only": isinstance(runner.ema, EMA) and not runner.ema.runnable,
        }


def _resume(root: str, name: str, source: str, *, resized: bool = False, **layout: Any) -> dict:
    """Resume `source` on `layout`; return the EMA right after loading and after training on."""
    overrides = {"resume": source, **EMA_CONFIG}
    if resized:  # another data-parallel size: the interrupted pass restarts
        overrides["checkpoint.exclude_from_loading"] = ["dataloaders"]
    with EmaRegression(parallel_config(root, name, **layout, **overrides)) as runner:
        loaded = ema_weights(runner)
        runner.train()
        return {"loaded": loaded, "ema": ema_weights(runner), "end": runner.train_state.global_step}


def _worker(rank: int, world_size: int, root: str) -> dict:
    results = {name: _train(root, name, **layout) for name, layout in LAYOUTS.items()}
    for name, layout in LAYOUTS.items():
        results[f"{name}-resume"] = _resume(root, f"{name}-resume", results[name]["checkpoint"], **layout)
    fsdp, pipeline = results["fsdp"]["checkpoint"], results["pipeline"]["checkpoint"]
    results["tensor-from-fsdp"] = _resume(root, "tensor-from-fsdp", fsdp, resized=True, **LAYOUTS["tensor"])
    results["fsdp-from-pipeline"] = _resume(root, "fsdp-from-pipeline", pipeline, resized=True, **LAYOUTS["fsdp"])
    return results


def _reference(root: str, batch_size: int) -> dict:
    config = parallel_config(root, f"reference-{batch_size}", stack="torch", **EMA_CONFIG)
    config["dataloader.batch_size"] = batch_size
    with ParallelRegression(config) as runner:
        runner.train()
        evaluated = runner.evaluate(["val"])["val"]
        return {
            "ema": ema_weights(runner),
            "weights": full_weights(runner),
            "loss": float(evaluated["loss"]),
            "predictions": runner.infer("val"),
        }


def _merged(results: list[dict], key: str, entry: str) -> dict[str, torch.Tensor]:
    """The two pipeline stages' entries together (each rank holds its own stage's)."""
    return {**results[0][key][entry], **results[1][key][entry]}


def test_ema_is_sharded_like_the_model_and_matches_one_process(tmp_path):
    results = run_distributed(_worker, str(tmp_path / "dist"), init_process_group=False)
    references = {8: _reference(str(tmp_path), 8), 4: _reference(str(tmp_path), 4)}
    assert not torch.allclose(references[4]["ema"]["head.weight"], references[4]["weights"]["head.weight"])
    for name in LAYOUTS:
        reference = references[8 if name == "fsdp" else 4]
        pipelined = name == "pipeline"
        ema = _merged(results, name, "ema") if pipelined else results[0][name]["ema"]
        assert sorted(ema) == sorted(reference["ema"]), name
        for rank in (0, 1):
            got = results[rank][name]
            assert got["weights_only"] and got["restored"], (name, rank)
            if not pipelined:
                for key, value in got["ema"].items():
                    torch.testing.assert_close(value, ema[key], rtol=0, atol=0, msg=f"{name}: ranks differ at {key}")
            # evaluation and inference ran the averaged weights
            assert got["predictions"] == pytest.approx(reference["predictions"], **{"rel": 1e-5, "abs": 1e-6}), name
        for key, value in reference["ema"].items():
            torch.testing.assert_close(ema[key], value, **TOL, msg=f"{name}: EMA {key}")
        # the pipeline's last stage computes the loss
        loss = results[1][name]["loss"] if pipelined else results[0][name]["loss"]
        assert loss == pytest.approx(reference["loss"], rel=1e-5, abs=1e-6), name
        # a resume from the first epoch's checkpoint continues to the same EMA, bit for bit
        resumed = _merged(results, f"{name}-resume", "ema") if pipelined else results[0][f"{name}-resume"]["ema"]
        assert results[0][f"{name}-resume"]["end"] == 2 * STEPS_PER_EPOCH[name], name
        for key, value in ema.items():
            assert torch.equal(resumed[key], value), f"{name}: resumed EMA {key}"
    # DCP reshards the EMA like the weights: FSDP2 shards -> tensor slices, pipeline stages -> FSDP2 shards
    first = {name: _merged(results, name, "first_epoch") for name in ("pipeline",)}
    first["fsdp"] = results[0]["fsdp"]["first_epoch"]
    for rank in (0, 1):
        for name, source in (("tensor-from-fsdp", "fsdp"), ("fsdp-from-pipeline", "pipeline")):
            loaded = results[rank][name]["loaded"]
            assert sorted(loaded) == sorted(first[source]), name
            for key, value in first[source].items():
                assert torch.equal(loaded[key], value), f"{name}: loaded EMA {key}"
    # ... and one process loads the FSDP2 shards into its runnable copy
    config = parallel_config(str(tmp_path), "single-from-fsdp", resume=results[0]["fsdp"]["checkpoint"])
    config.update({**EMA_CONFIG, "checkpoint.backend": "dcp", "checkpoint.exclude_from_loading": ["dataloaders"]})
    with EmaRegression(config) as runner:
        assert runner.ema.runnable
        for key, value in first["fsdp"].items():
            assert torch.equal(ema_weights(runner)[key], value), f"single-from-fsdp: {key}"
