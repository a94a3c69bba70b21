"""The state of a streaming window, a pytree, and the rule that a consumed state is not reused."""

from __future__ import annotations

from typing import Any, Generic, NamedTuple, TypeVar

import torch

from .._errors import describe
from .._layout import Layout

__all__ = ["AccumState", "check_live", "check_state", "pass_on"]

T = TypeVar("T")


class AccumState(NamedTuple, Generic[T]):
    """The state of a streaming accumulation window, a pytree.

    See [`Accumulator`][gradaccum.Accumulator], whose methods take and return it.

    Attributes:
        sums: The running weighted sums of the window's gradients, one tensor per gradient leaf
            in the accumulation dtype, or ``None`` before the window's first micro-batch. Under
            a [`reduce_scatter()`][gradaccum.reduce_scatter] sync, an object holding the full
            sums (``boundary``) and the shard accumulators (``every``); checkpoint it with
            [`state_dict()`][gradaccum.Accumulator.state_dict].
        weight: The total weight added in this window: rows (``mean``, ``sum``) or counts
            (``count``); a number, or a 0-dim tensor when counts are tensors.
        micro_step: How many micro-batches this window holds so far.
        window: How many windows were finalized (or aborted) before this one: the window's
            index, which a sync checks to be the same on every rank.
        layout: Static description of the gradient tree (structure, shapes, dtypes).
        reduce_state: The state of a [`custom_reduce()`][gradaccum.custom_reduce] sync between
            windows (e.g. error-feedback buffers), ``None`` for other syncs; it is saved by
            [`state_dict()`][gradaccum.Accumulator.state_dict].
        ticket: Internal: marks which state of a window is the current one, so that a consumed
            state is refused (see [`Accumulator`][gradaccum.Accumulator]); ``None`` without sums.
        metrics: The window's running metric sums (``add(..., metrics=...)``): a dict, sorted by
            name, of 0-dim (or 1-D) float64 tensors on the gradients' device; ``None`` without
            metrics.
            Before a window's first micro-batch, zeros with the previous window's names (what
            an empty window sends).
        epoch: How many epochs were ended with [`end_epoch()`][gradaccum.Accumulator.end_epoch];
            a sync checks it with ``window``, so ranks whose epochs hold different numbers of
            windows raise instead of combining windows of different epochs.

    Examples:
        >>> import torch, gradaccum
        >>> acc = gradaccum.Accumulator(n=4, reduction="sum")
        >>> state = acc.add(acc.init({"w": torch.zeros(2)}), {"w": torch.ones(2)})
        >>> state.sums, state.weight, state.micro_step, state.window
        ({'w': tensor([1., 1.])}, 1, 1, 0)
    """

    sums: T | None
    weight: int | float | torch.Tensor
    micro_step: int
    window: int
    layout: Any
    reduce_state: Any = None
    ticket: Any = None
    metrics: Any = None
    epoch: int = 0


def check_live(where: str, state: AccumState[Any]) -> None:
    """Refuse a state holding running sums that was already passed to add, finalize or abort."""
    ticket = state.ticket
    if state.sums is None or ticket is None or ticket[0] == state.micro_step:
        return
    _consumed(where, state)


@torch.compiler.disable  # type: ignore[untyped-decorator]  # the message formats symbolic ints
def _consumed(where: str, state: AccumState[Any]) -> None:
    ticket = state.ticket
    by = ticket[1] if ticket[0] < 0 else "add()"
    raise ValueError(
        f"{where}: state was consumed: it was already passed to {by} (at micro-step "
        f"{state.micro_step} of window {state.window}), which updated its running sums in place "
        f"and returned a new state. Using it again would change gradients already returned; "
        f"use the state that {by} returned (state = acc.add(state, ...); grads, state = "
        f"acc.finalize(state))."
    )


def pass_on(old: AccumState[Any], new: AccumState[Any], by: str) -> AccumState[Any]:
    """Mark ``old`` consumed by ``by``; give ``new`` the window's ticket if it holds sums."""
    if old.sums is not None and old.ticket is not None:
        old.ticket[:] = [-1, by]  # consumed; a state of the window made later gets a new ticket
    if new.sums is None:
        return new
    ticket = old.ticket if old.sums is not None and old.ticket is not None else [0, None]
    ticket[:] = [new.micro_step, None]
    return new._replace(ticket=ticket)


def check_state(where: str, state: object) -> None:
    """Validate that ``state`` is an [`AccumState`][gradaccum.streaming.AccumState]."""
    if not isinstance(state, AccumState):
        raise TypeError(
            f"{where}: state must be an AccumState (from Accumulator.init, add or finalize), got "
            f"{describe(state)}; start with state = acc.init(params), then state = "
            f"acc.add(state, grads, ...)."
        )
    if not isinstance(state.layout, Layout):
        raise TypeError(
            f"{where}: state is an AccumState whose layout is {describe(state.layout)}, not one "
            f"that Accumulator.init made; build states only with acc.init(params) and pass on "
            f"the states that add and finalize return (replace other fields with "
            f"state._replace(...), never the layout)."
        )
