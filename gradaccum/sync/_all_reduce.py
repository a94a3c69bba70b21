"""Data-parallel sync: the window's sums live in flat buckets, all-reduced at the boundary.

The running sums are views into `_buckets`' flat buckets, all-reduced in place, one collective
per bucket; docs/sync.md ("What gradaccum does instead") describes the mechanism.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .. import _metrics, _tree
from .._checks import Check, check_bool, check_options, check_reduce_dtype, positive
from .._core.protocol import Sync, Window, WindowSpec
from .._dist.buckets import TAIL, Bucket, Plan, bucket_of, group_device, leaf_order, make_plan
from .._dist.comm import Probe, bucket_what, to_device
from .._dist.deferred import Deferred, capturing
from .._dist.mesh import axis, check_group
from .._errors import GradAccumError, describe, is_mesh
from .._layout import make_layout
from ._deferred import DeferredWindow, Deferring

__all__ = ["AllReduce", "Bucket", "all_reduce"]


@dataclass(frozen=True, eq=False)
class AllReduce(Deferring, Sync):
    """Data-parallel synchronisation at the accumulation boundary.

    Make one with [`all_reduce()`][gradaccum.all_reduce] and pass it as ``sync=`` to
    [`accumulate()`][gradaccum.accumulate] or [`Accumulator`][gradaccum.Accumulator]. See
    [`all_reduce()`][gradaccum.all_reduce] for the options and the contract. It caches the
    bucket plan of each gradient layout, and keeps the flat buckets between windows (reused
    only once no tensor shares their memory), so build it once and reuse it for every window.

    Examples:
        >>> import gradaccum
        >>> gradaccum.all_reduce(bucket_mb=50, timeout=120)  # doctest: +NORMALIZE_WHITESPACE
        AllReduce(group=None, bucket_mb=50.0, check='fingerprint', timeout=120.0, overlap=True,
                  reduce_dtype=None, defer=False)
    """

    group: Any = None
    bucket_mb: float = 25.0
    check: Check = "fingerprint"
    timeout: float | None = None
    overlap: bool = True
    reduce_dtype: torch.dtype | None = None
    defer: bool = False
    _plans: dict[Any, Plan] = field(default_factory=dict, init=False, repr=False, compare=False)
    # Layouts whose buckets are in the gradient-ready order the ranks agreed on.
    _ordered: set[Any] = field(default_factory=set, init=False, repr=False, compare=False)
    # The last total weight of a mean window per layout: the next window's Window.hint.
    _totals: dict[Any, float] = field(default_factory=dict, init=False, repr=False, compare=False)
    # Flat buckets kept between windows, as DDP keeps its buckets (see BucketWindow.storage).
    _spare: dict[Any, Spare] = field(default_factory=dict, init=False, repr=False, compare=False)
    # Per plan (by id, the plan kept): what ready() needs of it (_leaf_maps).
    _maps: dict[int, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    # defer=True: the flags, the last window's status on its way to the host, the agreed layout.
    _deferred: Deferred = field(default_factory=Deferred, init=False, repr=False, compare=False)

    def plan(self, params: Any, *, accum_dtype: torch.dtype | None = None) -> tuple[Bucket, ...]:
        """The buckets the boundary would all-reduce for gradients shaped like ``params``.

        A dry run: nothing is communicated and torch.distributed need not be initialised. After
        a window on the fast path with ``overlap``, the buckets are those of the next window:
        in the order the gradients became final (see [`all_reduce()`][gradaccum.all_reduce]).

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
        where = "AllReduce.plan(params)"
        buckets = self._plan(make_layout(where, params, accum_dtype)).buckets
        dim = axis(where, self.group).dim if is_mesh(self.group) else None
        return tuple(replace(b, collectives=(("all_reduce", dim),)) for b in buckets)

    def _leaf_maps(self, plan: Plan) -> tuple[list[int], dict[int, int], list[int]]:
        """Per bucket its leaf count, each leaf's bucket, each bucket's last leaf (cached)."""
        got = self._maps.get(id(plan))
        if got is None or got[0] is not plan:
            of = {i: k for k, m in enumerate(plan.members) for i in m}
            maps = ([len(m) for m in plan.members], of, [m[-1] if m else -1 for m in plan.members])
            got = self._maps[id(plan)] = (plan, maps)
        return got[1]

    def _plan(self, lay: Any) -> Plan:
        """The plan for a gradient layout (cached)."""
        plan = self._plans.get(lay)
        if plan is None:
            plan = self._plans[lay] = self._make_plan(lay)
        return plan

    def _make_plan(self, lay: Any, order: list[int] | None = None) -> Plan:
        """A new plan for ``lay``, in ``reduce_dtype`` on the wire.

        An empty layout's bucket (the tail alone) goes to the group's device: a CPU tensor
        cannot reach NCCL.
        """
        device = None if lay.paths else group_device(axis("all_reduce()", self.group).group)
        cap = int(self.bucket_mb * 2**20)
        return make_plan(lay, cap, order, device=device, reduce_dtype=self.reduce_dtype)

    def open(self, spec: WindowSpec) -> Window:
        """A window whose running sums are views into this sync's flat buckets."""
        return BucketWindow(self, spec)


