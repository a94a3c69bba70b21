"""A process group or a ``DeviceMesh``: what every ``group=`` accepts, resolved to groups once.

A 1-D mesh stands for its process group. A 2-D mesh means hybrid sharding, as FSDP2 reads it:
dim 0 replicates, dim 1 shards (HSDP). Only [`shard()`][gradaccum.shard] takes a 2-D mesh; a
sync that reduces over one group refuses it with an error that says what to pass instead.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch.distributed as dist

from .._errors import describe, is_mesh

__all__ = ["Axis", "axes", "axis", "check_group", "is_mesh"]


class Axis(NamedTuple):
    """One process group a collective runs on, and the mesh dim it is (``None``: a bare group)."""

    group: Any
    dim: str | None = None


def _dim_name(mesh: Any, d: int) -> str:
    names = mesh.mesh_dim_names
    return str(names[d]) if names else f"dim {d}"


def _shape(mesh: Any) -> str:
    dims = ", ".join(f"{_dim_name(mesh, d)}={mesh.size(d)}" for d in range(mesh.ndim))
    return f"a {mesh.ndim}-D DeviceMesh ({dims})"


def axis(where: str, group: Any, arg: str = "group") -> Axis:
    """``group`` as one [`Axis`][gradaccum._dist.mesh.Axis]: a group, ``None``, or a 1-D mesh."""
    if not is_mesh(group):
        return Axis(group)
    if group.ndim != 1:
        raise ValueError(
            f"{where}: {arg} is {_shape(group)}, but this sync reduces over one process group; "
            f"pass a 1-D mesh (e.g. mesh[{_dim_name(group, group.ndim - 1)!r}]) or its group. "
            f"For hybrid sharding over a 2-D (replicate, shard) mesh, shard the params with "
            f"gradaccum.shard(params, mesh) and use gradaccum.reduce_scatter(sharded)."
        )
    return Axis(group.get_group(0), _dim_name(group, 0))


def axes(where: str, group: Any, arg: str = "group") -> tuple[Axis, Axis | None]:
    """``group`` as ``(shard axis, replicate axis or None)``; a 2-D mesh is (replicate, shard)."""
    if not is_mesh(group) or group.ndim == 1:
        return axis(where, group, arg), None
    if group.ndim != 2:
        raise ValueError(
            f"{where}: {arg} is {_shape(group)}; gradaccum shards over a 1-D mesh (or a process "
            f"group) and shards hybrid over a 2-D mesh of (replicate, shard) dims, as FSDP2 "
            f"does; pass a 1-D or 2-D sub-mesh, e.g. mesh[('dp_replicate', 'dp_shard')]."
        )
    return (
        Axis(group.get_group(1), _dim_name(group, 1)),
        Axis(group.get_group(0), _dim_name(group, 0)),
    )


def check_group(where: str, group: Any, fix: str = "pass e.g. dist.new_group([0, 1])") -> None:
    """Refuse a ``group=`` that is neither ``None``, a process group nor a ``DeviceMesh``."""
    if group is None or is_mesh(group) or group is dist.GroupMember.NON_GROUP_MEMBER:
        return
    if not dist.is_available() or not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{where}: group must be None (the default group), a torch.distributed "
            f"ProcessGroup or a DeviceMesh, got {describe(group)}; {fix}."
        )
