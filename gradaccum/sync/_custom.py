"""Custom boundary reductions: the user's function decides how gradients cross the group.

The boundary protocol (the weight exchange, the shares, ``fn``) is described in
[`custom_reduce()`][gradaccum.custom_reduce].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import _tree
from .._checks import check_timeout
from .._core.protocol import Sync, WindowSpec
from .._dist.comm import Comm
from .._dist.mesh import axis
from .._errors import describe

__all__ = ["CustomReduce", "custom_reduce"]

ReduceFn = Callable[[Any, Any, Any], tuple[Any, Any]]
InitFn = Callable[[Any], Any]


@dataclass(frozen=True, eq=False)
class CustomReduce(Sync):
    """A boundary reduction of the user's (or a built-in one), with its state between windows.

    Make one with [`custom_reduce()`][gradaccum.custom_reduce] (or a built-in such as
    [`compressed_all_reduce()`][gradaccum.compression.compressed_all_reduce]) and pass it as
    ``sync=``. Its fields are the arguments of [`custom_reduce()`][gradaccum.custom_reduce],
    and ``name``, how the reduction calls itself in messages and reprs. It is a sync of the
    simple tier: its [`reduce()`][gradaccum.sync.Sync.reduce] calls ``fn``; the base
    class does the boundary's tail, the failure path and the state.

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

    @property
    def state(self) -> Any:
        """The state after the last window of [`accumulate()`][gradaccum.accumulate].

        [`Accumulator`][gradaccum.Accumulator] keeps it in its own state instead
        ([`AccumState.reduce_state`][gradaccum.streaming.AccumState], checkpointed with it). Save
        it with your checkpoint and restore it with
        [`load_state()`][gradaccum.sync.CustomReduce.load_state].
        """
        return self._kept_state

    def load_state(self, state: Any) -> None:
        """Restore the state that [`state`][gradaccum.sync.CustomReduce.state] returned (resume)."""
        Sync.load_state(self, state)

    def describe(self) -> tuple[str, ...]:
        """The fingerprint covers the reduction function's name."""
        return (f"reduction function {self.name}",)

    def reduce(
        self, spec: WindowSpec, shares: list[torch.Tensor], state: Any, comm: Comm | None
    ) -> tuple[list[torch.Tensor], Any]:
        """``fn(shares as a tree, state, group)``: its result checked, flat, and its state."""
        lay, where = spec.layout, spec.where
        tree = _tree.unflatten(lay.spec, shares)
        if state is None and self.init is not None:
            state = self.init(_tree.map_(torch.zeros_like, tree))
        out = self.fn(tree, state, comm.group if comm is not None else None)
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(
                f"{where}: the reduction {self.name} must return (grads, state), got "
                f"{describe(out)}; return the summed gradients and the new state (None if it "
                f"keeps none)."
            )
        summed, state = out
        leaves, tree_spec = _tree.flatten(summed)
        if tree_spec != lay.spec or any(
            not isinstance(g, torch.Tensor) or g.shape != s for g, s in zip(leaves, lay.shapes)
        ):
            raise ValueError(
                f"{where}: the reduction {self.name} must return gradients shaped like the ones "
                f"it was given (the params tree), got {describe(summed)}; return one tensor per "
                f"leaf, of the same shape."
            )
        return leaves, state


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
