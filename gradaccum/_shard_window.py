"""One window of a reduce-scatter sync: running sums, shard accumulators, collectives in flight.

The window keeps the sequence of collectives the same on every rank whatever happens on it:
[fingerprint, first window only, issued when the window opens], then ``n`` micro-steps of
[params all-gathers, when the window gathers per micro-batch; ``every`` buckets in plan order],
then the ``boundary`` buckets in plan order, then the weight. A rank with fewer micro-batches, or
one that failed, completes the sequence with zeros in ``finish``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import _comm, _reduce
from ._errors import GradAccumError
from ._record import record
from ._shard import Sharded
from ._shard_plan import wire_plan

if TYPE_CHECKING:
    from ._fast_window import Progress
    from ._scatter import ReduceScatter

__all__ = ["MAX_IN_FLIGHT", "Window", "fast_window", "is_sharded_arg", "with_params"]

MAX_IN_FLIGHT = 2  # buckets on the wire at once: bounds the memory of (backend copies of) inputs


class Window:
    """One window of a reduce-scatter sync: running sums, shards, collectives in flight."""

    def __init__(
        self, sync: ReduceScatter, where: str, lay: Any, group: Any, rank: int, world: int
    ):
        self.sync, self.where, self.lay = sync, where, lay
        self.group, self.rank, self.world = group, rank, world
        sp = sync.sharded
        plan = self.plan = sp.plan
        self.wire = wire_plan(plan)
        pol = sync.policies()
        self.every = [pol[b.shard] == "every" for b in plan.buckets]
        self.accum = [
            lay.accum_dtypes[b.members[0]] if b.members else b.dtype for b in plan.buckets
        ]
        shard_accum = [torch.float64] * len(sp.shards)
        for b, a in zip(plan.buckets, self.accum):
            shard_accum[b.shard] = a
        # The window's gradient shards, in the accumulation dtype (every: the running sum).
        self.out = [
            torch.zeros(size, dtype=a, device=dev)
            for size, a, dev in zip(plan.sizes, shard_accum, plan.devices)
        ]
        # boundary buckets: the full running sums (zeroed, padded); leaves are views of them.
        self.full: list[torch.Tensor | None] = []
        self.sums: list[torch.Tensor | None] = [None] * len(lay.shapes)
        for k, b in enumerate(plan.buckets):
            if self.every[k]:
                self.full.append(None)
                continue
            buf = torch.zeros(b.padded, dtype=self.accum[k], device=b.device)
            self.full.append(buf)
            for i, off in zip(b.members, b.offsets):
                self.sums[i] = buf[off : off + lay.shapes[i].numel()].view(lay.shapes[i])
        self.every_order = [k for k in range(len(plan.buckets)) if self.every[k]]
        self.bound_order = [k for k in range(len(plan.buckets)) if not self.every[k]]
        self.steps = 0  # completed micro-steps
        self.gathers = 0  # params gathers done by the window (gather="micro_batch")
        self.regather = False  # set when the window gathers the params for each micro-step
        self.overlapping = False
        self._new_step()
        self.bound_remaining = [len(b.members) for b in plan.buckets]
        self.bound_launched = 0  # boundary buckets launched (a prefix of bound_order)
        self.bound_works: list[tuple[int, Any]] = []  # launched, not yet waited on
        self.leaf_off = [0] * len(lay.shapes)  # each leaf's offset in its bucket
        for b in plan.buckets:
            for i, off in zip(b.members, b.offsets):
                self.leaf_off[i] = off

    # -- micro-steps --------------------------------------------------------------------------

    def _new_step(self) -> None:
        self.staging: dict[int, torch.Tensor] = {}
        self.remaining = [len(b.members) for b in self.plan.buckets]
        self.launched = 0  # every buckets launched this step (a prefix of every_order)
        self.in_flight: list[tuple[int, Any, torch.Tensor, torch.Tensor]] = []

    def gather_params(self) -> Any:
        """The full params for one micro-step (gather='micro_batch'), counted for padding."""
        self.gathers += 1
        return self.sync.sharded._gather(self.where, self.sync.timeout)

    def grad_ready(self, i: int, g: torch.Tensor, alpha: float = 1) -> None:
        """Leaf ``i``'s gradient for this micro-step is ``alpha * g``."""
        k = self.plan.bucket_of_leaf[i]
        b = self.plan.buckets[k]
        if self.every[k]:
            buf = self.staging.get(k)
            if buf is None:
                buf = self.staging[k] = torch.zeros(b.padded, dtype=self.accum[k], device=b.device)
            off = self.leaf_off[i]
            view = buf[off : off + g.numel()]
            view.copy_(g.reshape(-1))
            if alpha != 1:
                view.mul_(alpha)
            self.remaining[k] -= 1
            if self.remaining[k] == 0:
                self._launch_ready()
            return
        s = self.sums[i]
        assert s is not None
        s.add_(g, alpha=alpha)
        if self.overlapping:
            self.bound_remaining[k] -= 1
            if self.bound_remaining[k] == 0:
                self._launch_bound(ready_only=True)

    def begin_last(self) -> None:
        """The coming backward is the window's last: launch boundary buckets as they complete."""
        if self.sync.overlap and not self.every_order:
            self.overlapping = True

    def _launch_ready(self) -> None:
        while self.launched < len(self.every_order):
            k = self.every_order[self.launched]
            if self.remaining[k] > 0:
                return
            self._launch_every(k)

    def _launch_every(self, k: int) -> None:
        b = self.plan.buckets[k]
        buf = self.staging.pop(k, None)
        if buf is None:  # no leaf of this bucket got a gradient this step: zeros
            buf = torch.zeros(b.padded, dtype=self.accum[k], device=b.device)
        while len(self.in_flight) >= MAX_IN_FLIGHT:
            self._fold(self.in_flight.pop(0))
        first = self.steps == 0
        region = self.out[b.shard][b.start : b.start + b.chunk]
        target = region if first else torch.empty_like(region)
        record("reduce_scatter", self.group, buf.dtype, b.padded, "gradients (every)")
        work = self._scatter(k, target, buf)
        self.in_flight.append((k, work, target, buf))
        self.launched += 1

    def _fold(self, item: tuple[int, Any, torch.Tensor, torch.Tensor]) -> None:
        k, work, target, _buf = item
        self.sync._comm._wait(self.where, k, self.wire, work, self.rank)
        b = self.plan.buckets[k]
        region = self.out[b.shard][b.start : b.start + b.chunk]
        if target.data_ptr() != region.data_ptr():
            region.add_(target)

    def end_step(self) -> None:
        """The micro-step's backward is over: send what is left of it, fold it into the shards."""
        for k in self.every_order[self.launched :]:
            self._launch_every(k)
        while self.in_flight:
            self._fold(self.in_flight.pop(0))
        self.steps += 1
        self._new_step()

    def add(self, leaves: list[torch.Tensor], alpha: float) -> None:
        """A whole micro-batch's gradients (from a step function returning them)."""
        for i, g in enumerate(leaves):
            self.grad_ready(i, g, alpha)
        self.end_step()

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
            record("reduce_scatter", self.group, buf.dtype, b.padded, "gradients")
            self.bound_works.append((k, self._scatter(k, region, buf)))
            self.bound_launched += 1

    def _wait_bound(self) -> None:
        k, work = self.bound_works.pop(0)
        self.sync._comm._wait(self.where, k, self.wire, work, self.rank)

    def _scatter(self, k: int, out: torch.Tensor, inp: torch.Tensor) -> Any:
        try:
            return _comm.reduce_scatter(out, inp, self.group, self.sync.timeout)
        except RuntimeError as err:
            raise self.sync._comm._failure(self.where, k, self.wire, self.rank, err) from err

    def finish(
        self, where: str, reduction: str, weight: Any, n: int, failed: bool = False
    ) -> tuple[tuple[torch.Tensor, ...], float]:
        """Complete the sequence (padding to ``n`` micro-steps), reduce, return the shards."""
        self.where = where  # errors from here on are the boundary's (finalize), not add's
        self.overlapping = False
        if self.launched or self.in_flight:  # a step cut short by an error
            self.end_step()
        regather = self.regather
        while self.every_order and self.steps < n or (regather and self.gathers < n):
            if regather and self.gathers <= self.steps:
                self.gather_params()
            self.end_step()
        self._launch_bound(ready_only=False)
        dev = self.plan.devices[0] if self.plan.devices else torch.device("cpu")
        tail = torch.zeros(2, dtype=torch.float64, device=dev)
        if isinstance(weight, torch.Tensor):
            tail[:1].copy_(weight.reshape(1))
        else:
            tail[0] = weight
        tail[1] = 1.0 if failed else 0.0
        record("all_reduce", self.group, torch.float64, 2, "weight")
        try:
            tail_work = _comm.all_reduce(tail, self.group, self.sync.timeout)
        except RuntimeError as err:
            raise self.sync._comm._broken(
                self.where, "the weight all_reduce", self.rank, err
            ) from err
        while self.bound_works:
            self._wait_bound()
        try:
            _comm.wait(tail_work, self.sync.timeout)
        except RuntimeError as err:
            raise self.sync._comm._broken(
                self.where, "the weight all_reduce", self.rank, err
            ) from err
        total, n_failed = tail.tolist()
        if n_failed and not failed:
            raise GradAccumError(
                f"{self.where}: {int(n_failed)} other rank(s) of the {self.world} in the group "
                f"raised an error during this window (rank {self.rank} did not); no gradient is "
                f"returned on any rank. The cause is in the failing rank's traceback."
            )
        if not failed and reduction != "sum" and total <= 0:
            raise ValueError(
                f"{self.where}: the window's "
                f"{'counts' if reduction == 'count' else 'rows'} add up to {total:g} over all "
                f"{self.world} ranks, so there is no mean to divide by; skip windows with no "
                f"items on any rank (e.g. all padding), or use reduction='sum'."
            )
        with torch.no_grad():
            _reduce.normalise(reduction, self.out, total)  # type: ignore[arg-type]
            shards = tuple(o.to(s.dtype) for o, s in zip(self.out, self.sync.sharded.shards))
        return shards, float(total)


