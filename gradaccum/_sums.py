"""The running sums of a window, shared by `accumulate` and `Accumulator`.

The gradient layout (key paths, shapes, dtypes), the state pytree, each micro-batch's weight, adding
a micro-batch's gradients into the sums, and the boundary (`finalize`, or `abort` after an error),
which is the one place that hands the sums to a sync.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

import torch

from . import _reduce, _tree
from ._custom import CustomReduce
from ._errors import check_not_dtensor, describe, dtype_name, is_broken
from ._scatter import ReduceScatter
from ._sync import AllReduce

__all__ = ["AccumState"]

T = TypeVar("T")

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _Layout:
    """Static description of the gradient tree: structure, key paths, shapes, dtypes, devices."""

    spec: _tree.PyTreeSpec
    paths: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    accum_dtypes: tuple[torch.dtype, ...]
    devices: tuple[torch.device, ...]


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
        window: How many windows were finalized before this one.
        layout: Static description of the gradient tree (structure, shapes, dtypes).
        reduce_state: The state of a [`custom_reduce()`][gradaccum.custom_reduce] sync between
            windows (e.g. error-feedback buffers), ``None`` for other syncs; it is saved by
            [`state_dict()`][gradaccum.Accumulator.state_dict].
        ticket: Internal: marks which state of a window is the current one. The running sums are
            updated in place, so once a state holding sums has been passed to ``add``,
            ``finalize`` or ``abort``, only the state returned may be used; ``add``, ``finalize``
            and ``state_dict`` refuse the consumed one (it would change gradients already
            returned). ``None`` while the window holds no sums: such a state may be reused.

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


def check_n(where: str, n: object) -> int:
    """Validate a number of micro-batches."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(
            f"{where}: n must be a positive int (the number of micro-batches), got "
            f"{describe(n)}; pass e.g. n=4."
        )
    if n < 1:
        raise ValueError(
            f"{where}: n must be a positive int (the number of micro-batches), got {n}; pass "
            f"n >= 1 (n=1 computes the whole batch in one micro-batch)."
        )
    return n


def check_state(where: str, state: object) -> None:
    """Validate that ``state`` is an [`AccumState`][gradaccum.streaming.AccumState]."""
    if not isinstance(state, AccumState):
        raise TypeError(
            f"{where}: state must be an AccumState (from Accumulator.init, add or finalize), got "
            f"{describe(state)}; start with state = acc.init(params), then state = "
            f"acc.add(state, grads, ...)."
        )
    if not isinstance(state.layout, _Layout):
        raise TypeError(
            f"{where}: state is an AccumState whose layout is {describe(state.layout)}, not one "
            f"that Accumulator.init made; build states only with acc.init(params) and pass on "
            f"the states that add and finalize return (replace other fields with "
            f"state._replace(...), never the layout)."
        )


