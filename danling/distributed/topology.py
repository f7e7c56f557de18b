"""Where this rank sits along each parallel axis, and the process group of each reduction domain.

A run that splits work along several axes (data replicas, parameter shards, sequence context,
pipeline stages, tensor slices) lays its ranks out on a grid: one dimension per axis, in the
order of [`AXES`][danling.distributed.topology.AXES], filled row by row, so that the tensor
axis varies fastest. A *reduction domain* is the set of ranks that must be combined for one
purpose; each is a sub-grid over some of the axes, listed in
[`DOMAINS`][danling.distributed.topology.DOMAINS]:

- `"data"`: the ranks that read different batches (replicate x shard). Samplers, loader
  sharding, seed offsets and gathered predictions use its size and rank.
- `"metrics"`: the same ranks, under the name that loss and metric reductions ask for. Ranks
  that differ only along the tensor, pipeline or context axes hold the same batch, so they
  must not be averaged together.
- `"gradient"`: the ranks whose gradients are averaged (replicate x shard x context).
- `"replicate"`, `"shard"`, `"context"`, `"pipeline"`, `"tensor"`: one axis each.
- `"expert"`: the ranks that exchange tokens with all-to-all and hold one share each of a
  mixture-of-experts layer's experts (`parallel.axes.expert`).
- `"expert_data"`: the ranks that hold the same experts; expert gradients are reduced over it.
- `"world"`: every rank.

**Experts borrow data-parallel ranks.** The expert axis is not another factor of the world size:
like torchtitan's, its ranks are data-parallel ranks (each reads its own batch) that also split
the experts among them. The innermost data axis above one (`shard`, else `replicate`) is cut in
two grid dimensions, `"<axis>_rest"` (outer) and `"expert"` (inner, so that token exchange stays
between neighbouring ranks); `expert` must divide that axis. Dense parameters are still reduced
over the whole data domain; expert parameters over `"expert_data"`, the data domain without the
expert dimension.

Two classes keep the arithmetic apart from the process groups:
[`ParallelTopology`][danling.distributed.topology.ParallelTopology] is the layout (degrees, this
rank's coordinates, the domains, the mesh shape) and builds nothing;
[`ParallelContext`][danling.distributed.topology.ParallelContext] holds the device mesh and the
process group of each domain, built collectively from a topology. A topology answers
`group(domain)` through the context built for it, and `None` for a domain that spans every rank:
torch reads `None` as its default group, so plain data-parallel runs keep using the default group
and pay nothing for the abstraction. `Topology` is another name of `ParallelTopology`.
"""

from __future__ import annotations

import itertools
import logging
import math
import numbers
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from .process_group import get_rank, get_world_size

if TYPE_CHECKING:  # only for annotations: builds without distributed support lack these classes
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "AXES",
    "DOMAINS",
    "ParallelContext",
    "ParallelTopology",
    "Topology",
    "axes_spanning_nodes",
    "resolve_degrees",
]

logger = logging.getLogger("danling.distributed")

AXES: tuple[str, ...] = ("replicate", "shard", "context", "pipeline", "tensor")
"""Parallel axes, in the order of the rank grid's dimensions (the last one varies fastest)."""

EXPERT = "expert"
"""The expert axis (`parallel.axes.expert`): it borrows its ranks from the data axes (see the module)."""

# Tensor parallelism inside each expert would need a mesh of its own for the expert weights; refused above 1.
_DEGREE_ONE_AXES: tuple[str, ...] = ("expert_tensor",)

DOMAINS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "world": AXES,
        "data": ("replicate", "shard"),
        "metrics": ("replicate", "shard"),
        "gradient": ("replicate", "shard", "context"),
        **{axis: (axis,) for axis in AXES},
        EXPERT: (EXPERT,),
        "expert_data": ("replicate", "shard"),
    }
)
"""Each reduction domain and the axes it spans (in grid order), without expert parallelism.

With `expert > 1` a topology's own `domains` spell out the split axis (see the module): e.g.
``"data": ("replicate_rest", "expert", "shard")`` and ``"expert_data": ("replicate_rest", "shard")``.
"""


