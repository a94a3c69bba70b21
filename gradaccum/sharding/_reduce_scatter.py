"""The sharded boundary: gradients reduce-scattered into each rank's shard.

The ``boundary`` and ``every`` policies (per parameter group) are described in
[`reduce_scatter()`][gradaccum.reduce_scatter]; the window is `_scatter_window`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._checks import Check, check_options, check_reduce_dtype
from .._core.checkpoint_format import check_counters, check_meta, check_progress
from .._core.protocol import Sync, Window, WindowSpec
from .._core.state import AccumState
from .._dist.buckets import Bucket
from .._errors import GradAccumError, describe
from .._layout import Layout, make_layout, with_accum
from .._metrics import check_saved
from ._sharded import Sharded
from ._window import ScatterWindow

__all__ = ["ReduceScatter", "reduce_scatter"]

POLICIES = ("boundary", "every")
SAVE_FORMAT = "gradaccum.ShardedAccumState/1"


@dataclass(frozen=True, eq=False)
class ReduceScatter(Sync):
    """Sharded synchronisation: the window's gradient, reduce-scattered into shards.

    Make one with [`reduce_scatter()`][gradaccum.reduce_scatter] and pass it as ``sync=`` to
    [`accumulate()`][gradaccum.accumulate] or [`Accumulator`][gradaccum.Accumulator]; see
    there for the options and the contract. Its [`plan()`][gradaccum.sharding.ReduceScatter.plan]
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
    check: Check = "fingerprint"
    timeout: float | None = None
    overlap: bool = True
    reduce_dtype: torch.dtype | None = None
    shards = True  # the boundary returns this rank's gradient shards (Sync.shards)

    @property
    def group(self) -> Any:
        """The shards' group (``Sync.group``): the reduce-scatter's."""
        return self.sharded.group

    def data_group(self) -> Any:
        """The data is split over the shards' mesh (sharded hybrid: both dims), or group."""
        sp = self.sharded
        return sp.mesh if sp.mesh is not None else sp.group

    def wire_dtype(self, b: Any, accum: torch.dtype) -> torch.dtype | None:
        """The dtype bucket ``b`` is reduce-scattered in; ``None``: ``accum``, its sums' own.

        ``reduce_dtype`` if given, else an FSDP2 unit's ``MixedPrecisionPolicy`` (its
        ``reduce_dtype``, or its ``param_dtype`` when that is None, as FSDP2 reduces).
        """
        wire = self.reduce_dtype
        fsdp = self.sharded.fsdp
        if wire is None and fsdp is not None and b.members:
            wire = fsdp.reduce_dtypes[b.members[0]]
        return None if wire == accum else wire

    def policies(self) -> tuple[str, ...]:
        """The policy of each shard tensor (``"boundary"`` or ``"every"``), in shard order."""
        if isinstance(self.policy, str):
            return tuple(self.policy for _ in self.sharded.names)
        return tuple(self.policy[name] for name in self.sharded.names)

    def plan(self, *, accum_dtype: torch.dtype | None = None) -> tuple[Bucket, ...]:
        """The reduce-scatter buckets (full, padded sizes), in the order they are reduced.

        A dry run: nothing is communicated. The ``every`` buckets are reduced once per
        micro-batch, the ``boundary`` buckets once per window, in the dtype on the wire
        (``Bucket.dtype``: ``reduce_dtype``, else the accumulation dtype).
        ``Bucket.tail`` is False: the weight travels in an all-reduce of its own (16 bytes, and
        8 more per metric of ``Accumulator.add``).
        Sharded hybrid over a 2-D mesh, each bucket's shard is then all-reduced across the
        replicate dim once per window (``Bucket.collectives`` lists both, with their dims).

        Args:
            accum_dtype: As in [`accumulate()`][gradaccum.accumulate].
        """
        lay, pol = with_accum(self.sharded.compute, accum_dtype), self.policies()
        sp, out = self.sharded, []
        wire: tuple[tuple[str, str | None], ...] = (("reduce_scatter", sp.axis.dim),)
        if sp.replicate_axis is not None:
            wire += (("all_reduce", sp.replicate_axis.dim),)
        for b in sorted(sp.plan.buckets, key=lambda b: pol[b.shard] != "every"):
            dt = lay.accum_dtypes[b.members[0]] if b.members else b.dtype
            dt = self.wire_dtype(b, dt) or dt
            paths = tuple(lay.paths[i] for i in b.members)
            out.append(Bucket(dt, b.device, paths, b.padded, b.padded * dt.itemsize, False, wire))
        return tuple(out)

    def layout(
        self, where: str, params: Any, accum_dtype: torch.dtype | None, argnums: Any = 0
    ) -> Layout:
        """The sharded layout when given the ``Sharded`` itself, else the params' own."""
        if not isinstance(argnums, int):
            raise ValueError(
                f"{where}: with sync=reduce_scatter(...), the gradients must be taken with "
                f"respect to one argument (argnums an int), got argnums={argnums!r}; pass "
                f"argnums=0 (the position of the Sharded or of its gathered params)."
            )
        if params is self.sharded:
            return with_accum(self.sharded.compute, accum_dtype)
        if isinstance(params, Sharded):
            raise ValueError(
                f"{where}: the params argument is a Sharded object other than the one the sync "
                f"reduce-scatters into; pass the Sharded given to gradaccum.reduce_scatter."
            )
        return make_layout(where, params, accum_dtype)

    def open(self, spec: WindowSpec) -> Window:
        """A window checked against the sharded layout, after the fingerprint (see ``check``)."""
        return ScatterWindow(self, spec)

    def window_of(self, sums: Any) -> Window | None:
        """The live window ``sums`` stands for: a reduce-scatter window keeps itself in the state.

        It has no full tree of running sums (its shards and collectives in flight live in the
        window), so its [`tree()`][gradaccum.sync.Window.tree] is the window itself.
        """
        return sums if isinstance(sums, ScatterWindow) else None

    def state_dict(self, reduction: str, state: AccumState[Any]) -> dict[str, Any]:
        """An accumulator state as a dict (copies), mid-window included."""
        window, lay = state.sums, state.layout
        return {
            "format": SAVE_FORMAT,
            **self.sharded.checkpoint_meta(),
            "reduction": reduction,
            "policies": list(self.policies()),
            "accum_dtypes": [str(d) for d in lay.accum_dtypes],
            "weight": state.weight,
            "micro_step": state.micro_step,
            "window": state.window,
            "epoch": state.epoch,
            **(window.saved() if window is not None else ScatterWindow.NOTHING_SAVED),
            "metrics": None
            if state.metrics is None
            else {k: v.clone() for k, v in state.metrics.items()},
        }

    def load_state_dict(
        self, spec: WindowSpec, state: AccumState[Any], sd: dict[str, Any]
    ) -> AccumState[Any]:
        """Validate a saved sharded accumulator state against this rank's, then rebuild it."""
        where, reduction, n, lay = spec.where, spec.reduction, spec.n, state.layout
        check_meta(where, sd, SAVE_FORMAT, self.sharded.checkpoint_meta())
        mine = {
            "reduction": reduction,
            "policies": list(self.policies()),
            "accum_dtypes": [str(d) for d in lay.accum_dtypes],
        }
        for key, value in mine.items():
            if sd.get(key) != value:
                raise GradAccumError(
                    f"{where}: the state was saved with {key}={sd.get(key)!r} but this accumulator "
                    f"has {key}={value!r}; load it with the same reduction, policy and accum_dtype."
                )
        fix = "; pass the dict that Accumulator.state_dict() returned on this rank."
        epoch_key = ("epoch",) if "epoch" in sd else ()
        check_counters(where, sd, ("micro_step", "window", "steps", *epoch_key), fix)
        weight = sd["weight"]
        check_progress(where, reduction, sd, n, sd.get("full") is not None)
        if sd["steps"] > n:
            raise GradAccumError(
                f"{where}: steps is {sd['steps']}, more than the window's n={n} micro-steps{fix}"
            )
        dev = lay.devices[0] if lay.devices else torch.device("cpu")
        if isinstance(weight, torch.Tensor):
            weight = weight.to(dev, copy=True)
        metrics = check_saved(where, sd.get("metrics"), dev, fix)
        epoch = int(sd.get("epoch", 0))
        if sd.get("full") is None:
            return type(state)(
                None, weight, sd["micro_step"], sd["window"], lay, metrics=metrics, epoch=epoch
            )
        window = ScatterWindow(self, spec, verify=False)
        window.load(sd, fix)
        return type(state)(
            window, weight, sd["micro_step"], sd["window"], lay, metrics=metrics, epoch=epoch
        )


