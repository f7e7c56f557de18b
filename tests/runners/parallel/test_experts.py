"""Expert parallelism on real process groups (gloo, CPU): a 4-expert MoE on 2 ranks with expert=2.

One launch trains the experts split over the two ranks (tokens exchanged with all-to-all) under DDP,
with accumulation and clipping, and under FSDP2, resumes the DDP run from its first epoch's DCP
checkpoint, and collects the refused layouts; the parent trains
the same model in one process and loads the two-rank checkpoint there (DCP reshards the experts).
"""

from __future__ import annotations

import re

import pytest
import torch

from danling.distributed import ParallelTopology
from danling.distributed.layout import check_layout
from danling.runners import ParallelRunner
from tests.dist import run_distributed
from tests.runners._moe_toy import MoERunner
from tests.runners._parallel_toy import ParallelRegression, full_weights, parallel_config

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

EXPERT = {"parallel.axes.replicate": 2, "parallel.axes.expert": 2}
CLIPPED = {"accum_steps": 2, "max_grad_norm": 0.05}  # DDP's no_sync window, then a norm over DTensor experts
# FSDP2 shards the dense layers over the data ranks; the experts stay split over the expert axis
SHARDED = {"parallel.axes.replicate": 1, "parallel.axes.shard": 2, "parallel.axes.expert": 2, "fsdp.enabled": True}
STEPS_PER_EPOCH = 4  # 32 samples, 2 data ranks of 4 per batch

REFUSED = {
    "no-experts-split": (ParallelRegression, {}, NotImplementedError, r"expert=2 but ResidualMLP split no experts"),
    "with-ema": (
        MoERunner,
        {"ema.enabled": True},
        ValueError,
        r"expert=2 is supported with the data axes \(replicate, shard\) only .* not with ema.enabled",
    ),
    "expert-tensor": (
        MoERunner,
        {"parallel.axes.expert_tensor": 2},
        ValueError,
        r"tensor parallelism inside experts is not supported: expert_tensor=2 must be 1",
    ),
    "indivisible": (
        MoERunner,
        {"parallel.axes.expert": 3},
        ValueError,
        r"expert=3 borrows data-parallel ranks from parallel.axes.replicate=2 .* must divide it",
    ),
}


class Snapshot(MoERunner):
    snapshot_steps = (STEPS_PER_EPOCH,)


def _refusals(root: str) -> dict:
    errors = {}
    for name, (runner_class, layout, _, _) in REFUSED.items():
        try:
            with runner_class(parallel_config(root, f"refused-{name}", **{**EXPERT, **layout})):
                errors[name] = None
        except Exception as error:
            errors[name] = (type(error), str(error))
    return errors


def _train_experts(rank: int, world_size: int, root: str) -> dict:
    with Snapshot(parallel_config(root, "experts", **EXPERT)) as runner:
        runner.train()
        model = runner.unwrap(runner.model)
        topology = runner.topology
        result = {
            "losses": runner.losses,
            "weights": full_weights(runner),
            "saved": runner.snapshots[STEPS_PER_EPOCH],
            "path": str(runner.workspace.checkpoint_dir / "epoch-000000"),
            "local_shape": tuple(model.experts.w1.to_local().shape),
            "topology": (
                topology.coordinates["expert"],
                topology.ranks("expert"),
                topology.ranks("expert_data"),
                topology.mesh_dim_names,
                topology.domains["data"],
            ),
            "received": model.received is runner.parallel,
            "ddp_ignores": sorted(getattr(runner.model, "parameters_to_ignore", ())),
        }
    overrides = {"resume": result["path"], **EXPERT}
    with MoERunner(parallel_config(root, "experts-resumed", **overrides)) as runner:
        result["resumed_start"] = runner.train_state.global_step
        result["resumed_loaded"] = full_weights(runner)
        runner.train()
        result["resumed"] = {"losses": runner.losses, "weights": full_weights(runner)}
    with MoERunner(parallel_config(root, "experts-clipped", **EXPERT, **CLIPPED)) as runner:
        runner.train()
        result["clipped"] = {"losses": runner.losses, "weights": full_weights(runner)}
    with MoERunner(parallel_config(root, "experts-fsdp", **SHARDED)) as runner:
        runner.train()
        model = runner.unwrap(runner.model)
        placements = (str(model.experts.w1.placements), str(model.inp.weight.placements))
        result["fsdp"] = {"losses": runner.losses, "weights": full_weights(runner), "placements": placements}
    result["errors"] = _refusals(root)
    return result