def resolve_degrees(axes: Mapping[str, int], world_size: int) -> dict[str, int]:
    """Check parallel degrees against the world size and fill in the missing ones.

    Args:
        axes: Degree of each named axis; axes left out have degree 1 and one axis may be -1 to
            take whatever the others leave of `world_size`. ``expert`` borrows data-parallel
            ranks, so it is not part of the product (it may not be -1); ``expert_tensor`` is
            accepted at degree 1.
        world_size: Number of ranks the degrees of [`AXES`][danling.distributed.topology.AXES] must multiply to.

    Returns:
        The degree of every axis of [`AXES`][danling.distributed.topology.AXES], in that order, then ``expert``.

    Raises:
        ValueError: An unknown axis name, a degree that is neither positive nor a single -1,
            ``expert_tensor`` above 1, degrees whose product is not `world_size`, or an expert
            degree that does not divide the data axis it borrows from.

    Examples:
        >>> resolve_degrees({"tensor": 2, "shard": -1}, world_size=8)
        {'replicate': 1, 'shard': 4, 'context': 1, 'pipeline': 1, 'tensor': 2, 'expert': 1}
        >>> resolve_degrees({"replicate": 4, "expert": 2}, world_size=4)["expert"]
        2
    """
    if not isinstance(axes, Mapping):
        raise TypeError(f"axes must be a mapping from axis names to degrees, got {type(axes).__name__}")
    unknown = [name for name in axes if name not in (*AXES, EXPERT, *_DEGREE_ONE_AXES)]
    if unknown:
        raise ValueError(f"unknown parallel axes {unknown}; accepted axes: {', '.join((*AXES, EXPERT))}")
    inner = {name: axes[name] for name in _DEGREE_ONE_AXES if name in axes and axes[name] != 1}
    if inner:
        raise ValueError(
            f"tensor parallelism inside experts is not supported: {_format(inner)} must be 1 (experts are "
            "split over parallel.axes.expert only; their weights would need a mesh of their own)"
        )
    expert = axes.get(EXPERT, 1)
    if isinstance(expert, bool) or not isinstance(expert, numbers.Integral) or expert < 1:
        raise ValueError(f"parallel.axes.expert must be a positive integer (it borrows data ranks), got {expert!r}")
    degrees = {name: axes.get(name, 1) for name in AXES}
    bad = {
        name: degree
        for name, degree in degrees.items()
        if isinstance(degree, bool) or not isinstance(degree, numbers.Integral) or (degree < 1 and degree != -1)
    }
    if bad:
        raise ValueError(f"parallel degrees must be positive integers (or -1 for one axis), got {_format(bad)}")
    degrees = {name: int(degree) for name, degree in degrees.items()}
    absorbing = [name for name, degree in degrees.items() if degree == -1]
    if len(absorbing) > 1:
        raise ValueError(f"only one axis may be -1, got {_format({name: -1 for name in absorbing})}")
    fixed = math.prod(degree for degree in degrees.values() if degree != -1)
    if absorbing and world_size % fixed == 0:
        degrees[absorbing[0]] = world_size // fixed
    if math.prod(degrees.values()) != world_size:
        raise ValueError(
            f"parallel degrees {' x '.join(f'{n}={d}' for n, d in degrees.items())} do not multiply to the "
            f"world size {world_size}"
        )
    host = _expert_host(degrees)
    if degrees[host] % expert:
        raise ValueError(
            f"parallel.axes.expert={expert} borrows data-parallel ranks from parallel.axes.{host}={degrees[host]} "
            f"(the innermost data axis above 1), so it must divide it"
        )
    degrees[EXPERT] = int(expert)
    return degrees


def _expert_host(degrees: Mapping[str, int]) -> str:
    """The data axis the expert axis borrows from: `shard` when above one, else `replicate`."""
    return "shard" if degrees["shard"] > 1 else "replicate"


