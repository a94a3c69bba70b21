"""Sharded params (FSDP / ZeRO style): each rank owns a flat, padded shard of every bucket.

The buckets are `_shard_plan`'s. A rank's shard tensor for a parameter group is the
concatenation of its chunks of that group's buckets, so that

- ``all_gather_single(bucket, chunk)`` rebuilds a bucket, whose slices are the full params
  (no copy-out), and
- ``reduce_scatter_single(chunk, bucket)`` sums a bucket of gradients over the group straight
  into this rank's slice of the gradient shard (no copy-in).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import _tree
from .._checks import positive
from .._core.checkpoint_format import check_like, check_meta
from .._dist.comm import Comm, bucket_what
from .._dist.mesh import Axis, axes, check_group
from .._errors import GradAccumError, describe, is_mesh
from .._layout import make_layout
from ._fsdp import FsdpParams, dtensor_grads, fsdp_params, local_chunk
from ._plan import ShardBucket, ShardPlan, make_shard_plan
from ._window import MAX_IN_FLIGHT

__all__ = ["Sharded", "shard"]

FORMAT = "gradaccum.Sharded/1"


class Sharded:
    """Params sharded over a process group: each rank holds a flat, padded shard.

    Make one with [`shard()`][gradaccum.shard]. The optimizer steps on
    [`shards`][gradaccum.sharding.Sharded.shards] (plain tensors, one per parameter group, device
    and dtype); [`gather()`][gradaccum.sharding.Sharded.gather] rebuilds the full params for
    compute; a [`reduce_scatter()`][gradaccum.reduce_scatter] sync returns the window's gradient as
    shards of the same shapes, which [`write_grads()`][gradaccum.sharding.Sharded.write_grads]
    puts in ``.grad``.

    Attributes:
        shards: This rank's shard tensors, flat and padded; give them to the optimizer. For an
            FSDP2 model they are ``meta`` tensors (no storage) that only give the gradient
            shards' shapes and dtypes: its parameters stay in the model, and the optimizer
            steps on ``model.parameters()``.
        names: The parameter group of each shard tensor (see ``param_groups`` of
            [`shard()`][gradaccum.shard]).
        group: The process group the params are sharded over (a mesh's shard dim).
        rank: This process's rank in ``group``.
        world: The size of ``group``.
        replicate: With a 2-D (replicate, shard) mesh, the process group of this rank's
            replicas (the mesh's replicate dim), which hold the same shards; ``None`` otherwise.
        replicas: The size of ``replicate`` (1 without it).

    Examples:
        >>> import torch, torch.distributed as dist, gradaccum
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> sharded = gradaccum.shard(
        ...     {"fc.weight": torch.ones(2, 2), "fc.bias": torch.zeros(2)},
        ...     param_groups=lambda path: "no_decay" if "bias" in path else "decay",
        ... )
        >>> sharded.names
        ('decay', 'no_decay')
        >>> opt = torch.optim.AdamW(
        ...     [
        ...         {"params": sharded.group_shards("decay"), "weight_decay": 0.1},
        ...         {"params": sharded.group_shards("no_decay"), "weight_decay": 0.0},
        ...     ]
        ... )
        >>> sharded.write_grads([torch.ones(4), torch.ones(2)])
        >>> opt.step()
        >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        layout: Any,
        plan: ShardPlan,
        comm: Comm,
        bucket_mb: float,
        rcomm: Comm | None,
        fsdp: FsdpParams | None = None,
    ) -> None:
        self.layout, self.plan, self.bucket_mb, self.fsdp = layout, plan, bucket_mb, fsdp
        # An FSDP2 model's rows stay in its DTensors: the shards only give the gradient shards'
        # shapes and dtypes (meta tensors, no storage), and the optimizer steps on the model.
        self.shards = tuple(
            torch.zeros(size, dtype=dt, device="meta" if fsdp is not None else dev)
            for size, dt, dev in zip(plan.sizes, plan.dtypes, plan.devices)
        )
        """This rank's shard tensors, flat and padded: give them to the optimizer."""
        # Per bucket, the dtype its params are gathered in (an FSDP2 unit's param_dtype).
        self.gather_dtypes: tuple[torch.dtype, ...] = tuple(
            _gather_dtype(b, fsdp) for b in plan.buckets
        )
        # The layout of the gathered params, which the gradients are taken of: the shards'
        # own, but in each bucket's gather dtype (and accumulated in the shards' dtype).
        dtypes = tuple(
            self.gather_dtypes[plan.bucket_of_leaf[i]] for i in range(len(plan.bucket_of_leaf))
        )
        self.compute = dataclasses.replace(layout, dtypes=dtypes)
        self.names = plan.names
        """The parameter group of each shard tensor."""
        self.rank, self.world = comm.rank, comm.world
        # The groups are held weakly (Axis): destroy_process_group() frees them.
        self.axis = Axis(comm.group, comm.dim)
        self.replicate_axis = None if rcomm is None else Axis(rcomm.group, rcomm.dim)
        self.replicas = 1 if rcomm is None else rcomm.world
        self.mesh: Any = None  # the DeviceMesh it was sharded over, if any

    @property
    def group(self) -> Any:
        """The process group the shards are cut over (the mesh's shard dim)."""
        return self.axis.group

    @property
    def replicate(self) -> Any:
        """The group the shards are replicated over (a 2-D mesh's dim 0), or ``None``."""
        return None if self.replicate_axis is None else self.replicate_axis.group

    def __repr__(self) -> str:
        full = sum(s.numel() for s in self.layout.shapes)
        mine = sum(s.numel() for s in self.shards)
        return (
            f"Sharded({len(self.layout.paths)} leaves, {full} elements, shards of {mine} "
            f"elements on rank {self.rank} of {self.world}"
            f"{f' (x{self.replicas} replicas)' if self.replicas > 1 else ''}, "
            f"{len(self.plan.buckets)} buckets)"
        )

    def group_shards(self, name: str) -> list[torch.Tensor]:
        """The shard tensors of one parameter group (for an optimizer's param groups).

        Raises:
            KeyError: No shard belongs to a parameter group called ``name``.
            GradAccumError: The shards are an FSDP2 model's (the optimizer steps on the model).
        """
        if self.fsdp is not None:
            raise GradAccumError(
                f"Sharded.group_shards({name!r}): these shards are an FSDP2 model's parameters, "
                f"which stay in the model; build the optimizer on model.parameters()."
            )
        found = [s for s, n in zip(self.shards, self.names) if n == name]
        if not found:
            raise KeyError(
                f"Sharded.group_shards({name!r}): no parameter group {name!r}; the groups are "
                f"{sorted(set(self.names))} (from param_groups= of gradaccum.shard)."
            )
        return found

    def gather(self, *, timeout: float | None = None) -> Any:
        """The full params, all-gathered from every rank's shards (one collective per bucket).

        Args:
            timeout: Seconds to wait for each all-gather before raising
                [`GradAccumError`][gradaccum.GradAccumError]; ``None`` uses the process
                group's timeout.

        Returns:
            A pytree shaped like the params given to [`shard()`][gradaccum.shard], whose leaves
            are views into freshly gathered flat buffers (they do not require grad, and later
            optimizer steps do not change them: gather again after each step). An FSDP2
            model's leaves are in its units' ``param_dtype`` where their
            ``MixedPrecisionPolicy`` sets one.

        Raises:
            GradAccumError: A collective failed.
        """
        return self._gather("Sharded.gather()", timeout)

    def _gather(self, where: str, timeout: float | None) -> Any:
        """[`gather`][gradaccum.sharding.Sharded.gather], with failures named after ``where``."""
        lay, plan = self.layout, self.plan
        comm = Comm(where, self.axis, timeout)
        views: list[torch.Tensor] = [torch.empty(0)] * len(lay.shapes)
        # An FSDP2 model's inputs (and, packed, its outputs) are copies: at most MAX_IN_FLIGHT
        # of them live at once. Plain shards' inputs are views, and all go out at once.
        bound = MAX_IN_FLIGHT if self.fsdp is not None else len(plan.buckets)
        works: list[tuple[Any, str, ShardBucket, torch.Tensor, torch.Tensor]] = []
        last = len(plan.buckets) - 1
        with torch.no_grad():
            for k, b in enumerate(plan.buckets):
                dtype = self.gather_dtypes[k]
                wire = torch.empty(b.padded, dtype=dtype, device=b.device)
                if self.fsdp is not None:  # the model's own rows (cast to its param_dtype)
                    mine = local_chunk(self, k, dtype)
                else:
                    mine = self.shards[b.shard][b.start : b.start + b.chunk]
                what = bucket_what("all_gather", plan.buckets, k, "params bucket")
                works.append((comm.all_gather(wire, mine, what, "params"), what, b, wire, mine))
                while works and (len(works) >= bound or k == last):
                    work, what, done, gathered, _mine = works.pop(0)  # _mine: alive until now
                    comm.wait(work, what)
                    full = done.from_wire(gathered) if done.parts else gathered  # copy-out
                    for i, off in zip(done.members, done.offsets):
                        views[i] = full[off : off + lay.shapes[i].numel()].view(lay.shapes[i])
        return _tree.unflatten(lay.spec, views)

    def write_grads(self, grads: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> None:
        """Set each shard's ``.grad`` (replacing it), ready for ``optimizer.step()``.

        Args:
            grads: What an accumulated function with a
                [`reduce_scatter()`][gradaccum.reduce_scatter] sync returned: one tensor per
                shard, in order.

        Raises:
            ValueError: ``grads`` does not match the shards in number, shape or dtype; nothing
                is written then.
        """
        check_like(
            "Sharded.write_grads(grads)",
            grads,
            self.shards,
            "gradient shard",
            ValueError,
            "pass the gradients that the accumulated function with "
            "sync=gradaccum.reduce_scatter(sharded) returned",
        )
        if self.fsdp is not None:  # DTensor gradients on the model's DTensor parameters
            for p, g in zip(self.fsdp.params, dtensor_grads(self, grads)):
                p.grad = g
            return
        for g, s in zip(grads, self.shards):
            s.grad = g

    def checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint of these shards (or of an accumulator of them) must match.

        The group's size and this rank in it (and the replicas, sharded hybrid), ``bucket_mb``
        and the shard plan's description: a state saved under another sharding is refused.

        Examples:
            >>> import torch, torch.distributed as dist, gradaccum
            >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            >>> meta = gradaccum.shard({"w": torch.zeros(3)}).checkpoint_meta()
            >>> meta["world"], meta["rank"], meta["bucket_mb"]
            (1, 0, 25.0)
            >>> dist.destroy_process_group()
        """
        replicas = {"replicas": self.replicas} if self.replicas > 1 else {}
        return {
            "world": self.world,
            "rank": self.rank,
            **replicas,
            "bucket_mb": self.bucket_mb,
            "description": list(self.plan.description),
        }

    def _not_fsdp(self, call: str) -> None:
        if self.fsdp is not None:
            raise GradAccumError(
                f"Sharded.{call}: these shards are an FSDP2 model's parameters; checkpoint the "
                f"model itself (model.state_dict(), or torch.distributed.checkpoint) and the "
                f"optimizer as you would without gradaccum."
            )

    def state_dict(self) -> dict[str, Any]:
        """This rank's shards (copies) and the layout they were cut with.

        Save one file per rank; ``torch.load(..., weights_only=True)`` reads it back.
        """
        self._not_fsdp("state_dict()")
        return {
            "format": FORMAT,
            **self.checkpoint_meta(),
            "shards": [s.detach().clone() for s in self.shards],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy saved shards into [`shards`][gradaccum.sharding.Sharded.shards] (in place).

        The optimizer keeps referring to the same tensors, so load its state afterwards as
        usual. Nothing is changed when the check fails.

        Raises:
            GradAccumError: The state was saved by another rank, with another world size or
                another layout (params, parameter groups or ``bucket_mb``); the message names
                the first difference and the fix (to change the number of ranks, see
                [`dcp_checkpoint()`](../sharded.md#changing-the-number-of-ranks)).
        """
        where = "Sharded.load_state_dict(state_dict)"
        self._not_fsdp("load_state_dict(state_dict)")
        check_meta(where, state_dict, FORMAT, self.checkpoint_meta())
        saved = state_dict.get("shards")
        check_like(
            where,
            saved,
            self.shards,
            "saved shard",
            GradAccumError,
            "pass the dict that Sharded.state_dict() returned on this rank",
        )
        with torch.no_grad():
            for t, s in zip(saved or (), self.shards):
                s.copy_(t)


def shard(
    params: Any,
    group: Any = None,
    *,
    bucket_mb: float = 25.0,
    param_groups: Callable[[str], str] | None = None,
    src: int | None = 0,
) -> Sharded:
    """Shard a params pytree over a process group or a mesh (FSDP / ZeRO / HSDP style).

    Each rank keeps only its shard of the params: the leaves are cut into buckets (per
    parameter group, device and dtype; reverse natural order of key paths; a bucket closes
    once it holds ``bucket_mb``), each bucket is padded to a multiple of the world size, and
    rank ``r`` keeps the ``r``-th chunk of each. Leaves of any size and any mix of floating
    dtypes work; padding is zero and stays zero.

    Given a 2-D ``DeviceMesh``, the sharding is hybrid (HSDP), read as FSDP2 reads such a
    mesh: dim 0 replicates, dim 1 shards. The params are sharded over dim 1 and every
    replica along dim 0 holds the same shards. A [`reduce_scatter()`][gradaccum.reduce_scatter]
    sync then reduce-scatters within the shard dim (per micro-batch or at the boundary, by
    its ``policy``) and all-reduces the shards across the replicate dim once per window
    ([Hybrid sharding](../scale.md)).

    Args:
        params: A pytree of floating tensors (e.g. [`params_of(model)`][gradaccum.params_of]),
            or a model wrapped with FSDP2's ``fully_shard`` (on a 1-D mesh, or a 2-D
            (replicate, shard) mesh): its parameters stay where they are (no copy is kept), one
            bucket per ``fully_shard`` unit in FSDP2's layout, its units'
            ``MixedPrecisionPolicy`` is honoured, and
            [`write_grads()`][gradaccum.sharding.Sharded.write_grads] gives them DTensor gradients
            ([FSDP2 models](../scale.md#fsdp2-models)). ``group``, ``bucket_mb`` and ``src``
            do not apply then.
        group: The process group or a 1-D ``DeviceMesh``; ``None`` for the default group. A
            2-D ``DeviceMesh`` of (replicate, shard) dims shards hybrid.
        bucket_mb: Bucket size in MiB (as in [`all_reduce()`][gradaccum.all_reduce]): one
            all-gather and one reduce-scatter per bucket.
        param_groups: A function from a leaf's key path (e.g. ``"['fc.bias']"``) to the name
            of its parameter group. Each group gets shard tensors of its own, so that an
            optimizer can give it its own options and a sync its own gradient policy. Default:
            one group, ``"params"``.
        src: The rank (in the shard group) whose params are the initial values: each bucket is
            broadcast from it once (so ranks initialised with different seeds still agree), and
            on a 2-D mesh then from replica 0 to the other replicas. ``None`` takes each rank's
            own params, which must then be identical.

    Returns:
        A [`Sharded`][gradaccum.sharding.Sharded].

    Raises:
        RuntimeError: torch.distributed is not initialised.
        TypeError: A params leaf is not a floating tensor, or an argument has the wrong kind.
        ValueError: ``bucket_mb`` is not a positive, finite number, ``src`` is not a rank
            of the group, ``group`` is a mesh of more than 2 dims, or a leaf is on a device
            the group's backend takes no tensors of (the CPU under NCCL, e.g. FSDP2's
            ``CPUOffloadPolicy``).
        GradAccumError: The ranks passed params of different key paths, shapes or dtypes (the
            message names the first difference).

    Examples:
        A world of one process (every rank runs the same code under torchrun):

        >>> import torch, torch.distributed as dist, gradaccum
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> sharded = gradaccum.shard({"w": torch.ones(3), "b": torch.zeros(2)})
        >>> sharded.shards  # leaves in reverse key order: w, then b
        (tensor([1., 1., 1., 0., 0.]),)
        >>> sharded.gather()
        {'w': tensor([1., 1., 1.]), 'b': tensor([0., 0.])}
        >>> dist.destroy_process_group()

        In a training loop:

        ```python
        sharded = gradaccum.shard(gradaccum.params_of(model))
        opt = torch.optim.AdamW(sharded.shards, lr=1e-3)
        sync = gradaccum.reduce_scatter(sharded, policy="boundary")
        step = gradaccum.accumulate(gradaccum.grad(loss_fn), n=4, sync=sync)
        sharded.write_grads(step(sharded, batch))  # gathers, accumulates, reduce-scatters
        opt.step()
        opt.zero_grad(set_to_none=True)
        ```
    """
    where = "shard(params, group, bucket_mb=..., param_groups=..., src=...)"
    if not positive(bucket_mb):
        raise ValueError(
            f"{where}: bucket_mb must be a positive, finite number of MiB, got "
            f"{describe(bucket_mb)}; pass e.g. bucket_mb=25."
        )
    if param_groups is not None and not callable(param_groups):
        raise TypeError(
            f"{where}: param_groups must be None or a function from a key path to a group "
            f"name, got {describe(param_groups)}; pass e.g. "
            f"param_groups=lambda path: 'no_decay' if 'bias' in path else 'decay'."
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{where}: sharding needs torch.distributed initialised, but no process group "
            f"exists; call torch.distributed.init_process_group(...) first (torchrun sets the "
            f"environment for it; a world of one process works too)."
        )
    fsdp = fsdp_params(where, params, group) if isinstance(params, torch.nn.Module) else None
    if fsdp is not None:  # an FSDP2 model: its mesh, and its own shards as they are
        lay, group = fsdp.layout, fsdp.mesh
    else:
        lay = make_layout(where, params, None)
    names = []
    for path in lay.paths:
        name = param_groups(path) if param_groups is not None else "params"
        if not isinstance(name, str):
            raise TypeError(
                f"{where}: param_groups({path!r}) returned {describe(name)}; it must return a "
                f"group name (a str)."
            )
        names.append(name)
    check_group(where, group)
    shard_axis, replicate_axis = axes(where, group)
    comm = Comm(where, shard_axis)
    rcomm = Comm(where, replicate_axis) if replicate_axis is not None else None
    if rcomm is not None and rcomm.world == 1:  # a 1 x k mesh: nothing to replicate
        rcomm = None
    rank, world = comm.rank, comm.world
    if src is not None and (
        isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world
    ):
        raise ValueError(
            f"{where}: src must be None or a rank of the group (0 to {world - 1}), got "
            f"{describe(src)}; pass src=0 to start every rank from rank 0's params."
        )
    units = fsdp.units if fsdp is not None else None
    plan = make_shard_plan(lay, world, int(bucket_mb * 2**20), tuple(names), units)
    for c in (comm, rcomm):
        if c is not None:
            check_devices(where, c.group, plan, lay, fsdp)
    dev = plan.devices[0] if plan.devices else torch.device("cpu")
    probes = [(c, c.probe(plan.description, dev)) for c in (comm, rcomm) if c is not None]
    for c, probe in probes:
        c.agree(probe, "params to shard")
    sharded = Sharded(lay, plan, comm, float(bucket_mb), rcomm, fsdp)
    sharded.mesh = group if is_mesh(group) else None
    if fsdp is not None:
        return sharded
    leaves = _tree.flatten(params)[0]
    with torch.no_grad():
        for k, b in enumerate(plan.buckets):
            full = torch.zeros(b.padded, dtype=b.dtype, device=b.device)
            for i, off in zip(b.members, b.offsets):
                full[off : off + lay.shapes[i].numel()].copy_(leaves[i].reshape(-1))
            what = bucket_what("broadcast", plan.buckets, k, "params bucket")
            if src is not None and world > 1:
                comm.wait(comm.broadcast(full, src, what, "params"), what)
            if src is not None and rcomm is not None:
                rcomm.wait(rcomm.broadcast(full, 0, what, "params"), what)
            sharded.shards[b.shard][b.start : b.start + b.chunk].copy_(
                full[rank * b.chunk : (rank + 1) * b.chunk]
            )
    return sharded


def _gather_dtype(b: ShardBucket, fsdp: FsdpParams | None) -> torch.dtype:
    """The dtype bucket ``b``'s params are gathered in: an FSDP2 unit's ``param_dtype``."""
    if fsdp is None or not b.members:
        return b.dtype
    return fsdp.param_dtypes[b.members[0]] or b.dtype


GPU_ONLY = ("nccl", "xccl")  # backends whose collectives take no CPU tensors


def backend_of(group: Any) -> str:
    """The group's backend as ``torch.distributed.get_backend`` names it.

    For example ``"nccl"``, ``"gloo"`` or ``"cpu:gloo,cuda:nccl"`` (one per device type).
    """
    return str(dist.get_backend(group))


def reaches(backend: str, device: torch.device) -> bool:
    """Whether a group of ``backend`` takes tensors on ``device`` (unknown backends: yes)."""
    if ":" in backend:  # per device type: "cpu:gloo,cuda:nccl"
        per_type = dict(part.split(":", 1) for part in backend.split(","))
        if device.type not in per_type:
            return device.type != "cpu" or all(b not in GPU_ONLY for b in per_type.values())
        backend = per_type[device.type]
    return device.type != "cpu" or backend not in GPU_ONLY


def check_devices(where: str, group: Any, plan: ShardPlan, lay: Any, fsdp: Any) -> None:
    """Refuse a bucket on a device the group's backend cannot reduce (CPU under NCCL).

    Its all-gathers and reduce-scatters would hand CPU tensors to NCCL, which fails or hangs.
    """
    backend = backend_of(group)
    for b in plan.buckets:
        if not b.members or reaches(backend, b.device):
            continue
        i = b.members[0]
        offloaded = fsdp is not None and fsdp.offloaded[i]
        why = " (FSDP2's CPUOffloadPolicy keeps it there)" if offloaded else ""
        fix = (
            "fully_shard the model without offload_policy=CPUOffloadPolicy() (gradaccum "
            "gathers each parameter on the device of its shard)"
            if offloaded
            else "move the params to the group's device first"
        )
        raise ValueError(
            f"{where}: params leaf {lay.paths[i]} is on {b.device}{why}, but the group's backend "
            f"is {backend!r}, whose collectives take no {b.device.type} tensors; {fix}, or "
            f"initialise the group with a backend for each device type, e.g. "
            f"init_process_group('cpu:gloo,cuda:nccl')."
        )
