"""A data-parallel window's boundary in flight: its buckets' all-reduces, launched in plan order.

With overlap, the all-reduce of each bucket starts during the last backward, as soon as all of
its leaves have their final sum; the rest, and the bucket with the weight and failure flag, start
at ``finish``, which waits on all of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from . import _comm
from ._buckets import TAIL, Plan, bucket_of
from ._errors import GradAccumError
from ._record import record

if TYPE_CHECKING:
    from ._sync import AllReduce

__all__ = ["InFlight"]


class InFlight:
    """One window's boundary in flight: buckets all-reduced in plan order as they are ready.

    Each bucket is launched as soon as it is ready, all of them before the tail bucket (which
    carries the weight and failure flag and so goes last, at ``finish``), then waited on together.

    The launch order is the same on every rank whatever the timing: the non-tail buckets in plan
    order, then the tail bucket.
    """

    def __init__(
        self,
        sync: AllReduce,
        where: str,
        reduction: str,
        plan: Plan,
        sums: list[torch.Tensor],
        group: Any,
        rank: int,
        world: int,
        probe: Any = None,
    ) -> None:
        self.sync, self.where, self.reduction, self.plan = sync, where, reduction, plan
        self.probe = probe  # the window's fingerprint exchange, waited for before any bucket
        self.sums, self.group, self.rank, self.world = sums, group, rank, world
        # The flat bucket each group of sums is a view of, or None (packed at finish).
        self.bufs: list[torch.Tensor | None] = [
            bucket_of([sums[i] for i in members], offsets, numel, b)
            for b, members, offsets, numel in zip(
                plan.buckets, plan.members, plan.offsets, plan.grad_numel
            )
        ]
        self.tail_k = next(k for k, b in enumerate(plan.buckets) if b.tail)
        self.order = [k for k in range(len(plan.buckets)) if k != self.tail_k] + [self.tail_k]
        self.remaining = [len(m) for m in plan.members]
        self.bucket_of_leaf = {i: k for k, m in enumerate(plan.members) for i in m}
        self.works: list[Any] = []  # in launch order

    def leaf_ready(self, i: int, _tensor: Any = None) -> None:
        """Leaf ``i``'s sum is final: launch every bucket that is now ready, in order."""
        k = self.bucket_of_leaf[i]
        self.remaining[k] -= 1
        if self.remaining[k] == 0:
            while len(self.works) < len(self.order) - 1:
                nxt = self.order[len(self.works)]
                if self.remaining[nxt] > 0 or self.bufs[nxt] is None:
                    break
                self._launch(nxt)

    def _agreed(self) -> None:
        """Wait for the fingerprint exchange (once): the ranks' buckets must agree."""
        if self.probe is not None:
            probe, self.probe = self.probe, None
            self.sync._agree(self.where, probe, self.group, self.rank, self.world)

    def _launch(self, k: int) -> None:
        self._agreed()
        buf = self.bufs[k]
        assert buf is not None
        record("all_reduce", self.group, buf.dtype, buf.numel(), "gradients")
        try:
            work = _comm.all_reduce(buf, self.group, self.sync.timeout)
        except RuntimeError as err:
            raise self.sync._failure(self.where, k, self.plan, self.rank, err) from err
        self.works.append(work)

    def finish(self, weight: int | float | torch.Tensor, failed: bool = False) -> float:
        """Launch what is left (the weight and failure flag in the tail), wait, return the total."""
        self._agreed()
        plan, packed = self.plan, []
        for k, (b, members, offsets, numel) in enumerate(
            zip(plan.buckets, plan.members, plan.offsets, plan.grad_numel)
        ):
            if self.bufs[k] is None:  # the sums are not views of one bucket (a hand-built state)
                buf = torch.empty(numel + (TAIL if b.tail else 0), dtype=b.dtype, device=b.device)
                for i, off in zip(members, offsets):
                    buf[off : off + self.sums[i].numel()].copy_(self.sums[i].reshape(-1))
                self.bufs[k] = buf
                packed.append(k)
        tail_buf = self.bufs[self.tail_k]
        assert tail_buf is not None
        tail = tail_buf[plan.grad_numel[self.tail_k] :]
        if isinstance(weight, torch.Tensor):
            tail[:1].copy_(weight.reshape(1))
        else:
            tail[0] = weight
        tail[1] = 1.0 if failed else 0.0
        while len(self.works) < len(self.order):
            self._launch(self.order[len(self.works)])
        for j, work in enumerate(self.works):
            self.sync._wait(self.where, self.order[j], plan, work, self.rank)
        for k in packed:
            packed_buf = self.bufs[k]
            assert packed_buf is not None
            for i, off in zip(plan.members[k], plan.offsets[k]):
                s = self.sums[i]
                s.copy_(packed_buf[off : off + s.numel()].view_as(s))
        total, n_failed = tail.tolist()
        if n_failed and not failed:
            raise GradAccumError(
                f"{self.where}: {int(n_failed)} other rank(s) of the {self.world} in the group "
                f"raised an error during this window (rank {self.rank} did not); no gradient is "
                f"returned on any rank. The cause is in the failing rank's traceback."
            )
        if not failed and self.reduction != "sum" and total <= 0:
            raise ValueError(
                f"{self.where}: the window's "
                f"{'counts' if self.reduction == 'count' else 'rows'} add up to {total:g} over "
                f"all {self.world} ranks, so there is no mean to divide by; skip windows with no "
                f"items on any rank (e.g. all padding), or use reduction='sum'."
            )
        return float(total)
