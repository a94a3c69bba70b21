"""The layout of sharded params: which leaf lies where in which bucket and shard (no communication).

Leaves are grouped by (parameter group, device, dtype), taken in reverse natural order of their
key paths and cut into buckets as the data-parallel buckets are; each bucket is padded to a
multiple of the world size, and rank ``r`` owns chunk ``r`` of every bucket.

An FSDP2 model's buckets are its ``fully_shard`` units instead (one bucket per unit, parameter
group, device and dtype), in FSDP2's own layout: each parameter is cut by rows (``torch.chunk``
on dim 0, padded to ``world * c`` rows), and rank ``r``'s chunk of the bucket is the
concatenation of its rows of every member, as FSDP2's all-gather input and reduce-scatter
output are. The bucket's running sums are kept member by member (each member's padded rows in
one piece, so that its gradient is a view); `ShardBucket.to_wire` and
`ShardBucket.from_wire` move between that and the rank-major order on the wire, as FSDP2's
copy-in and copy-out do.
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
    # FSDP2's layout (rows): each member's elements per rank, in bucket order; () otherwise.
    # Member j's rows then start at ``offsets[j] = world * sum(parts[:j])`` in the full bucket,
    # and at ``sum(parts[:j])`` in every rank's chunk.
    parts: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes of the full (padded) bucket."""
        return self.padded * self.dtype.itemsize

    @property
    def world(self) -> int:
        """The ranks the bucket is sharded over."""
        return self.padded // self.chunk if self.chunk else 1

    @property
    def interleaved(self) -> bool:
        """Whether the wire's rank-major order differs from the member-major running sums."""
        return len(self.parts) > 1 and self.world > 1

    def part(self, j: int) -> tuple[int, int]:
        """Member ``j``'s elements in a rank's chunk: ``(start, size)`` (FSDP2's layout only)."""
        return self.offsets[j] // self.world, self.parts[j]

    def to_wire(self, full: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The full bucket as the collective takes it: rank-major, in ``dtype``.

        ``full`` itself when it already is (no copy); else a copy (FSDP2's copy-in, with its
        cast to the reduce dtype).
        """
        if not self.interleaved:
            return full if dtype == full.dtype else full.to(dtype)
        wire = torch.empty(self.padded, dtype=dtype, device=full.device)
        ranks = wire.view(self.world, self.chunk)
        for j, (start, size) in enumerate(map(self.part, range(len(self.parts)))):
            mine = full[self.offsets[j] : self.offsets[j] + self.world * size]
            ranks[:, start : start + size].copy_(mine.view(self.world, size))
        return wire

    def from_wire(self, wire: torch.Tensor) -> torch.Tensor:
        """An all-gathered bucket (rank-major) in member order, whose slices are the leaves.

        ``wire`` itself when the orders agree; else a copy (FSDP2's copy-out).
        """
        if not self.interleaved:
            return wire
        full = torch.empty_like(wire)
        ranks = wire.view(self.world, self.chunk)
        for j, (start, size) in enumerate(map(self.part, range(len(self.parts)))):
            mine = full[self.offsets[j] : self.offsets[j] + self.world * size]
            mine.view(self.world, size).copy_(ranks[:, start : start + size])
        return full


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


def _units(idx: list[int], units: tuple[int, ...]) -> list[list[int]]:
    """``idx`` cut into one run per FSDP2 unit, in the order the units first appear."""
    runs: dict[int, list[int]] = {}
    for i in idx:
        runs.setdefault(units[i], []).append(i)
    return list(runs.values())


def make_shard_plan(
    lay: Any,
    world: int,
    cap: int,
    names: tuple[str, ...],
    units: tuple[int, ...] | None = None,
) -> ShardPlan:
    """Group leaves by (parameter group, device, dtype), cut each group into buckets, pad.

    ``units``: FSDP2's layout. The ``fully_shard`` unit of each leaf: one bucket per unit (in
    each group), each member cut by rows (dim 0) into ``world`` chunks of ``ceil(rows / world)``
    rows, as FSDP2 shards; ``cap`` does not apply.
    """
    groups: dict[tuple[str, torch.device, torch.dtype], list[int]] = {}
    for i in leaf_order(lay.paths):
        groups.setdefault((names[i], lay.devices[i], lay.dtypes[i]), []).append(i)
    buckets: list[ShardBucket] = []
    bucket_of_leaf = [0] * len(lay.paths)
    for s, ((_, dev, dt), idx) in enumerate(groups.items()):
        start = 0
        nbytes = [lay.shapes[i].numel() * dt.itemsize for i in idx]
        for run in _units(idx, units) if units is not None else cut_runs(idx, nbytes, cap):
            for i in run:
                bucket_of_leaf[i] = len(buckets)
            if units is not None:  # whole rows per rank: torch.chunk on dim 0, as FSDP2 shards
                parts = tuple(_rows_part(lay.shapes[i], world) for i in run)
                offs = [world * sum(parts[:j]) for j in range(len(run))]
                chunk = sum(parts)
                padded = world * chunk
            else:
                parts = ()
                *offs, off = starts(lay, run)
                padded = -(-off // world) * world
                chunk = padded // world
            buckets.append(
                ShardBucket(s, tuple(run), tuple(offs), padded, chunk, start, dt, dev, parts)
            )
            start += chunk
    shard_names, devices, dtypes = zip(*groups) if groups else ((), (), ())
    sizes = tuple(sum(b.chunk for b in buckets if b.shard == s) for s in range(len(groups)))
    desc = [
        f"params leaf {p} of shape {list(shape)} {dtype_name(dt)} in parameter group {g!r}"
        for p, shape, dt, g in zip(lay.paths, lay.shapes, lay.dtypes, names)
    ]
    desc.append(
        f"{len(lay.paths)} params leaves sharded over {world} ranks"
        + (" by rows in FSDP2's units (FSDP2's layout)" if units is not None else "")
    )
    desc.extend(
        f"bucket {k} of {b.padded} {dtype_name(b.dtype)} elements in shard {b.shard}"
        + (f", members' rows per rank {list(b.parts)}" if b.parts else "")
        for k, b in enumerate(buckets)
    )
    return ShardPlan(
        shard_names, dtypes, devices, sizes, tuple(buckets), tuple(bucket_of_leaf), tuple(desc)
    )


def _rows_part(shape: torch.Size, world: int) -> int:
    """Elements per rank of a leaf cut by rows: ``ceil(rows / world)`` rows of it."""
    if len(shape) == 0 or shape[0] == 0:
        return 0
    return -(-shape[0] // world) * (shape.numel() // shape[0])
