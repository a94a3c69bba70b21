"""One coupled window up to pass 2: pass 1, the exchange, the loss and its gradient per micro-batch.

Shared by [`coupled()`][gradaccum.coupled] (params as a pytree) and
[`loop.Step`][gradaccum.loop.Step] with a [`loop.Coupled`][gradaccum.loop.Coupled] loss (a
module): each gives the micro-batches' forwards, the loss on the global representations and the
tensors the loss may use directly; ``cache`` returns what pass 2 needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .. import _split, _tree
from .._core.protocol import LOCAL, Sync
from .._errors import GradAccumError, describe
from ..sharding._sharded import Sharded
from ._exchange import Exchange, Leaves, Rows
from ._replay import KeptBuffers, RandomStates, ReplayCheck

__all__ = ["Cached", "Opened", "cache", "name_of", "open_call", "second_pass"]

T = TypeVar("T")


def name_of(fn: Any) -> str:
    """A function's name in a call shape: ``__name__``, or its type's."""
    return getattr(fn, "__name__", None) or type(fn).__name__


@dataclass(frozen=True)
class Opened:
    """The start of one call of ``coupled`` or ``window_stats``.

    Attributes:
        exchange: The call's collectives over the sync's data group; ``None`` in one process.
        micro: The batch split as the inner ``accumulate`` will split it: ``(micro_batch, rows)``.
        failure: The batch did not split on this rank (under a sync): it joins pass 1's
            agreement flagged, so that every rank raises there.
        params: The params pass 1 runs with (a ``Sharded``'s, gathered once).
        device: Where the agreement's numbers go when no micro-batch says (the params').
    """

    exchange: Exchange | None
    micro: list[tuple[Any, int]]
    failure: Exception | None
    params: Any
    device: torch.device


def open_call(call: str, sync: Sync, params: Any, batch: Any, n: int, fn: str) -> Opened:
    """Open one call: its exchange, its micro-batches and its params for pass 1.

    ``fn``: the function pass 1 runs, ``"embed"`` or ``"stats"``, as the messages name it.
    """
    exchange = None
    if sync is not LOCAL:
        exchange = Exchange(call, sync.data_group(), sync.timeout, fn=fn)
    micro: list[tuple[Any, int]] = []
    failure: Exception | None = None
    try:
        micro = _split.split(call, batch, n, short_ok=exchange is not None)
    except Exception as err:  # a bad batch on this rank: joined as failed in pass 1
        if exchange is None:
            raise
        failure = err
    # Gathered whatever happened above: the other ranks gather too (the same collectives).
    full = params.gather(timeout=sync.timeout) if isinstance(params, Sharded) else params
    device = next(
        (t.device for t in _tree.flatten(full)[0] if isinstance(t, torch.Tensor)),
        torch.device("cpu"),
    )
    return Opened(exchange, micro, failure, full, device)


def second_pass(rng: RandomStates, run: Callable[[], T], restore: bool = True) -> T:
    """Pass 2: ``run()`` with pass 1's random states to replay, and module buffers kept.

    With ``restore``, the random state ends as pass 1 left it (``coupled``; ``window_stats``
    leaves it as its loss left it: see ``RandomStates``); after an error, as pass 1 left it
    in both (a retry of the window starts there). ``run``'s errors name the user's
    call already: the inner ``accumulate`` is built with it (``accumulate_as``), and
    ``Step.add`` run by ``add_window`` names ``Step.add_window(batches)``.
    """
    rng.end_of_pass()
    try:
        with KeptBuffers():
            out = run()
    except BaseException:
        rng.restore()
        raise
    if restore:
        rng.restore()
    return out


@dataclass(frozen=True)
class Cached:
    """What pass 2 needs of a window, and the objective.

    Attributes:
        leaves: The representations' leaves (their floating ones are differentiated).
        rows: Where this rank's rows sit in the global window.
        value: The objective: the sum over the ranks of their shares (0-dim, detached).
        share: This rank's share of it.
        slices: Per micro-batch, the gradient of the objective for each floating leaf of its
            representations (summed over every rank's share).
        direct: ``(k, grad)`` for each of the ``targets`` the loss used directly (this rank's
            share only: the sync sums them with the rest).
        replay: Pass 1's floating leaves per micro-batch, to compare pass 2's with.
        failure: The loss's error on this rank, under a sync: raised by ``check`` in pass 2.
    """

    leaves: Leaves
    rows: Rows
    value: torch.Tensor
    share: torch.Tensor
    slices: list[tuple[torch.Tensor, ...]]
    direct: list[tuple[int, torch.Tensor]]
    replay: ReplayCheck
    failure: Exception | None = None

    def check(self) -> None:
        """Pass 2's first micro-batch: raise this rank's loss error, inside the sync's window.

        So that it joins the boundary flagged as failed, and every other rank raises there.
        """
        if self.failure is not None:
            raise self.failure


def cache(
    call: str,
    forwards: list[tuple[Callable[[], Any], int | None]],
    run_loss: Callable[[Any, Rows], Any],
    targets: list[torch.Tensor],
    rng: RandomStates,
    exchange: Exchange | None,
    index: int,
    device: torch.device,
) -> Cached:
    """Pass 1, the exchange, the loss and its gradient: what pass 2 needs.

    ``forwards``: each micro-batch's ``embed`` call, and its rows if known. ``run_loss(reps,
    rows)``: this rank's share; its gradient is taken for the representations and ``targets``.
    A rank without rows (where the exchange allows it: ``loop.Coupled``) holds a share of 0: its
    loss is not run, and it sends zeros for the gradient.

    With a sync every rank takes part in each collective even when it failed: in pass 1 it
    joins the agreement flagged, and every rank raises there; in the loss it sends zeros and
    raises in pass 2 (``Cached.check``), inside the sync's window, whose boundary tells the
    others. The failing rank raises its own error.
    """
    leaves, spec, local, per_rank, sizes = _first(call, forwards, rng, exchange, index, device)
    total = sum(per_rank)
    rank = exchange.rank if exchange is not None else 0
    start = sum(per_rank[:rank])
    rows = Rows(start, start + per_rank[rank], total, tuple(per_rank), rank)
    if exchange is not None:  # the global window's representations, in rank order
        where = _index(per_rank, local[0].device)
        glob = _unpack(leaves, exchange.gather(_pack(leaves, local), per_rank, where), total)
    else:
        glob = local
    if rows.stop > rows.start:
        share, rep_grads, direct, failure = _loss(call, run_loss, targets, leaves, spec, glob, rows)
    else:  # no rows here: a share of 0, without a gradient
        share = torch.zeros((), dtype=_wide(leaves), device=local[0].device)
        rep_grads, direct, failure = [None] * len(leaves.floating), [], None
    flat = _flat_grads(leaves, rep_grads, total, _wide(leaves), local[0].device)
    if exchange is not None:
        flat, value = exchange.scatter(flat, share, per_rank)
        value = value.to(share.dtype)
    else:
        if failure is not None:
            raise failure
        value = share
    slices, at, widths = [], 0, leaves.widths()
    for r in sizes:
        cols, g = 0, []
        for i in leaves.floating:
            g.append(flat[at : at + r, cols : cols + widths[i]].reshape(r, *leaves.shapes[i]))
            cols += widths[i]
        slices.append(tuple(g))
        at += r
    floating = [torch.split(local[i], sizes) for i in leaves.floating]
    replay = ReplayCheck(
        call, [leaves.paths[i] for i in leaves.floating], list(zip(*floating)) if sizes else []
    )
    return Cached(leaves, rows, value, share, slices, direct, replay, failure)


# -- pass 1 --------------------------------------------------------------------------------------


def _first(
    call: str,
    forwards: list[tuple[Callable[[], Any], int | None]],
    rng: RandomStates,
    exchange: Exchange | None,
    index: int,
    device: torch.device,
) -> tuple[Leaves, Any, list[torch.Tensor], list[int], list[int]]:
    """Pass 1: every micro-batch embedded without a graph; the ranks' rows agreed.

    A rank without rows (where the exchange allows it) gets the layout from the others.
    """
    leaves: Leaves | None = None
    spec: Any = None
    parts: list[list[torch.Tensor]] = []
    sizes: list[int] = []
    failure: Exception | None = None
    try:
        with torch.no_grad():
            for j, (forward, r) in enumerate(forwards):
                rng.capture()
                leaves, spec, flat = _check_reps(call, j, forward(), r, leaves, spec)
                parts.append(flat)
                sizes.append(flat[0].shape[0])
        if leaves is not None:
            device = parts[0][leaves.floating[0]].device
    except Exception as err:  # joined as failed below, then re-raised
        failure = err
    rows = sum(sizes) if failure is None else 0
    if exchange is not None:
        per_rank = exchange.agree(rows, failure is not None, leaves, index, device)
        if failure is None and 0 in per_rank:  # (agree raised on every rank if all have none)
            leaves = exchange.layout(leaves, per_rank, device)
    else:
        per_rank = [rows]
    if failure is not None:
        raise failure
    if leaves is None:  # no rows, in one process (with a sync, agree raised on every rank)
        raise GradAccumError(
            f"{call}: the window has no rows; a coupled loss needs at least one row; pass a "
            f"window with at least one micro-batch."
        )
    if not parts:  # this rank has no rows (others have): none of each leaf
        local = [
            torch.empty((0, *shape), dtype=dtype, device=device)
            for dtype, shape in zip(leaves.dtypes, leaves.shapes)
        ]
    else:
        local = [torch.cat([p[i] for p in parts]) for i in range(len(leaves.paths))]
    return leaves, spec, local, per_rank, sizes


def _check_reps(
    call: str, j: int, out: Any, rows: int | None, leaves: Leaves | None, spec: Any
) -> tuple[Leaves, Any, list[torch.Tensor]]:
    """Micro-batch ``j``'s representations, checked (against micro-batch 0's) and detached."""
    paths, flat, tree = _tree.flatten_with_paths(out)
    for p, t in zip(paths, flat):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{call}: embed returned a non-tensor leaf {p} ({describe(t)}) for micro-batch "
                f"{j}; embed must return a pytree of tensors whose dim 0 is the micro-batch's "
                f"rows."
            )
        if rows is None and t.dim() > 0:
            rows = t.shape[0]
        if t.is_complex():  # its gradient would be dropped beside a float leaf: refused
            raise TypeError(
                f"{call}: embed returned a complex leaf {p} ({describe(t)}) for micro-batch {j}; "
                f"representations must be real: return torch.view_as_real(z) (a float leaf "
                f"with a trailing dim of 2) and take torch.view_as_complex(reps) in the loss."
            )
        if t.dim() == 0 or t.shape[0] != rows:
            got = "a 0-dim tensor" if t.dim() == 0 else f"{t.shape[0]} rows"
            raise ValueError(
                f"{call}: embed's output {p} has {got} for micro-batch {j} of {rows} rows; each "
                f"representation must have one row per example (dim 0 = the micro-batch's rows)."
            )
    mine = Leaves(
        tuple(paths), tuple(t.dtype for t in flat), tuple(tuple(t.shape[1:]) for t in flat)
    )
    if leaves is None:
        if not mine.floating:
            raise TypeError(
                f"{call}: embed returned no floating tensor "
                f"({'; '.join(mine.lines()) or 'no leaves'}); return the representations to "
                f"differentiate (e.g. the embeddings) as floating tensors."
            )
        return mine, tree, [t.detach() for t in flat]
    if tree != spec or mine != leaves:
        raise ValueError(
            f"{call}: embed's output for micro-batch {j} differs from micro-batch 0's: "
            f"{'; '.join(mine.lines())} against {'; '.join(leaves.lines())}; return the same "
            f"tree, dtypes and trailing shapes for every micro-batch."
        )
    return leaves, spec, [t.detach() for t in flat]


# -- the exchange's packing ---------------------------------------------------------------------


def _pack(leaves: Leaves, local: list[torch.Tensor]) -> list[torch.Tensor]:
    """The local rows as one ``[rows, width]`` tensor per dtype, leaves in order."""
    widths, out = leaves.widths(), []
    for dtype in dict.fromkeys(leaves.dtypes):
        cols = [
            local[i].reshape(local[i].shape[0], widths[i])
            for i, d in enumerate(leaves.dtypes)
            if d == dtype
        ]
        out.append(torch.cat(cols, dim=1) if len(cols) > 1 else cols[0])
    return out


def _unpack(leaves: Leaves, parts: list[torch.Tensor], total: int) -> list[torch.Tensor]:
    """``_pack``'s inverse, for the gathered rows."""
    widths = leaves.widths()
    out: list[torch.Tensor] = [torch.empty(0)] * len(widths)
    for dtype, part in zip(dict.fromkeys(leaves.dtypes), parts):
        cols = 0
        for i, d in enumerate(leaves.dtypes):
            if d == dtype:
                out[i] = part[:, cols : cols + widths[i]].reshape(total, *leaves.shapes[i])
                cols += widths[i]
    return out


