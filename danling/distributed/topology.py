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
- `"world"`: every rank.

[`Topology.group`][danling.distributed.topology.Topology.group] returns `None` for a domain
that spans every rank: torch reads `None` as its default group, so plain data-parallel runs
keep using the default group and pay nothing for the abstraction.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from .process_group import get_rank, get_world_size

if TYPE_CHECKING:  # only for annotations: builds without distributed support lack these classes
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["AXES", "DOMAINS", "Topology", "resolve_degrees"]

AXES: tuple[str, ...] = ("replicate", "shard", "context", "pipeline", "tensor")
"""Parallel axes, in the order of the rank grid's dimensions (the last one varies fastest)."""

# Axes of the runner's `parallel.axes` config that this layout does not implement: degree 1 only.
_DEGREE_ONE_AXES: tuple[str, ...] = ("expert", "expert_tensor")

DOMAINS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "world": AXES,
        "data": ("replicate", "shard"),
        "metrics": ("replicate", "shard"),
        "gradient": ("replicate", "shard", "context"),
        **{axis: (axis,) for axis in AXES},
    }
)
"""Each reduction domain and the axes it spans (always in the order of `AXES`)."""


def resolve_degrees(axes: Mapping[str, int], world_size: int) -> dict[str, int]:
    """Check parallel degrees against the world size and fill in the missing ones.

    Args:
        axes: Degree of each named axis; axes left out have degree 1 and one axis may be -1 to
            take whatever the others leave of `world_size`. ``expert`` and ``expert_tensor``
            (names of the runner's config) are accepted at degree 1.
        world_size: Number of ranks the degrees must multiply to.

    Returns:
        The degree of every axis of [`AXES`][danling.distributed.topology.AXES], in that order.

    Raises:
        ValueError: An unknown axis name, a degree that is neither positive nor a single -1, an
            expert axis above 1, or degrees whose product is not `world_size`.

    Examples:
        >>> resolve_degrees({"tensor": 2, "shard": -1}, world_size=8)
        {'replicate': 1, 'shard': 4, 'context': 1, 'pipeline': 1, 'tensor': 2}
    """
    if not isinstance(axes, Mapping):
        raise TypeError(f"axes must be a mapping from axis names to degrees, got {type(axes).__name__}")
    unknown = [name for name in axes if name not in AXES and name not in _DEGREE_ONE_AXES]
    if unknown:
        raise ValueError(f"unknown parallel axes {unknown}; accepted axes: {', '.join(AXES)}")
    experts = {name: axes[name] for name in _DEGREE_ONE_AXES if name in axes and axes[name] != 1}
    if experts:
        raise ValueError(f"expert parallelism is not supported: {_format(experts)} must be 1")
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
    return degrees


def _format(degrees: Mapping[str, Any]) -> str:
    return ", ".join(f"{name}={degree!r}" for name, degree in degrees.items())


