"""Custom boundary reductions: the user's function decides how gradients cross the group.

At the boundary gradaccum first sums the window's weight and failure flag over the group (one
32-byte ``all_reduce``, which also checks that the ranks agree on the gradient tree), so that
every rank knows the global rows or counts and whether another
rank failed. Then it divides this rank's running sums by the global weight, which makes them
this rank's *share*: the shares of all ranks add up to the exact window gradient. The reduction
function gets the shares, the process group and its state, and returns the (exact or estimated)
sum over the group and its new state.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import _comm, _reduce, _tree
from ._buckets import make_plan
from ._errors import GradAccumError, describe
from ._record import record
from ._sync import AllReduce

__all__ = ["CustomReduce", "custom_reduce"]

ReduceFn = Callable[[Any, Any, Any], tuple[Any, Any]]
InitFn = Callable[[Any], Any]


@dataclass(frozen=True, eq=False)
class CustomReduce:
    """A boundary reduction of the user's (or a built-in one), with its state between windows.

    Make one with [`custom_reduce()`][gradaccum.custom_reduce] (or a built-in such as
    [`compressed_all_reduce()`][gradaccum.compression.compressed_all_reduce]) and pass it as ``sync=``.

    Attributes:
        fn: The reduction: ``fn(grads, state, group) -> (summed_grads, new_state)``.
        init: ``init(grads) -> state``, called at the first window with zeros shaped like the
            gradient; ``None``: the state is ``None``.
        group: The process group (``None``: the default group).
        timeout: Seconds to wait for the weight all-reduce; ``None``: the group's timeout.
        name: How the reduction calls itself in messages and reprs.

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
    _last: list[Any] = field(default_factory=list, init=False, repr=False, compare=False)
    _hashes: dict[Any, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def state(self) -> Any:
        """The state after the last window of [`accumulate()`][gradaccum.accumulate].

        [`Accumulator`][gradaccum.Accumulator] keeps it in its own state instead
        (``AccumState.reduce_state``). Save it with your checkpoint and restore it with
        [`load_state()`][gradaccum.sync.CustomReduce.load_state].
        """
        return self._state[0]

    def load_state(self, state: Any) -> None:
        """Restore the state that [`state`][gradaccum.sync.CustomReduce.state] returned (resume)."""
        self._state[0] = state

    def _group(self, where: str) -> tuple[Any, int, int]:
        return AllReduce(self.group, timeout=self.timeout)._group(where, f"sync={self.name}")

    def _sum_weight(
        self,
        where: str,
        lay: Any,
        reduction: str,
        group: Any,
        rank: int,
        weight: Any,
        failed: bool,
    ) -> tuple[float, float, bool]:
        """All-reduce ``[weight, failed, h, h**2]`` (float64, 32 bytes).

        Returns the global weight, the number of failed ranks, and whether every rank has the
        same 20-bit hash ``h`` of its gradient tree, reduction and reduction function: the sums
        of ``h`` and ``h**2`` are exact in float64, and ``world * sum(h**2) == sum(h)**2`` only
        when all the ``h`` are equal.
        """
        device = lay.devices[0] if lay is not None and lay.devices else torch.device("cpu")
        tail = torch.zeros(4, dtype=torch.float64, device=device)
        if isinstance(weight, torch.Tensor):
            tail[:1].copy_(weight.reshape(1))
        else:
            tail[0] = weight
        tail[1] = 1.0 if failed else 0.0
        h = self._hash(lay, reduction) if lay is not None else 0
        tail[2], tail[3] = float(h), float(h * h)
        record("all_reduce", group, torch.float64, 4, "weight")
        try:
            work = _comm.all_reduce(tail, group, self.timeout)
            _comm.wait(work, self.timeout)
        except RuntimeError as err:
            comm = AllReduce(self.group, timeout=self.timeout)
            raise comm._broken(where, "the weight all_reduce", rank, err) from err
        total, n_failed, sum_h, sum_h2 = tail.tolist()
        world = dist.get_world_size(group)
        return total, n_failed, world * sum_h2 == sum_h * sum_h

    def _hash(self, lay: Any, reduction: str) -> int:
        """A 20-bit hash of the gradient tree, reduction and function (cached per layout)."""
        h = self._hashes.get((lay, reduction))
        if h is None:
            desc = (*make_plan(lay, 1).description, f"reduction={reduction!r}", self.name)
            digest = hashlib.blake2b("\n".join(desc).encode(), digest_size=8).digest()
            h = self._hashes[(lay, reduction)] = int.from_bytes(digest, "little") % 2**20 + 1
        return h

    def _finish(
        self,
        where: str,
        reduction: str,
        lay: Any | None,
        sums: list[torch.Tensor] | None,
        weight: Any,
        reduce_state: Any,
        failed: bool,
    ) -> tuple[list[torch.Tensor], Any]:
        """The boundary: sum the weight, take this rank's share, apply ``fn``, check its output."""
        if lay is None:  # a rank that failed before its window had a layout
            lay = self._last[0] if self._last else None
        else:
            self._last[:] = [lay]
        if self.group is None and not (dist.is_available() and dist.is_initialized()):
            group: Any = None  # one process: nobody to talk to
            rank, world = 0, 1
            total, n_failed, agree = float(weight), 0.0, True
        else:
            group, rank, world = self._group(where)
            total, n_failed, agree = self._sum_weight(
                where, lay, reduction, group, rank, weight, failed
            )
        if failed or lay is None:
            return [], reduce_state
        if n_failed:
            raise GradAccumError(
                f"{where}: {int(n_failed)} other rank(s) of the {world} in the group raised an "
                f"error during this window (rank {rank} did not); no gradient is returned on any "
                f"rank. The cause is in the failing rank's traceback."
            )
        if not agree:
            raise GradAccumError(
                f"{where}: the ranks disagree on the gradients to reduce with {self.name} (their "
                f"params' key paths, shapes or dtypes, the reduction, or the reduction function "
                f"differ); nothing was reduced. Every rank must pass params of the same tree and "
                f"the same reduction; gradaccum.all_reduce() names the difference."
            )
        if reduction != "sum" and total <= 0:
            raise ValueError(
                f"{where}: the window's {'counts' if reduction == 'count' else 'rows'} add up to "
                f"{total:g} over all {world} ranks, so there is no mean to divide by; skip "
                f"windows with no items on any rank (e.g. all padding), or use reduction='sum'."
            )
        if sums is None:  # an empty window: a zero share
            sums = [
                torch.zeros(s, dtype=d, device=v)
                for s, d, v in zip(lay.shapes, lay.accum_dtypes, lay.devices)
            ]
        with torch.no_grad():
            _reduce.normalise(reduction, sums, total)  # type: ignore[arg-type]
        shares = _tree.unflatten(lay.spec, sums)
        if reduce_state is None and self.init is not None:
            reduce_state = self.init(_tree.map_(torch.zeros_like, shares))
        with torch.no_grad():
            out = self.fn(shares, reduce_state, group)
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(
                f"{where}: the reduction {self.name} must return (grads, state), got "
                f"{describe(out)}; return the summed gradients and the new state (None if it "
                f"keeps none)."
            )
        summed, new_state = out
        leaves, spec = _tree.flatten(summed)
        if spec != lay.spec or any(
            not isinstance(g, torch.Tensor) or g.shape != s for g, s in zip(leaves, lay.shapes)
        ):
            raise ValueError(
                f"{where}: the reduction {self.name} must return gradients shaped like the ones "
                f"it was given (the params tree), got {describe(summed)}; return one tensor per "
                f"leaf, of the same shape."
            )
        return leaves, new_state


def custom_reduce(
    fn: ReduceFn,
    *,
    init: InitFn | None = None,
    group: Any = None,
    timeout: float | None = None,
) -> CustomReduce:
    """A boundary reduction written by you: how the window's gradients cross the group.

    Pass the result as ``sync=`` to [`accumulate()`][gradaccum.accumulate] or
    [`Accumulator`][gradaccum.Accumulator]. At the boundary gradaccum sums the window's weight
    (rows or counts), a failure flag and a hash of the gradient tree over the group in one
    32-byte ``all_reduce``, divides
    this rank's running sums by the global weight, and calls

    ``fn(grads, state, group) -> (summed_grads, new_state)``

    where ``grads`` is this rank's *share*: a pytree shaped like the params, in the accumulation
    dtype, such that the sum of the shares of all ranks is exactly the window's gradient (under
    ``reduction="sum"``, the shares are the plain sums). ``fn`` returns its sum over ``group``
    (exact, like ``dist.all_reduce``, or an estimate, like a compressed one) and its state for
    the next window. ``fn`` may communicate as it likes on ``group``; every rank calls it once
    per window, also a rank whose window was empty (its share is zero). When a rank failed
    during the window, no rank calls ``fn``: every rank raises instead. In one process without
    torch.distributed (and ``group=None``), nothing is communicated and ``fn`` gets
    ``group=None``: a world of one, where the share is the whole gradient.

    Args:
        fn: The reduction, ``(grads, state, group) -> (summed_grads, new_state)``. It runs under
            ``torch.no_grad()`` and may modify ``grads`` in place.
        init: ``init(grads) -> state``: the state before the first window, built from zeros
            shaped like the gradient (e.g. error-feedback buffers). ``None``: the state starts
            as ``None``.
        group: The process group; ``None`` for the default group.
        timeout: Seconds to wait for the weight all-reduce before raising
            [`GradAccumError`][gradaccum.GradAccumError]; ``None`` uses the group's timeout.

    Returns:
        A [`CustomReduce`][gradaccum.sync.CustomReduce]. With [`accumulate()`][gradaccum.accumulate]
        it keeps the state itself ([`state`][gradaccum.sync.CustomReduce.state],
        [`load_state()`][gradaccum.sync.CustomReduce.load_state]); with
        [`Accumulator`][gradaccum.Accumulator] the state travels in
        [`AccumState.reduce_state`][gradaccum.streaming.AccumState] and is checkpointed with it.

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
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 < timeout < math.inf  # refuses NaN and inf too
    ):
        raise ValueError(
            f"{where}: timeout must be None or a positive, finite number of seconds, got "
            f"{describe(timeout)}; pass e.g. timeout=60."
        )
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return CustomReduce(fn, init, group, None if timeout is None else float(timeout), name)
