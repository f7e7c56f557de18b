"""Pipeline parallelism: stage layout, model parts, schedules against single-process training, loaders.

The distributed checks run in two launches (2 and 4 gloo ranks) that each cover several
scenarios; everything that needs no process group runs in-process.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from danling.data import build_dataloader
from danling.distributed import ParallelTopology
from danling.distributed.pipeline import (
    build_stage_part,
    check_forward_only,
    microbatch_count,
    pipeline_loader,
    stage_count,
    stage_indices,
    train_batch_size,
)
from danling.distributed.pipeline_loader import StepProxyLoader
from danling.distributed.pipeline_parts import PipelineModelPart, stage_placement, validate_module_fqns
from danling.distributed.pipeline_runtime import ScheduleCache
from danling.runners.config import RunnerConfig
from tests.dist import process_group, run_distributed
from tests.runners._pipeline_harness import (
    PipelineHost,
    make_batches,
    make_net,
    max_weight_diff,
    reference_training,
)
from tests.runners._pipeline_runner import PipelinedRunner, PlainRunner, SavingRunner, run, runner_config

FQNS_2 = [["inp", "layers.0", "layers.1"], ["layers.2", "layers.3", "head"]]
FQNS_4 = [["inp", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "head"]]
TOL = 1e-6
SCHEDULE_CASES = {
    "gpipe": dict(schedule="GPipe", fqns=FQNS_2, n_microbatches=4),
    "1f1b": dict(schedule="1F1B", microbatch_size=2),  # stages from the model's hook
    "interleaved": dict(schedule="Interleaved1F1B", fqns=FQNS_4, n_microbatches=4),
    "zbv": dict(schedule="ZBVZeroBubble", fqns=FQNS_4, n_microbatches=4),  # V placement
    "dualpipev": dict(schedule="DualPipeV", fqns=FQNS_4, n_microbatches=4),
    "loopedbfs": dict(schedule="LoopedBFS", fqns=FQNS_4, n_microbatches=4),
    "zero_bubble": dict(schedule="InterleavedZeroBubble", fqns=FQNS_4, n_microbatches=4),
}


# ---------------------------------------------------------------------- in-process
class LayoutHost:
    """Just enough of a runner to ask layout questions of `danling.distributed.pipeline`: no process groups.

    Its methods are what `ParallelRunner` computes with those functions from its config sections.
    """

    def __init__(self, rank: int = 0, degree: int = 2, model: nn.Module | None = None, **parallel) -> None:
        self.topology = ParallelTopology({"pipeline": degree}, rank=rank)
        options = {
            "pipeline_schedule": "1F1B",
            "pipeline_microbatch_size": 1,
            "pipeline_n_microbatches": None,
            "module_fqns_per_model_part": None,
        }
        options.update(parallel)
        self.config = SimpleNamespace(parallel=SimpleNamespace(**options), dataloader=SimpleNamespace(batch_size=8))
        self.model = model

    def _count(self, model=None) -> int:
        parallel = self.config.parallel
        return stage_count(
            self.topology.size("pipeline"),
            schedule=parallel.pipeline_schedule,
            module_fqns=parallel.module_fqns_per_model_part,
            model=model if model is not None else self.model,
        )

    def pipeline_stage_indices(self, num_stages=None):
        num_stages = self._count() if num_stages is None else num_stages
        schedule = self.config.parallel.pipeline_schedule
        return stage_indices(
            self.topology.rank("pipeline"), self.topology.size("pipeline"), num_stages, schedule=schedule
        )

    def pipeline_microbatches(self):
        parallel = self.config.parallel
        return microbatch_count(
            train_batch_size(self.config.dataloader),
            n_microbatches=parallel.pipeline_n_microbatches,
            microbatch_size=parallel.pipeline_microbatch_size,
        )

    def build_pipeline_model_part(self, model, stage_index=None):
        num_stages = self._count(model)
        if stage_index is None:
            stage_index = self.pipeline_stage_indices(num_stages)[0]
        degree, fqns = self.topology.size("pipeline"), self.config.parallel.module_fqns_per_model_part
        return build_stage_part(model, stage_index, num_stages, degree=degree, module_fqns=fqns)


def test_stage_indices_loop_and_v():
    assert [LayoutHost(rank).pipeline_stage_indices() for rank in (0, 1)] == [(0,), (1,)]
    interleaved = [LayoutHost(rank, pipeline_schedule="interleaved1f1b") for rank in (0, 1)]
    assert [host.pipeline_stage_indices() for host in interleaved] == [(0, 2), (1, 3)]  # two per rank by default
    assert LayoutHost(1, degree=4, pipeline_schedule="Interleaved1F1B").pipeline_stage_indices(12) == (1, 5, 9)
    assert [LayoutHost(rank, pipeline_schedule="ZBVZeroBubble").pipeline_stage_indices() for rank in (0, 1)] == [
        (0, 3),
        (1, 2),
    ]
    assert stage_placement(6, 3, "v") == {0: 0, 1: 1, 2: 2, 3: 2, 4: 1, 5: 0}
    # The stage count follows module_fqns_per_model_part, then the model's declaration.
    six = [[f"layers.{index}"] for index in range(6)]
    assert LayoutHost(
        1, pipeline_schedule="Interleaved1F1B", module_fqns_per_model_part=six
    ).pipeline_stage_indices() == (
        1,
        3,
        5,
    )
    declared = make_net()
    declared.pipeline_num_stages = 6
    assert LayoutHost(1, model=declared, pipeline_schedule="LoopedBFS").pipeline_stage_indices() == (1, 3, 5)


def test_stage_layout_errors():
    with pytest.raises(ValueError, match=r"'1F1B' runs one stage per rank.*4 stages"):
        LayoutHost(0).pipeline_stage_indices(4)
    with pytest.raises(ValueError, match=r"3 pipeline stages cannot be spread evenly over pipeline degree 2"):
        LayoutHost(0, pipeline_schedule="Interleaved1F1B").pipeline_stage_indices(3)
    with pytest.raises(ValueError, match=r"unknown parallel.pipeline_schedule 'Bogus'; accepted: GPipe, 1F1B"):
        LayoutHost(0, pipeline_schedule="Bogus").pipeline_stage_indices()
    with pytest.raises(ValueError, match=r"unknown parallel.pipeline_schedule 'PipelineScheduleSingle'"):
        LayoutHost(0, pipeline_schedule="PipelineScheduleSingle").pipeline_stage_indices()
    with pytest.raises(ValueError, match=r"has 3 stages, which is not a multiple of the pipeline degree 2"):
        LayoutHost(0, module_fqns_per_model_part=FQNS_4[:3]).pipeline_stage_indices()
    declared = make_net()
    declared.pipeline_num_stages = 3
    with pytest.raises(ValueError, match=r"pipeline_num_stages must be a positive multiple of the pipeline degree 2"):
        LayoutHost(0, model=declared).pipeline_stage_indices()


def test_microbatch_count_errors():
    assert LayoutHost(0, pipeline_microbatch_size=2).pipeline_microbatches() == 4
    assert LayoutHost(0, pipeline_n_microbatches=2, pipeline_microbatch_size=3).pipeline_microbatches() == 2
    with pytest.raises(ValueError, match=r"pipeline_microbatch_size=3 must be a positive divisor of .*batch_size=8"):
        LayoutHost(0, pipeline_microbatch_size=3).pipeline_microbatches()
    with pytest.raises(ValueError, match=r"pipeline_n_microbatches=3 must be a positive divisor of .*batch_size=8"):
        LayoutHost(0, pipeline_n_microbatches=3).pipeline_microbatches()
    with pytest.raises(ValueError, match=r"pipeline_n_microbatches=0"):
        LayoutHost(0, pipeline_n_microbatches=0).pipeline_microbatches()
    # A batch size set for the train split only counts as well.
    host = LayoutHost(0, pipeline_microbatch_size=2)
    host.config.dataloader = RunnerConfig({"dataloader": {"train": {"batch_size": 6}}}).dataloader
    assert host.pipeline_microbatches() == 3


def test_model_parts_keep_original_keys_and_compute_the_model():
    model = make_net()
    x = torch.randn(5, 4)
    parts = [LayoutHost(rank, module_fqns_per_model_part=FQNS_2).build_pipeline_model_part(model) for rank in (0, 1)]
    assert list(parts[0].state_dict()) == [
        "inp.weight",
        "inp.bias",
        "layers.0.linear.weight",
        "layers.0.linear.bias",
        "layers.1.linear.weight",
        "layers.1.linear.bias",
    ]
    assert {k for part in parts for k in part.state_dict()} == set(model.state_dict())
    assert (
        parts[0].get_submodule("layers.0") is model.layers[0]
    )  # shared, not copied: other stages' weights can be freed
    torch.testing.assert_close(parts[1](parts[0](x)), model(x), rtol=0, atol=0)
    # A part loads the whole model's checkpoint entries under the same keys.
    other = make_net(seed=3)
    part = PipelineModelPart(other, FQNS_2[1])
    part.load_state_dict({k: v for k, v in model.state_dict().items() if k in part.state_dict()})
    torch.testing.assert_close(other.head.weight, model.head.weight)


def test_model_hook_and_part_errors():
    hooked = make_net(hooked=True)
    parts = [LayoutHost(rank, model=hooked).build_pipeline_model_part(hooked) for rank in (0, 1)]
    assert parts[1].fqns == ("layers.2", "layers.3", "head")
    with pytest.raises(ValueError, match=r"define Net.build_pipeline_model_part\(stage_index, num_stages\) or set"):
        LayoutHost(0).build_pipeline_model_part(make_net())

    class Bad(nn.Module):
        def build_pipeline_model_part(self, stage_index, num_stages):
            return "not a module"

    with pytest.raises(TypeError, match=r"must return an nn.Module, got str"):
        LayoutHost(0).build_pipeline_model_part(Bad())
    with pytest.raises(ValueError, match=r"Net has no submodule 'layers.9'"):
        LayoutHost(0, module_fqns_per_model_part=[["inp"], ["layers.9"]]).build_pipeline_model_part(make_net(), 1)
    with pytest.raises(ValueError, match=r"'inp' is listed for pipeline stages 0 and 1"):
        validate_module_fqns([["inp"], ["inp"]], 2)
    with pytest.raises(ValueError, match=r"module_fqns_per_model_part\[1\] is empty"):
        validate_module_fqns([["inp"], []], 2)
    with pytest.raises(ValueError, match=r"'layers.0.linear' lies inside 'layers'"):
        PipelineModelPart(make_net(), ["layers", "layers.0.linear"])


def test_step_proxy_loader_counts_and_resumes():
    loader = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=3)
    proxy = StepProxyLoader(loader)
    assert len(proxy) == 4 and list(proxy) == [None] * 4 and list(proxy) == [None] * 4
    iterator = iter(proxy)
    next(iterator), next(iterator)
    assert proxy.position == 2
    # Nothing of its own is saved: the checkpoint's copy is the real loader's (pipeline peers share it).
    assert not hasattr(proxy, "state_dict")
    assert proxy.sampler is loader.sampler and proxy.batch_sampler is loader.batch_sampler
    resumed = StepProxyLoader(loader)
    resumed.load_state_dict({"position": 2})
    assert list(resumed) == [None, None]  # the rest of the interrupted pass
    assert list(resumed) == [None] * 4 and resumed.position == 0
    with pytest.raises(ValueError, match=r"position 7 is outside a pass of 4 batches"):
        resumed.load_state_dict({"position": 7})
    # The real loader's state (pipeline peers share a data rank's copy) gives the same position.
    real = build_dataloader(TensorDataset(torch.arange(12.0)), split="train", config={"batch_size": 3}, seed=0)
    workers = build_dataloader(
        TensorDataset(torch.arange(12.0)), split="train", config={"batch_size": 3, "num_workers": 1}, seed=0
    )
    for source in (real, workers):
        iterator = iter(source)
        next(iterator), next(iterator), next(iterator)
        resumed = StepProxyLoader(source)
        resumed.load_state_dict(source.state_dict())
        assert list(resumed) == [None]
        list(iterator)
        resumed.load_state_dict(source.state_dict())  # a finished pass: the next one is full
        assert list(resumed) == [None] * 4
    with pytest.raises(TypeError, match=r"has no len\(\)"):
        StepProxyLoader(batch for batch in loader)


def test_v_schedules_refuse_forward_only_steps():
    # What PipelineSteps.evaluate_step and infer_step check first, on every rank.
    with pytest.raises(NotImplementedError, match=r"'DualPipeV' trains, but torch's V schedules"):
        check_forward_only("DualPipeV")
    with pytest.raises(NotImplementedError, match=r"cannot run forward-only \(evaluate/infer\)"):
        check_forward_only("ZBVZeroBubble")
    check_forward_only("Interleaved1F1B")


def test_pipeline_loader_gives_data_only_to_edge_stages():
    loader = DataLoader(list(range(4)))
    for first, last, target, proxied in [
        (True, False, True, False),
        (False, True, True, False),
        (False, True, False, True),  # inference: the last stage needs no target
        (False, False, True, True),
    ]:
        result = pipeline_loader(loader, first, last, needs_target=target)
        assert isinstance(result, StepProxyLoader) is proxied and (proxied or result is loader)


def test_schedule_cache_picks_equal_microbatches_per_shape():
    built: list[int] = []

    def build(count):
        if count in (3, 1):
            raise ValueError("rejected")  # as a schedule class may reject a count
        built.append(count)
        return SimpleNamespace(_n_microbatches=count)

    cache, main = ScheduleCache(build, capacity=2), SimpleNamespace(_n_microbatches=4)
    assert cache.get(main, (1, 2, 8, 4)) is main  # the first shape the main count divides
    assert cache.get(main, (1, 2, 8, 4)) is main
    assert cache.get(main, (1, 2, 6, 4))._n_microbatches == 2  # 6 = 2 x 3: 3 is rejected, 2 divides
    assert cache.get(main, (1, 2, 12, 4))._n_microbatches == 4  # another shape: a schedule of its own
    assert cache.get(main, (1, 2, 5, 4))._n_microbatches == 5  # 1 is rejected: the next larger divisor
    assert built == [2, 4, 5] and len(cache.others) == 2  # the least recently used was dropped
    with pytest.raises(ValueError, match=r"no pipeline schedule accepts any microbatch count for a batch of 3"):
        cache.get(main, (1, 2, 3, 4))
    fallback = ScheduleCache(build, lambda count: SimpleNamespace(_n_microbatches=count, simple=True))
    assert fallback.get(main, (1, 2, 3, 4)).simple and fallback.others[1, 2, 3, 4]._n_microbatches == 3


# ---------------------------------------------------------------------- distributed
def _train(host, reference, batches, accum_steps=1):
    """Pipeline losses and the reference losses/weights for the same batches."""
    ref_losses, ref_state = reference_training(reference, batches, accum_steps=accum_steps)
    losses = [host.pipeline.train_step(batch)[1].item() for batch in batches]
    return {
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "weights": max_weight_diff(host.state(), ref_state),
        "stepped": max_weight_diff(host.state(), reference.state_dict()),
    }


def _two_rank_hosts():
    results = {}
    batches = make_batches(4, 8)
    batches[3] = (batches[3][0][:6], batches[3][1][:6])  # a short last batch: microbatches of 2 x 3
    for name, options in SCHEDULE_CASES.items():
        model = make_net(hooked=name == "1f1b")
        reference = copy.deepcopy(model)
        host = PipelineHost(model, **options)
        results[name] = _train(host, reference, batches)
        results[name]["stages"] = host.pipeline_stage_indices()
        results[name]["keys"] = sorted(host.state())
    model = make_net()
    host = PipelineHost(copy.deepcopy(model), schedule="1F1B", fqns=FQNS_2, n_microbatches=2, accum_steps=2)
    results["accumulate"] = _train(host, model, batches, accum_steps=2)
    # A loss scale (a power of two: exact) enters in the pipeline loss and leaves in the optimizer step.
    model = make_net()
    host = PipelineHost(copy.deepcopy(model), schedule="GPipe", fqns=FQNS_2, n_microbatches=4, loss_scale=1024.0)
    results["scaled"] = _train(host, model, batches)
    results["evaluate"] = _evaluate_and_infer(make_net())
    return results


def _two_rank_worker(rank, world_size, root):
    with process_group():  # the hosts' collectives; each runner below starts and ends its own group
        results = _two_rank_hosts()
    # The real torch runner's loops, accumulation, metrics, evaluation and inference on top.
    options = {"parallel.axes.pipeline": 2, "parallel.module_fqns_per_model_part": FQNS_2}
    results["runner"] = run(PipelinedRunner(runner_config(f"{root}/pipelined", **options)))
    # Resume the single-process DCP checkpoint of the first epoch on the pipeline layout.
    resume = {**options, "resume": f"{root}/plain-checkpoints/epoch-000000"}
    results["resumed"] = run(PipelinedRunner(runner_config(f"{root}/resumed", **resume)), predict=False)
    # fp16 autocast through the stages (no loss scaler on CPU).
    half = {**options, "precision": "fp16"}
    results["fp16"] = run(PipelinedRunner(runner_config(f"{root}/fp16", **half)), predict=False)["rows"]
    return results


def _evaluate_and_infer(model):
    """Evaluate and infer before any training step (inference mode), then train, then evaluate again."""
    host = PipelineHost(copy.deepcopy(model), schedule="Interleaved1F1B", fqns=FQNS_4, n_microbatches=4)
    (x, y), train = make_batches(2, 8, seed=5)
    out = {}
    with torch.inference_mode():
        _, loss = host.pipeline.evaluate_step((x, y))
        predictions = host.pipeline.infer_step(x)
        _, no_target = host.pipeline.evaluate_step(x[:5])  # another batch size, and no target
    with torch.no_grad():
        expected = model(x)
    out["eval_loss"] = abs(loss.item() - nn.functional.mse_loss(expected, y).item())
    out["infer"] = max(abs(a - b) for a, b in zip(predictions, expected.squeeze(-1).tolist()))
    out["infer_len"], out["no_target"] = len(predictions), no_target
    out["metric_pred"] = [
        (pred - expected).abs().max().item() if host.pipeline_has_last_stage else None
        for pred, _ in host.metric_updates
    ]
    _, trained = host.pipeline.train_step(train)
    with torch.no_grad():
        out["train_after_eval"] = abs(trained.item() - nn.functional.mse_loss(model(train[0]), train[1]).item())
    return out


@pytest.mark.distributed
def test_pipeline_schedules_match_single_process(tmp_path):
    expected = run(PlainRunner(runner_config(str(tmp_path / "plain"), **{"checkpoint.backend": "dcp"})))
    (tmp_path / "plain-checkpoints").symlink_to(expected["checkpoints"])
    results = run_distributed(_two_rank_worker, str(tmp_path), world_size=2, init_process_group=False)
    for rank, result in enumerate(results):
        for name in (*SCHEDULE_CASES, "accumulate", "scaled"):
            assert result[name]["loss"] < TOL, (rank, name, result[name])
            assert result[name]["weights"] < TOL, (rank, name, result[name])
            assert result[name]["stepped"] > 1e-3  # the weights did move
        assert result["gpipe"]["stages"] == result["1f1b"]["stages"] == (rank,)
        assert result["interleaved"]["stages"] == (rank, rank + 2)
        assert result["zbv"]["stages"] == (rank, 3 - rank)
        evaluation = result["evaluate"]
        assert evaluation["eval_loss"] < TOL and evaluation["infer"] < TOL and evaluation["infer_len"] == 8
        assert evaluation["no_target"] is None and evaluation["train_after_eval"] < TOL
    # Rank 1 holds the last stage: its metrics saw the whole-batch predictions; rank 0 saw none.
    assert results[0]["evaluate"]["metric_pred"] == []
    assert len(results[1]["evaluate"]["metric_pred"]) == 1 and results[1]["evaluate"]["metric_pred"][0] < TOL
    keys = [set(result[name]["keys"]) for result in results for name in ("gpipe", "interleaved")]
    assert keys[0] | keys[2] == keys[1] | keys[3] == set(make_net().state_dict())  # original FQNs, any layout
    assert not keys[0] & keys[2]
    # Runner: every rank logs the single-process losses; the last stage's metrics match too.
    runs = [result["runner"] for result in results]
    assert set(runs[0]["rows"]) == set(expected["rows"]) == {(0, "train"), (0, "val"), (1, "train"), (1, "val")}
    for key, (loss, mse) in expected["rows"].items():
        assert abs(runs[0]["rows"][key][0] - loss) < TOL and abs(runs[1]["rows"][key][0] - loss) < TOL, key
        # The last stage's metrics on every rank: scores, best checkpoints and early stopping agree.
        assert abs(runs[0]["rows"][key][1] - mse) < TOL and abs(runs[1]["rows"][key][1] - mse) < TOL, key
    for run_ in runs:
        assert max(abs(a - b) for a, b in zip(run_["predictions"], expected["predictions"])) < TOL
        assert len(run_["predictions"]) == len(expected["predictions"]) == 6
    assert runs[0]["keys"] == sorted(keys[0]) and runs[1]["keys"] == sorted(keys[2])
    for key, (loss, _) in expected["rows"].items():
        assert abs(results[0]["fp16"][key][0] - loss) < 2e-3, (key, results[0]["fp16"][key])
    # DCP checkpoints reshard between the pipeline and the single-process layout, both ways.
    for result in results:
        assert abs(result["resumed"]["rows"][1, "train"][0] - expected["rows"][1, "train"][0]) < TOL
        for key, value in result["resumed"]["weights"].items():
            torch.testing.assert_close(value, expected["weights"][key], rtol=0, atol=TOL)
    config = runner_config(str(tmp_path / "back"), **{"checkpoint.backend": "dcp", "epochs": 2})
    config["resume"] = f"{runs[0]['checkpoints']}/epoch-000001"
    back = PlainRunner(config)
    for key, value in back.model.state_dict().items():
        assert torch.equal(value, runs[0]["weights"].get(key, runs[1]["weights"].get(key))), key
    back.close()


def _four_rank_hosts():
    out = {}
    # Four stages, one per rank: the middle ranks read no data and still take every step.
    model = make_net()
    reference = copy.deepcopy(model)
    host = PipelineHost(model, schedule="1F1B", fqns=FQNS_4, n_microbatches=4, batch_size=4)
    xs, ys = zip(*make_batches(3, 4, seed=7))
    loader = host.pipeline.runtime.loader(DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=4))
    losses, seen = [], []
    for batch in loader:
        seen.append(batch is None)
        losses.append(host.pipeline.train_step(batch)[1].item())
    ref_losses, ref_state = reference_training(reference, list(zip(xs, ys)))
    out["proxied"], out["seen_none"] = isinstance(loader, StepProxyLoader), seen
    out["loss"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
    out["weights"] = max_weight_diff(host.state(), ref_state)
    # Replicas x pipeline: the pipeline group is a proper subgroup, each replica its own batches.
    model = make_net()
    host = PipelineHost(copy.deepcopy(model), schedule="GPipe", fqns=FQNS_2, axes={"replicate": 2, "pipeline": 2})
    batches = make_batches(2, 8, seed=10 + host.topology.rank("replicate"))
    with torch.inference_mode():
        out["replica_infer"] = host.pipeline.infer_step(batches[0][0])
    with torch.no_grad():
        out["replica_expected"] = model(batches[0][0]).squeeze(-1).tolist()
    out["replica"] = _train(host, model, batches)
    # FSDP2 x pipeline with accumulation: each shard rank reads half of every global batch.
    model = make_net()
    host = PipelineHost(
        copy.deepcopy(model),
        fqns=FQNS_2,
        n_microbatches=4,
        accum_steps=2,
        axes={"shard": 2, "pipeline": 2},
        wrap=_shard,
    )
    shard, full = host.topology.rank("shard"), make_batches(4, 16, seed=20)
    for x, y in full:
        host.pipeline.train_step((x[8 * shard : 8 * shard + 8], y[8 * shard : 8 * shard + 8]))
    out["fsdp"] = max_weight_diff(host.state(), reference_training(model, full, accum_steps=2)[1])
    return out


def _four_rank_worker(rank, world_size, root):
    out = {}
    # Resume mid-epoch (after update 4 of 6) on four stages: the middle ranks' StepProxyLoaders
    # take the real loaders' position from the checkpoint, and the run ends bit for bit the same.
    four = {"parallel.axes.pipeline": 4, "parallel.module_fqns_per_model_part": FQNS_4}
    four["dataloader.train.shuffle"] = True
    whole = run(SavingRunner(runner_config(f"{root}/whole", **four)), predict=False)
    four["resume"] = f"{whole['checkpoints']}/step-000004"
    resumed = run(PipelinedRunner(runner_config(f"{root}/resumed", **four)), predict=False)
    out["resume_equal"] = all(torch.equal(value, resumed["weights"][key]) for key, value in whole["weights"].items())
    # The runner over FSDP2 x pipeline: each shard rank reads half of every global batch.
    options = {
        "parallel.axes.shard": 2,
        "parallel.axes.pipeline": 2,
        "parallel.module_fqns_per_model_part": FQNS_2,
        "fsdp.enabled": True,
    }
    out["runner"] = run(PipelinedRunner(runner_config(f"{root}/fsdp", **options)))
    with process_group():  # the hosts' collectives, after the runners (each starts and ends its own group)
        out.update(_four_rank_hosts())
    return out


def _shard(part, topology):
    from torch.distributed.fsdp import fully_shard

    return fully_shard(part, mesh=topology.mesh["shard"])


@pytest.mark.distributed
def test_middle_stages_get_no_data_and_subgroups_and_fsdp_work(tmp_path):
    # Two shard ranks with batches of 4 see what one process sees with batches of 8.
    expected = run(PlainRunner(runner_config(str(tmp_path / "plain"), **{"dataloader.batch_size": 8})))
    results = run_distributed(_four_rank_worker, str(tmp_path), world_size=4, init_process_group=False)
    assert [result["proxied"] for result in results] == [False, True, True, False]
    assert [all(result["seen_none"]) for result in results] == [False, True, True, False]
    assert all(len(result["seen_none"]) == 3 for result in results)
    for rank, result in enumerate(results):
        assert result["loss"] < TOL and result["weights"] < TOL, (rank, result)
        assert result["replica"]["loss"] < TOL and result["replica"]["weights"] < TOL, (rank, result)
        assert max(abs(a - b) for a, b in zip(result["replica_infer"], result["replica_expected"])) < TOL
        assert result["fsdp"] < TOL, (rank, result["fsdp"])
        assert result["resume_equal"], rank
        for epoch in (0, 1):
            assert abs(result["runner"]["rows"][epoch, "train"][0] - expected["rows"][epoch, "train"][0]) < TOL, rank
        assert max(abs(a - b) for a, b in zip(result["runner"]["predictions"], expected["predictions"])) < TOL
        assert len(result["runner"]["predictions"]) == 6


def _weighted_loss_reduction(rank, world_size, root):
    options = {"parallel.axes.pipeline": 2, "parallel.module_fqns_per_model_part": FQNS_2}
    with PipelinedRunner(runner_config(f"{root}/weighted", **options)) as runner:
        last = runner.topology.coordinates["pipeline"] == 1
        loss = torch.tensor(2.5) if last else None  # only the last stage has a loss, as in a pipelined step
        return {
            "weighted": runner.reduce_loss_for_logging(loss, 4),
            "plain": runner.reduce_loss_for_logging(loss, None),
        }


def test_a_weighted_loss_is_reduced_over_the_metrics_domain_like_an_unweighted_one(tmp_path):
    # Weighted by `loss_n`, the loss used to be summed over every rank, so the last stage waited in a
    # collective the other stages never enter. Both forms reduce over the ranks holding other batches.
    first, second = run_distributed(_weighted_loss_reduction, str(tmp_path), init_process_group=False, timeout=90)
    assert first == {"weighted": None, "plain": None}
    assert float(second["weighted"]) == float(second["plain"]) == 2.5