def is_sharded_arg(
    call: str, sync: ReduceScatter, args: tuple[Any, ...], argnums: tuple[int, ...]
) -> bool:
    """Whether the params argument is the sync's Sharded (the window then gathers the params)."""
    if len(argnums) != 1:
        raise ValueError(
            f"{call}: with sync=reduce_scatter(...), the gradients must be taken with respect "
            f"to one argument (argnums an int), got argnums={argnums!r}; pass argnums=0 (the "
            f"position of the Sharded or of its gathered params)."
        )
    target = args[argnums[0]]
    if target is not sync.sharded and isinstance(target, Sharded):
        raise ValueError(
            f"{call}: the params argument is a Sharded object other than the one the sync "
            f"reduce-scatters into; pass the Sharded given to gradaccum.reduce_scatter."
        )
    return target is sync.sharded


def with_params(args: tuple[Any, ...], argnum: int, params: Any) -> tuple[Any, ...]:
    """``args`` with ``params`` at ``argnum``."""
    new = list(args)
    new[argnum] = params
    return tuple(new)


@torch.compiler.disable  # type: ignore[untyped-decorator]  # hooks, .grad writes: eager
def fast_window(
    call: str,
    fn: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    batch_argnum: int,
    micro: list[tuple[Any, int]],
    win: Progress,
    aux_acc: Any,
    *,
    reduction: _reduce.Reduction,
    count: Callable[[Any], Any] | None,
    window: Window,
    regather: bool,
    n: int,
) -> None:
    """The window of a [`grad()`][gradaccum.grad] step function under a reduce-scatter sync.

    Hooks on the aliased leaves hand each gradient to the window as soon as autograd has
    accumulated it (and drop it): ``boundary`` leaves add into their full running sums,
    ``every`` leaves fill their bucket, which is reduce-scattered once complete.
    """
    from ._sums import weigh

    state = win.state
    assert state is not None
    lay = state.layout
    argnum = fn.argnums if isinstance(fn.argnums, int) else fn.argnums[0]
    direct = lay.accum_dtypes == lay.dtypes
    alpha_now: list[float] = [1]
    handles: list[Any] = []
    leaves: list[torch.Tensor] = []
    new_args: list[Any] = []

    def on_grad(i: int, leaf: torch.Tensor) -> None:
        assert leaf.grad is not None
        window.grad_ready(i, leaf.grad, alpha_now[0])
        leaf.grad = None

    def drop() -> None:
        for h in handles:
            h.remove()
        handles.clear()
        for leaf in leaves:
            leaf.grad = None

    seeds: dict[tuple[float, torch.dtype, torch.device], torch.Tensor] = {}
    try:
        last = len(micro) - 1
        for j, (mb, rows) in enumerate(micro):
            if j == 0 or regather:
                drop()
                params = window.gather_params() if regather else args[argnum]
                new_args, leaves, _ = fn.alias(call, with_params(args, argnum, params))
                del params
                handles.extend(
                    leaf.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                        functools.partial(on_grad, i)
                    )
                    for i, leaf in enumerate(leaves)
                )
            new_args[batch_argnum] = mb
            value, aux = fn.forward(call, new_args, kwargs)
            raw, items, alpha, weight = weigh(call, reduction, count, rows, aux)
            if j == last and len(micro) == n:
                window.begin_last()
            if leaves and value.requires_grad:
                if direct:
                    key = (float(alpha), value.dtype, value.device)
                    seed = seeds.get(key)
                    if seed is None:
                        seed = seeds[key] = torch.full(
                            (), alpha, dtype=value.dtype, device=value.device
                        )
                else:
                    alpha_now[0] = alpha
                    seed = None
                torch.autograd.backward(value, seed, inputs=leaves)
            window.end_step()
            win.state = state = state._replace(
                sums=window, weight=state.weight + weight, micro_step=state.micro_step + 1
            )
            if aux_acc is not None:
                aux_acc.add(aux, rows, items, raw)
            del value, aux, raw, mb
            if regather:
                drop()
                leaves, new_args = [], []
    finally:
        drop()
