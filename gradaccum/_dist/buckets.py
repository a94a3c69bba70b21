"""Flat gradient buckets: which leaves go in which bucket, at which offset (no communication).

Leaves are grouped by (device, accumulation dtype) in reverse natural order of their key paths
(the usual backward order; the same on every rank), or in an order the ranks agreed on (the order
their gradients became final, as DDP rebuilds its buckets), and added to a bucket until it holds
at least ``bucket_mb`` (1 MiB for the first bucket, so that with overlap the first all-reduce
starts early), as DDP does; a leaf is never split, so a bucket may exceed its limit by its last
leaf. The last bucket of the widest dtype carries a two-element tail: the window's weight and a
"this rank failed" flag. With a wire dtype (``reduce_dtype``) other than the buckets' own, the
gradient buckets are sent in it and the tail, which must stay exact, travels in a bucket of its
own (float64, or float32 where no leaf accumulates in float64).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist

from .._errors import dtype_name

__all__ = [
    "TAIL",
    "Bucket",
    "Plan",
    "bucket_of",
    "cut_runs",
    "group_device",
    "leaf_order",
    "make_plan",
    "starts",
]

TAIL = 2  # [weight, failed]
FIRST = 2**20  # bytes: the first bucket's limit, as DDP's (so the first all-reduce starts early)


@dataclass(frozen=True)
class Bucket:
    """One flat bucket of the boundary all-reduce, as reported by a dry run.

    [`AllReduce.plan()`][gradaccum.sync.AllReduce.plan] returns them, in the order they are reduced.

    Attributes:
        dtype: The bucket's dtype (the accumulation dtype of its leaves).
        device: Where the bucket lives.
        paths: Key paths of the gradient leaves in the bucket, in flat order.
        numel: Elements on the wire, the two-element tail included.
        nbytes: Bytes on the wire (in ``reduce_dtype`` when it is set).
        tail: Whether the bucket carries the window's weight and failure flag.
        collectives: Each collective the bucket goes through in a window, as
            ``(kind, mesh dim)``: e.g. ``(("all_reduce", None),)`` on a process group, or
            ``(("reduce_scatter", "shard"), ("all_reduce", "replicate"))`` sharded hybrid over
            a 2-D ``DeviceMesh`` (the dim is ``None`` for a process group given as such).
        reduce_dtype: The dtype the bucket is sent in, when it is not ``dtype`` (the sync's
            ``reduce_dtype`` option: cast before the collective, cast back after it); ``None``:
            sent in ``dtype``.

    Examples:
        >>> import torch, gradaccum
        >>> (bucket,) = gradaccum.all_reduce().plan({"w": torch.zeros(3, dtype=torch.float64)})
        >>> bucket.paths, bucket.numel, bucket.nbytes, bucket.tail
        (("['w']",), 5, 40, True)
    """

    dtype: torch.dtype
    device: torch.device
    paths: tuple[str, ...]
    numel: int
    nbytes: int
    tail: bool
    collectives: tuple[tuple[str, str | None], ...] = (("all_reduce", None),)
    reduce_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class Plan:
    buckets: tuple[Bucket, ...]
    members: tuple[tuple[int, ...], ...]  # leaf indices per bucket
    offsets: tuple[tuple[int, ...], ...]  # element offset of each member in its bucket
    description: tuple[str, ...]  # what the fingerprint covers, one line per item


def group_device(group: Any) -> torch.device:
    """Where a collective on ``group`` takes its tensors when no gradient says: an empty tree's.

    The CPU for gloo (and without torch.distributed, or for a group with a CPU backend beside
    others, such as ``"cpu:gloo,cuda:nccl"``); for a backend of one accelerator type (NCCL:
    CUDA, as ``torch.distributed.Backend.default_device_backend_map`` pairs them), the current
    device of that type, as ``torch.cuda.current_device()``: a CPU tensor cannot reach NCCL.
    """
    cpu = torch.device("cpu")
    if not dist.is_available() or not dist.is_initialized():
        return cpu
    pg = dist.group.WORLD if group is None else group
    if pg is dist.GroupMember.NON_GROUP_MEMBER:
        return cpu  # not a member: Comm refuses it with its own message
    backend = str(dist.get_backend(pg))
    if ":" in backend:  # one backend per device type, e.g. "cpu:gloo,cuda:nccl"
        kinds = [part.split(":")[0] for part in backend.split(",")]
        kind = "cpu" if "cpu" in kinds else kinds[0]
    else:
        pairs = dist.Backend.default_device_backend_map.items()
        kind = next((d for d, b in pairs if b == backend), "cpu")  # "cpu": "gloo" comes first
    if kind == "cpu":
        return cpu
    return torch.device(kind, torch.get_device_module(kind).current_device())


def _natural_key(path: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key comparing the numbers in a key path as numbers: ``layers.10`` after ``layers.9``."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", path) if p)


def leaf_order(paths: tuple[str, ...]) -> list[int]:
    """Leaf indices in reverse natural order of their key paths (backward's usual order)."""
    return sorted(range(len(paths)), key=lambda i: _natural_key(paths[i]), reverse=True)


def cut_runs(idx: list[int], nbytes: list[int], cap: int) -> list[list[int]]:
    """Cut leaves into buckets of at least ``min(FIRST, cap)`` bytes, then ``cap``; at least one."""
    runs: list[list[int]] = []
    current: list[int] = []
    used, limit = 0, min(FIRST, cap)
    for i, size in zip(idx, nbytes):
        current.append(i)
        used += size
        if used >= limit:
            runs.append(current)
            current, used, limit = [], 0, cap
    if current or not runs:
        runs.append(current)
    return runs


def starts(lay: Any, idx: list[int]) -> tuple[int, ...]:
    """Where each leaf of ``idx`` starts in a flat bucket of them (elements), then its size."""
    return (0, *accumulate(lay.shapes[i].numel() for i in idx))


def make_plan(
    lay: Any,
    cap: int,
    order: list[int] | None = None,
    *,
    device: torch.device | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> Plan:
    """Group leaves by (device, dtype), then fill buckets as the module docstring says.

    ``order``: the leaves in the order to fill the buckets (default: ``leaf_order``).
    ``device``: where the bucket of a layout without leaves lives, which holds only the tail
    (default: the CPU; a sync passes its group's, see ``group_device``). ``reduce_dtype``: the
    dtype the gradient buckets are sent in (``None``: their own); the fingerprint covers it.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i in leaf_order(lay.paths) if order is None else order:
        groups.setdefault((lay.devices[i], lay.accum_dtypes[i]), []).append(i)
    cut: list[tuple[torch.device, torch.dtype, list[int]]] = []
    for (dev, dt), idx in groups.items():
        sizes = [lay.shapes[i].numel() * dt.itemsize for i in idx]
        cut.extend((dev, dt, run) for run in cut_runs(idx, sizes, cap))
    if not cut:
        cut.append((torch.device("cpu") if device is None else device, torch.float64, []))

    def wire(dt: torch.dtype, idx: list[int]) -> torch.dtype | None:
        return reduce_dtype if idx and reduce_dtype not in (None, dt) else None

    # The weight rides in the last bucket of the widest dtype that counts exactly, sent as is.
    exact = (torch.float64, torch.float32)
    wide = [k for k, (_, dt, idx) in enumerate(cut) if dt in exact and wire(dt, idx) is None]
    if wide:
        tail_k = max(wide, key=lambda k: (cut[k][1] == torch.float64, k))
    else:  # only float16/bfloat16 accumulators, or a wire dtype: a tiny bucket of its own
        dt = torch.float64 if any(c[1] == torch.float64 for c in cut) else torch.float32
        cut.append((cut[-1][0], dt, []))
        tail_k = len(cut) - 1
    buckets, members, offsets = [], [], []
    desc = [
        f"params leaf {p} of shape {list(shape)} {dtype_name(dt)} accumulated in {dtype_name(adt)}"
        for p, shape, dt, adt in zip(lay.paths, lay.shapes, lay.dtypes, lay.accum_dtypes)
    ]
    desc.append(f"{len(lay.paths)} params leaves")
    if order is not None:
        desc.append("buckets in the agreed gradient-ready order")
    for k, (dev, dt, idx) in enumerate(cut):
        *offs, off = starts(lay, idx)
        total = off + (TAIL if k == tail_k else 0)
        paths = tuple(lay.paths[i] for i in idx)
        sent = wire(dt, idx)
        nbytes = total * (dt if sent is None else sent).itemsize
        buckets.append(Bucket(dt, dev, paths, total, nbytes, k == tail_k, reduce_dtype=sent))
        members.append(tuple(idx))
        offsets.append(tuple(offs))
        desc.append(
            f"bucket {k} of {total} {dtype_name(dt)} elements"
            f"{f' sent as {dtype_name(sent)}' if sent is not None else ''}"
            f"{' with the weight' if k == tail_k else ''}"
        )
    return Plan(tuple(buckets), tuple(members), tuple(offsets), tuple(desc))


def bucket_of(
    leaves: list[torch.Tensor], offsets: tuple[int, ...], b: Bucket, numel: int | None = None
) -> torch.Tensor | None:
    """The flat bucket the leaves are views of (zero-copy), or None if they are not.

    ``numel``: the bucket's size, if not ``b.numel`` (a tail bucket with metrics is longer).
    """
    if not leaves:
        return None
    base = leaves[0]._base
    size = b.numel if numel is None else numel
    if base is None or base.dim() != 1 or base.numel() != size or base.dtype != b.dtype:
        return None
    start, item = base.data_ptr(), base.element_size()
    for leaf, off in zip(leaves, offsets):
        if leaf._base is not base or leaf.data_ptr() != start + off * item:
            return None
    return base