def _index(per_rank: list[int], device: torch.device) -> torch.Tensor:
    """The padded all-gather's rows that are real rows, in rank order."""
    top = max(per_rank)
    ranges = [torch.arange(r * top, r * top + n) for r, n in enumerate(per_rank)]
    return torch.cat(ranges).to(device)


def _wide(leaves: Leaves) -> torch.dtype:
    """The dtype the representations' gradient is summed in: float32 or the widest floating."""
    dtype = torch.float32
    for i in leaves.floating:
        dtype = torch.promote_types(dtype, leaves.dtypes[i])
    return dtype


# -- the loss ------------------------------------------------------------------------------------


def _loss(
    call: str,
    run_loss: Callable[[Any, Rows], Any],
    targets: list[torch.Tensor],
    leaves: Leaves,
    spec: Any,
    glob: list[torch.Tensor],
    rows: Rows,
) -> tuple[
    torch.Tensor, list[torch.Tensor | None], list[tuple[int, torch.Tensor]], Exception | None
]:
    """The loss on the global representations; its gradient for them and for ``targets``."""
    share = torch.zeros((), dtype=_wide(leaves), device=glob[leaves.floating[0]].device)
    try:
        reps = [
            t.detach().requires_grad_() if i in leaves.floating else t for i, t in enumerate(glob)
        ]
        out = run_loss(_tree.unflatten(spec, reps), rows)
        if not isinstance(out, torch.Tensor) or out.numel() != 1 or not out.is_floating_point():
            raise TypeError(
                f"{call}: loss must return this rank's share of the objective as a 0-dim "
                f"floating tensor, got {describe(out)}; reduce it to a scalar (e.g. a sum over "
                f"this rank's rows divided by rows.total)."
            )
        share = out.reshape(())
        wrt = [reps[i] for i in leaves.floating] + targets
        got: tuple[torch.Tensor | None, ...] = (None,) * len(wrt)
        if share.requires_grad:
            got = torch.autograd.grad(share, wrt, allow_unused=True)
        k = len(leaves.floating)
        direct = [(i, g) for i, g in enumerate(got[k:]) if g is not None]
        return share.detach(), list(got[:k]), direct, None
    except Exception as err:  # joined as failed (with a sync), then re-raised
        return share, [None] * len(leaves.floating), [], _in_place(call, err)


