"""The layout of sharded params: which leaf lies where in which bucket and shard (no communication).

Leaves are grouped by (parameter group, device, dtype), taken in reverse natural order of their
key paths and cut into buckets as the data-parallel buckets are; each bucket is padded to a
multiple of the world size, and rank ``r`` owns chunk ``r`` of every bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._dist.buckets import cut_runs, leaf_order, starts
from .._errors import dtype_name

__all__ = ["ShardBucket", "ShardPlan", "make_shard_plan"]


@dataclass(frozen=True)
class ShardBucket:
    """One bucket of a sharded layout (internal)."""

    shard: int  # which shard tensor its chunk lives in
    members: tuple[int, ...]  # leaf indices, in bucket order
    offsets: tuple[int, ...]  # element offset of each member in the full bucket
    padded: int  # its elements, rounded up to a multiple of the world size
    chunk: int  # padded // world: elements per rank
    start: int  # where this bucket's chunk starts in its shard tensor
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        """Bytes of the full (padded) bucket."""
        return self.padded * self.dtype.itemsize


@dataclass(frozen=True)
class ShardPlan:
    """Which leaf is where, for one world size (internal; no communication)."""

    names: tuple[str, ...]  # parameter group of each shard tensor
    dtypes: tuple[torch.dtype, ...]  # dtype of each shard tensor
    devices: tuple[torch.device, ...]
    sizes: tuple[int, ...]  # elements of each shard tensor (on every rank)
    buckets: tuple[ShardBucket, ...]
    bucket_of_leaf: tuple[int, ...]
    description: tuple[str, ...]  # what the fingerprint covers


def make_shard_plan(
    lay: Any, world: int, cap: int, names: tuple[str, ...], rows: bool = False
) -> ShardPlan:
    """Group leaves by (parameter group, device, dtype), cut each group into buckets, pad.

    ``rows``: FSDP2's layout, one bucket per leaf padded to a multiple of ``world`` rows (dim 0).
    """
    groups: dict[tuple[str, torch.device, torch.dtype], list[int]] = {}
    for i in leaf_order(lay.paths):
        groups.setdefault((names[i], lay.devices[i], lay.dtypes[i]), []).append(i)
    buckets: list[ShardBucket] = []
    bucket_of_leaf = [0] * len(lay.paths)
    for s, ((_, dev, dt), idx) in enumerate(groups.items()):
        start = 0
        nbytes = [lay.shapes[i].numel() * dt.itemsize for i in idx]
        for run in [[i] for i in idx] if rows else cut_runs(idx, nbytes, cap):
            *offs, off = starts(lay, run)
            for i in run:
                bucket_of_leaf[i] = len(buckets)
            if rows:  # whole rows per rank: torch.chunk on dim 0, as FSDP2 shards
                dim0 = lay.shapes[run[0]][0]
                off = world * -(-dim0 // world) * (off // dim0 if dim0 else 0)
            padded = -(-off // world) * world
            chunk = padded // world
            buckets.append(ShardBucket(s, tuple(run), tuple(offs), padded, chunk, start, dt, dev))
            start += chunk
    shard_names, devices, dtypes = zip(*groups) if groups else ((), (), ())
    sizes = tuple(sum(b.chunk for b in buckets if b.shard == s) for s in range(len(groups)))
    desc = [
        f"params leaf {p} of shape {list(shape)} {dtype_name(dt)} in parameter group {g!r}"
        for p, shape, dt, g in zip(lay.paths, lay.shapes, lay.dtypes, names)
    ]
    desc.append(
        f"{len(lay.paths)} params leaves sharded over {world} ranks"
        + (" by rows (FSDP2's layout)" if rows else "")
    )
    desc.extend(
        f"bucket {k} of {b.padded} {dtype_name(b.dtype)} elements in shard {b.shard}"
        for k, b in enumerate(buckets)
    )
    return ShardPlan(
        shard_names, dtypes, devices, sizes, tuple(buckets), tuple(bucket_of_leaf), tuple(desc)
    )