def check_accum_dtype(where: str, dtype: object) -> None:
    """Validate ``accum_dtype``."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(
            f"{where}: accum_dtype must be None or a floating torch.dtype, got {describe(dtype)}; "
            f"pass e.g. accum_dtype=torch.float32."
        )


def check_sync(where: str, sync: object) -> None:
    """Validate ``sync=``."""
    if sync is not None and not isinstance(sync, (AllReduce, ReduceScatter, CustomReduce)):
        raise TypeError(
            f"{where}: sync must be None, gradaccum.all_reduce(...), "
            f"gradaccum.reduce_scatter(sharded) or a custom reduction, got {describe(sync)}; "
            f"pass sync=gradaccum.all_reduce() to synchronise over the default process group."
        )


def make_layout(where: str, params: Any, accum_dtype: torch.dtype | None) -> _Layout:
    """Describe the gradient tree from ``params``, validating that its leaves are float tensors."""
    paths, leaves, spec = _tree.flatten_with_paths(params)
    for path, leaf in zip(paths, leaves):
        check_not_dtensor(where, f"params leaf {path}", leaf)
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{where}: params leaf {path} is {describe(leaf)}; every params leaf must be a "
                f"floating tensor. Move non-tensor values out of the params pytree."
            )
        if not leaf.is_floating_point():
            raise TypeError(
                f"{where}: params leaf {path} has dtype {dtype_name(leaf.dtype)}; gradients exist "
                f"only for floating tensors. Move it out of the params pytree (into buffers, or "
                f"another argument of step_fn)."
            )
    dtypes = tuple(x.dtype for x in leaves)
    return _Layout(
        spec=spec,
        paths=tuple(paths),
        shapes=tuple(x.shape for x in leaves),
        dtypes=dtypes,
        accum_dtypes=_accum_dtypes(dtypes, accum_dtype),
        devices=tuple(x.device for x in leaves),
    )


def _accum_dtypes(
    dtypes: tuple[torch.dtype, ...], accum_dtype: torch.dtype | None
) -> tuple[torch.dtype, ...]:
    if accum_dtype is not None:
        return tuple(accum_dtype for _ in dtypes)
    return tuple(torch.float32 if d in _LOW_PRECISION else d for d in dtypes)


def with_accum(lay: _Layout, accum_dtype: torch.dtype | None) -> _Layout:
    """``lay`` with the accumulation dtypes that ``accum_dtype`` gives."""
    return dataclasses.replace(lay, accum_dtypes=_accum_dtypes(lay.dtypes, accum_dtype))


def micro_weight(
    where: str,
    reduction: _reduce.Reduction,
    size: int | None,
    count: int | float | torch.Tensor | None,
) -> tuple[int, _reduce.Weight]:
    """``(alpha, weight)`` of one micro-batch: its gradient is scaled by alpha, adds weight."""
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        error = ValueError if isinstance(size, int) and not isinstance(size, bool) else TypeError
        raise error(
            f"{where}: size must be the micro-batch's number of rows, a positive int, got "
            f"{describe(size)}; pass size=len(micro_batch)."
        )
    if count is not None and reduction != "count":
        raise ValueError(
            f"{where}: count= is used only with reduction='count', got reduction={reduction!r}; "
            f"pass size= (the micro-batch's rows), or use Accumulator(n, reduction='count')."
        )
    if reduction == "mean":
        if size is None:
            raise ValueError(
                f"{where}: reduction='mean' needs size=, the micro-batch's number of rows, to "
                f"weight it exactly; pass size=len(micro_batch)."
            )
        return size, size
    if reduction == "count":
        if count is None:
            raise ValueError(
                f"{where}: reduction='count' needs count=, the number of items the micro-batch's "
                f"summed loss covers; pass e.g. count=(labels != pad_id).sum()."
            )
        return 1, _reduce.check_count(where, count)
    return 1, size if size is not None else 1


def weigh(
    call: str,
    reduction: _reduce.Reduction,
    count: Callable[[Any], Any] | None,
    rows: int,
    aux: Any,
) -> tuple[Any, _reduce.Weight | None, int, _reduce.Weight]:
    """One micro-batch's ``(raw count, checked count, alpha, weight)`` in ``accumulate``."""
    raw = count(aux) if count is not None else None
    items = _reduce.check_count(call, raw) if count is not None else None
    alpha, weight = micro_weight(call, reduction, rows, items)
    return raw, items, alpha, weight


def _check_grads(where: str, lay: _Layout, grads: Any) -> list[torch.Tensor]:
    """Flatten ``grads`` and check it against the layout; the message names the key path."""
    if torch.compiler.is_compiling():
        return _check_traced(where, lay, grads)
    leaves, spec = _tree.flatten(grads)
    if spec == lay.spec:
        # Fast path: one tuple comparison for the shapes, one pass for floating dtypes; the
        # slow path below runs only to name the offending leaf.
        try:
            if tuple(g.shape for g in leaves) == lay.shapes and all(
                g.is_floating_point() for g in leaves
            ):
                return leaves
        except AttributeError:
            pass
    else:
        for path in _tree.none_paths(grads):
            if path in lay.paths:
                shape = tuple(lay.shapes[lay.paths.index(path)])
                raise TypeError(
                    f"{where}: gradient leaf {path} is None, expected a tensor of shape {shape}; "
                    f"step_fn must return a tensor for every params leaf (torch.autograd.grad "
                    f"returns None for an unused parameter: pass materialize_grads=True, or use "
                    f"torch.func.grad)."
                )
        expected = _tree.unflatten(lay.spec, [0] * lay.spec.num_leaves)
        got = _tree.map_(lambda _: 0, grads)
        hint = (
            "; if step_fn returns (grads, aux), pass has_aux=True"
            if isinstance(grads, tuple) and len(grads) == 2
            else ""
        )
        raise ValueError(
            f"{where}: the gradients do not match the params tree "
            f"{_tree.first_difference(expected, got)}; step_fn must return one gradient per "
            f"params leaf, in a tree of the same structure (as torch.func.grad does){hint}."
        )
    for path, g, shape in zip(lay.paths, leaves, lay.shapes):
        if not isinstance(g, torch.Tensor):
            raise TypeError(
                f"{where}: gradient leaf {path} is {describe(g)}, expected a tensor of shape "
                f"{tuple(shape)}; step_fn must return tensors (as torch.func.grad does)."
            )
        if not g.is_floating_point():
            raise TypeError(
                f"{where}: gradient leaf {path} has dtype {dtype_name(g.dtype)}; gradients must "
                f"be real floating tensors (integer and complex gradients are not supported). "
                f"Check that step_fn returns gradients, not inputs or indices."
            )
        if g.shape != shape:
            raise ValueError(
                f"{where}: gradient leaf {path} has shape {tuple(g.shape)} but the params leaf "
                f"has shape {tuple(shape)}; step_fn must return gradients shaped like params "
                f"(per-sample gradients must be reduced inside step_fn)."
            )
    raise AssertionError("unreachable")  # pragma: no cover