def reduce_scatter(
    sharded: Sharded,
    *,
    policy: str | Mapping[str, str] = "boundary",
    gather: str = "window",
    check: Check = "fingerprint",
    timeout: float | None = None,
    overlap: bool = True,
    reduce_dtype: torch.dtype | None = None,
) -> ReduceScatter:
    """Reduce-scatter accumulated gradients into the shards of sharded params.

    Pass the result as ``sync=`` to [`accumulate()`][gradaccum.accumulate] or
    [`Accumulator`][gradaccum.Accumulator]. The accumulated function then returns the window's
    gradient as a tuple of shards, one per tensor of ``sharded.shards`` (same shape and dtype),
    equal to this rank's slice of the gradient over the *global* batch under the reduction
    (weights and counts are summed over ranks, as with [`all_reduce()`][gradaccum.all_reduce]).
    Give them to [`Sharded.write_grads()`][gradaccum.sharding.Sharded.write_grads].

    Args:
        sharded: What [`shard()`][gradaccum.shard] returned.
        policy: When gradients are reduce-scattered:

            - ``"boundary"`` (default): gradients accumulate in full, locally, and each bucket is
              reduce-scattered once per window: the least communication.
            - ``"every"``: each micro-batch's gradients are reduce-scattered bucket by bucket
              (during its backward, with [`grad()`][gradaccum.grad] step functions) into a shard
              accumulator: ``n`` times the communication, gradient memory about ``1/world``.

            A dict from parameter-group name (``param_groups`` of
            [`shard()`][gradaccum.shard]) to policy chooses per group
            ([costs](../sharded.md#the-two-policies)).
        gather: When the accumulated function is called with the
            [`Sharded`][gradaccum.sharding.Sharded] itself as its params: ``"window"`` (default)
            all-gathers the full params once per window and keeps them for all micro-batches;
            ``"micro_batch"`` all-gathers them before each micro-batch and drops them after its
            backward ([costs](../sharded.md#gathering-per-window-or-per-micro-batch)). Params passed
            already gathered are used as they are.
        check: As in [`all_reduce()`][gradaccum.all_reduce]; the fingerprint also covers the
            policies, ``gather`` and, where it sets the number of collectives (an ``every``
            group or ``gather="micro_batch"``), ``n``.
        timeout: As in [`all_reduce()`][gradaccum.all_reduce], for each collective of the sync.
        overlap: With [`grad()`][gradaccum.grad] step functions and only ``boundary`` groups,
            reduce-scatter each bucket during the last backward as soon as it is complete.
        reduce_dtype: The dtype the gradients travel in (the wire dtype), e.g.
            ``torch.bfloat16``: half of float32's bytes per reduce-scatter, each sum rounded to
            it once (per micro-batch with ``"every"``, per window with ``"boundary"``), while
            the running sums and the shards stay in the accumulation dtype. ``None`` (default):
            the accumulation dtype, exact; for an FSDP2 model, the dtype of its units'
            ``MixedPrecisionPolicy`` (``reduce_dtype``, or ``param_dtype`` when that is None,
            as FSDP2 reduces). Sharded hybrid, the replicas' all-reduce of the shards travels
            in it too ([the wire dtype](../sharded.md#the-wire-dtype)).

    Returns:
        A [`ReduceScatter`][gradaccum.sharding.ReduceScatter].

    Raises:
        TypeError: ``sharded`` is not a Sharded, an option has the wrong kind, or
            ``reduce_dtype`` is neither ``None`` nor a ``torch.dtype``.
        ValueError: A policy or gather name is unknown, the policy dict does not name every
            parameter group, or ``reduce_dtype`` is a dtype that is not floating.

    Examples:
        >>> import torch, torch.distributed as dist, gradaccum
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> sharded = gradaccum.shard({"w": torch.ones(3), "b": torch.zeros(2)})
        >>> def loss_fn(params, x):
        ...     return (x @ params["w"] + params["b"].sum()).sum()
        >>> sync = gradaccum.reduce_scatter(sharded, policy="every")
        >>> step = gradaccum.accumulate(gradaccum.grad(loss_fn), 2, reduction="sum", sync=sync)
        >>> with gradaccum.sync.record_collectives() as log:
        ...     grads = step(sharded, torch.ones(4, 3))  # gathers the params, then 2 micro-batches
        >>> grads  # this rank's gradient shard: w's gradient, then b's
        (tensor([4., 4., 4., 4., 4.]),)
        >>> [(c.kind, c.purpose) for c in log]  # doctest: +NORMALIZE_WHITESPACE
        [('all_reduce', 'fingerprint'), ('all_gather', 'params'),
         ('reduce_scatter', 'gradients (every)'), ('reduce_scatter', 'gradients (every)'),
         ('all_reduce', 'weight')]
        >>> sharded.write_grads(grads)
        >>> dist.destroy_process_group()

    Every rank runs [the same collectives](../sharded.md#the-collective-sequence) in every window: a
    rank with fewer micro-batches than ``n``, or one that failed, completes its ``n`` micro-steps
    with zeros. With [`MicroBatches`][gradaccum.MicroBatches], no rank may pass more than ``n``.
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
                f"group to one of them), got {policy!r}; pass policy='boundary' (one "
                f"reduce-scatter per window) or policy='every' (one per micro-batch)."
            )
    elif isinstance(policy, Mapping):
        missing = [n for n in names if n not in policy]
        extra = [n for n in policy if n not in names]
        bad = {n: p for n, p in policy.items() if p not in POLICIES}
        if missing or extra or bad:
            raise ValueError(
                f"{where}: policy must map each parameter group {names} to 'boundary' or "
                f"'every'; missing {missing}, unknown groups {extra}, unknown policies {bad}; "
                f"pass e.g. policy={ {n: 'boundary' for n in names}!r}."
            )
        policy = dict(policy)
    else:
        raise TypeError(
            f"{where}: policy must be 'boundary', 'every' or a dict from parameter group to "
            f"one of them, got {describe(policy)}; pass e.g. policy='boundary'."
        )
    if gather not in ("window", "micro_batch"):
        raise ValueError(
            f"{where}: gather must be 'window' or 'micro_batch', got {describe(gather)}; pass "
            f"gather='window' (once per window) or 'micro_batch' (before each micro-batch)."
        )
    check_options(where, check, timeout, overlap)
    check_reduce_dtype(
        where,
        reduce_dtype,
        "each bucket in its accumulation dtype, exact; for an FSDP2 model, the reduce_dtype of "
        "its MixedPrecisionPolicy",
    )
    return ReduceScatter(
        sharded,
        policy,
        gather,
        check,
        None if timeout is None else float(timeout),
        overlap,
        reduce_dtype,
    )