def axes_spanning_nodes(degrees: Mapping[str, int], local_world_size: int) -> tuple[str, ...]:
    """The axes whose groups would hold ranks of more than one node, innermost last; `()` when none do.

    Launchers number the ranks of a node consecutively, and the grid varies the tensor axis
    fastest, so the groups of the axes inside `replicate` stay in a node as long as the product
    of their degrees, taken from `tensor` outward, divides the processes per node. The first axis
    (from the inside) where it stops dividing, and every axis inside it, are returned.

    Examples:
        >>> axes_spanning_nodes({"replicate": 2, "shard": 4}, 4)
        ()
        >>> axes_spanning_nodes({"shard": 4, "tensor": 2}, 4)
        ('shard', 'tensor')
        >>> axes_spanning_nodes({"replicate": 2, "tensor": 8}, 4)
        ('tensor',)
    """
    product = 1
    inner = [axis for axis in AXES[1:] if degrees.get(axis, 1) > 1]
    for index in range(len(inner) - 1, -1, -1):
        product *= degrees[inner[index]]
        if local_world_size % product:
            return tuple(inner[index:])
    return ()


def _warn_if_groups_span_nodes(topology: ParallelTopology) -> None:
    """One WARNING (on rank 0) when a multi-node run's inner groups cross nodes (see `axes_spanning_nodes`)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not local.isdigit() or int(local) < 1 or topology.world_size <= int(local) or topology.global_rank != 0:
        return
    spanning = axes_spanning_nodes(topology.degrees, int(local))
    if spanning:
        groups = " x ".join(f"{axis}={topology.degrees[axis]}" for axis in spanning)
        logger.warning(
            "parallel.axes %s: their groups span nodes of LOCAL_WORLD_SIZE=%s processes, so their collectives "
            "cross the link between nodes; keep the product of these degrees a divisor of the processes per node "
            "and put the rest in parallel.axes.replicate",
            groups,
            local,
        )


def _format(degrees: Mapping[str, Any]) -> str:
    return ", ".join(f"{name}={degree!r}" for name, degree in degrees.items())


class ParallelTopology:
    r"""Where this rank sits on the parallel grid: axis degrees, coordinates, reduction domains, mesh shape.

    A topology is arithmetic over the degrees and this rank's global rank; building one starts
    nothing. [`data_parallel`][danling.distributed.topology.ParallelTopology.data_parallel] is plain
    DDP (or a single process); [`from_axes`][danling.distributed.topology.ParallelTopology.from_axes]
    also builds the [`ParallelContext`][danling.distributed.topology.ParallelContext] (device mesh and
    process groups) over the given degrees, collectively.

    Attributes:
        degrees: Degree of each axis of [`AXES`][danling.distributed.topology.AXES], then ``expert``.
        coordinates: This rank's index along each of these axes.
        world_size: Number of ranks (the product of the degrees of `AXES`; experts borrow data ranks).
        global_rank: This rank in the default group.
        domains: The grid dimensions each reduction domain spans ([`DOMAINS`][danling.distributed.topology.DOMAINS]
            without experts; with them the split data axis reads ``"<axis>_rest", "expert"``).
        context: The process groups built for this topology, if any (set by `ParallelContext`).

    Args:
        degrees: Degree of every axis, multiplying to the world size (see
            [`resolve_degrees`][danling.distributed.topology.resolve_degrees]).
        rank: This process's global rank.

    Examples:
        >>> topology = ParallelTopology({"replicate": 2, "pipeline": 2, "tensor": 2}, rank=5)
        >>> topology.coordinates
        {'replicate': 1, 'shard': 0, 'context': 0, 'pipeline': 0, 'tensor': 1, 'expert': 0}
        >>> topology.mesh_shape, topology.mesh_dim_names
        ((2, 2, 2), ('replicate', 'pipeline', 'tensor'))
        >>> topology.size("data"), topology.rank("data"), topology.ranks("tensor")
        (2, 1, [4, 5])
        >>> experts = ParallelTopology({"replicate": 4, "expert": 2}, rank=3)
        >>> experts.mesh_dim_names, experts.coordinates["expert"], experts.ranks("expert"), experts.ranks("expert_data")
        (('replicate_rest', 'expert'), 1, [2, 3], [1, 3])
    """

    def __init__(self, degrees: Mapping[str, int], *, rank: int = 0) -> None:
        # Resolved degrees are expected; checking them again catches names, types and signs.
        sizes = [degrees.get(axis, 1) for axis in AXES]
        world_size = math.prod(d for d in sizes if isinstance(d, numbers.Integral) and d > 0)
        self.degrees: dict[str, int] = resolve_degrees(degrees, world_size)
        self.world_size = world_size
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}) for degrees {_format(self.degrees)}, got {rank}")
        self.global_rank = rank
        self.context: ParallelContext | None = None
        self._grid, self.domains = _grid_and_domains(self.degrees)
        # Row-major grid: the stride of a dimension is the product of the degrees after it.
        dims = list(self._grid)
        self._strides = {dim: math.prod(self._grid[d] for d in dims[i + 1 :]) for i, dim in enumerate(dims)}
        self._coordinates = {dim: (rank // self._strides[dim]) % self._grid[dim] for dim in dims}
        self.coordinates: dict[str, int] = {axis: self._logical_coordinate(axis) for axis in self.degrees}

    def _logical_coordinate(self, axis: str) -> int:
        """An axis's coordinate; a split data axis reads its two grid dimensions as one (`rest * expert + expert`)."""
        if axis in self._grid:
            return self._coordinates[axis]
        return self._coordinates[f"{axis}_rest"] * self.degrees[EXPERT] + self._coordinates[EXPERT]

    @classmethod
    def data_parallel(cls) -> ParallelTopology:
        """Every rank reads its own batch: data, metrics and gradient domains are the whole world.

        World size and rank come from the default process group when one runs, else from
        torchrun's environment variables, else a single process. No process group is created.
        """
        degrees = dict.fromkeys(AXES, 1)
        degrees["replicate"] = get_world_size()
        return cls(degrees, rank=get_rank())

    @classmethod
    def from_axes(cls, axes: Mapping[str, int], *, device_type: str = "cpu") -> ParallelTopology:
        """The grid of the given degrees, with its [`ParallelContext`][danling.distributed.topology.ParallelContext].

        A collective when several ranks run: every rank must call it with the same `axes`, after
        the default process group has started (see
        [`ParallelContext.build`][danling.distributed.topology.ParallelContext.build]).

        Args:
            axes: Degree of each axis (see
                [`resolve_degrees`][danling.distributed.topology.resolve_degrees]).
            device_type: Device type of the mesh, e.g. ``"cpu"`` or ``"cuda"``.

        On a multi-node run (`WORLD_SIZE` above `LOCAL_WORLD_SIZE`), rank 0 logs one WARNING when
        the groups of some axes would span nodes (see
        [`axes_spanning_nodes`][danling.distributed.topology.axes_spanning_nodes]).

        Raises:
            ValueError: Bad axis names or degrees, or a product other than the world size.
            RuntimeError: Several ranks are expected (``WORLD_SIZE``) but no process group runs.
        """
        initialized = dist.is_available() and dist.is_initialized()
        world_size = dist.get_world_size() if initialized else get_world_size()
        topology = cls(resolve_degrees(axes, world_size), rank=dist.get_rank() if initialized else get_rank())
        _warn_if_groups_span_nodes(topology)
        ParallelContext.build(topology, device_type)
        return topology

    def _dims(self, domain: str) -> tuple[str, ...]:
        dims = self.domains.get(domain)
        if dims is None:
            raise ValueError(f"unknown domain {domain!r}; known domains: {', '.join(self.domains)}")
        return dims

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The grid dimensions above degree one, in grid order: the dimensions of the device mesh."""
        return tuple(dim for dim, degree in self._grid.items() if degree > 1)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The device mesh's shape: the degree of each axis of `mesh_dim_names` (`()` for one process)."""
        return tuple(self._grid[dim] for dim in self.mesh_dim_names)

    @property
    def mesh(self) -> DeviceMesh | None:
        """The device mesh of the context built for this topology (`None` without one, or in plain data parallel)."""
        return None if self.context is None else self.context.mesh

    def group(self, domain: str) -> ProcessGroup | None:
        """Process group of this rank's `domain`, or `None` (torch's default group) when it spans every rank.

        Groups come from this topology's [`ParallelContext`][danling.distributed.topology.ParallelContext]
        (an empty one is made on first need: it can still make the one-rank group of a domain this
        rank is alone in). Without a running process group the answer is `None`: there is no one
        to talk to.
        """
        if self.size(domain) == self.world_size or not (dist.is_available() and dist.is_initialized()):
            return None
        context = self.context if self.context is not None else ParallelContext(self)
        return context.group(domain)

    def size(self, domain: str = "world") -> int:
        """Number of ranks in `domain`."""
        return math.prod(self._grid[dim] for dim in self._dims(domain))

    def rank(self, domain: str = "world") -> int:
        """This rank's index within `domain` (its group rank), e.g. the sampler rank for ``"data"``."""
        index = 0
        for dim in self._dims(domain):
            index = index * self._grid[dim] + self._coordinates[dim]
        return index

    def ranks(self, domain: str = "world") -> list[int]:
        """Global ranks of this rank's `domain`, in increasing order (= group rank order)."""
        dims = self._dims(domain)
        base = self.global_rank - sum(self._coordinates[dim] * self._strides[dim] for dim in dims)
        steps = [[i * self._strides[dim] for i in range(self._grid[dim])] for dim in dims]
        return [base + sum(offsets) for offsets in itertools.product(*steps)]

    @property
    def is_data_parallel_only(self) -> bool:
        """Whether every rank reads its own batch (the data domain is the whole world)."""
        return self.size("data") == self.world_size

    def describe(self) -> dict[str, Any]:
        """The same plain, JSON-able summary on every rank, e.g. to detect a resized run on resume."""
        return {"world_size": self.world_size, "degrees": dict(self.degrees), "data_size": self.size("data")}

    def __repr__(self) -> str:
        parallel = "".join(f", {axis}={degree}" for axis, degree in self.degrees.items() if degree > 1)
        return f"{type(self).__name__}(world_size={self.world_size}, rank={self.global_rank}{parallel})"


