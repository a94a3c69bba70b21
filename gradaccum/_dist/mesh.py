"""A process group or a ``DeviceMesh``: what every ``group=`` accepts, resolved to groups once.

A 1-D mesh stands for its process group. A 2-D mesh means hybrid sharding, as FSDP2 reads it:
dim 0 replicates, dim 1 shards (HSDP). Only [`shard()`][gradaccum.shard] takes a 2-D mesh; a
sync that reduces over one group refuses it with an error that says what to pass instead.

A resolved group is held weakly ([`Axis`][gradaccum._dist.mesh.Axis], and through it every
[`Comm`][gradaccum.sync.Comm]): ``torch.distributed.destroy_process_group()`` then frees it, and
its backend's destructor joins the gloo worker threads there, while the interpreter runs. A group
that outlived it (a windows, step or sync kept in a module global) was freed at interpreter exit
instead, and a worker thread that released a collective's tensors then took the GIL during
finalization: CPython ends such a thread inside a C++ destructor and the process aborts
("terminate called without an active exception", exit code 134). ``docs/reliability.md`` has the
whole story.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from .._errors import GradAccumError, describe, is_mesh

__all__ = ["Axis", "axes", "axis", "check_group", "hold", "is_mesh"]


def hold(group: Any) -> Callable[[], Any]:
    """A function that returns ``group``, holding a process group weakly.

    ``None`` (the default group, resolved later) and objects that take no weak reference (the
    non-member sentinel) are held as they are. Calling it once the group was freed (after
    ``destroy_process_group()``, with no other reference left) raises ``GradAccumError``.

    Examples:
        >>> hold(None)() is None
        True
    """
    try:
        ref = weakref.ref(group)
    except TypeError:  # None, a sentinel: nothing to free
        return lambda: group

    def held() -> Any:
        pg = ref()
        if pg is None:
            raise GradAccumError(
                "the process group it was built with has been destroyed "
                "(torch.distributed.destroy_process_group()) and freed; build the sync, the "
                "windows and the step again after init_process_group(), or keep a reference to "
                "a group you made yourself for as long as you use it."
            )
        return pg

    return held


class Axis:
    """One process group a collective runs on (held weakly), and its mesh dim (``None``: none).

    It unpacks as ``(group, dim)``. The group is held weakly (see ``hold``), so that
    ``destroy_process_group()`` frees it whatever gradaccum object keeps the ``Axis``.
    """

    __slots__ = ("_group", "dim")

    def __init__(self, group: Any, dim: str | None = None) -> None:
        self._group = hold(group)
        self.dim = dim

    @property
    def group(self) -> Any:
        """The process group (``None``: the default group); raises once it was freed."""
        return self._group()

    def __iter__(self) -> Iterator[Any]:
        return iter((self.group, self.dim))

    def __repr__(self) -> str:
        return f"Axis(dim={self.dim!r})"


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
