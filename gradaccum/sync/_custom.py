"""Custom boundary reductions: the user's function decides how gradients cross the group.

The boundary protocol (the weight exchange, the shares, ``fn``) is described in
[`custom_reduce()`][gradaccum.custom_reduce].
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import _metrics, _reduce, _tree
from .._core.protocol import Sync, Window, WindowSpec
from .._dist.buckets import make_plan
from .._dist.comm import check_timeout, settle
from .._dist.mesh import axis
from .._errors import GradAccumError, describe, is_broken

__all__ = ["CustomReduce", "custom_reduce"]

ReduceFn = Callable[[Any, Any, Any], tuple[Any, Any]]
InitFn = Callable[[Any], Any]


@dataclass(frozen=True, eq=False)
class CustomReduce(Sync):
    """A boundary reduction of the user's (or a built-in one), with its state between windows.

    Make one with [`custom_reduce()`][gradaccum.custom_reduce] (or a built-in such as
    [`compressed_all_reduce()`][gradaccum.compression.compressed_all_reduce]) and pass it as
    ``sync=``. Its fields are the arguments of [`custom_reduce()`][gradaccum.custom_reduce],
    and ``name``, how the reduction calls itself in messages and reprs.

    Examples:
        >>> import gradaccum
        >>> sync = gradaccum.compression.topk_all_reduce(ratio=0.01)
        >>> sync.name, sync.state  # the state is built at the first window
        ('topk_all_reduce(ratio=0.01)', None)
    """

    fn: ReduceFn
    init: InitFn | None = None
    group: Any = None
    timeout: float | None = None
    name: str = "custom_reduce"
    _state: list[Any] = field(default_factory=lambda: [None], init=False, repr=False)
    _hashes: dict[Any, tuple[int, tuple[str, ...]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def state(self) -> Any:
        """The state after the last window of [`accumulate()`][gradaccum.accumulate].

        [`Accumulator`][gradaccum.Accumulator] keeps it in its own state instead
        ([`AccumState.reduce_state`][gradaccum.streaming.AccumState], checkpointed with it). Save
        it with your checkpoint and restore it with
        [`load_state()`][gradaccum.sync.CustomReduce.load_state].
        """
        return self._state[0]

    def load_state(self, state: Any) -> None:
        """Restore the state that [`state`][gradaccum.sync.CustomReduce.state] returned (resume)."""
        self._state[0] = state

    def open(self, spec: WindowSpec) -> Window:
        """A window of plain running sums, reduced by ``fn`` at the boundary."""
        return CustomWindow(self, spec)

    def _hash(self, spec: WindowSpec) -> tuple[int, tuple[str, ...]]:
        """A 20-bit hash of the window (its index, metrics, tree, reduction, function, n).

        Also the description it hashes, without the lines of the index and metrics.
        """
        metrics = (spec.metrics, spec.metric_shapes)
        key = (spec.layout, spec.reduction, spec.n if spec.agree_n else None, metrics)
        cached = self._hashes.get(key)
        if cached is None:
            desc = (
                *make_plan(spec.layout, 1).description,
                f"reduction={spec.reduction!r}",
                *((f"n={spec.n} micro-batches per window",) if spec.agree_n else ()),
                f"reduction function {self.name}",
            )
            full = (_metrics.line(spec), *desc)
            digest = hashlib.blake2b("\n".join(full).encode(), digest_size=8).digest()
            cached = self._hashes[key] = (int.from_bytes(digest, "little"), desc)
        h, desc = cached
        return (h + spec.index) % 2**20 + 1, desc  # consecutive windows never share a hash


class CustomWindow(Window):
    """A window of a custom reduction: plain sums; the boundary calls the user's ``fn``."""

    def __init__(self, sync: CustomReduce, spec: WindowSpec) -> None:
        super().__init__(spec)
        self.sync = sync

    def finish(self, weight: Any, failed: bool = False) -> Any:
        """Sum the weight (and check the tree) over the group, take the share, apply ``fn``.

        The one collective is an all-reduce of ``[weight, failed, *metrics, h, h**2]`` (float64,
        32 bytes without metrics): every rank has the same 20-bit hash ``h`` of its window index,
        metric names, gradient tree, reduction and function exactly when
        ``world * sum(h**2) == sum(h)**2`` (exact in float64); if not, the ranks compare their
        descriptions to name the difference.
        """
        sync, lay, where, reduction = self.sync, self.layout, self.where, self.spec.reduction
        group, world = None, 1
        if sync.group is None and not (dist.is_available() and dist.is_initialized()):
            if failed:  # one process: nobody to tell; fn and its state stay untouched
                return None
            total, agree = float(weight), True
            self.totals = (total, list(self.metrics))
        else:  # the group is first needed here (not at open: add() runs without it)
            comm = self.connect(sync.group, sync.timeout, what=f"sync={sync.name}")
            group, world = comm.group, comm.world
            h, desc = sync._hash(self.spec)
            dev = lay.devices[0] if lay.devices else torch.device("cpu")
            tail = comm.exchange(dev, weight, failed, (float(h), float(h) * h))
            if failed:
                return None
            if tail[1]:
                comm.settle(tail, reduction)  # raises: another rank failed
            total, agree = tail[0], world * tail[3] == tail[2] * tail[2]
            if not agree:  # every rank is here: name the difference (raises if one is found)
                comm.compare(comm.lines(desc), f"gradients to reduce with {sync.name}")
        if not agree:
            raise GradAccumError(
                f"{where}: the ranks disagree on the gradients to reduce with {sync.name} (their "
                f"params' key paths, shapes or dtypes, the reduction, n, or the reduction "
                f"function differ); nothing was reduced. Every rank must pass params of the "
                f"same tree and the same reduction; gradaccum.all_reduce() names the difference."
            )
        total = settle(where, world, 0, [total, 0.0], reduction)
        sums = self.sums if self.sums is not None else self.storage(zero=True)
        assert sums is not None
        shares = _tree.unflatten(lay.spec, sums)
        state = self.state
        if state is None and sync.init is not None:
            state = sync.init(_tree.map_(torch.zeros_like, shares))
        with torch.no_grad():
            _reduce.normalise(reduction, sums, total)  # type: ignore[arg-type]
            out = sync.fn(shares, state, group)
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(
                f"{where}: the reduction {sync.name} must return (grads, state), got "
                f"{describe(out)}; return the summed gradients and the new state (None if it "
                f"keeps none)."
            )
        summed, self.state = out
        leaves, spec = _tree.flatten(summed)
        if spec != lay.spec or any(
            not isinstance(g, torch.Tensor) or g.shape != s for g, s in zip(leaves, lay.shapes)
        ):
            raise ValueError(
                f"{where}: the reduction {sync.name} must return gradients shaped like the ones "
                f"it was given (the params tree), got {describe(summed)}; return one tensor per "
                f"leaf, of the same shape."
            )
        with torch.no_grad():
            return _tree.unflatten(lay.spec, [g.to(d) for g, d in zip(leaves, lay.dtypes)])

    def abort(self, weight: Any) -> None:
        """Join the boundary flagged as failed, unless a collective of the group failed."""
        if not is_broken(self.sync.group):
            self.finish(weight, failed=True)