def _grid_and_domains(degrees: Mapping[str, int]) -> tuple[dict[str, int], dict[str, tuple[str, ...]]]:
    """The rank grid's dimensions (the borrowed data axis cut for the experts) and each domain's dimensions."""
    expert = degrees[EXPERT]
    if expert == 1:  # the expert axis is a dimension of degree one: every rank holds every expert
        grid = {axis: degrees[axis] for axis in AXES}
        grid[EXPERT] = 1
        return grid, dict(DOMAINS)
    host = _expert_host(degrees)
    grid = {}
    for axis in AXES:
        if axis == host:  # expert innermost: the ranks exchanging tokens are neighbours
            grid[f"{host}_rest"], grid[EXPERT] = degrees[axis] // expert, expert
        else:
            grid[axis] = degrees[axis]

    def split(axes: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(dim for axis in axes for dim in ((f"{host}_rest", EXPERT) if axis == host else (axis,)))

    domains = {name: split(axes) for name, axes in DOMAINS.items() if name not in (EXPERT, "expert_data")}
    domains[EXPERT] = (EXPERT,)
    domains["expert_data"] = tuple(dim for dim in domains["data"] if dim != EXPERT)
    return grid, domains


Topology = ParallelTopology
"""Another name of [`ParallelTopology`][danling.distributed.topology.ParallelTopology] (the same class)."""


class ParallelContext:
    """The device mesh and the process group of each reduction domain of a topology.

    Build it with [`build`][danling.distributed.topology.ParallelContext.build] (collective). It
    binds itself to the topology (`topology.context`), so `topology.group(domain)` and
    `topology.mesh` answer from it. `ParallelRunner.parallel` is this object, and a model's
    `parallelize(parallel)` hook receives it: `parallel.mesh["tensor"]` is the tensor axis's mesh,
    `parallel.topology.degrees` the degrees.

    Args:
        topology: The [`ParallelTopology`][danling.distributed.topology.ParallelTopology] the groups are built for.
        mesh: The device mesh over `topology.mesh_dim_names`, if any.
        groups: Process group of each domain that is neither the whole world nor this rank alone.

    Raises:
        ValueError: `groups` names an unknown domain.
    """

    def __init__(
        self,
        topology: ParallelTopology,
        *,
        mesh: DeviceMesh | None = None,
        groups: Mapping[str, ProcessGroup] | None = None,
    ) -> None:
        unknown = [domain for domain in groups or {} if domain not in topology.domains]
        if unknown:
            raise ValueError(f"unknown domains {unknown}; known domains: {', '.join(topology.domains)}")
        self.topology = topology
        self.mesh = mesh
        self._groups: dict[str, ProcessGroup] = dict(groups or {})
        topology.context = self

    @classmethod
    def build(cls, topology: ParallelTopology, device_type: str = "cpu") -> ParallelContext:
        """The device mesh over the topology's axes above degree one, and each domain's process group.

        A collective: every rank calls it with the same degrees, after the default process group
        has started. A domain spanning several axes gets one flattened group, shared by domains
        over the same axes; the one-rank group of a domain this rank is alone in is made on request.

        Raises:
            RuntimeError: Several ranks are expected but no process group runs.
        """
        if topology.world_size == 1:
            return cls(topology)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"ParallelContext.build needs the default process group of the {topology.world_size} ranks; "
                "start it first (e.g. with init_process_group_from_env())"
            )
        mesh, groups = _build_groups(topology, device_type)
        return cls(topology, mesh=mesh, groups=groups)

    @property
    def groups(self) -> dict[str, ProcessGroup]:
        """The process groups built so far, by domain (domains spanning every rank are absent: `None`)."""
        return dict(self._groups)

    def group(self, domain: str) -> ProcessGroup | None:
        """Process group of this rank's `domain`; `None` (torch's default group) when it spans every rank."""
        topology = self.topology
        size = topology.size(domain)
        if size == topology.world_size or not (dist.is_available() and dist.is_initialized()):
            return None
        group = self._groups.get(domain)
        if group is None:
            if size != 1:
                raise RuntimeError(f"no process group was built for domain {domain!r} of {size} ranks")
            # Only this rank is in it, so no other rank has to take part in creating it.
            group = dist.new_group([topology.global_rank], use_local_synchronization=True)
            for name in topology.domains:  # one such group serves every one-rank domain
                if topology.size(name) == 1:
                    self._groups[name] = group
        return group

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.topology!r}, mesh={self.mesh!r})"


def _build_groups(topology: ParallelTopology, device_type: str) -> tuple[DeviceMesh, dict[str, ProcessGroup]]:
    """Device mesh over the axes above degree one, and the group of every partial, multi-rank domain."""
    from torch.distributed.device_mesh import init_device_mesh

    degrees, world_size = topology._grid, topology.world_size  # grid dimensions: the split data axis, if any
    mesh = init_device_mesh(device_type, topology.mesh_shape, mesh_dim_names=topology.mesh_dim_names)
    groups: dict[str, ProcessGroup] = {}
    flattened: dict[tuple[str, ...], ProcessGroup] = {}
    for domain, axes in topology.domains.items():  # the same order on every rank: group creation is collective
        dims = tuple(axis for axis in axes if degrees[axis] > 1)
        size = math.prod(degrees[axis] for axis in dims)
        if size in (1, world_size):
            continue  # this rank alone (made on request) or the default group
        if len(dims) == 1:
            groups[domain] = mesh.get_group(dims[0])
        else:
            if dims not in flattened:
                flattened[dims] = mesh[dims]._flatten("_".join(dims)).get_group()
            groups[domain] = flattened[dims]
    return mesh, groups
