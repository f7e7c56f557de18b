"""ParallelRunner on real process groups (gloo, CPU): FSDP2, HSDP, tensor parallel, DDP, layout errors.

Each distributed launch trains several layouts in turn; the parent trains the single-process
reference with TorchRunner on the same global batch and compares weights and losses.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from danling.distributed import ParallelContext, ParallelTopology
from danling.runners import ParallelRunner
from tests.dist import free_ports, run_distributed
from tests.runners._parallel_toy import (
    TENSOR_PLAN,
    ParallelRegression,
    ResidualMLP,
    ema_weights,
    full_weights,
    parallel_config,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
_REPO = Path(__file__).resolve().parents[3]

LAYOUTS = {
    "fsdp": {"parallel.axes.shard": 2, "fsdp.enabled": True},
    "fsdp-keep": {"parallel.axes.shard": 2, "fsdp.enabled": True, "fsdp.reshard_after_forward": False},
    "fsdp-ac": {"parallel.axes.shard": -1, "fsdp.enabled": True, "parallel.activation_checkpointing": "block"},
    "fsdp-sac": {"parallel.axes.shard": 2, "fsdp.enabled": True, "parallel.activation_checkpointing": "selective"},
    "fsdp-offload": {"parallel.axes.shard": 2, "fsdp.enabled": True, "fsdp.offload_policy": True},
    "fsdp-clip-accum": {"parallel.axes.shard": 2, "fsdp.enabled": True, "max_grad_norm": 0.5, "accum_steps": 2},
    "ddp": {"parallel.axes.replicate": 2},
    "tensor": {"parallel.axes.tensor": 2, "parallel.tensor_plan": TENSOR_PLAN},
    "tensor-clip": {"parallel.axes.tensor": 2, "parallel.tensor_plan": TENSOR_PLAN, "max_grad_norm": 0.5},
}
# Layouts with two data-parallel ranks read a global batch of 8; tensor-parallel ranks share one batch of 4.
REFERENCE = {
    name: {"dataloader.batch_size": 4 if name.startswith("tensor") else 8}
    | {k: v for k, v in layout.items() if k in ("max_grad_norm", "accum_steps")}
    for name, layout in LAYOUTS.items()
}


BAD_LAYOUTS = {
    "product": ({"parallel.axes.tensor": 3}, ValueError, r"tensor=3 do not multiply to the world size 2"),
    "two-absorbing": (
        {"parallel.axes.shard": -1, "parallel.axes.tensor": -1},
        ValueError,
        "at most one config.parallel.axes entry may be -1",
    ),
    "shard-without-fsdp": ({"parallel.axes.shard": 2}, ValueError, "set fsdp.enabled"),
    "fsdp-without-shard": ({"parallel.axes.replicate": 2, "fsdp.enabled": True}, ValueError, "shard above 1"),
    "tensor-without-plan": ({"parallel.axes.tensor": 2}, NotImplementedError, "parallelize.*tensor_plan is empty"),
    "bad-style": (
        {"parallel.axes.tensor": 2, "parallel.tensor_plan": {"layers.*.up": "diagonal"}},
        ValueError,
        "'diagonal' is not a style; accepted: colwise, rowwise, sequence",
    ),
    "unmatched-plan": (
        {"parallel.axes.tensor": 2, "parallel.tensor_plan": {"blocks.*": "colwise"}},
        ValueError,
        "'blocks.\\*' matches no module",
    ),
    "context-on-cpu": ({"parallel.axes.context": 2}, RuntimeError, "context=2 needs CUDA devices"),
    "file-backend": ({"parallel.axes.replicate": 2, "checkpoint.backend": "file"}, ValueError, "only 'dcp'"),
}


def _layout_errors(root: str) -> dict:
    errors = {}
    for name, (layout, _, _) in BAD_LAYOUTS.items():
        try:
            with ParallelRegression(parallel_config(root, f"bad-{name}", **layout)):
                errors[name] = None
        except Exception as error:
            errors[name] = (type(error), str(error))
    return errors


class HookedMLP(ResidualMLP):
    """Splits its own blocks over the tensor axis with the `ParallelContext` its `parallelize` receives."""

    def parallelize(self, parallel: ParallelContext) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.received = parallel
        for block in self.layers:
            parallelize_module(block, parallel.mesh["tensor"], {"up": ColwiseParallel(), "down": RowwiseParallel()})


class HookedRegression(ParallelRegression):
    def __init__(self, config) -> None:
        super().__init__(config)
        torch.manual_seed(0)  # the same initial weights as ResidualMLP
        self.model = HookedMLP()


def _topology_and_context(runner) -> dict:
    """What `runner.topology` and `runner.parallel` say on this rank (a tensor=2 run)."""
    topology, parallel = runner.topology, runner.parallel
    return {
        "types": (type(topology).__name__, type(parallel).__name__),
        "layout": (topology.degrees["tensor"], topology.coordinates, topology.mesh_shape, topology.mesh_dim_names),
        "domains": (topology.domains["metrics"], topology.size("tensor"), topology.rank("tensor")),
        "context": (parallel.topology is topology, parallel.mesh is topology.mesh, parallel.mesh.mesh_dim_names),
        "groups": (
            parallel.group("data") is topology.group("data"),
            dist.get_process_group_ranks(parallel.group("data")),
        ),
        "received": runner.unwrap(runner.model).received is parallel,
    }


def _train_layouts(rank: int, world_size: int, root: str) -> dict:
    results = {"errors": _layout_errors(root)}
    for name, layout in LAYOUTS.items():
        with ParallelRegression(parallel_config(root, name, **layout)) as runner:
            runner.train()
            results[name] = {"losses": runner.losses, "weights": full_weights(runner), "sharded": _sharded(runner)}
    with HookedRegression(parallel_config(root, "tensor-hook", **{"parallel.axes.tensor": 2})) as runner:
        runner.train()
        results["tensor-hook"] = {"losses": runner.losses, "weights": full_weights(runner)}
        results["tensor-hook"].update(_topology_and_context(runner))
    with ParallelRegression(parallel_config(root, "bf16", precision="bf16", **LAYOUTS["fsdp"])) as runner:
        runner.train()
        results["bf16"] = {"losses": runner.losses, "param_dtype": str(next(runner.model.parameters()).dtype)}
    return results


def _sharded(runner) -> bool:
    return any(type(p).__name__ == "DTensor" for p in runner.model.parameters())


def _reference(tmp_path, name: str) -> dict:
    config = parallel_config(str(tmp_path), f"reference-{name}", stack="torch", **REFERENCE[name])
    with ParallelRegression(config) as runner:
        runner.train()
        return {"losses": runner.losses, "weights": full_weights(runner)}


def test_topology_and_context_types_in_one_process(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    hints = typing.get_type_hints(ParallelRunner.build_topology)
    assert hints["return"] is ParallelTopology
    assert typing.get_type_hints(ParallelRunner.parallel.fget)["return"] is ParallelContext
    with ParallelRegression(parallel_config(str(tmp_path), "one")) as runner:
        assert isinstance(runner.topology, ParallelTopology) and isinstance(runner.parallel, ParallelContext)
        assert runner.parallel.topology is runner.topology and runner.topology.mesh_shape == ()
        assert (runner.parallel.mesh, runner.topology.coordinates["tensor"], runner.parallel.group("data")) == (
            None,
            0,
            None,
        )


def test_fsdp_tensor_and_ddp_layouts_train_like_one_process(tmp_path):
    results = run_distributed(_train_layouts, str(tmp_path / "dist"), init_process_group=False)
    for name, (_, kind, pattern) in BAD_LAYOUTS.items():
        for rank in (0, 1):  # refused on every rank alike, before any training
            error = results[rank]["errors"][name]
            assert error is not None and error[0] is kind and re.search(pattern, error[1]), (name, error)
    references = {name: _reference(tmp_path, name) for name in LAYOUTS}
    for name in [*LAYOUTS, "tensor-hook"]:
        reference = references["tensor" if name == "tensor-hook" else name]
        for rank in (0, 1):
            got = results[rank][name]
            assert got.get("sharded", True) is (name != "ddp"), name
            assert len(got["losses"]) == len(reference["losses"]), name
            assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6), name
            for key, value in reference["weights"].items():
                torch.testing.assert_close(got["weights"][key], value, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
    # The reference's ParallelTopology and ParallelContext, and the context a model's `parallelize` receives
    for rank in (0, 1):
        hooked = results[rank]["tensor-hook"]
        assert hooked["types"] == ("ParallelTopology", "ParallelContext")
        coordinates = {"replicate": 0, "shard": 0, "context": 0, "pipeline": 0, "tensor": rank, "expert": 0}
        assert hooked["layout"] == (2, coordinates, (2,), ("tensor",))
        assert hooked["domains"] == (("replicate", "shard"), 2, rank)
        assert hooked["context"] == (True, True, ("tensor",))
        assert hooked["groups"] == (True, [rank])  # tensor peers read the same batch: a data domain of one
        assert hooked["received"]
    # bf16 parameters in compute (FSDP2 mixed precision), fp32 master weights, finite losses
    bf16 = results[0]["bf16"]
    assert bf16["param_dtype"] == "torch.float32"
    assert all(math.isfinite(loss) for loss in bf16["losses"]) and len(bf16["losses"]) == 8


def test_exact_resume_after_sigkill_fsdp_tensor_and_pipeline_parallel(tmp_path):
    procs, ports = [], free_ports(18)  # the same list on both ranks: 2 per scenario
    for rank in range(2):
        env = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
        env.update(PYTHONPATH=str(_REPO), OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
        command = [sys.executable, "-X", "faulthandler", "-m", "tests.runners._parallel_resume_child"]
        command += ["--root", str(tmp_path), "--ports", ",".join(map(str, ports))]
        procs.append(subprocess.Popen(command, cwd=_REPO, env=env))
    for proc in procs:
        assert proc.wait(timeout=300) == 0, f"the resume child failed; logs are in {tmp_path}"
    for rank in range(2):
        status = json.loads((tmp_path / f"status-rank{rank}.json").read_text())
        for layout in ("fsdp", "tensor", "pipeline"):
            assert status[f"{layout}-clean"] == "exit 0", (layout, status)
            assert status[f"{layout}-killed"] == "SIGKILL", (layout, status)
            assert status[f"{layout}-resume"] == "exit 0", (layout, status)
    for layout in ("fsdp", "tensor", "pipeline"):
        clean = torch.load(tmp_path / layout / "clean.pt", weights_only=False)
        resumed = torch.load(tmp_path / layout / "resume.pt", weights_only=False)
        assert resumed["start"] == 2 and resumed["global_step"] == clean["global_step"]  # resumed mid-epoch
        for key, value in clean["weights"].items():
            assert torch.equal(value, resumed["weights"][key]), f"{layout}: {key} differs after the resume"


def _resharded(root: str, name: str, source: str, **layout) -> dict:
    """Resume `source` on `layout` (a new data-parallel size: the interrupted pass restarts), then train on."""
    overrides = {"resume": source, "checkpoint.exclude_from_loading": ["dataloaders"]}
    with ParallelRegression(parallel_config(root, name, **layout, **overrides)) as runner:
        loaded, start = full_weights(runner), runner.train_state.global_step
        runner.train()
        return {"loaded": loaded, "start": start, "end": runner.train_state.global_step, "losses": runner.losses}


def _first_epoch(root: str, name: str, steps_per_epoch: int, **layout) -> tuple[dict, str]:
    """Train two epochs; return the weights after the first and the path of its checkpoint."""

    class Snapshot(ParallelRegression):
        snapshot_steps = (steps_per_epoch,)

    with Snapshot(parallel_config(root, name, **layout)) as runner:
        runner.train()
        path = runner.workspace.checkpoint_dir / "epoch-000000"
        assert path.is_dir()
        return runner.snapshots[steps_per_epoch], str(path)


def _reshard_layouts(rank: int, world_size: int, root: str, single: str) -> dict:
    saved, path = _first_epoch(root, "fsdp-save", 4, **LAYOUTS["fsdp"])
    return {
        "saved": saved,
        "path": path,
        "tensor-from-fsdp": _resharded(root, "tensor-from-fsdp", path, **LAYOUTS["tensor"]),
        "fsdp-from-single": _resharded(root, "fsdp-from-single", single, **LAYOUTS["fsdp"]),
    }


def test_dcp_checkpoints_reshard_between_layouts_and_training_continues(tmp_path):
    # one process writes a DCP checkpoint ...
    single_weights, single = _first_epoch(str(tmp_path), "single-save", 8, **{"checkpoint.backend": "dcp"})
    # ... two ranks save FSDP shards and load on other layouts (shard=2 -> tensor=2, 1 process -> shard=2)
    results = run_distributed(_reshard_layouts, str(tmp_path), single, init_process_group=False)
    for rank in (0, 1):
        got = results[rank]
        for key, value in got["saved"].items():
            assert torch.equal(got["tensor-from-fsdp"]["loaded"][key], value), key
        for key, value in single_weights.items():
            assert torch.equal(got["fsdp-from-single"]["loaded"][key], value), key
        # tensor=2 has 1 data rank: it keeps the 2-rank global batch with 2 micro-batches per update
        # (4 updates per epoch, as on 2 ranks); 2 ranks cannot keep 1 micro-batch per update.
        for name, start, steps_per_epoch in (("tensor-from-fsdp", 4, 4), ("fsdp-from-single", 8, 4)):
            run = got[name]
            assert run["start"] == start and run["end"] == start + steps_per_epoch, name
            assert all(math.isfinite(loss) for loss in run["losses"]), name
    # ... and one process loads the FSDP shards (shard=2 -> 1)
    back = _resharded(str(tmp_path), "single-from-fsdp", results[0]["path"], **{"checkpoint.backend": "dcp"})
    for key, value in results[0]["saved"].items():
        assert torch.equal(back["loaded"][key], value), key
    assert back["start"] == 4 and back["end"] == 4 + 4  # 2 micro-batches per update, as on 2 ranks


FOUR_RANK_LAYOUTS = {
    "fsdp+tensor": {
        "parallel.axes.shard": 2,
        "parallel.axes.tensor": 2,
        "fsdp.enabled": True,
        "max_grad_norm": 0.5,
        "ema.enabled": True,  # the EMA sharded over the 2x2 mesh too
    },
    "hsdp": {"parallel.axes.replicate": 2, "parallel.axes.shard": 2, "fsdp.enabled": True},
}


def _train_four_rank_layouts(rank: int, world_size: int, root: str) -> dict:
    results = {}
    for name, layout in FOUR_RANK_LAYOUTS.items():
        if "parallel.axes.tensor" in layout:
            layout = {**layout, "parallel.tensor_plan": TENSOR_PLAN}
        with ParallelRegression(parallel_config(root, name, **layout)) as runner:
            runner.train()
            results[name] = {"losses": runner.losses, "weights": full_weights(runner), "mesh": runner.topology.mesh}
            results[name]["ema"] = ema_weights(runner) if runner.ema is not None else {}
    return {name: {**result, "mesh": str(result["mesh"])} for name, result in results.items()}


def test_two_dimensional_meshes_on_four_ranks_train_like_one_process(tmp_path):
    results = run_distributed(_train_four_rank_layouts, str(tmp_path / "dist"), world_size=4, init_process_group=False)
    references = {  # 2 data-parallel ranks of 4 (fsdp+tensor), 4 of 4 (hsdp)
        "fsdp+tensor": {"dataloader.batch_size": 8, "max_grad_norm": 0.5, "ema.enabled": True},
        "hsdp": {"dataloader.batch_size": 16},
    }
    for name, overrides in references.items():
        config = parallel_config(str(tmp_path), f"reference-{name}", stack="torch", **overrides)
        with ParallelRegression(config) as runner:
            runner.train()
            reference = {"losses": runner.losses, "weights": full_weights(runner)}
            reference["ema"] = ema_weights(runner) if runner.ema is not None else {}
        assert sorted(results[0][name]["ema"]) == sorted(reference["ema"]), name
        for rank in range(4):
            got = results[rank][name]
            for key, value in reference["ema"].items():
                torch.testing.assert_close(got["ema"][key], value, rtol=1e-5, atol=1e-6, msg=f"{name}: EMA {key}")
            assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6), name
            for key, value in reference["weights"].items():
                torch.testing.assert_close(got["weights"][key], value, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
    assert "(shard=2, tensor=2)" in results[0]["fsdp+tensor"]["mesh"]
    assert "(replicate=2, shard=2)" in results[0]["hsdp"]["mesh"]