class Topology:
    r"""This rank's coordinates on the parallel grid and the process group of each reduction domain.

    Build one with [`data_parallel`][danling.distributed.topology.Topology.data_parallel] (plain
    DDP or a single process: no groups beyond the default one) or
    [`from_axes`][danling.distributed.topology.Topology.from_axes] (a device mesh over the
    given degrees). Process groups are created while the topology is built, collectively,
    except the one-rank group of a domain this rank is alone in: that one involves no other
    rank and is made on first request.

    Attributes:
        degrees: Degree of each axis of [`AXES`][danling.distributed.topology.AXES].
        coordinates: This rank's index along each axis.
        world_size: Number of ranks (the product of the degrees).
        global_rank: This rank in the default group.
        mesh: The device mesh over the axes of degree above one (`None` when the world is one
            process or the topology is plain data parallel).

    Args:
        degrees: Degree of every axis, multiplying to the world size (see
            [`resolve_degrees`][danling.distributed.topology.resolve_degrees]).
        rank: This process's global rank.
        mesh: Device mesh the groups come from, if any.
        groups: Process group of each domain that is neither the whole world nor this rank alone.

    Examples:
        >>> topology = Topology.data_parallel()  # one process here
        >>> topology.size("data"), topology.rank("data"), topology.group("metrics")
        (1, 0, None)
        >>> topology.describe()
        {'world_size': 1, 'degrees': {'replicate': 1, 'shard': 1, ...}, 'data_size': 1}
    """

    def __init__(
        self,
        degrees: Mapping[str, int],
        *,
        rank: int = 0,
        mesh: DeviceMesh | None = None,
        groups: Mapping[str, ProcessGroup] | None = None,
    ) -> None:
        # Resolved degrees are expected; checking them again catches names, types and signs.
        world_size = math.prod(d for d in degrees.values() if isinstance(d, numbers.Integral) and d > 0)
        self.degrees: dict[str, int] = resolve_degrees(degrees, world_size)
        self.world_size = world_size
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}) for degrees {_format(self.degrees)}, got {rank}")
        self.global_rank = rank
        self.mesh = mesh
        unknown = [domain for domain in groups or {} if domain not in DOMAINS]
        if unknown:
            raise ValueError(f"unknown domains {unknown}; known domains: {', '.join(DOMAINS)}")
        self._groups: dict[str, ProcessGroup] = dict(groups or {})
        # Row-major grid: the stride of an axis is the product of the degrees after it.
        self._strides = {axis: math.prod(self.degrees[a] for a in AXES[i + 1 :]) for i, axis in enumerate(AXES)}
        self.coordinates: dict[str, int] = {axis: (rank // self._strides[axis]) % self.degrees[axis] for axis in AXES}

    @classmethod
    def data_parallel(cls) -> Topology:
        """Every rank reads its own batch: data, metrics and gradient domains are the whole world.

        World size and rank come from the default process group when one runs, else from
        torchrun's environment variables, else a single process. No process group is created.
        """
        degrees = dict.fromkeys(AXES, 1)
        degrees["replicate"] = get_world_size()
        return cls(degrees, rank=get_rank())

    @classmethod
    def from_axes(cls, axes: Mapping[str, int], *, device_type: str = "cpu") -> Topology:
        """Lay the ranks out on a grid of the given degrees and build each domain's process group.

        A collective: every rank must call it with the same `axes`, after the default process
        group has started. Axes of degree one are left out of the mesh; a domain spanning
        several axes gets one flattened group, shared by domains over the same axes.

        Args:
            axes: Degree of each axis (see
                [`resolve_degrees`][danling.distributed.topology.resolve_degrees]).
            device_type: Device type of the mesh, e.g. ``"cpu"`` or ``"cuda"``.

        Raises:
            ValueError: Bad axis names or degrees, or a product other than the world size.
            RuntimeError: Several ranks are expected (``WORLD_SIZE``) but no process group runs.
        """
        initialized = dist.is_available() and dist.is_initialized()
        world_size = dist.get_world_size() if initialized else get_world_size()
        degrees = resolve_degrees(axes, world_size)
        rank = dist.get_rank() if initialized else get_rank()
        if world_size == 1:
            return cls(degrees, rank=rank)
        if not initialized:
            raise RuntimeError(
                f"Topology.from_axes needs the default process group of the {world_size} ranks; "
                "start it first (e.g. with init_process_group_from_env())"
            )
        mesh, groups = _build_groups(degrees, device_type)
        return cls(degrees, rank=rank, mesh=mesh, groups=groups)

    def _axes(self, domain: str) -> tuple[str, ...]:
        axes = DOMAINS.get(domain)
        if axes is None:
            raise ValueError(f"unknown domain {domain!r}; known domains: {', '.join(DOMAINS)}")
        return axes

    def group(self, domain: str) -> ProcessGroup | None:
        """Process group of this rank's `domain`, or `None` (torch's default group) when it spans every rank.

        Without a running process group the answer is `None` too: there is no one to talk to.
        """
        size = math.prod(self.degrees[axis] for axis in self._axes(domain))
        if size == self.world_size or not (dist.is_available() and dist.is_initialized()):
            return None
        group = self._groups.get(domain)
        if group is None:
            if size != 1:
                raise RuntimeError(f"no process group was built for domain {domain!r} of {size} ranks")
            # Only this rank is in it, so no other rank has to take part in creating it.
            group = dist.new_group([self.global_rank], use_local_synchronization=True)
            for name, axes in DOMAINS.items():  # one such group serves every one-rank domain
                if math.prod(self.degrees[axis] for axis in axes) == 1:
                    self._groups[name] = group
        return group

    def size(self, domain: str = "world") -> int:
        """Number of ranks in `domain`."""
        return math.prod(self.degrees[axis] for axis in self._axes(domain))

    def rank(self, domain: str = "world") -> int:
        """This rank's index within `domain` (its group rank), e.g. the sampler rank for ``"data"``."""
        index = 0
        for axis in self._axes(domain):
            index = index * self.degrees[axis] + self.coordinates[axis]
        return index

    def ranks(self, domain: str = "world") -> list[int]:
        """Global ranks of this rank's `domain`, in increasing order (= group rank order)."""
        axes = self._axes(domain)
        base = self.global_rank - sum(self.coordinates[axis] * self._strides[axis] for axis in axes)
        steps = [[i * self._strides[axis] for i in range(self.degrees[axis])] for axis in axes]
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


def _build_groups(degrees: Mapping[str, int], device_type: str) -> tuple[DeviceMesh, dict[str, ProcessGroup]]:
    """Device mesh over the axes above degree one, and the group of every partial, multi-rank domain."""
    from torch.distributed.device_mesh import init_device_mesh

    world_size = math.prod(degrees.values())
    active = tuple(axis for axis in AXES if degrees[axis] > 1)
    mesh = init_device_mesh(device_type, tuple(degrees[axis] for axis in active), mesh_dim_names=active)
    groups: dict[str, ProcessGroup] = {}
    flattened: dict[tuple[str, ...], ProcessGroup] = {}
    for domain, axes in DOMAINS.items():  # the same order on every rank: group creation is collective
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