# Under torch.compile, Dynamo runs optree's Python polyfill, whose PyTreeSpec cannot be compared
# with (or unflatten like) the layout's optree PyTreeSpec, made by init outside the compiled
# region: the traced check matches key paths instead (folded away at trace time), and a bad tree
# is reported by the eager check, out of the graph (under fullgraph=True, Dynamo's error for the
# graph break carries this reason, where the torch has reason=).
_MISMATCH = (
    "gradaccum: the gradients do not match the params tree (key paths, shapes or floating "
    "dtypes); run the step without fullgraph=True, or eagerly, for the error naming the leaf"
)
try:
    _check_eager = torch.compiler.disable(_check_grads, reason=_MISMATCH)  # type: ignore[no-untyped-call]
except TypeError:  # torch < 2.8: no reason=
    _check_eager = torch.compiler.disable(_check_grads)  # type: ignore[no-untyped-call]


def _check_traced(where: str, lay: _Layout, grads: Any) -> list[torch.Tensor]:
    paths, leaves, _ = _tree.flatten_with_paths(grads)
    if (
        tuple(paths) == lay.paths
        and all(isinstance(g, torch.Tensor) and g.is_floating_point() for g in leaves)
        and tuple(g.shape for g in leaves) == lay.shapes
    ):
        return leaves
    return _check_eager(where, lay, grads)  # type: ignore[no-any-return]


def _spec(lay: _Layout, tree: Any) -> _tree.PyTreeSpec:
    """``lay.spec``; under torch.compile, the (polyfill) structure of ``tree``, checked like it."""
    return _tree.flatten(tree)[1] if torch.compiler.is_compiling() else lay.spec


def add_grads(
    where: str,
    state: AccumState[T],
    grads: T,
    alpha: int,
    weight: _reduce.Weight,
    sync: AllReduce | ReduceScatter | CustomReduce | None = None,
    reduction: str = "mean",
    n: int = 0,
) -> AccumState[T]:
    """Validate, then add ``alpha * grads`` into the running sums (allocated on first use).

    With ``sync``, the running sums are views into the flat buckets the boundary reduces.
    """
    lay: _Layout = state.layout
    leaves = _check_grads(where, lay, grads)
    if isinstance(sync, ReduceScatter):
        # Only Accumulator gets here without a window: its n is part of the fingerprint.
        window: Any = (
            state.sums if state.sums is not None else sync._open(where, lay, reduction, n, True)
        )
        with torch.no_grad():
            window.add(leaves, alpha)
        return state._replace(
            sums=window, weight=state.weight + weight, micro_step=state.micro_step + 1
        )
    with torch.no_grad():
        if state.sums is None:
            out = sync._allocate(lay) if isinstance(sync, AllReduce) else None
            sums = _tree.unflatten(
                _spec(lay, grads), _reduce.first_add(leaves, lay.accum_dtypes, alpha, out)
            )
        else:
            sums = state.sums
            _reduce.add_into(_tree.flatten(sums)[0], leaves, alpha)
    return state._replace(sums=sums, weight=state.weight + weight, micro_step=state.micro_step + 1)


def allocate(lay: _Layout, sync: AllReduce | None) -> list[torch.Tensor]:
    """Zeroed running sums for ``lay``: views into the sync's buckets, or plain tensors."""
    if sync is not None:
        return sync._allocate(lay, zero=True)
    return [
        torch.zeros(shape, dtype=dtype, device=device)
        for shape, dtype, device in zip(lay.shapes, lay.accum_dtypes, lay.devices)
    ]


