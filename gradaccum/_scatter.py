"""The sharded boundary: gradients reduce-scattered into each rank's shard.

Two policies, per parameter group:

- ``boundary``: full gradients accumulate locally in flat (padded) buckets; one
  ``reduce_scatter`` per bucket per window, into the rank's slice of the gradient shard.
- ``every``: each micro-batch's gradients are reduce-scattered bucket by bucket (during its
  backward, on the fast path) and added into the gradient shard; no full gradient outlives its
  bucket.

Both end with one ``all_reduce`` of ``[weight, failed]`` (two float64 numbers). The sequence of
collectives of a window is the same on every rank whatever happens on it: [fingerprint, first
window only], then ``n`` micro-steps of [params all-gathers, with ``gather="micro_batch"``;
``every`` buckets in plan order], then the ``boundary`` buckets in plan order, then the weight. A
rank with fewer micro-batches, or one that failed, completes the sequence with zeros.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from . import _reduce
from ._buckets import Bucket
from ._errors import GradAccumError, describe
from ._record import record
from ._shard import Sharded, ShardPlan, wire_plan
from ._sync import AllReduce, Check, check_options

__all__ = ["ReduceScatter", "reduce_scatter"]

Policy = Literal["boundary", "every"]
POLICIES = ("boundary", "every")
GATHERS = ("window", "micro_batch")
MAX_IN_FLIGHT = 2  # buckets on the wire at once: bounds the memory of (backend copies of) inputs


@dataclass(frozen=True, eq=False)
class ReduceScatter:
    """Sharded synchronisation: the window's gradient, reduce-scattered into shards.

    Make one with [`reduce_scatter()`][gradaccum.reduce_scatter] and pass it as ``sync=`` to
    [`accumulate()`][gradaccum.accumulate] or [`Accumulator`][gradaccum.Accumulator]; see
    there for the options and the contract. Its [`plan()`][gradaccum.ReduceScatter.plan]
    lists the buckets without communicating.

    Examples:
        >>> import torch, torch.distributed as dist, gradaccum
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> sharded = gradaccum.shard({"w": torch.ones(300_000), "b": torch.zeros(10)})
        >>> sync = gradaccum.reduce_scatter(sharded, policy="every")
        >>> [(b.paths, b.numel, b.nbytes) for b in sync.plan()]  # once per micro-batch
        [(("['w']",), 300000, 1200000), (("['b']",), 10, 40)]
        >>> dist.destroy_process_group()
    """

    sharded: Sharded
    policy: str | Mapping[str, str] = "boundary"
    gather: str = "window"
    check: Check = "first"
    timeout: float | None = None
    overlap: bool = True
    _comm: AllReduce = field(init=False, repr=False, compare=False)
    _verified: set[Any] = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "_comm", AllReduce(self.sharded.group, check=self.check, timeout=self.timeout)
        )

    def policies(self) -> tuple[str, ...]:
        """The policy of each shard tensor (``"boundary"`` or ``"every"``), in shard order."""
        if isinstance(self.policy, str):
            return tuple(self.policy for _ in self.sharded.names)
        return tuple(self.policy[name] for name in self.sharded.names)

    def plan(self, *, accum_dtype: torch.dtype | None = None) -> tuple[Bucket, ...]:
        """The reduce-scatter buckets (full, padded sizes), in the order they are reduced.

        A dry run: nothing is communicated. The ``every`` buckets are reduced once per
        micro-batch, the ``boundary`` buckets once per window, in the accumulation dtype.
        ``Bucket.tail`` is False: the weight travels in an all-reduce of its own (16 bytes).

        Args:
            accum_dtype: As in [`accumulate()`][gradaccum.accumulate].
        """
        from ._state import with_accum

        lay = with_accum(self.sharded.layout, accum_dtype)
        out = []
        for b in _order(self.sharded.plan, self.policies()):
            dt = lay.accum_dtypes[b.members[0]] if b.members else b.dtype
            paths = tuple(lay.paths[i] for i in b.members)
            out.append(Bucket(dt, b.device, paths, b.padded, b.padded * dt.itemsize, False))
        return tuple(out)

    # -- used by accumulate and Accumulator ---------------------------------------------------

    def _open(self, where: str, lay: Any, reduction: str, verify: bool = True) -> _Window:
        """A window for gradients of layout ``lay`` (checked against the sharded params)."""
        mine = self.sharded.layout
        if (lay.spec, lay.paths, lay.shapes, lay.dtypes, lay.devices) != (
            mine.spec,
            mine.paths,
            mine.shapes,
            mine.dtypes,
            mine.devices,
        ):
            raise ValueError(
                f"{where}: the gradients are for params that differ from the sharded ones "
                f"({_first_diff(lay, mine)}); pass the Sharded object (or what its gather() "
                f"returned) as the params of the step function."
            )
        if len(set(lay.accum_dtypes)) > 1 and not _uniform(self.sharded.plan, lay):
            raise ValueError(
                f"{where}: mixed accumulation dtypes within a shard are not supported."
            )
        pg, rank, world = self._comm._group(where)
        key = (lay, reduction)
        if verify and (
            self.check == "always" or (self.check == "first" and key not in self._verified)
        ):
            extra = (
                *(f"shard {k} policy {p!r}" for k, p in enumerate(self.policies())),
                f"gather={self.gather!r}",
                *(f"accumulated in {d}" for d in lay.accum_dtypes),
            )
            desc = wire_plan(self.sharded.plan, extra)
            self._comm._verify(where, desc, reduction, pg, rank, world)
            self._verified.add(key)
        return _Window(self, where, lay, pg, rank, world)


def _uniform(plan: ShardPlan, lay: Any) -> bool:
    return all(len({lay.accum_dtypes[i] for i in b.members}) <= 1 for b in plan.buckets)


def _order(plan: ShardPlan, pol: tuple[str, ...]) -> list[Any]:
    every = [b for b in plan.buckets if pol[b.shard] == "every"]
    return every + [b for b in plan.buckets if pol[b.shard] != "every"]


def _first_diff(lay: Any, mine: Any) -> str:
    if lay.paths != mine.paths:
        return f"key paths {list(lay.paths)} against {list(mine.paths)}"
    for p, a, b, da, db, va, vb in zip(
        lay.paths, lay.shapes, mine.shapes, lay.dtypes, mine.dtypes, lay.devices, mine.devices
    ):
        if (a, da, va) != (b, db, vb):
            return f"leaf {p} is {list(a)} {da} on {va}, sharded as {list(b)} {db} on {vb}"
    return "the tree structure differs"


class _Window:
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
        return self.sync.sharded.gather(timeout=self.sync.timeout)

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
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        try:
            return fn(out, inp, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
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
            tail_work = dist.all_reduce(tail, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        except RuntimeError as err:
            raise self.sync._comm._broken(
                self.where, "the weight all_reduce", self.rank, err
            ) from err
        while self.bound_works:
            self._wait_bound()
        try:
            if self.sync.timeout is None:
                tail_work.wait()
            else:
                tail_work.wait(timeout=datetime.timedelta(seconds=self.sync.timeout))
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


def reduce_scatter(
    sharded: Sharded,
    *,
    policy: str | Mapping[str, str] = "boundary",
    gather: str = "window",
    check: Check = "first",
    timeout: float | None = None,
    overlap: bool = True,
) -> ReduceScatter:
    """Reduce-scatter accumulated gradients into the shards of sharded params.

    Pass the result as ``sync=`` to [`accumulate()`][gradaccum.accumulate] or
    [`Accumulator`][gradaccum.Accumulator]. The accumulated function then returns the window's
    gradient as a tuple of shards, one per tensor of ``sharded.shards`` (same shape and dtype),
    equal to this rank's slice of the gradient over the *global* batch under the reduction
    (weights and counts are summed over ranks, as with [`all_reduce()`][gradaccum.all_reduce]).
    Give them to [`Sharded.write_grads()`][gradaccum.Sharded.write_grads].

    Args:
        sharded: What [`shard()`][gradaccum.shard] returned.
        policy: When gradients are reduce-scattered:

            - ``"boundary"`` (default): gradients accumulate in full, locally, and each bucket is
              reduce-scattered once per window. Least communication (one reduce-scatter per
              bucket per window, whatever ``n``); a full gradient (in the accumulation dtype)
              lives through the window.
            - ``"every"``: each micro-batch's gradients are reduce-scattered bucket by bucket
              (during its backward, with [`grad()`][gradaccum.grad] step functions) and added
              into a shard accumulator, so no full gradient outlives its bucket (at most two
              buckets are in flight). ``n`` times the communication; gradient memory about
              ``1/world``.

            A dict from parameter-group name (``param_groups`` of
            [`shard()`][gradaccum.shard]) to policy chooses per group.
        gather: When the accumulated function is called with the
            [`Sharded`][gradaccum.Sharded] itself as its params: ``"window"`` (default)
            all-gathers the full params once per window and keeps them for all micro-batches;
            ``"micro_batch"`` all-gathers them before each micro-batch and drops them after its
            backward (``n`` times the gather traffic; between micro-batches only the shards are
            held). Params passed already gathered are used as they are.
        check: As in [`all_reduce()`][gradaccum.all_reduce]: verify once (``"first"``), at every
            window (``"always"``) or never that every rank has the same layout, policy and
            reduction.
        timeout: Seconds to wait for each collective before raising
            [`GradAccumError`][gradaccum.GradAccumError]; ``None`` uses the process group's.
        overlap: With [`grad()`][gradaccum.grad] step functions and only ``boundary`` groups,
            reduce-scatter each bucket during the last backward as soon as it is complete.

    Returns:
        A [`ReduceScatter`][gradaccum.ReduceScatter].

    Raises:
        TypeError: ``sharded`` is not a Sharded, or an option has the wrong kind.
        ValueError: A policy or gather name is unknown, or the policy dict does not name every
            parameter group.

    Examples:
        >>> import torch, torch.distributed as dist, gradaccum
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> sharded = gradaccum.shard({"w": torch.ones(3), "b": torch.zeros(2)})
        >>> def loss_fn(params, x):
        ...     return (x @ params["w"] + params["b"].sum()).sum()
        >>> sync = gradaccum.reduce_scatter(sharded, policy="every")
        >>> step = gradaccum.accumulate(gradaccum.grad(loss_fn), 2, reduction="sum", sync=sync)
        >>> with gradaccum.record_collectives() as log:
        ...     grads = step(sharded, torch.ones(4, 3))  # gathers the params, then 2 micro-batches
        >>> grads  # this rank's gradient shard: w's gradient, then b's
        (tensor([4., 4., 4., 4., 4.]),)
        >>> [(c.kind, c.purpose) for c in log]  # doctest: +NORMALIZE_WHITESPACE
        [('all_gather', 'params'), ('all_reduce', 'fingerprint'),
         ('reduce_scatter', 'gradients (every)'), ('reduce_scatter', 'gradients (every)'),
         ('all_reduce', 'weight')]
        >>> sharded.write_grads(grads)
        >>> dist.destroy_process_group()

    Every rank runs the same collectives in the same order in every window: under ``"every"``
    and with ``gather="micro_batch"``, a rank with fewer micro-batches than ``n`` (a short or
    empty batch) or one that failed completes its ``n`` micro-steps with zeros, so ranks never
    wait on each other. With [`MicroBatches`][gradaccum.MicroBatches], no rank may pass more
    than ``n``.
    """
    where = "reduce_scatter(sharded, policy=..., gather=...)"
    if not isinstance(sharded, Sharded):
        raise TypeError(
            f"{where}: sharded must be what gradaccum.shard(params) returned, got "
            f"{describe(sharded)}; shard the params first: sharded = gradaccum.shard(params)."
        )
    names = sorted(set(sharded.names))
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(
                f"{where}: policy must be 'boundary' or 'every' (or a dict from parameter "
                f"group to one of them), got {policy!r}."
            )
    elif isinstance(policy, Mapping):
        missing = [n for n in names if n not in policy]
        extra = [n for n in policy if n not in names]
        bad = {n: p for n, p in policy.items() if p not in POLICIES}
        if missing or extra or bad:
            raise ValueError(
                f"{where}: policy must map each parameter group {names} to 'boundary' or "
                f"'every'; missing {missing}, unknown groups {extra}, unknown policies {bad}."
            )
        policy = dict(policy)
    else:
        raise TypeError(
            f"{where}: policy must be 'boundary', 'every' or a dict from parameter group to "
            f"one of them, got {describe(policy)}."
        )
    if gather not in GATHERS:
        raise ValueError(
            f"{where}: gather must be 'window' or 'micro_batch', got {describe(gather)}."
        )
    check_options(where, check, timeout, overlap)
    return ReduceScatter(
        sharded, policy, gather, check, None if timeout is None else float(timeout), overlap
    )


# -- the window of accumulate -------------------------------------------------------------------


def params_arg(
    call: str, sync: ReduceScatter, args: tuple[Any, ...], argnums: tuple[int, ...]
) -> tuple[tuple[Any, ...], bool]:
    """Substitute gathered params for a Sharded params argument (once per window).

    Returns the new args and whether the params are to be gathered per micro-batch.
    """
    if len(argnums) != 1:
        raise ValueError(
            f"{call}: with sync=reduce_scatter(...), the gradients must be taken with respect "
            f"to one argument (argnums an int), got argnums={argnums!r}."
        )
    a = argnums[0]
    target = args[a]
    if target is not sync.sharded:
        if isinstance(target, Sharded):
            raise ValueError(
                f"{call}: the params argument is a Sharded object other than the one the sync "
                f"reduce-scatters into; pass the Sharded given to gradaccum.reduce_scatter."
            )
        return args, False
    if sync.gather == "micro_batch":
        return args, True
    new = list(args)
    new[a] = sync.sharded.gather(timeout=sync.timeout)
    return tuple(new), False


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
    win: Any,
    aux_acc: Any,
    *,
    reduction: _reduce.Reduction,
    count: Callable[[Any], Any] | None,
    window: _Window,
    regather: bool,
    n: int,
) -> None:
    """The window of a [`grad()`][gradaccum.grad] step function under a reduce-scatter sync.

    Hooks on the aliased leaves hand each gradient to the window as soon as autograd has
    accumulated it (and drop it): ``boundary`` leaves add into their full running sums,
    ``every`` leaves fill their bucket, which is reduce-scattered once complete.
    """
    from ._state import AccumState, weigh

    state = win.state
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
            win.state = state = AccumState(
                window, state.weight + weight, state.micro_step + 1, state.window, lay
            )
            if aux_acc is not None:
                aux_acc.add(aux, rows, items, raw)
            del value, aux, raw, mb
            if regather:
                drop()
                leaves, new_args = [], []
    finally:
        drop()


SAVE_FORMAT = "gradaccum.ShardedAccumState/1"


def save(sync: ReduceScatter, reduction: str, state: Any) -> dict[str, Any]:
    """An accumulator state under a reduce-scatter sync, as a dict (copies), mid-window included."""
    window = state.sums
    lay = state.layout
    return {
        "format": SAVE_FORMAT,
        **sync.sharded._meta(),
        "reduction": reduction,
        "policies": list(sync.policies()),
        "accum_dtypes": [str(d) for d in lay.accum_dtypes],
        "weight": state.weight,
        "micro_step": state.micro_step,
        "window": state.window,
        "steps": window.steps if window is not None else 0,
        "full": None if window is None else [None if f is None else f.clone() for f in window.full],
        "out": None if window is None else [o.clone() for o in window.out],
    }


def load(sync: ReduceScatter, reduction: str, state: Any, sd: Any) -> Any:
    """Validate a saved sharded accumulator state against this rank's, then rebuild it."""
    from ._shard import check_meta

    where = "Accumulator.load_state_dict(state, state_dict)"
    lay = state.layout
    check_meta(where, sd, SAVE_FORMAT, sync.sharded._meta())
    mine = {
        "reduction": reduction,
        "policies": list(sync.policies()),
        "accum_dtypes": [str(d) for d in lay.accum_dtypes],
    }
    for key, value in mine.items():
        if sd.get(key) != value:
            raise GradAccumError(
                f"{where}: the state was saved with {key}={sd.get(key)!r} but this accumulator "
                f"has {key}={value!r}; load it with the same reduction, policy and accum_dtype."
            )
    for key in ("micro_step", "window", "steps"):
        if isinstance(sd.get(key), bool) or not isinstance(sd.get(key), int) or sd[key] < 0:
            raise GradAccumError(f"{where}: {key} must be a non-negative int, got {sd.get(key)!r}.")
    weight = sd.get("weight")
    if isinstance(weight, torch.Tensor):
        weight = weight.to(lay.devices[0] if lay.devices else "cpu", copy=True)
    if sd.get("full") is None:
        return type(state)(None, weight, sd["micro_step"], sd["window"], lay)
    window = sync._open(where, lay, reduction, verify=False)
    saved = list(sd["full"]) + list(sd["out"])
    for k, (t, f) in enumerate(zip(saved, window.full + window.out)):  # type: ignore[operator]
        if (t is None) != (f is None) or (
            f is not None
            and (not isinstance(t, torch.Tensor) or t.shape != f.shape or t.dtype != f.dtype)
        ):
            raise GradAccumError(
                f"{where}: saved buffer {k} is {describe(t)}, expected "
                f"{'None' if f is None else f'shape {tuple(f.shape)} {f.dtype}'}; pass the dict "
                f"that Accumulator.state_dict() returned on this rank."
            )
    with torch.no_grad():
        for t, f in zip(saved, window.full + window.out):  # type: ignore[operator]
            if f is not None:
                f.copy_(t)
    window.steps = sd["steps"]
    return type(state)(window, weight, sd["micro_step"], sd["window"], lay)