class BucketWindow(DeferredWindow, Window):
    """One window of an all-reduce sync: fingerprint, buckets in plan order, the tail last."""

    def __init__(self, sync: AllReduce, spec: WindowSpec) -> None:
        super().__init__(spec, sync)
        self.sync: AllReduce = sync
        self.plan, self.overlap = sync._plan(spec.layout), sync.overlap
        # The first fast window with overlap records the order the sums become final; at its
        # boundary the ranks agree on it and the next windows' buckets follow it.
        self.reorder = sync.overlap and spec.fast and spec.layout not in sync._ordered
        self.seen: list[int] = []
        self.tail_k = next(k for k, b in enumerate(self.plan.buckets) if b.tail)
        self.extra = _metrics.width(spec)  # the tail's metric sums, after [weight, failed]
        self.order = [k for k in range(len(self.plan.buckets)) if k != self.tail_k] + [self.tail_k]
        self.probe: Probe | None = None
        self.own: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # storage()'s
        # The fast path under "mean" divides each backward by the last window's total weight,
        # which every rank has from the same all-reduce; finish() scales by hint / total, which
        # is 1 (no pass over the gradients) while the global batch keeps its size. Decided from
        # the spec alone, so an empty rank, whose fast path does not run, decides the same.
        # Deferred (defer=True), the total is not read on the host: the sums are divided by it
        # on the device, and no rank has it as a hint.
        self.defer = sync.defer
        self.hinted = spec.fast and spec.reduction == "mean" and spec.layout.wide and not sync.defer
        if self.hinted:
            self.hint = sync._totals.get(spec.layout)
        self.probing = False  # the fingerprint exchange was started (_probe)
        self.steady = False  # deferred: the layout is the one the ranks last agreed on
        self.held: Probe | None = None  # deferred, steady: the fingerprint, checked on the device
        self.joined = False  # the boundary was joined (or skipped on every rank): no abort
        self.opened = False
        self.sealed = False  # the tail holds the final weight and "no failure" (seal)
        self.bufs: list[torch.Tensor | None] = []
        self.works: list[Any] = []  # in launch order
        # reduce_dtype: the buckets as sent (cast copies), by bucket; cast back in finish().
        self.wires: dict[int, torch.Tensor] = {}
        self.named = self.plan.buckets  # how failures name the buckets: as sent
        if sync.reduce_dtype is not None:
            self.named = tuple(replace(b, dtype=b.reduce_dtype or b.dtype) for b in self.named)

    def storage(self, zero: bool) -> list[torch.Tensor]:
        """Views into flat buckets (zeroed, or uninitialised) that nothing else references.

        The buckets of an earlier window are reused once no tensor holds their memory any more
        (the gradients it returned, and the ``.grad`` that ``write_grads`` set from them, have
        been dropped): a storage's reference count says so. Otherwise new ones are allocated.
        """
        plan = self.plan
        key = (self.layout, self.extra)
        spare = self.sync._spare.get(key)
        if spare is None or spare.plan is not plan:
            spare = self.sync._spare[key] = Spare(plan, self.layout, self.extra)
        bufs = spare.take()
        if zero:
            for buf in bufs:
                buf.zero_()
        views: list[torch.Tensor] = [torch.empty(0)] * len(self.layout.shapes)
        for buf, members, metas in zip(bufs, plan.members, spare.metas):
            if members:
                for i, v in zip(members, torch._C._nn.unflatten_dense_tensors(buf, metas)):
                    views[i] = v
        self.own = (bufs, views)
        return views

    def prepare(self, zero: bool) -> bool:
        """The flat buckets, zeroed whatever ``zero`` says: autograd accumulates into them.

        Zeroing a few flat buckets is a kernel each; moving each leaf's first gradient in
        instead (``adopt``) takes a Python hook and a copy per leaf.
        """
        return super().prepare(zero=True)

    def begin(self, count: int) -> None:
        """A window run by one call (``spec.fast``): start the fingerprint now.

        The exchange then runs beside the micro-batches, and ``last`` reads it before the last
        backward at the cost of the exchange alone. An ``Accumulator`` opens a window per
        ``add``, so its fingerprint starts at the boundary.
        """
        if self.spec.fast and not self.probing and not self.defer:
            self._probe()

    def _probe(self) -> None:
        """Start the window's fingerprint exchange (once: ``probing`` says it started)."""
        self.probing = True
        self.comm = self.connect(self.sync.group, self.sync.timeout, self.sync.check)
        extra: tuple[str, ...] = ()
        if self.spec.agree_n:
            extra = (f"n={self.spec.n} micro-batches per window",)
        if self.reorder:
            extra += ("the bucket order is agreed at this boundary",)
        desc = (*self.plan.description, f"reduction={self.spec.reduction!r}", *extra)
        if self.defer:
            agreed = self.sync._deferred.agreed
            self.key = self.comm.lines(desc)[1:]  # less the window's index
            self.steady = agreed is not None and agreed.key == self.key
        # A steady deferred window never reads its fingerprint: it goes into the device's flag,
        # exchanged in the sync's own buffer (the same memory in every window, for a graph).
        device = self.plan.buckets[0].device
        into = self.sync._deferred.on(device).probe if self.steady else None
        if self.defer and capturing(device) and (not self.steady or self.sync.timeout):
            why = "a timeout= is kept by host reads" if self.steady else "its layout is new"
            raise GradAccumError(
                f"{self.where}: this window cannot be captured in a CUDA graph: {why}. Capture "
                f"a window of all_reduce(defer=True, timeout=None) after warm-up windows run "
                f"eagerly with the same params (two, with overlap: the bucket order is agreed "
                f"in the first), and call sync.verify() before the capture."
            )
        read = not self.steady
        self.probe = self.comm.probe(desc, device, read=read, into=into, deferred=self.defer)

    def last(self) -> None:
        """Open the boundary: agree on the fingerprint; find the buckets the sums are views of.

        The fingerprint is read here, before the last backward (no bucket starts before the
        ranks agree, and nothing waits on the host inside a backward).
        """
        if self.opened:
            return
        self.opened = True
        if self.defer:  # the last window's checks, read before this window's first collective
            self.joined = True  # raised here, on every rank: no boundary to join
            self.sync._deferred.settle(self.where)
            self.joined = False
        if not self.probing:  # an Accumulator's window, or a call that never began
            self._probe()
        probe, self.probe = self.probe, None
        if self.steady:
            self.held = probe  # sent; its result goes into the flag at the boundary
        elif self.defer and self.sync._deferred.agreed is not None and probe is not None:
            hi, neg_lo, _, neg_least = self.comm.read_probe(probe)
            if hi != -neg_lo and neg_least == -1:  # every rank reads: they can name it
                self.joined = True  # every rank raises in compare(): no boundary to join
                self.comm.compare(probe.desc)
            if hi != -neg_lo:
                self._refuse()
        else:
            self.comm.agree(probe)  # the ranks' buckets must agree before the first one starts
        if self.sums is None:  # an empty window still joins, with zero weight
            self.sums = self.storage(zero=True)
        plan, sums = self.plan, self.sums
        own = self.own
        if own is not None and all(map(operator.is_, sums, own[1])):  # in C: no call per leaf
            self.bufs = list(own[0])  # the views storage() made: no need to check them
        else:
            self.own = None
            self.bufs = [
                bucket_of([sums[i] for i in members], offsets, b, b.numel + self.extra * b.tail)
                for b, members, offsets in zip(plan.buckets, plan.members, plan.offsets)
            ]
        # Per bucket, the leaves reported final in the last backward (ready, or a C-level mark).
        self.marks: list[dict[int, Any]] = [{} for _ in plan.members]
        self.sizes, self.bucket_of_leaf, self.last_of = self.sync._leaf_maps(plan)
        if self.defer and not self.steady and self.sync.check != "never":
            self.sync._deferred.agreed = self._agreed()

    def seal(self, weight: Any) -> None:
        """The weight is final: fill the tail now, so that ``ready`` launches its bucket too.

        The last bucket then starts as the backward ends, as DDP's does, not after it returns.
        """
        tail_buf = self.bufs[self.tail_k] if self.bufs else None
        if tail_buf is None or self.extra:  # restored sums, or metrics still to come
            return
        self.comm.fill(tail_buf[-TAIL:], weight, False)
        self.sealed = True

    def ready(self, i: int) -> None:
        """Leaf ``i``'s sum is final: launch every bucket that is now ready, in order."""
        if self.reorder:
            self.seen.append(i)
        k = self.bucket_of_leaf[i]
        marks = self.marks[k]
        marks[i] = True
        if len(marks) == self.sizes[k]:
            self._launch_ready()

    def ready_hooks(self, report: list[int]) -> list[Any] | None:
        """In the agreed bucket order, one Python hook per bucket, not per leaf.

        Each leaf but the last to become final in its bucket (in the agreed order) marks itself
        in C (``operator.setitem``, no Python call); the last one's hook launches what is then
        complete. A bucket whose leaves come in another order is launched at the boundary,
        whole: never before all of its leaves are marked. The first window records the order,
        leaf by leaf (``None``: the core's per-leaf ``ready``).
        """
        if self.reorder:
            return None
        of, last, marks = self.bucket_of_leaf, self.last_of, self.marks
        return [
            functools.partial(self._ready_bucket, of[i])
            if last[of[i]] == i
            else functools.partial(operator.setitem, marks[of[i]], i)
            for i in report
        ]

    def _ready_bucket(self, k: int, _leaf: torch.Tensor) -> None:
        """The leaf expected last in bucket ``k`` is final: launch what is complete, in order."""
        self.marks[k][self.last_of[k]] = True
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch, in order, every bucket whose leaves are all final (the tail once sealed)."""
        marks, sizes, order = self.marks, self.sizes, self.order
        while len(self.works) < len(order) - (0 if self.sealed else 1):
            nxt = order[len(self.works)]
            if len(marks[nxt]) < sizes[nxt] or self.bufs[nxt] is None:
                break
            self._launch(nxt)

    def _launch(self, k: int) -> None:
        buf = self.bufs[k]
        assert buf is not None
        wire = self.plan.buckets[k].reduce_dtype
        if wire is not None:  # sent in the wire dtype; the sums stay in their own
            buf = self.wires[k] = buf.to(wire)
        what = bucket_what("boundary all_reduce", self.named, k)
        self.works.append(self.comm.all_reduce(buf, what, "gradients"))

    def finish(self, weight: Any, failed: bool = False) -> Any:
        """Launch what is left (the weight and failure flag in the tail), wait, normalise."""
        self.last()
        self.comm.where = self.where
        plan, sums, packed = self.plan, self.sums, []
        assert sums is not None
        with torch.no_grad():
            for k, b in enumerate(plan.buckets):
                if self.bufs[k] is None:  # the sums are not views of one bucket (restored)
                    size = b.numel + self.extra * b.tail
                    buf = self.bufs[k] = torch.empty(size, dtype=b.dtype, device=b.device)
                    for i, off in zip(plan.members[k], plan.offsets[k]):
                        buf[off : off + sums[i].numel()].copy_(sums[i].reshape(-1))
                    packed.append((k, buf))
            tail_buf = self.bufs[self.tail_k]
            assert tail_buf is not None
            tail = tail_buf[-TAIL - self.extra :]
            if len(self.works) < len(self.order):  # the tail bucket is not sent yet
                self.comm.fill(tail, weight, failed)
            while len(self.works) < len(self.order):
                self._launch(self.order[len(self.works)])
            for k, work in zip(self.order, self.works):
                self.comm.wait(work, bucket_what("boundary all_reduce", self.named, k))
            if self.wires:  # back into the accumulation dtype
                for k, wire in self.wires.items():
                    self.bufs[k].copy_(wire)  # type: ignore[union-attr]
            for k, buf in packed:
                for i, off in zip(plan.members[k], plan.offsets[k]):
                    sums[i].copy_(buf[off : off + sums[i].numel()].view_as(sums[i]))
            if self.defer:
                divisor = self._decide(tail, failed)
                return None if failed else self.normalised(divisor)
            total = self.comm.read(self.comm.fetch(tail), failed)
            if self.hinted and not failed:
                # Reached on every rank or on none (settle raises where another rank failed).
                self.sync._totals[self.layout] = total
            if self.reorder and not failed:
                self._agree_order()
        return self.normalised(total)

    def abort(self, weight: Any) -> None:
        """As ``Window.abort``, unless the boundary was joined, or skipped on every rank."""
        if not self.joined:
            super().abort(weight)

    def normalised(self, total: Any) -> Any:
        """As ``Window.normalised``; the sums in this window's own buckets are divided flat.

        With a ``hint``, the sums were divided by it already: they are scaled by hint / total.
        """
        lay = self.layout
        if self.hint:
            total = total / self.hint
        if self.own is None or not lay.same_dtypes or self.spec.reduction == "sum":
            return super().normalised(total)
        with torch.no_grad():
            if not (isinstance(total, (int, float)) and total == 1):
                torch._foreach_div_(self.own[0], total)  # the tails too: read already
        return _tree.unflatten(lay.spec, self.own[1])

    def _agree_order(self) -> None:
        """Re-plan the buckets in the order the sums became final, agreed over the ranks.

        Each rank sends each leaf's position in its own order (the leaves without a gradient
        last); the ranks sort the leaves by the summed positions, ties in key-path order, so all
        of them get the same plan. One all-reduce of one number per leaf, once per layout (none
        in a group of one).
        """
        lay, sync = self.layout, self.sync
        pos = [float(len(lay.paths))] * len(lay.paths)
        for p, i in enumerate(self.seen):
            pos[i] = float(p)
        agreed = pos
        if self.comm.world > 1:
            sums = to_device(pos, torch.float64, self.plan.buckets[0].device)
            what = "the bucket order all_reduce"
            self.comm.wait(self.comm.all_reduce(sums, what, "bucket order"), what)
            agreed = self.comm.fetch(sums)
        rank = {i: r for r, i in enumerate(leaf_order(lay.paths))}
        order = sorted(rank, key=lambda i: (agreed[i], rank[i]))
        sync._plans[lay] = sync._make_plan(lay, order)
        sync._ordered.add(lay)


class Spare:
    """The flat buckets of a plan kept between windows.

    At most two sets: the caller may still hold one while the next window runs.
    """

    def __init__(self, plan: Plan, lay: Any, extra: int) -> None:
        self.plan, self.extra = plan, extra  # extra: the tail bucket's metric sums
        self.sets: list[tuple[list[torch.Tensor], list[int]]] = []  # buffers, their ref counts
        # Shape-only tensors for each bucket's members, to cut the views in one call.
        self.metas = [
            [torch.empty(lay.shapes[i], device="meta") for i in members] for members in plan.members
        ]

    def take(self) -> list[torch.Tensor]:
        """A set of buffers nothing else references, or a new one."""
        for bufs, counts in self.sets:
            if all(_refs(b) == c for b, c in zip(bufs, counts)):
                return bufs
        bufs = [
            torch.empty(b.numel + self.extra * b.tail, dtype=b.dtype, device=b.device)
            for b in self.plan.buckets
        ]
        if len(self.sets) < 2:
            self.sets.append((bufs, [_refs(b) for b in bufs]))
        return bufs


def _refs(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s memory (views and detached copies included)."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


def all_reduce(
    group: Any = None,
    *,
    bucket_mb: float = 25.0,
    check: Check = "fingerprint",
    timeout: float | None = None,
    overlap: bool = True,
    reduce_dtype: torch.dtype | None = None,
    defer: bool = False,
) -> AllReduce:
    """Average (or sum) accumulated gradients over a process group, once per window.

    Pass the result as ``sync=`` to [`accumulate()`][gradaccum.accumulate] or
    [`Accumulator`][gradaccum.Accumulator]. Inside a window no gradient is communicated (the
    window's 16-byte fingerprint starts with it); at the boundary the window's running sums,
    which already live in flat contiguous buckets, are summed over the group with one
    asynchronous ``torch.distributed.all_reduce`` per bucket, in place. The window's weight
    (rows under ``mean``, counts under ``count``) travels in the last bucket, so the result is
    the gradient over the *global* batch: exact with unequal rows or tokens per rank, and a rank
    with an empty window contributes zero weight. The metrics of
    [`Accumulator.add()`][gradaccum.Accumulator.add] travel there too.

    Leaves fill the buckets in reverse natural order of their key paths (``layers.10`` after
    ``layers.9``), the same on every rank. With ``overlap`` and a step function made by
    [`grad()`][gradaccum.grad] (or a ``torch.func`` one), the first window also records the order
    in which the gradients become final during the last backward; at its boundary the ranks
    agree on that order (one all-reduce of one number per leaf, once per gradient layout) and
    the later windows fill their buckets in it, as DDP rebuilds its buckets after the first
    iteration, so that the first bucket's all-reduce starts early in the backward
    ([how](../sync.md#what-gradaccum-does-instead)).

    Args:
        group: The process group, or a 1-D ``DeviceMesh`` (its group); ``None`` for the
            default (world) group.
        bucket_mb: Bucket size in MiB: as in DDP, a bucket takes leaves until it holds at least
            ``bucket_mb`` (the first bucket of each dtype closes at 1 MiB). Fewer, larger
            buckets mean fewer collectives; more buckets, more overlap.
        check: ``"fingerprint"`` (default): in every window, before its first bucket, the
            ranks exchange a fingerprint of their window index, key paths, shapes, dtypes,
            reduction, buckets and metric names (one 16-byte all-reduce); a mismatch raises
            [`GradAccumError`][gradaccum.GradAccumError] on every rank, naming the difference
            (ranks at [different windows](../sync.md#ranks-at-different-windows) get a message
            of their own), before any gradient is sent. ``"full"`` also compares the whole
            descriptions (a debug mode); ``"never"`` skips it, and then nothing is checked:
            neither the trees nor the windows ([why](../sync.md#mismatched-gradient-trees)).
        timeout: Seconds after which each of the sync's collectives fails (the timeout is set
            on the collective itself, so every backend and kind enforces it), raising
            [`GradAccumError`][gradaccum.GradAccumError]; ``None`` uses the process group's
            timeout.
        overlap: With a step function made by [`grad()`][gradaccum.grad] or
            [`grad_and_value()`][gradaccum.grad_and_value], start each bucket's all-reduce
            during the last backward, as soon as its gradients are final; ``False`` starts them
            all after the backward ([how](../sync.md#overlap-with-the-last-backward)).
        reduce_dtype: The dtype the gradient buckets travel in. ``None`` (the default): each
            bucket in its accumulation dtype, an exact sum (float32 for float32 or bfloat16
            params). ``torch.bfloat16``: each bucket is cast to bfloat16 at the boundary,
            all-reduced, and cast back into the float32 sums, as DDP's ``bf16_compress_hook``
            does: half the bytes, one bfloat16 rounding of each rank's sum and of their total
            ([the trade-off](../sync.md#the-wire-dtype)). ``torch.float32`` with
            ``accum_dtype=torch.bfloat16`` goes the other way (Megatron's
            ``grad_reduce_in_fp32``). The window's weight, failure flag and metrics stay exact
            in a small bucket of their own (float64 or float32). Every rank must pass the same
            (the fingerprint covers it).
        defer: ``False`` (default): the boundary reads its checks on the host (one read per
            window) and raises there, on every rank. ``True``: no host read in a steady window.
            The checks become a flag on the device, the same on every rank, that a fused
            optimizer given it by [`guard()`][gradaccum.sync.AllReduce.guard] skips on; the
            ranks raise [`GradAccumError`][gradaccum.GradAccumError] for a bad window at the
            next window, before its first collective (the failing rank at once, and again
            there), and [`verify()`][gradaccum.sync.AllReduce.verify] reads the last window
            ([the deferred boundary](../sync.md#the-deferred-boundary)). Not with
            ``check="full"``, which compares on the host every window.

    Returns:
        An [`AllReduce`][gradaccum.sync.AllReduce]; its
        [`plan()`][gradaccum.sync.AllReduce.plan] reports the buckets without communicating.

    Raises:
        ValueError: ``bucket_mb`` is not positive, ``check`` is not one of its names,
            ``timeout`` is not positive, or ``reduce_dtype`` is a dtype that is not floating.
        TypeError: ``reduce_dtype`` is neither ``None`` nor a ``torch.dtype``.

    Examples:
        >>> import torch, gradaccum
        >>> sync = gradaccum.all_reduce(bucket_mb=25)
        >>> [b.numel for b in sync.plan({"w": torch.zeros(4, 3), "b": torch.zeros(4)})]
        [18]

    See Also:
        [`record_collectives()`][gradaccum.sync.record_collectives] to count what is communicated.
    """
    where = "all_reduce(group, bucket_mb=..., check=..., timeout=...)"
    if not positive(bucket_mb):
        raise ValueError(
            f"{where}: bucket_mb must be a positive, finite number of MiB, got "
            f"{describe(bucket_mb)}; "
            f"pass e.g. bucket_mb=25 (DDP's default)."
        )
    check_options(where, check, timeout, overlap)
    check_bool(where, "defer", defer)
    if defer and check == "full":
        raise ValueError(
            f"{where}: check='full' compares every window's descriptions on the host, which "
            f"defer=True exists to avoid; pass check='fingerprint' with defer=True (a mismatch "
            f"still fails the window on every rank), or defer=False to have it named."
        )
    check_reduce_dtype(where, reduce_dtype, "each bucket in its accumulation dtype, exact")
    check_group(where, group)
    axis(where, group)  # a mesh of more than one dim is refused here, not at the first window
    return AllReduce(
        group,
        float(bucket_mb),
        check,
        None if timeout is None else float(timeout),
        overlap,
        reduce_dtype,
        bool(defer),
    )