def test_four_experts_on_two_ranks_train_resume_and_reshard_like_one_process(tmp_path):
    results = run_distributed(_train_experts, str(tmp_path / "dist"), init_process_group=False)
    config = parallel_config(str(tmp_path), "reference", stack="torch", **{"dataloader.batch_size": 8})
    with MoERunner(config) as runner:
        runner.train()
        reference = {"losses": runner.losses, "weights": full_weights(runner)}
    assert reference["weights"]["experts.w1"].shape[0] == 4
    config = parallel_config(
        str(tmp_path), "reference-clipped", stack="torch", **{"dataloader.batch_size": 8}, **CLIPPED
    )
    with MoERunner(config) as runner:
        runner.train()
        clipped = {"losses": runner.losses, "weights": full_weights(runner)}
    for rank in (0, 1):
        got = results[rank]
        # the experts are split, the dense layers replicated; DDP leaves the experts to ExpertGradients
        assert got["local_shape"] == (2, 8, 16) and got["received"]
        assert got["ddp_ignores"] == ["experts.w1", "experts.w2"]
        assert got["topology"] == (rank, [0, 1], [rank], ("expert",), ("replicate_rest", "expert", "shard"))
        assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
        for key, value in reference["weights"].items():
            torch.testing.assert_close(got["weights"][key], value, rtol=1e-5, atol=1e-6, msg=key)
        assert got["fsdp"]["placements"] == ("(Shard(dim=0),)", "(Shard(dim=0),)")  # experts: expert mesh; dense: FSDP2
        assert got["fsdp"]["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
        for key, value in reference["weights"].items():
            torch.testing.assert_close(got["fsdp"]["weights"][key], value, rtol=1e-5, atol=1e-6, msg=f"fsdp: {key}")
        assert got["clipped"]["losses"] == pytest.approx(clipped["losses"], rel=1e-5, abs=1e-6)
        for key, value in clipped["weights"].items():
            torch.testing.assert_close(got["clipped"]["weights"][key], value, rtol=1e-5, atol=1e-6, msg=key)
        # DCP resume on the same layout continues exactly
        assert got["resumed_start"] == STEPS_PER_EPOCH
        for key, value in got["saved"].items():
            assert torch.equal(got["resumed_loaded"][key], value), key
        for key, value in got["weights"].items():
            assert torch.equal(got["resumed"]["weights"][key], value), f"{key} differs after the resume"
        assert got["resumed"]["losses"] == got["losses"][len(got["losses"]) // 2 :]
        for name, (_, _, kind, pattern) in REFUSED.items():  # refused on every rank alike, before training
            error = got["errors"][name]
            assert error is not None and error[0] is kind and re.search(pattern, error[1]), (name, error)
    # one process loads the two ranks' expert shards (DCP reshards them into the whole stack)
    overrides = {"resume": results[0]["path"], "checkpoint.backend": "dcp"}
    with MoERunner(parallel_config(str(tmp_path), "single-from-experts", **overrides)) as runner:
        assert isinstance(runner, ParallelRunner)
        for key, value in results[0]["saved"].items():
            assert torch.equal(full_weights(runner)[key], value), key


@pytest.mark.parametrize("axis", ["tensor", "pipeline"])
def test_experts_with_model_parallel_axes_are_refused(axis):
    data = "shard" if axis == "tensor" else "replicate"  # tensor parallelism with several data ranks needs FSDP2
    topology = ParallelTopology({data: 2, axis: 2, "expert": 2}, rank=0)
    with pytest.raises(ValueError, match=rf"expert=2 is supported with the data axes .* not with {axis}=2"):
        check_layout(topology, fsdp=data == "shard", ema=False)
