"""One window of a reduce-scatter sync: running sums, shard accumulators, collectives in flight.

The window keeps the sequence of collectives (docs/sharded.md, "The collective sequence") the
same on every rank whatever happens on it: a rank with fewer micro-batches, or one that failed,
completes it with zeros in ``finish``.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import torch

from .. import _metrics, _reduce
from .._core.protocol import Window, WindowSpec
from .._dist.broken import is_broken
from .._dist.buckets import TAIL
from .._dist.comm import bucket_what
from .._errors import GradAccumError, describe

__all__ = ["MAX_IN_FLIGHT", "ScatterWindow"]

_FIXED = attrgetter("spec", "paths", "shapes", "dtypes", "devices")  # what a Sharded fixes
MAX_IN_FLIGHT = 2  # buckets on the wire at once: bounds the memory of (backend copies of) inputs


class ScatterWindow(Window):
    """One window of a reduce-scatter sync: running sums, shards, collectives in flight."""

    def __init__(self, sync: Any, spec: WindowSpec, verify: bool = True) -> None:
        """``sync`` is the ReduceScatter (its sharded params, policies, gather and options)."""
        super().__init__(spec, sync)
        self.sync: Any = sync
        lay, where, sp = spec.layout, spec.where, sync.sharded
        if _FIXED(lay) != _FIXED(sp.compute):
            raise ValueError(
                f"{where}: the gradients are for params that differ from the sharded ones "
                f"({_first_diff(lay, sp.compute)}); pass the Sharded object (or what its gather() "
                f"returned) as the params of the step function."
            )
        plan = self.plan = sp.plan
        self.accum = [
            lay.accum_dtypes[b.members[0]] if b.members else b.dtype for b in plan.buckets
        ]
        if any(len({lay.accum_dtypes[i] for i in b.members}) > 1 for b in plan.buckets):
            raise ValueError(
                f"{where}: mixed accumulation dtypes within a shard are not supported."
            )
        # The dtype each bucket travels in (None: its accumulation dtype, no cast).
        self.wire: list[torch.dtype | None] = [None] * len(plan.buckets)
        if sync.reduce_dtype is not None or sp.fsdp is not None:
            self.wire = [sync.wire_dtype(b, a) for b, a in zip(plan.buckets, self.accum)]
        # Whether a bucket goes on the wire as it is (no copy into rank order, no cast).
        self.as_is = [
            w is None and not (b.parts and b.interleaved) for b, w in zip(plan.buckets, self.wire)
        ]
        what = "sync=reduce_scatter(...)"
        self.comm = self.connect(sp.axis, sync.timeout, sync.check, what)
        # Hybrid: the replicas' group; the shards are all-reduced over it once per window.
        rep = sp.replicate_axis
        self.rcomm = None if rep is None else self.connect(rep, sync.timeout, sync.check, what)
        # (work, what, region, sent): ``sent`` is ``region`` cast to the wire dtype, if any.
        self.rworks: list[tuple[Any, str, torch.Tensor, torch.Tensor]] = []
        self.given_sharded = spec.params is sp
        self.regather = self.given_sharded and sync.gather == "micro_batch"
        pol = sync.policies()
        if verify and sync.check != "never" and not is_broken(self.comm.group):
            per_step = spec.agree_n or "every" in pol or self.regather
            desc = (
                *plan.description,
                *(f"shard {k} policy {p!r}" for k, p in enumerate(pol)),
                f"gather={sync.gather!r}",
                *(f"accumulated in {d}" for d in lay.accum_dtypes),
                *(f"bucket {k} reduced in {w}" for k, w in enumerate(self.wire) if w is not None),
                *((f"n={spec.n} micro-steps per window",) if per_step else ()),
                f"reduction={spec.reduction!r}",
            )
            dev = plan.devices[0] if plan.devices else torch.device("cpu")
            probes = [(c, c.probe(desc, dev)) for c in (self.comm, self.rcomm) if c is not None]
            for c, probe in probes:
                c.agree(probe)
        self.every = [pol[b.shard] == "every" for b in plan.buckets]
        shard_accum = [torch.float64] * len(sp.shards)
        for b, a in zip(plan.buckets, self.accum):
            shard_accum[b.shard] = a
        # The window's gradient shards, in the accumulation dtype (every: the running sum).
        self.out = [
            torch.zeros(size, dtype=a, device=dev)
            for size, a, dev in zip(plan.sizes, shard_accum, plan.devices)
        ]
        # boundary buckets: the full running sums (zeroed, padded); leaves are views of them.
        self.full: list[torch.Tensor | None] = [
            None if every else torch.zeros(b.padded, dtype=a, device=b.device)
            for b, a, every in zip(plan.buckets, self.accum, self.every)
        ]
        sums: list[Any] = [None] * len(lay.shapes)
        self.leaf_off = [0] * len(lay.shapes)  # each leaf's offset in its bucket
        for b, buf in zip(plan.buckets, self.full):
            for i, off in zip(b.members, b.offsets):
                self.leaf_off[i] = off
                if buf is not None:
                    sums[i] = buf[off : off + lay.shapes[i].numel()].view(lay.shapes[i])
        self.sums = sums
        self.every_order = [k for k in range(len(plan.buckets)) if self.every[k]]
        self.bound_order = [k for k in range(len(plan.buckets)) if not self.every[k]]
        self.overlap = sync.overlap and not self.every_order
        self.steps = 0  # completed micro-steps
        self.gathers = 0  # params gathers done by the window
        self.overlapping = False
        self._new_step()
        self.bound_remaining = [len(b.members) for b in plan.buckets]
        self.bound_launched = 0  # boundary buckets launched (a prefix of bound_order)
        # launched, not yet waited on: (work, what, bucket, region, target, input)
        self.bound_works: list[tuple[Any, str, int, Any, Any, Any]] = []

    # What state_dict() saves of a state with no window open.
    NOTHING_SAVED: dict[str, Any] = {"steps": 0, "full": None, "out": None}

    def tree(self, like: Any = None) -> Any:
        """The window itself stands for its sums in ``AccumState.sums`` (no full tree exists).

        ``ReduceScatter.window_of`` gives it back to the core at the next ``add``.
        """
        return self

    def saved(self) -> dict[str, Any]:
        """What a checkpoint of the window holds (copies): its micro-steps, buckets and shards."""
        return {
            "steps": self.steps,
            "full": [None if f is None else f.clone() for f in self.full],
            "out": [o.clone() for o in self.out],
        }

    def load(self, sd: dict[str, Any], fix: str) -> None:
        """Take what ``saved()`` returned (in a state dict ``sd``), checked first.

        Raises ``GradAccumError`` naming the first buffer of another shape or dtype; a fresh
        window is left as it was by an error (``fix``: how the message ends).
        """
        where = self.where
        saved = list(sd["full"]) + list(sd["out"])
        if len(saved) != len(self.full) + len(self.out):
            raise GradAccumError(
                f"{where}: the state holds {len(sd['full'])} bucket and {len(sd['out'])} shard "
                f"buffers, but this window has {len(self.full)} and {len(self.out)}{fix}"
            )
        mine: list[torch.Tensor | None] = [*self.full, *self.out]
        for k, (t, f) in enumerate(zip(saved, mine)):
            if (t is None) != (f is None) or (
                f is not None
                and (not isinstance(t, torch.Tensor) or t.shape != f.shape or t.dtype != f.dtype)
            ):
                raise GradAccumError(
                    f"{where}: saved buffer {k} is {describe(t)}, expected "
                    f"{'None' if f is None else f'shape {tuple(f.shape)} {f.dtype}'}{fix}"
                )
        with torch.no_grad():
            for t, f in zip(saved, mine):
                if f is not None:
                    f.copy_(t)
        self.steps = sd["steps"]

    def streams(self, i: int) -> bool:
        """``every`` leaves hand their gradient over each micro-step."""
        return bool(self.every[self.plan.bucket_of_leaf[i]])

    # -- micro-steps --------------------------------------------------------------------------

    def _new_step(self) -> None:
        self.staging: dict[int, torch.Tensor] = {}
        self.remaining = [len(b.members) for b in self.plan.buckets]
        self.launched = 0  # every buckets launched this step (a prefix of every_order)
        self.in_flight: list[tuple[Any, str, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def begin(self, count: int) -> None:
        """Refuse more than ``n`` micro-steps: every rank runs exactly ``n`` per window."""
        n = self.spec.n
        if self.steps + count <= n:
            return
        if self.steps == 0:
            raise ValueError(
                f"{self.where}: the batch has {count} micro-batches but n={n}; with "
                f"sync=reduce_scatter(...) every rank runs exactly n micro-steps per window. "
                f"Pass at most n micro-batches, or a larger n."
            )
        raise ValueError(
            f"{self.where}: the window already holds its n={n} micro-batches; with "
            f"sync=reduce_scatter(...) every rank runs exactly n micro-steps per window, so "
            f"call finalize(state) before adding more."
        )

    def params(self, step: int, given: Any) -> Any:
        """Given the ``Sharded``: the full params, gathered once or for each micro-step."""
        if not self.given_sharded:
            return given
        if self.regather or self.gathers == 0:
            self.gathers += 1
            self.full_params = self.sync.sharded._gather(self.where, self.sync.timeout)
        return self.full_params

    def add(self, grads: list[torch.Tensor], alpha: float) -> None:
        """A whole micro-batch's gradients (the caller checked ``begin`` first)."""
        with torch.no_grad():
            for i, g in enumerate(grads):
                self.grad(i, g, alpha)

    def grad(self, i: int, g: torch.Tensor, alpha: float) -> None:
        """Leaf ``i``'s gradient for this micro-step is ``alpha * g``."""
        k = self.plan.bucket_of_leaf[i]
        if not self.every[k]:
            self.sums[i].add_(g, alpha=alpha)  # type: ignore[index]
            return
        b = self.plan.buckets[k]
        buf = self.staging.get(k)
        if buf is None:
            buf = self.staging[k] = torch.zeros(b.padded, dtype=self.accum[k], device=b.device)
        off = self.leaf_off[i]
        view = buf[off : off + g.numel()]
        view.copy_(g.reshape(-1))
        if alpha != 1:
            view.mul_(alpha)
        self.remaining[k] -= 1
        if self.remaining[k] == 0:  # launch the every buckets now complete, in order
            order = self.every_order
            while self.launched < len(order) and self.remaining[order[self.launched]] == 0:
                self._launch_every(order[self.launched])

    def last(self) -> None:
        """The coming backward is the window's last: launch boundary buckets as they complete."""
        self.overlapping = self.overlap and self.steps + 1 == self.spec.n

    def ready(self, i: int) -> None:
        """Leaf ``i``'s sum is final: launch the boundary buckets that are complete, in order."""
        k = self.plan.bucket_of_leaf[i]
        if self.overlapping and not self.every[k]:
            self.bound_remaining[k] -= 1
            if self.bound_remaining[k] == 0:
                self._launch_bound(ready_only=True)

    def _launch_every(self, k: int) -> None:
        b = self.plan.buckets[k]
        buf = self.staging.pop(k, None)
        if buf is None:  # no leaf of this bucket got a gradient this step: zeros
            buf = torch.zeros(b.padded, dtype=self.accum[k], device=b.device)
        while len(self.in_flight) >= MAX_IN_FLIGHT:
            self._fold(self.in_flight.pop(0))
        region = self.out[b.shard][b.start : b.start + b.chunk]
        wire = self.wire[k]
        inp = buf if self.as_is[k] else b.to_wire(buf, wire or self.accum[k])
        if self.steps == 0 and wire is None:
            target = region
        else:
            target = torch.empty(b.chunk, dtype=inp.dtype, device=b.device)
        what = bucket_what("reduce_scatter", self.plan.buckets, k)
        work = self.comm.reduce_scatter(target, inp, what, "gradients (every)")
        self.in_flight.append((work, what, region, target, inp))
        self.launched += 1

    def _fold(self, item: tuple[Any, str, torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        work, what, region, target, _inp = item  # _inp: the input lives until it is waited on
        self.comm.wait(work, what)
        if target is not region:
            region.add_(target)  # a wire dtype's sum, added in the accumulation dtype

    def step(self) -> None:
        """The micro-step's backward is over: send what is left of it, fold it into the shards."""
        for k in self.every_order[self.launched :]:
            self._launch_every(k)
        while self.in_flight:
            self._fold(self.in_flight.pop(0))
        self.steps += 1
        self._new_step()

    # -- the boundary -------------------------------------------------------------------------

    def _launch_bound(self, ready_only: bool) -> None:
        while self.bound_launched < len(self.bound_order):
            k = self.bound_order[self.bound_launched]
            if ready_only and self.bound_remaining[k] > 0:
                return
            while len(self.bound_works) >= MAX_IN_FLIGHT:  # the backend may copy each input
                self._wait_bound()
            b = self.plan.buckets[k]
            buf = self.full[k]
            assert buf is not None
            region = self.out[b.shard][b.start : b.start + b.chunk]
            wire = self.wire[k]
            inp = buf if self.as_is[k] else b.to_wire(buf, wire or self.accum[k])
            target = region if wire is None else torch.empty(b.chunk, dtype=wire, device=b.device)
            what = bucket_what("reduce_scatter", self.plan.buckets, k)
            work = self.comm.reduce_scatter(target, inp, what, "gradients")
            self.bound_works.append((work, what, k, region, target, inp))
            self.bound_launched += 1

    def _wait_bound(self) -> None:
        work, what, k, region, target, _inp = self.bound_works.pop(0)
        self.comm.wait(work, what)
        if target is not region:
            region.copy_(target)  # back in the accumulation dtype
        self._replicate(k)

    def _replicate(self, k: int) -> None:
        """Hybrid: start summing bucket ``k``'s final shard region over the replicas."""
        if self.rcomm is None:
            return
        b = self.plan.buckets[k]
        region = self.out[b.shard][b.start : b.start + b.chunk]
        what = bucket_what("replicate all_reduce", self.plan.buckets, k)
        wire = self.wire[k]
        sent = region if wire is None else region.to(wire)
        self.rworks.append((self.rcomm.all_reduce(sent, what, "gradients"), what, region, sent))

    def finish(self, weight: Any, failed: bool = False) -> tuple[torch.Tensor, ...]:
        """Complete the sequence (padding to ``n`` micro-steps), reduce, return the shards."""
        self.overlapping = False
        if self.launched or self.in_flight:  # a step cut short by an error
            self.step()
        n = self.spec.n
        if self.given_sharded and self.gathers == 0 and not self.regather:
            self.params(0, self.sync.sharded)  # an empty batch still gathers once
        while self.every_order and self.steps < n or (self.regather and self.gathers < n):
            if self.regather and self.gathers <= self.steps:
                self.params(self.steps, self.sync.sharded)
            self.step()
        self.full_params = None
        for k in self.every_order:  # final now; before any boundary bucket, on every rank
            self._replicate(k)
        self._launch_bound(ready_only=False)
        dev = self.plan.devices[0] if self.plan.devices else torch.device("cpu")
        tail = torch.zeros(TAIL + _metrics.width(self.spec), dtype=torch.float64, device=dev)
        self.comm.fill(tail, weight, failed)
        tail_work = self.comm.all_reduce(tail, "the weight all_reduce", "weight")
        while self.bound_works:
            self._wait_bound()
        self.comm.wait(tail_work, "the weight all_reduce")
        world = self.comm.world
        if self.rcomm is not None:  # the shard group's sums, summed over the replicas
            world *= self.rcomm.world
            what = "the replicate weight all_reduce"
            self.rworks.append((self.rcomm.all_reduce(tail, what, "weight"), what, tail, tail))
            while self.rworks:
                work, what, region, sent = self.rworks.pop(0)
                self.rcomm.wait(work, what)
                if sent is not region:
                    region.copy_(sent)  # back in the accumulation dtype
        total = self.comm.read(self.comm.fetch(tail), failed, world)
        with torch.no_grad():
            _reduce.normalise(self.spec.reduction, self.out, total)  # type: ignore[arg-type]
            return tuple(o.to(s.dtype) for o, s in zip(self.out, self.sync.sharded.shards))


def _first_diff(lay: Any, mine: Any) -> str:
    if lay.paths != mine.paths:
        return f"key paths {list(lay.paths)} against {list(mine.paths)}"
    for p, a, b, da, db, va, vb in zip(
        lay.paths, lay.shapes, mine.shapes, lay.dtypes, mine.dtypes, lay.devices, mine.devices
    ):
        if (a, da, va) != (b, db, vb):
            return f"leaf {p} is {list(a)} {da} on {va}, sharded as {list(b)} {db} on {vb}"
    return "the tree structure differs"