def finalize(
    where: str,
    reduction: _reduce.Reduction,
    state: AccumState[T],
    sync: AllReduce | ReduceScatter | CustomReduce | None = None,
    failed: bool = False,
    pending: Any = None,
    n: int = 1,
    agree_n: bool = False,
) -> tuple[T, AccumState[T]]:
    """The boundary: reduce over the group (with ``sync``), normalise, cast, start a new window.

    This is the one place where a cross-process collective is issued. ``failed`` joins the
    collective on behalf of a rank whose window raised, so that the others raise too.
    ``agree_n`` puts ``n`` in the window's fingerprint (Accumulator: the ranks must agree on the
    window size, or their windows would pair up micro-batches of different windows).
    ``pending`` is a boundary already opened (some buckets launched during the last backward).
    """
    lay: _Layout = state.layout
    if isinstance(sync, CustomReduce):
        sums = None if state.sums is None else _tree.flatten(state.sums)[0]
        leaves, new = sync._finish(
            where, reduction, lay, sums, state.weight, state.reduce_state, failed
        )
        with torch.no_grad():
            out = [g.to(d) for g, d in zip(leaves, lay.dtypes)]
        nxt = AccumState(None, 0, 0, state.window + 1, lay, new)
        return _tree.unflatten(lay.spec, out) if not failed else None, nxt  # type: ignore[return-value]
    if isinstance(sync, ReduceScatter):
        window: Any = (
            state.sums if state.sums is not None else sync._open(where, lay, reduction, n, agree_n)
        )
        shards, _ = window.finish(where, reduction, state.weight, n, failed)
        return shards, AccumState(None, 0, 0, state.window + 1, lay)
    if sync is not None:
        with torch.no_grad():
            if pending is not None:
                sums = pending.sums
                total = pending.finish(state.weight, failed)
            else:
                if state.sums is None:  # an empty window still joins, with zero weight
                    sums = sync._allocate(lay, zero=True)
                else:
                    sums = _tree.flatten(state.sums)[0]
                total = sync._reduce(
                    where, reduction, lay, sums, state.weight, failed, n if agree_n else None
                )
            _reduce.normalise(reduction, sums, total)
            out = [s.to(d) for s, d in zip(sums, lay.dtypes)]
        return _tree.unflatten(lay.spec, out), AccumState(None, 0, 0, state.window + 1, lay)
    if state.sums is None:
        raise ValueError(
            f"{where}: the window holds no micro-batch, so there is no gradient to return; "
            f"call add() at least once before finalize()."
        )
    if reduction == "count" and not isinstance(state.weight, torch.Tensor) and state.weight <= 0:
        raise ValueError(
            f"{where}: the window's counts add up to {state.weight}, so there is no item mean to "
            f"divide by; skip windows with no items (e.g. all padding), or use reduction='sum'."
        )
    sums = _tree.flatten(state.sums)[0]
    with torch.no_grad():
        _reduce.normalise(reduction, sums, state.weight)
        out = [s.to(d) for s, d in zip(sums, lay.dtypes)]
    grads = _tree.unflatten(_spec(lay, state.sums), out)
    return grads, AccumState(None, 0, 0, state.window + 1, lay)


def abort(
    where: str,
    reduction: _reduce.Reduction,
    state: AccumState[Any] | None,
    sync: AllReduce | ReduceScatter | CustomReduce | None,
    pending: Any = None,
    n: int = 1,
    agree_n: bool = False,
) -> None:
    """Join the window's boundary flagged as failed, so the other ranks raise instead of waiting.

    ``state`` may be None (the failure came before the layout was known): the sync's last layout
    is used, if it has one. Errors while joining are dropped: the caller re-raises its own.
    """
    if sync is None:
        return
    group = sync.sharded.group if isinstance(sync, ReduceScatter) else sync.group
    if is_broken(group):  # a collective already failed: joining would only wait for timeouts
        return
    if state is None and isinstance(sync, CustomReduce):
        try:
            sync._finish(where, reduction, None, None, 0, None, True)
        except Exception:  # noqa: BLE001, S110 - the caller's error is the one to report
            pass
        return
    if state is None:
        if isinstance(sync, ReduceScatter):
            state = AccumState(None, 0, 0, 0, sync.sharded.layout)
        elif not sync._last:
            return
        else:
            state = AccumState(None, 0, 0, 0, sync._last[0])
    try:
        finalize(where, reduction, state, sync, failed=True, pending=pending, n=n, agree_n=agree_n)
    except Exception:  # noqa: BLE001, S110 - the caller's error is the one to report
        pass
