"""ParallelTopology and ParallelContext: rank coordinates, reduction domains and their groups; metrics over a domain.

Two launches cover the distributed part: two ranks (the default topology, ``{"tensor": 2}`` and
``{"shard": -1}``) and four ranks (``{"replicate": 2, "tensor": 2}``, and ``{"replicate": 4, "expert": 2}``
with a token exchange over its expert groups).
"""

import copy
import math
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

from danling.distributed import (
    ParallelContext,
    ParallelTopology,
    Topology,
    all_gather_strided,
    all_reduce_any,
    all_reduce_gradients,
    all_reduce_mean,
    barrier,
    broadcast_object,
    get_rank,
    get_world_size,
    is_distributed,
)
from danling.distributed.expert_parallel import combine_tokens, dispatch_tokens
from danling.distributed.topology import AXES, DOMAINS, resolve_degrees
from danling.metrics import (
    AverageMeter,
    AverageMeters,
    GlobalMetrics,
    MultiTaskMetrics,
    StreamMetrics,
    multiclass_metrics,
)
from danling.metrics.functional import accuracy
from tests.dist import run_distributed

DATA_SIZES = [5, 7]  # batch length of data rank 0 and 1: uneven on purpose


# ----------------------------------------------------------------------------- one process


def test_data_parallel_in_one_process_is_the_world_of_one(monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    topology = ParallelTopology.data_parallel()
    assert (topology.world_size, topology.global_rank, topology.mesh) == (1, 0, None)
    for domain in DOMAINS:
        assert (topology.size(domain), topology.rank(domain), topology.ranks(domain)) == (1, 0, [0])
        assert topology.group(domain) is None
    assert topology.coordinates == dict.fromkeys((*AXES, "expert"), 0)
    assert topology.is_data_parallel_only
    assert topology.describe() == {"world_size": 1, "degrees": dict.fromkeys((*AXES, "expert"), 1), "data_size": 1}
    assert ParallelTopology.from_axes({"shard": -1, "expert": 1}).describe() == topology.describe()


def test_data_parallel_reads_torchrun_environment_without_a_group(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    topology = ParallelTopology.data_parallel()
    assert (topology.size("data"), topology.rank("data"), topology.size("tensor"), topology.ranks("tensor")) == (
        4,
        3,
        1,
        [3],
    )
    assert topology.group("tensor") is None  # no process group: nothing to talk to
    with pytest.raises(RuntimeError, match="default process group of the 4 ranks"):
        ParallelTopology.from_axes({"tensor": 2, "shard": 2})


def test_grid_is_row_major_in_axis_order():
    # Rank 5 of replicate=2 x pipeline=2 x tensor=2 sits at replicate 1, pipeline 0, tensor 1.
    topology = ParallelTopology({"replicate": 2, "pipeline": 2, "tensor": 2}, rank=5)
    assert topology.coordinates == {"replicate": 1, "shard": 0, "context": 0, "pipeline": 0, "tensor": 1, "expert": 0}
    assert topology.ranks("data") == [1, 5] and topology.rank("data") == 1
    assert topology.ranks("tensor") == [4, 5] and topology.rank("tensor") == 1
    assert topology.ranks("pipeline") == [5, 7] and topology.rank("pipeline") == 0
    assert topology.ranks("world") == list(range(8)) and topology.rank() == 5
    assert not topology.is_data_parallel_only
    assert repr(topology) == "ParallelTopology(world_size=8, rank=5, replicate=2, pipeline=2, tensor=2)"


def test_topology_is_the_layout_and_builds_nothing():
    assert Topology is ParallelTopology  # one class, two names
    topology = ParallelTopology({"replicate": 2, "pipeline": 2, "tensor": 2}, rank=5)
    assert (topology.mesh_shape, topology.mesh_dim_names) == ((2, 2, 2), ("replicate", "pipeline", "tensor"))
    assert dict(topology.domains) == dict(DOMAINS) and topology.domains["gradient"] == ("replicate", "shard", "context")
    assert (topology.context, topology.mesh) == (None, None)  # no process groups were built
    alone = ParallelTopology.data_parallel()
    assert (alone.mesh_shape, alone.mesh_dim_names) == ((), ())


def test_context_holds_the_mesh_and_groups_of_its_topology(monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    topology = ParallelTopology.from_axes({"shard": -1})
    context = topology.context
    assert isinstance(context, ParallelContext) and context.topology is topology
    assert (context.mesh, context.groups, context.group("data"), topology.group("data")) == (None, {}, None, None)
    assert repr(context) == "ParallelContext(ParallelTopology(world_size=1, rank=0), mesh=None)"
    bare = ParallelTopology({"tensor": 1})
    assert ParallelContext.build(bare).topology is bare and bare.context is not None
    with pytest.raises(ValueError, match=r"unknown domains \['batch'\]; known domains: world, data"):
        ParallelContext(bare, groups={"batch": None})
    with pytest.raises(RuntimeError, match="ParallelContext.build needs the default process group of the 4 ranks"):
        ParallelContext.build(ParallelTopology({"tensor": 2, "shard": 2}, rank=1))


def test_product_mismatch_names_every_degree_and_the_world_size():
    with pytest.raises(ValueError) as error:
        ParallelTopology.from_axes({"tensor": 2, "shard": 3})  # one process here
    for part in ("replicate=1", "shard=3", "context=1", "pipeline=1", "tensor=2", "world size 1"):
        assert part in str(error.value)
    with pytest.raises(ValueError, match=r"shard=-1 x context=1 x pipeline=1 x tensor=3 .* world size 4"):
        resolve_degrees({"tensor": 3, "shard": -1}, world_size=4)


@pytest.mark.parametrize(
    ("axes", "message"),
    [
        ({"shard": -1, "tensor": -1}, "only one axis may be -1, got shard=-1, tensor=-1"),
        ({"data": 2, "tensors": 1}, r"unknown parallel axes \['data', 'tensors'\]; accepted axes: replicate, shard"),
        ({"shard": 0, "pipeline": -2}, "positive integers .* got shard=0, pipeline=-2"),
        ({"tensor": 1.5}, "positive integers .* got tensor=1.5"),
        ({"replicate": True}, "positive integers .* got replicate=True"),
        ({"expert_tensor": 2}, "tensor parallelism inside experts is not supported: expert_tensor=2 must be 1"),
        ({"expert": -1, "replicate": 4}, "parallel.axes.expert must be a positive integer .* got -1"),
        ({"replicate": 4, "expert": 3}, "expert=3 borrows data-parallel ranks from parallel.axes.replicate=4"),
        ({"replicate": 2, "shard": 2, "expert": 4}, "expert=4 borrows data-parallel ranks from parallel.axes.shard=2"),
    ],
)
def test_bad_axes_are_named(axes, message):
    with pytest.raises(ValueError, match=message):
        resolve_degrees(axes, world_size=4)


def test_resolution_fills_missing_axes_and_the_absorbing_one():
    assert resolve_degrees({"tensor": 2, "shard": -1}, 8) == {
        "replicate": 1,
        "shard": 4,
        "context": 1,
        "pipeline": 1,
        "tensor": 2,
        "expert": 1,
    }
    assert resolve_degrees({}, 1) == dict.fromkeys((*AXES, "expert"), 1)
    assert resolve_degrees({"replicate": -1, "expert": 2}, 4)["replicate"] == 4  # experts borrow, not multiply


def test_experts_split_the_innermost_data_axis():
    # shard=4 x tensor=2 with expert=2: shard splits into shard_rest=2 (outer) x expert=2 (inner)
    topology = ParallelTopology({"shard": 4, "tensor": 2, "expert": 2}, rank=5)
    assert topology.world_size == 8 and topology.coordinates["shard"] == 2 and topology.coordinates["expert"] == 0
    assert (topology.mesh_dim_names, topology.mesh_shape) == (("shard_rest", "expert", "tensor"), (2, 2, 2))
    assert topology.domains["data"] == ("replicate", "shard_rest", "expert")
    assert topology.ranks("data") == [1, 3, 5, 7] and topology.rank("data") == 2
    assert topology.ranks("expert") == [5, 7] and topology.rank("expert") == 0
    assert topology.ranks("expert_data") == [1, 5] and topology.rank("expert_data") == 1
    assert topology.ranks("tensor") == [4, 5]
    plain = ParallelTopology({"replicate": 2, "tensor": 2}, rank=3)
    assert (plain.size("expert"), plain.ranks("expert"), plain.ranks("expert_data")) == (1, [3], plain.ranks("data"))


def test_unknown_domain_and_rank_out_of_range_are_named():
    topology = ParallelTopology.data_parallel()
    with pytest.raises(ValueError, match="unknown domain 'batch'; known domains: world, data, metrics, gradient"):
        topology.group("batch")
    with pytest.raises(ValueError, match="unknown domain"):
        topology.size("batch")
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\)"):
        ParallelTopology({"tensor": 4}, rank=4)


# ----------------------------------------------------------------------------- two ranks


def _members(group):
    return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)


def _two_ranks(rank, world_size):
    out = {}
    default = ParallelTopology.data_parallel()
    out["default"] = {d: (default.size(d), default.rank(d), _members(default.group(d))) for d in DOMAINS}
    out["default_describe"] = default.describe()

    tensor = ParallelTopology.from_axes({"tensor": 2})
    data_group = tensor.group("data")
    context = tensor.context
    out["context"] = (
        type(context).__name__,
        context.topology is tensor and context.mesh is tensor.mesh,
        tensor.mesh_shape,
        tuple(context.mesh.shape),
        context.group("tensor") is tensor.group("tensor") is None,  # the whole world: torch's default group
        context.group("pipeline") is tensor.group("pipeline") is data_group,  # the one-rank group, made once
        sorted(context.groups),
    )
    out["tensor"] = {d: (tensor.size(d), tensor.rank(d), tensor.ranks(d), _members(tensor.group(d))) for d in DOMAINS}
    out["tensor_info"] = (tensor.mesh.mesh_dim_names, tensor.is_data_parallel_only, tensor.describe())
    out["same_singleton"] = data_group is tensor.group("metrics") is tensor.group("pipeline")
    out["group_queries"] = (is_distributed(data_group), get_world_size(data_group), get_rank(data_group))
    out["world_queries"] = (is_distributed(), get_world_size(), get_rank())
    # A one-rank domain: every collective and metric over it stays local.
    value = torch.tensor(float(rank))
    out["local"] = (
        all_reduce_mean(value, group=data_group).item(),
        bool(all_reduce_any(torch.tensor(rank == 1), group=data_group)),
        broadcast_object(f"from {rank}", group=data_group),
        all_gather_strided([rank, rank], group=data_group),
    )
    barrier(data_group)
    meter = AverageMeter(group=data_group)
    meter.update(value)
    out["local_meter"] = (meter.avg, meter.sync().count, meter.bat)
    out["copies"] = (copy.deepcopy(meter).group is data_group, pickle.loads(pickle.dumps(meter)).group)
    metrics = GlobalMetrics(acc=accuracy)
    metrics.group = data_group
    restored = pickle.loads(pickle.dumps(metrics))
    out["metrics_copies"] = (copy.deepcopy(metrics).group is data_group, restored.group)

    shard = ParallelTopology.from_axes({"shard": -1})
    out["shard"] = (shard.degrees["shard"], shard.size("data"), shard.group("data"), shard.describe())
    return out


@pytest.mark.distributed
def test_two_ranks_default_tensor_and_shard_topologies():
    results = run_distributed(_two_ranks, world_size=2)
    for rank, out in enumerate(results):
        for domain in ("world", "data", "metrics", "gradient", "replicate"):
            assert out["default"][domain] == (2, rank, [0, 1]), domain
        for domain in ("shard", "context", "pipeline", "tensor"):
            assert out["default"][domain] == (1, 0, [rank]), domain  # a real one-rank group
        assert out["default_describe"] == {
            "world_size": 2,
            "degrees": {**dict.fromkeys((*AXES, "expert"), 1), "replicate": 2},
            "data_size": 2,
        }

        for domain in ("data", "metrics", "gradient", "pipeline"):
            assert out["tensor"][domain] == (1, 0, [rank], [rank]), domain
        assert out["tensor"]["tensor"] == (2, rank, [0, 1], [0, 1])
        assert out["tensor"]["world"] == (2, rank, [0, 1], [0, 1])
        one_rank = ["context", "data", "expert", "expert_data", "gradient", "metrics", "pipeline", "replicate", "shard"]
        assert out["context"] == ("ParallelContext", True, (2,), (2,), True, True, one_rank)
        names, data_parallel_only, described = out["tensor_info"]
        assert names == ("tensor",) and not data_parallel_only
        degrees = {**dict.fromkeys((*AXES, "expert"), 1), "tensor": 2}
        assert described == {"world_size": 2, "degrees": degrees, "data_size": 1}
        assert out["same_singleton"]
        assert out["group_queries"] == (False, 1, 0) and out["world_queries"] == (True, 2, rank)

        assert out["local"] == (float(rank), rank == 1, f"from {rank}", [rank, rank])
        assert out["local_meter"] == (float(rank), 1, float(rank))
        assert out["copies"] == (True, None)  # copies share the group; pickles cannot carry it
        assert out["metrics_copies"] == (True, None)
        assert out["shard"][:3] == (2, 2, None)  # the data domain is the world: torch's default group
        assert out["shard"][3]["degrees"]["shard"] == 2


# ----------------------------------------------------------------------------- four ranks


def _batch(data_rank):
    generator = torch.Generator().manual_seed(100 + data_rank)
    n = DATA_SIZES[data_rank]
    return torch.randn(n, 3, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def _four_ranks(rank, world_size):
    topology = ParallelTopology.from_axes({"replicate": 2, "tensor": 2})
    out = {"domains": {}}
    for domain in ("world", "data", "metrics", "gradient", "tensor", "pipeline"):
        group = topology.group(domain)
        own = topology.rank() if group is None else dist.get_rank(group)
        out["domains"][domain] = (topology.ranks(domain), _members(group), topology.rank(domain), own)
    coordinate = topology.mesh.get_coordinate()
    out["coordinates"] = (topology.coordinates["replicate"], topology.coordinates["tensor"]) == tuple(coordinate)
    data, tensor_group = topology.group("data"), topology.group("tensor")

    # Tensor peers hold the same batch: reductions over the data domain count it once.
    input, target = _batch(topology.rank("data"))
    loss = float(target.float().mean())
    meter = AverageMeter(group=topology.group("metrics"))
    meter.update(loss, n=len(target))
    synced = meter.sync()
    out["meter"] = (synced.avg, synced.count)
    meters = AverageMeters()
    meters.update(loss=torch.tensor(loss))
    meters.group = data  # set after the meter exists: the meter follows
    out["meters"] = (meters.avg["loss"], meters.loss.sync().count, meters["loss"].group is data)
    stream = StreamMetrics(acc=accuracy, group=data)
    stream.update(input, target)
    out["stream"] = (stream.avg["acc"], stream.acc.sync().count)
    exact = multiclass_metrics(3, ["acc", "auroc"])
    exact.group = data
    exact.update(input, target)
    values, counts = exact.read("avg")
    out["global"] = (dict(values), counts["acc"])
    tasks = MultiTaskMetrics(aggregate="micro", a=multiclass_metrics(3, ["acc"]))
    tasks.group = data
    tasks.b = multiclass_metrics(3, ["acc"])  # added later: takes the group over
    tasks.update({"a": (input, target), "b": (input, target)})
    out["tasks"] = (tasks.avg["aggregate"]["acc"], tasks.b.group is data)

    # Values that differ between tensor peers show which ranks each reduction combined.
    value = torch.tensor(float(rank))
    grouped, everyone = AverageMeter(group=data), AverageMeter()
    grouped.update(value)
    everyone.update(value)
    out["scope"] = (grouped.avg, everyone.avg, all_reduce_mean(value, group=data).item(), all_reduce_mean(value).item())
    out["gather"] = all_gather_strided([rank], group=data)
    out["broadcast"] = broadcast_object(rank, src=1, group=tensor_group)
    out["any"] = bool(all_reduce_any(torch.tensor(rank == 3), group=tensor_group))
    layer = nn.Linear(1, 1, bias=False)
    layer.weight.grad = torch.full_like(layer.weight, float(rank))
    all_reduce_gradients(layer.parameters(), group=data)
    out["gradient"] = layer.weight.grad.item()
    out["experts"] = _expert_exchange(rank)
    return out


def _expert_exchange(rank):
    """Expert groups of replicate=4 x expert=2, and one token per global expert sent there and back."""
    experts = ParallelTopology.from_axes({"replicate": 4, "expert": 2})
    group = experts.group("expert")
    tokens = torch.arange(4.0).unsqueeze(1) + 10 * rank  # sorted by expert: token e goes to expert e
    counts = torch.ones(4, dtype=torch.long)
    received, received_counts = dispatch_tokens(tokens, counts, group)
    back = combine_tokens(received * 2, counts, received_counts, group)
    holders = experts.group("expert_data")
    return (
        (experts.ranks("expert"), _members(group), experts.ranks("expert_data"), _members(holders)),
        (experts.coordinates["expert"], experts.mesh_dim_names, received_counts.tolist()),
        (received.flatten().tolist(), torch.equal(back, tokens * 2)),
    )


@pytest.mark.distributed
def test_four_ranks_replicate_by_tensor_reduce_metrics_over_data_peers_only():
    results = run_distributed(_four_ranks, world_size=4)
    inputs, targets = zip(*(_batch(d) for d in (0, 1)))
    union = multiclass_metrics(3, ["acc", "auroc"])
    union.update(torch.cat(inputs), torch.cat(targets))
    total = sum(DATA_SIZES)
    mean_target = sum(float(t.float().sum()) for t in targets) / total
    mean_step = sum(float(t.float().mean()) for t in targets) / 2
    for rank, out in enumerate(results):
        data_peers, tensor_peers = [rank % 2, rank % 2 + 2], [rank - rank % 2, rank - rank % 2 + 1]
        assert out["domains"]["world"] == ([0, 1, 2, 3], [0, 1, 2, 3], rank, rank)
        for domain in ("data", "metrics", "gradient"):
            assert out["domains"][domain] == (data_peers, data_peers, rank // 2, rank // 2), domain
        assert out["domains"]["tensor"] == (tensor_peers, tensor_peers, rank % 2, rank % 2)
        assert out["domains"]["pipeline"] == ([rank], [rank], 0, 0)
        assert out["coordinates"]

        assert out["meter"] == (pytest.approx(mean_target), total)  # not 2 * total
        assert out["meters"] == (pytest.approx(mean_step), 2, True)
        assert out["stream"] == (pytest.approx(float(union.avg["acc"])), total)
        assert out["global"][0] == pytest.approx(dict(union.avg))
        assert out["global"][1] == total
        assert out["tasks"] == (pytest.approx(float(union.avg["acc"])), True)

        peers_mean = sum(data_peers) / 2
        assert out["scope"] == (pytest.approx(peers_mean), pytest.approx(1.5), peers_mean, 1.5)
        assert out["gather"] == data_peers
        assert out["broadcast"] == tensor_peers[1]
        assert out["any"] == (rank >= 2)
        assert out["gradient"] == pytest.approx(peers_mean)
        expert_peers, holders, local = [rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2], rank % 2
        groups, layout, exchange = out["experts"]
        assert groups == (expert_peers, expert_peers, holders, holders)
        assert layout == (local, ("replicate_rest", "expert"), [[1, 1], [1, 1]])
        # from each expert peer, in rank order, its tokens for this rank's experts 2 * local and 2 * local + 1
        assert exchange == ([10.0 * peer + 2 * local + e for peer in expert_peers for e in (0, 1)], True)
    assert not math.isnan(results[0]["global"][0]["auroc"])


@pytest.mark.parametrize(
    ("degrees", "local", "spanning"),
    [
        ({"replicate": 2, "shard": 4}, 4, ()),  # HSDP on 2 nodes of 4: shards inside a node
        ({"replicate": 4, "shard": 2, "tensor": 2}, 4, ()),
        ({"shard": 8}, 4, ("shard",)),  # FSDP over both nodes
        ({"shard": 4, "tensor": 2}, 4, ("shard", "tensor")),  # the product (8) spans; tensor pairs alone would not
        ({"replicate": 2, "tensor": 8}, 4, ("tensor",)),
        ({"replicate": 2, "shard": 3}, 4, ("shard",)),  # 3 does not divide 4: some groups straddle two nodes
        ({"replicate": 8}, 1, ()),
    ],
)
def test_axes_spanning_nodes(degrees, local, spanning):
    from danling.distributed.topology import axes_spanning_nodes

    assert axes_spanning_nodes(degrees, local) == spanning


@pytest.mark.parametrize(
    ("env", "degrees", "rank", "warned"),
    [
        ({"LOCAL_WORLD_SIZE": "4"}, {"shard": 4, "tensor": 2}, 0, True),
        ({"LOCAL_WORLD_SIZE": "4"}, {"shard": 4, "tensor": 2}, 1, False),  # once per run: rank 0 only
        ({"LOCAL_WORLD_SIZE": "4"}, {"replicate": 2, "shard": 2, "tensor": 2}, 0, False),
        ({"LOCAL_WORLD_SIZE": "8"}, {"shard": 4, "tensor": 2}, 0, False),  # one node
        ({}, {"shard": 4, "tensor": 2}, 0, False),  # no launcher said how many processes a node has
    ],
)
def test_multi_node_groups_that_span_nodes_warn_once(monkeypatch, caplog, env, degrees, rank, warned):
    from danling.distributed.topology import _warn_if_groups_span_nodes

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    full = {axis: degrees.get(axis, 1) for axis in AXES}
    with caplog.at_level("WARNING", logger="danling.distributed"):
        _warn_if_groups_span_nodes(ParallelTopology(full, rank=rank))
    messages = [record.getMessage() for record in caplog.records if record.name == "danling.distributed"]
    if warned:
        (message,) = messages
        assert "shard=4 x tensor=2" in message and "LOCAL_WORLD_SIZE=4" in message
    else:
        assert messages == []