def custom_reduce(
    fn: ReduceFn, *, init: InitFn | None = None, group: Any = None, timeout: float | None = None
) -> CustomReduce:
    """A boundary reduction written by you: how the window's gradients cross the group.

    Pass the result as ``sync=`` to [`accumulate()`][gradaccum.accumulate] or
    [`Accumulator`][gradaccum.Accumulator]. At the boundary gradaccum sums the window's weight
    (rows or counts), a failure flag and a hash of the gradient tree and window index over the
    group in one 32-byte ``all_reduce`` (8 bytes more per metric of
    [`Accumulator.add()`][gradaccum.Accumulator.add]), divides this rank's running sums by the
    global weight, and calls

    ``fn(grads, state, group) -> (summed_grads, new_state)``

    where ``grads`` is this rank's *share*: a pytree shaped like the params, in the accumulation
    dtype, such that the sum of the shares of all ranks is exactly the window's gradient
    ([why](../reductions.md#why-shares-and-not-sums)). ``fn`` returns its sum over ``group`` (exact,
    or an estimate, like a compressed one) and its state for the next window; it may communicate on
    ``group``. Every rank calls it once per window, an empty one included; when a rank failed, every
    rank raises instead. Without torch.distributed (and ``group=None``), ``fn`` gets ``group=None``:
    a world of one.

    Args:
        fn: The reduction, ``(grads, state, group) -> (summed_grads, new_state)``. It runs under
            ``torch.no_grad()`` and may modify ``grads`` in place.
        init: ``init(grads) -> state``: the state before the first window, built from zeros
            shaped like the gradient (e.g. error-feedback buffers). ``None``: the state starts
            as ``None``.
        group: The process group, or a 1-D ``DeviceMesh`` (``fn`` gets its group); ``None``
            for the default group.
        timeout: Seconds to wait for the weight all-reduce before raising
            [`GradAccumError`][gradaccum.GradAccumError]; ``None`` uses the group's timeout.

    Returns:
        A [`CustomReduce`][gradaccum.sync.CustomReduce]; its
        [`state`][gradaccum.sync.CustomReduce.state] says where the reduction's state is kept.

    Raises:
        TypeError: ``fn`` or ``init`` is not callable.
        ValueError: ``timeout`` is not a positive, finite number.

    Examples:
        A plain all-reduce that also counts its windows in its state:

        >>> import torch, torch.distributed as dist, gradaccum
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> def summed(grads, windows, group):
        ...     for g in grads.values():
        ...         dist.all_reduce(g, group=group)
        ...     return grads, windows + 1
        >>> sync = gradaccum.custom_reduce(summed, init=lambda grads: 0)
        >>> step = gradaccum.accumulate(lambda p, x: {"w": x.mean(0) * p["w"]}, 2, sync=sync)
        >>> step({"w": torch.ones(2)}, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        {'w': tensor([2., 3.])}
        >>> sync.state
        1
        >>> dist.destroy_process_group()
    """
    where = "custom_reduce(fn, init=..., group=..., timeout=...)"
    if not callable(fn):
        raise TypeError(
            f"{where}: fn must be callable, (grads, state, group) -> (summed_grads, new_state); "
            f"got {describe(fn)}; pass a function, e.g. custom_reduce(my_sum) with "
            f"my_sum(grads, state, group) returning (grads, state)."
        )
    if init is not None and not callable(init):
        raise TypeError(
            f"{where}: init must be None or callable, got {describe(init)}; pass a function "
            f"from zeros shaped like the gradients to the first state, e.g. "
            f"init=lambda grads: 0, or None to start from state None."
        )
    check_timeout(where, timeout)
    axis(where, group)  # a mesh of more than one dim is refused here, not at the boundary
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return CustomReduce(fn, init, group, None if timeout is None else float(timeout), name)
