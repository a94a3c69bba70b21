"""The boundary: explicit torch.distributed collectives over flat gradient buckets.

Nothing here runs inside a window. At the boundary the running sums (which, under a sync, are
views into flat contiguous buckets allocated by [`AllReduce`][gradaccum.sync.AllReduce]) are summed
over the process group with one asynchronous ``all_reduce`` per bucket, in place. The last
bucket of the widest dtype carries two more elements, the window's weight (rows or counts) and a
"this rank failed" flag, so normalisation by the global weight needs no extra round trip.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist

from . import _comm
from ._buckets import TAIL, Bucket, Plan, make_plan
from ._errors import GradAccumError, describe, dtype_name, mark_broken
from ._in_flight import InFlight
from ._record import record

__all__ = ["AllReduce", "Bucket", "all_reduce"]

_FINGERPRINT = "the fingerprint exchange with the other ranks"
Check = Literal["fingerprint", "full", "never"]
_CHECKS = ("fingerprint", "full", "never")


@dataclass(frozen=True, eq=False)
class AllReduce:
    """Data-parallel synchronisation at the accumulation boundary.

    Make one with [`all_reduce()`][gradaccum.all_reduce] and pass it as ``sync=`` to
    [`accumulate()`][gradaccum.accumulate] or [`Accumulator`][gradaccum.Accumulator]. See
    [`all_reduce()`][gradaccum.all_reduce] for the options and the contract. It remembers which
    gradient layouts it has verified across ranks and their bucket plans, so build it once and
    reuse it for every window.

    Examples:
        >>> import gradaccum
        >>> gradaccum.all_reduce(bucket_mb=50, timeout=120)
        AllReduce(group=None, bucket_mb=50.0, check='fingerprint', timeout=120.0, overlap=True)
    """

    group: Any = None
    bucket_mb: float = 25.0
    check: Check = "fingerprint"
    timeout: float | None = None
    overlap: bool = True
    _plans: dict[Any, Plan] = field(default_factory=dict, init=False, repr=False, compare=False)
    _last: list[Any] = field(default_factory=list, init=False, repr=False, compare=False)

    # -- planning (no communication) ----------------------------------------------------------

    def plan(self, params: Any, *, accum_dtype: torch.dtype | None = None) -> tuple[Bucket, ...]:
        """The buckets the boundary would all-reduce for gradients shaped like ``params``.

        A dry run: nothing is communicated and torch.distributed need not be initialised.

        Args:
            params: The params pytree (the gradients' shape).
            accum_dtype: As in [`accumulate()`][gradaccum.accumulate].

        Returns:
            The [`Bucket`][gradaccum.sync.Bucket]s, in the order they are reduced.

        Examples:
            >>> import torch, gradaccum
            >>> sync = gradaccum.all_reduce(bucket_mb=1)
            >>> params = {"w": torch.zeros(300_000), "b": torch.zeros(10)}
            >>> [(b.paths, b.numel) for b in sync.plan(params)]
            [(("['w']",), 300000), (("['b']",), 12)]
        """
        from ._sums import make_layout

        return self._layout_plan(make_layout("AllReduce.plan(params)", params, accum_dtype)).buckets

    def _layout_plan(self, lay: Any) -> Plan:
        """The plan for a gradient layout (cached)."""
        plan = self._plans.get(lay)
        if plan is None:
            plan = make_plan(lay, int(self.bucket_mb * 2**20))
            self._plans[lay] = plan
        return plan

    def _allocate(self, lay: Any, zero: bool = False) -> list[torch.Tensor]:
        """Running sums for ``lay``: views into fresh flat buckets (zeroed, or uninitialised)."""
        plan = self._layout_plan(lay)
        views: list[torch.Tensor] = [torch.empty(0)] * len(lay.shapes)
        for b, members, offsets, numel in zip(
            plan.buckets, plan.members, plan.offsets, plan.grad_numel
        ):
            size = numel + (TAIL if b.tail else 0)
            buf = (torch.zeros if zero else torch.empty)(size, dtype=b.dtype, device=b.device)
            for i, off in zip(members, offsets):
                views[i] = buf[off : off + lay.shapes[i].numel()].view(lay.shapes[i])
        return views

    # -- the boundary -------------------------------------------------------------------------

    def _reduce(
        self,
        where: str,
        reduction: str,
        lay: Any,
        sums: list[torch.Tensor],
        weight: int | float | torch.Tensor,
        failed: bool = False,
        n: int | None = None,
    ) -> float:
        """Sum ``sums`` (in place) and ``weight`` over the group; return the global weight.

        Raises GradAccumError on every rank when ranks disagree on the gradient tree, when
        another rank failed during the window, or when a collective fails or times out.
        """
        return self._begin(where, reduction, lay, sums, n).finish(weight, failed)

    def _begin(
        self, where: str, reduction: str, lay: Any, sums: list[torch.Tensor], n: int | None = None
    ) -> InFlight:
        """Open the boundary of a window: start the fingerprint exchange of its buckets.

        The returned ``InFlight`` waits for the fingerprint before it launches its first bucket
        (a rank whose tree differs would otherwise send a bucket of another size), then launches
        buckets as they are marked ready, and the rest, with the weight, at ``finish``.
        """
        group, rank, world = self._group(where)
        plan = self._layout_plan(lay)
        self._last[:] = [lay]  # a rank that fails before its next window knows the layout
        extra = () if n is None else (f"n={n} micro-batches per window",)
        probe = (
            None
            if self.check == "never"
            else self._probe(where, plan, reduction, group, rank, extra)
        )
        return InFlight(self, where, reduction, plan, sums, group, rank, world, probe)

    def _group(self, where: str, what: str = "sync=all_reduce()") -> tuple[Any, int, int]:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"{where}: {what} needs torch.distributed initialised, but no process "
                f"group exists; call torch.distributed.init_process_group(...) first (torchrun "
                f"sets the environment for it), or drop sync= to train in one process."
            )
        group = self.group if self.group is not None else dist.group.WORLD
        outside = group is dist.GroupMember.NON_GROUP_MEMBER
        rank = -1 if outside else dist.get_rank(group)
        if rank < 0:
            raise ValueError(
                f"{where}: this process (global rank {dist.get_rank()}) is not a member of the "
                f"sync group {_name(group)}; build the sync with a group this rank belongs to "
                f"(every rank must call dist.new_group with the same ranks)."
            )
        return group, rank, dist.get_world_size(group)

    def _wait(self, where: str, k: int, plan: Plan, work: Any, rank: int) -> None:
        try:
            _comm.wait(work, self.timeout)
        except RuntimeError as err:
            raise self._failure(where, k, plan, rank, err) from err

    def _failure(self, where: str, k: int, plan: Plan, rank: int, err: Exception) -> Exception:
        b = plan.buckets[k]
        what = (
            f"the boundary all_reduce of bucket {k + 1}/{len(plan.buckets)} ({b.nbytes} bytes of "
            f"{dtype_name(b.dtype)})"
        )
        return self._broken(where, what, rank, err)

    @contextlib.contextmanager
    def _failing(self, where: str, what: str, rank: int) -> Iterator[None]:
        """Turn a failed collective (``RuntimeError`` from the backend) into ``_broken``'s error."""
        try:
            yield
        except RuntimeError as err:
            raise self._broken(where, what, rank, err) from err

    def _broken(self, where: str, what: str, rank: int, err: Exception) -> GradAccumError:
        mark_broken(self.group)
        limit = f"{self.timeout:g} s" if self.timeout is not None else "the process group's timeout"
        cause = str(err).splitlines()[0] if str(err) else type(err).__name__
        return GradAccumError(
            f"{where}: {what} failed on rank {rank}: {cause}. A peer process died, failed before "
            f"the boundary, or did not reach it in time (timeout: {limit}); every rank must call "
            f"the accumulated function the same number of times. The process group cannot be "
            f"reused: destroy it and restart from a checkpoint."
        )

    def _verify(
        self,
        where: str,
        plan: Plan,
        reduction: str,
        group: Any,
        rank: int,
        world: int,
    ) -> None:
        """Exchange a fingerprint of the tree, reduction and buckets; on mismatch, name it."""
        self._agree(where, self._probe(where, plan, reduction, group, rank), group, rank, world)

    def _probe(
        self,
        where: str,
        plan: Plan,
        reduction: str,
        group: Any,
        rank: int,
        extra: tuple[str, ...] = (),
    ) -> Probe:
        """Start the exchange of a fingerprint of ``plan`` (16 bytes: max of ``h`` and ``-h``)."""
        desc = (*plan.description, f"reduction={reduction!r}", *extra)
        digest = hashlib.blake2b("\n".join(desc).encode(), digest_size=8).digest()
        h = int.from_bytes(digest, "little") >> 2  # fits in int64 with its negation
        device = plan.buckets[0].device
        probe = torch.tensor([h, -h], dtype=torch.int64, device=device)
        record("all_reduce", group, torch.int64, 2, "fingerprint")
        with self._failing(where, _FINGERPRINT, rank):
            work = _comm.all_reduce(probe, group, self.timeout, op=dist.ReduceOp.MAX)
        return Probe(work, probe, desc, reduction)

    def _agree(self, where: str, pr: Probe, group: Any, rank: int, world: int) -> None:
        """Wait for a fingerprint exchange; when the ranks differ, name the difference.

        With ``check="full"`` the descriptions themselves are compared (a debug mode that
        does not rely on the 62-bit hash).
        """
        with self._failing(where, _FINGERPRINT, rank):
            _comm.wait(pr.work, self.timeout)
        hi, neg_lo = pr.probe.tolist()
        if hi == -neg_lo and self.check != "full":
            return
        desc, reduction = pr.desc, pr.reduction
        gathered: list[Any] = [None] * world
        record("all_gather_object", group, torch.uint8, 0, "fingerprint")
        dist.all_gather_object(gathered, desc, group=group)
        diffs = []
        for r, other in enumerate(gathered):
            if r == rank or other == desc:
                continue
            mine, theirs = _first_diff(desc, other)
            diffs.append(f"rank {rank} has {mine} but rank {r} has {theirs}")
        if not diffs:
            return
        # No collective of the window was started: the group still agrees on its sequence, but
        # the error path must not join a boundary whose buckets differ between ranks.
        mark_broken(self.group)
        if reduction == "shard":  # gradaccum.shard(): no gradients yet
            what, options, done = "params to shard", "bucket_mb and param_groups", "sharded"
        else:
            what, options, done = (
                "gradients to synchronise",
                "reduction, sync options and (where it sets the collectives) n",
                "reduced",
            )
        raise GradAccumError(
            f"{where}: the ranks disagree on the {what}: {'; '.join(diffs)}. Every rank must "
            f"pass params with the same key paths, shapes and dtypes, and the same {options}; "
            f"nothing was {done}."
        )


class Probe(NamedTuple):
    """A fingerprint exchange in flight."""

    work: Any
    probe: torch.Tensor
    desc: tuple[str, ...]
    reduction: str


def all_reduce(
    group: Any = None,
    *,
    bucket_mb: float = 25.0,
    check: Check = "fingerprint",
    timeout: float | None = None,
    overlap: bool = True,
) -> AllReduce:
    """Average (or sum) accumulated gradients over a process group, once per window.

    Pass the result as ``sync=`` to [`accumulate()`][gradaccum.accumulate] or
    [`Accumulator`][gradaccum.Accumulator]. Inside a window nothing is communicated; at the
    boundary the window's running sums, which already live in flat contiguous buckets, are
    summed over the group with one asynchronous ``torch.distributed.all_reduce`` per bucket, in
    place. The window's weight (rows under ``mean``, counts under ``count``) travels in the last
    bucket, so the result is the gradient over the *global* batch: exact with unequal rows or
    tokens per rank, and a rank with an empty window contributes zero weight.

    Leaves fill the buckets in reverse natural order of their key paths (``layers.10`` after
    ``layers.9``), the order backward usually produces them; it depends only on the paths, so it
    is the same on every rank whatever the dict insertion order.

    Args:
        group: The process group; ``None`` for the default (world) group.
        bucket_mb: Bucket size in MiB. As in DDP, a bucket takes leaves until it holds at
            least ``bucket_mb`` (leaves are never split, so a bucket may exceed it by its last
            leaf), and the first bucket of each dtype closes at 1 MiB, so that with overlap the
            first all-reduce starts early. Fewer, larger buckets mean fewer collectives; more
            buckets, more overlap.
        check: ``"fingerprint"`` (default): in every window, before its first bucket, the
            ranks exchange a fingerprint of their key paths, shapes, dtypes, reduction and
            buckets (one 16-byte all-reduce, started when the boundary opens, so that it
            overlaps the last backward); a mismatch raises
            [`GradAccumError`][gradaccum.GradAccumError] on every rank, naming the difference,
            before any gradient is sent. Every window, because a rank whose tree changes (a
            parameter unfrozen on one rank only) cannot know that the others did not.
            ``"full"``: the ranks also compare their whole descriptions in every window (a debug
            mode that does not rely on the hash). ``"never"``: skip it; a rank with another tree
            then sends buckets of other sizes (gloo aborts the process) or adds unrelated
            numbers.
        timeout: Seconds after which each of the sync's collectives fails (the timeout is set
            on the collective itself, so every backend and kind enforces it), raising
            [`GradAccumError`][gradaccum.GradAccumError]; ``None`` uses the process group's
            timeout.
        overlap: With a step function made by [`grad()`][gradaccum.grad] or
            [`grad_and_value()`][gradaccum.grad_and_value], start each bucket's all-reduce
            during the last micro-batch's backward, as soon as autograd has produced all of
            that bucket's gradients (as DDP does, but without module hooks), and wait for them
            only at the end. The bucket carrying the weight goes last. ``False`` starts them
            all after the backward. Other step functions (``torch.func.grad``) return all
            gradients at once, so there is nothing to overlap with.

    Returns:
        An [`AllReduce`][gradaccum.sync.AllReduce]; its [`plan()`][gradaccum.sync.AllReduce.plan] reports
        the buckets without communicating.

    Raises:
        ValueError: ``bucket_mb`` is not positive, ``check`` is not one of its names, or
            ``timeout`` is not positive.

    Examples:
        >>> import torch, gradaccum
        >>> sync = gradaccum.all_reduce(bucket_mb=25)
        >>> [b.numel for b in sync.plan({"w": torch.zeros(4, 3), "b": torch.zeros(4)})]
        [18]

    See Also:
        [`record_collectives()`][gradaccum.sync.record_collectives] to count what is communicated.
    """
    where = "all_reduce(group, bucket_mb=..., check=..., timeout=...)"
    if not _positive(bucket_mb):
        raise ValueError(
            f"{where}: bucket_mb must be a positive, finite number of MiB, got "
            f"{describe(bucket_mb)}; "
            f"pass e.g. bucket_mb=25 (DDP's default)."
        )
    check_options(where, check, timeout, overlap)
    if group is not None and not (
        dist.is_available()
        and (isinstance(group, dist.ProcessGroup) or group is dist.GroupMember.NON_GROUP_MEMBER)
    ):
        raise TypeError(
            f"{where}: group must be None (the default group) or a torch.distributed "
            f"ProcessGroup, got {describe(group)}; pass e.g. dist.new_group([0, 1])."
        )
    return AllReduce(
        group, float(bucket_mb), check, None if timeout is None else float(timeout), overlap
    )


# -- helpers ------------------------------------------------------------------------------------


def check_options(where: str, check: object, timeout: object, overlap: object) -> None:
    """Validate the options that all_reduce and reduce_scatter share."""
    if not isinstance(check, str) or check not in _CHECKS:
        raise ValueError(
            f"{where}: check must be one of {', '.join(map(repr, _CHECKS))}, got "
            f"{describe(check)}; pass check='fingerprint' (the default: the ranks check that their "
            f"trees agree in every window), 'full' (a debug mode) or 'never'."
        )
    if timeout is not None and not _positive(timeout):
        raise ValueError(
            f"{where}: timeout must be None or a positive, finite number of seconds, got "
            f"{describe(timeout)}; pass e.g. timeout=60."
        )
    if not isinstance(overlap, bool):
        raise TypeError(
            f"{where}: overlap must be a bool, got {describe(overlap)}; pass overlap=True or False."
        )


def _positive(x: object) -> bool:
    """Whether ``x`` is a positive, finite int or float (not a bool, NaN or inf)."""
    return not isinstance(x, bool) and isinstance(x, (int, float)) and 0 < x < float("inf")


def _name(group: Any) -> str:
    if group is None or group is dist.group.WORLD:
        return "the default group"
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return "(dist.new_group returned GroupMember.NON_GROUP_MEMBER here)"
    return f"{getattr(group, 'group_name', '?')!r}"


def _first_diff(mine: tuple[str, ...], theirs: Any) -> tuple[str, str]:
    """The first differing line of two plan descriptions, phrased for an error message."""
    theirs = tuple(theirs) if isinstance(theirs, (tuple, list)) else (repr(theirs),)
    for a, b in zip(mine, theirs):
        if a != b:
            return a, b
    if len(mine) > len(theirs):
        return mine[len(theirs)], "nothing there"
    return "nothing there", theirs[len(mine)]