_LEAF_IN_PLACE = "leaf Variable that requires grad is being used in an in-place operation"


def _in_place(call: str, err: Exception) -> Exception:
    """``err``, explained when it is torch's refusal of an in-place edit of ``reps``.

    The representations the loss gets are leaves of the graph its gradient is taken on, so an
    in-place operation on them (``reps.mul_(2)``, ``reps[0] = 0``) raises in torch with words
    that name neither the loss nor ``reps``.
    """
    if not isinstance(err, RuntimeError) or _LEAF_IN_PLACE not in str(err):
        return err
    explained = RuntimeError(
        f"{call}: the loss edited reps in place (torch: {str(err).rstrip('.')}); compute on a "
        f"copy: reps = reps.clone(), or with out-of-place ops (z = z / t, not z.div_(t))."
    )
    explained.__cause__ = err
    return explained


def _flat_grads(
    leaves: Leaves,
    grads: list[torch.Tensor | None],
    total: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The representations' gradient as one ``[total, width]`` tensor (zeros where unused)."""
    widths = leaves.widths()
    cols = []
    for i, g in zip(leaves.floating, grads):
        if g is None:
            cols.append(torch.zeros(total, widths[i], dtype=dtype, device=device))
        else:
            cols.append(g.reshape(total, widths[i]).to(dtype))
    return torch.cat(cols, dim=1) if len(cols) > 1 else cols[0]
