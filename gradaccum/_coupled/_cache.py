"""``coupled``: exact accumulation for a loss that ties a window's examples together (GradCache).

Pass 1 embeds every micro-batch without a graph and keeps its representations (and the random
state it started with). The representations are gathered over the ranks (``_exchange``), the loss
runs once on all of them, and its gradient for each representation is summed back to the rank
that owns it. Pass 2 runs each micro-batch again, with a graph and the same random numbers, and
back-propagates its slice of that gradient: it is one
[`accumulate()`][gradaccum.accumulate] of the surrogate ``sum(reps * grad_reps)`` under the
``sum`` reduction, so the sync's fast path, its single boundary and its failure handling are
those of any accumulated step. The loss's own parameters (a learned temperature) get their
gradient through the same window, with the first micro-batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .. import _split, _tree
from .._autograd import check_no_transform, grad
from .._core.accumulate import accumulate
from .._core.protocol import LOCAL, Sync, check_sync
from .._errors import GradAccumError, describe
from .._layout import check_n
from ..sharding._sharded import Sharded
from ._exchange import Exchange, Leaves, Rows
from ._replay import KeptBuffers, RandomStates

__all__ = ["coupled"]


class _Pass2:
    """What the surrogate loss of one call's pass 2 reads: set per call, read per micro-batch."""

    def __init__(self, embed: Callable[..., Any]) -> None:
        self.embed = embed
        self.rng = RandomStates()
        self.floating: tuple[int, ...] = ()
        self.direct: list[tuple[int, torch.Tensor]] = []
        self.next = 0

    def surrogate(self, params: Any, item: Any) -> torch.Tensor:
        """``sum(reps * grad_reps)`` for one micro-batch: its backward is the wanted VJP."""
        batch, grads = item
        j, self.next = self.next, self.next + 1
        self.rng.replay(j)
        leaves = _tree.flatten(self.embed(params, batch))[0]
        total = sum((leaves[i] * g).sum() for i, g in zip(self.floating, grads))
        if j == 0 and self.direct:  # the loss's own use of the params, added once
            flat = _tree.flatten(params)[0]
            total = total + sum((flat[i] * d).sum() for i, d in self.direct)
        return total  # type: ignore[no-any-return]


def coupled(
    embed: Callable[[Any, Any], Any],
    loss: Callable[[Any, Any, Rows], torch.Tensor],
    n: int,
    *,
    sync: Sync | None = None,
) -> Callable[[Any, Any], tuple[Any, torch.Tensor]]:
    """The exact gradient of a loss that couples a window's examples, over ``n`` micro-batches.

    Plain accumulation is exact only for a loss that is a sum over examples. A contrastive loss
    with in-batch negatives (InfoNCE, CLIP, multiple-negatives ranking) compares every example
    with every other one of the batch, so under accumulation each micro-batch sees only its own
    negatives and the objective changes without a word. ``coupled`` runs such a loss on the whole
    global window, exactly, with the memory of one micro-batch plus the window's representations
    (GradCache, Gao et al. 2021):

    1. each micro-batch is embedded without a graph: ``reps = embed(params, micro_batch)``;
    2. with a sync, every rank's representations are gathered (uneven rows allowed);
    3. ``loss(params, all_reps, rows)`` runs once, and its gradient for each representation is
       summed over the ranks back to the rank that owns it (the cross-rank terms included);
    4. each micro-batch is embedded again, with a graph and the random numbers of step 1
       (dropout masks replayed), and back-propagates its slice of that gradient into the
       window's running sums; the sync reduces them once, at the boundary.

    It costs about one more forward per micro-batch. Module buffers that the second forward
    changes (BatchNorm's running statistics) are put back as the first one left them, and the
    random state ends as after one forward per micro-batch. See the page "Coupled losses"
    (docs/coupled.md).

    Args:
        embed: ``embed(params, micro_batch) -> reps``: a pytree of tensors whose dim 0 is the
            micro-batch's rows. Floating leaves are differentiated; other leaves (labels, ids)
            are gathered and passed to ``loss`` as they are. Several towers: return a dict,
            e.g. ``{"image": ..., "text": ...}``.
        loss: ``loss(params, reps, rows) -> share``: ``reps`` is ``embed``'s tree with the rows
            of the global window (every rank's, in rank order, each rank's micro-batches in
            order); ``rows`` ([`Rows`][gradaccum.Rows]) says which are this rank's. It returns
            this rank's share of the objective, a 0-dim tensor: the objective is the sum of the
            ranks' shares. For a mean over the global rows, compute the loss of this rank's rows
            (``rows.local``) against all of them and divide by ``rows.total``; in one process
            the share is the whole loss. It may use ``params`` directly (a learned temperature).
        n: The number of micro-batches to split each rank's batch into (the first ones get one
            row more when ``n`` does not divide it); a [`MicroBatches`][gradaccum.MicroBatches]
            is used as given.
        sync: ``None`` (one process), [`all_reduce()`][gradaccum.all_reduce],
            [`reduce_scatter()`][gradaccum.reduce_scatter] (the params are then a
            [`Sharded`][gradaccum.sharding.Sharded], gathered once for pass 1 and as the sync
            gathers for pass 2) or a [`custom_reduce()`][gradaccum.custom_reduce]. The
            representations go over the sync's group (a process group or 1-D mesh).

    Returns:
        A function ``(params, batch) -> (grads, loss)``: the gradient of the objective over the
        global window (with a ``reduce_scatter`` sync, this rank's shards) and the objective
        (the sum of the ranks' shares, the same on every rank), a 0-dim tensor.

    Raises:
        TypeError: ``embed`` or ``loss`` is not callable; (when called) ``embed`` returned a
            non-tensor leaf or no floating leaf, or ``loss`` did not return a 0-dim floating
            tensor.
        ValueError: ``n < 1``; (when called) a representation whose dim 0 is not the
            micro-batch's rows, or micro-batches whose representations differ in tree, dtype or
            shape.
        GradAccumError: With a sync: another rank failed, the ranks disagree on the
            representations' layout or on the window, or a collective failed.

    Examples:
        >>> import torch, gradaccum
        >>> def embed(p, x):
        ...     return torch.nn.functional.normalize(x @ p["w"], dim=-1)
        >>> def info_nce(p, z, rows):  # rows 2i and 2i+1 are a positive pair
        ...     sim = z[rows.local] @ z.T / 0.1
        ...     sim = sim - 1e9 * torch.eye(len(z), dtype=z.dtype)[rows.local]  # no self-match
        ...     target = rows.arange() ^ 1
        ...     return torch.nn.functional.cross_entropy(sim, target, reduction="sum") / rows.total
        >>> torch.manual_seed(0)
        >>> p = {"w": torch.randn(8, 4, dtype=torch.float64)}
        >>> x = torch.randn(16, 8, dtype=torch.float64)
        >>> grads, value = gradaccum.coupled(embed, info_nce, n=4)(p, x)
        >>> everything = gradaccum.Rows(start=0, stop=16, total=16, per_rank=(16,))
        >>> whole = torch.func.grad(lambda p: info_nce(p, embed(p, x), everything))(p)
        >>> torch.allclose(grads["w"], whole["w"], rtol=1e-12, atol=1e-14)
        True
    """
    for arg, fn, shape in (
        ("embed", embed, "embed(params, micro_batch) -> reps"),
        ("loss", loss, "loss(params, reps, rows) -> share"),
    ):
        if not callable(fn):
            raise TypeError(
                f"coupled(embed, loss, n): {arg} must be a function {shape}, got {describe(fn)}."
            )
    where = f"coupled({_name(embed)}, {_name(loss)}, n={n!r})"
    check_n(where, n)
    check_sync(where, sync)
    kind = sync if sync is not None else LOCAL
    ctx = _Pass2(embed)
    inner = accumulate(grad(ctx.surrogate), n, reduction="sum", sync=sync)
    opened = [0]

    def step(params: Any, batch: Any) -> tuple[Any, torch.Tensor]:
        call = f"{where}(params, batch)"
        check_no_transform(call)
        index, opened[0] = opened[0], opened[0] + 1
        exchange = None
        if kind is not LOCAL:
            exchange = Exchange(call, kind.data_group(), kind.timeout)
        micro = _split.split(call, batch, n, short_ok=exchange is not None)
        full = params.gather(timeout=kind.timeout) if isinstance(params, Sharded) else params
        rng = RandomStates()
        first = _first(call, micro, full, embed, rng, exchange, index)
        leaves, spec, local, per_rank = first
        total = sum(per_rank)
        mine = per_rank[exchange.rank] if exchange is not None else total
        start = sum(per_rank[: exchange.rank]) if exchange is not None else 0
        rows = Rows(start, start + mine, total, tuple(per_rank), exchange.rank if exchange else 0)
        # The global window's representations, in rank order.
        if exchange is not None:
            glob = _unpack(
                leaves,
                exchange.gather(_pack(leaves, local), per_rank, _index(per_rank, local[0].device)),
                total,
            )
        else:
            glob = local
        share, rep_grads, direct, failure = _loss(call, loss, full, leaves, spec, glob, rows)
        wide = _wide(leaves)
        flat = _flat_grads(leaves, rep_grads, total, wide, local[0].device)
        if exchange is not None:
            flat, value, failed = exchange.scatter(flat, share, failure is not None, per_rank)
            if failure is not None:
                raise failure
            if failed:
                raise GradAccumError(
                    f"{call}: another rank failed in the loss (after the representations were "
                    f"gathered); this rank ({exchange.rank}) stops too. The failing rank raised "
                    f"the cause."
                )
            value = value.to(share.dtype)
        else:
            if failure is not None:
                raise failure
            value = share.detach()
        # Pass 2: each micro-batch again, with its slice of the representations' gradient.
        items, at = [], 0
        widths = leaves.widths()
        for mb, r in micro:
            cols, g = 0, []
            for i in leaves.floating:
                w = widths[i]
                g.append(flat[at : at + r, cols : cols + w].reshape(r, *leaves.shapes[i]))
                cols += w
            items.append((mb, tuple(g)))
            at += r
        ctx.rng, ctx.floating, ctx.direct, ctx.next = rng, leaves.floating, direct, 0
        rng.end_of_pass()
        try:
            with KeptBuffers():
                grads = inner(params, _split.MicroBatches(items))
        finally:
            rng.restore()
            ctx.direct = []
        return grads, value

    return functools.wraps(embed)(step) if not torch.compiler.is_compiling() else step


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _first(
    call: str,
    micro: list[tuple[Any, int]],
    params: Any,
    embed: Callable[..., Any],
    rng: RandomStates,
    exchange: Exchange | None,
    index: int,
) -> tuple[Leaves, Any, list[torch.Tensor], list[int]]:
    """Pass 1: every micro-batch embedded without a graph; the ranks' rows agreed."""
    leaves: Leaves | None = None
    spec: Any = None
    parts: list[list[torch.Tensor]] = []
    failure: Exception | None = None
    device = torch.device("cpu")
    try:
        with torch.no_grad():
            for j, (mb, r) in enumerate(micro):
                rng.capture()
                out = embed(params, mb)
                leaves, spec, flat = _check_reps(call, j, out, r, leaves, spec)
                parts.append(flat)
        if leaves is not None and leaves.floating:
            device = parts[0][leaves.floating[0]].device
        elif leaves is None:
            device = _device_of(params)
    except Exception as err:  # joined as failed below, then re-raised
        failure = err
        device = _device_of(params)
    rows = sum(r for _, r in micro) if failure is None else 0
    if exchange is not None:
        per_rank = exchange.agree(rows, failure is not None, leaves, index, device)
    else:
        per_rank = [rows]
    if failure is not None:
        raise failure
    if leaves is None:  # no rows, in one process (with a sync, agree raised on every rank)
        raise GradAccumError(
            f"{call}: this rank has no rows in this window; coupled() needs at least one row "
            f"per rank (the loss's share of a rank with no rows is not defined). Give every "
            f"rank at least one row."
        )
    local = [torch.cat([p[i] for p in parts]) for i in range(len(leaves.paths))]
    return leaves, spec, local, per_rank


def _device_of(params: Any) -> torch.device:
    for leaf in _tree.flatten(params)[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")


def _check_reps(
    call: str, j: int, out: Any, rows: int, leaves: Leaves | None, spec: Any
) -> tuple[Leaves, Any, list[torch.Tensor]]:
    paths, flat, tree = _tree.flatten_with_paths(out)
    for p, t in zip(paths, flat):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{call}: embed returned a non-tensor leaf {p} ({describe(t)}) for micro-batch "
                f"{j}; embed must return a pytree of tensors whose dim 0 is the micro-batch's "
                f"rows."
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
                f"({'; '.join(mine.lines()) or 'no leaves'}); "
                f"return the representations to differentiate (e.g. the embeddings) as floating "
                f"tensors."
            )
        return mine, tree, [t.detach() for t in flat]
    if tree != spec or mine != leaves:
        raise ValueError(
            f"{call}: embed's output for micro-batch {j} differs from micro-batch 0's: "
            f"{'; '.join(mine.lines())} against {'; '.join(leaves.lines())}; return the same "
            f"tree, dtypes and trailing shapes for every micro-batch."
        )
    return leaves, spec, [t.detach() for t in flat]


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
    return torch.cat([torch.arange(r * top, r * top + n) for r, n in enumerate(per_rank)]).to(
        device
    )


def _wide(leaves: Leaves) -> torch.dtype:
    """The dtype the representations' gradient is summed in: float32 or the widest floating."""
    dtype = torch.float32
    for i in leaves.floating:
        dtype = torch.promote_types(dtype, leaves.dtypes[i])
    return dtype


def _loss(
    call: str,
    loss: Callable[..., Any],
    params: Any,
    leaves: Leaves,
    spec: Any,
    glob: list[torch.Tensor],
    rows: Rows,
) -> tuple[
    torch.Tensor, list[torch.Tensor | None], list[tuple[int, torch.Tensor]], Exception | None
]:
    """The loss on the global representations, and its gradient for them and for the params."""
    share = torch.zeros((), dtype=_wide(leaves), device=glob[leaves.floating[0]].device)
    try:
        reps = [
            t.detach().requires_grad_() if i in leaves.floating else t for i, t in enumerate(glob)
        ]
        pflat, pspec = _tree.flatten(params)
        mine = [
            t.detach().requires_grad_()
            if isinstance(t, torch.Tensor) and t.is_floating_point()
            else t
            for t in pflat
        ]
        out = loss(_tree.unflatten(pspec, mine), _tree.unflatten(spec, reps), rows)
        if not isinstance(out, torch.Tensor) or out.numel() != 1 or not out.is_floating_point():
            raise TypeError(
                f"{call}: loss must return this rank's share of the objective as a 0-dim "
                f"floating tensor, got {describe(out)}; reduce it to a scalar (e.g. a sum over "
                f"this rank's rows divided by rows.total)."
            )
        share = out.reshape(())
        at = [i for i, t in enumerate(mine) if isinstance(t, torch.Tensor) and t.requires_grad]
        targets = [reps[i] for i in leaves.floating] + [mine[i] for i in at]
        got: tuple[torch.Tensor | None, ...] = (None,) * len(targets)
        if share.requires_grad:
            got = torch.autograd.grad(share, targets, allow_unused=True)
        k = len(leaves.floating)
        direct = [(i, g) for i, g in zip(at, got[k:]) if g is not None]
        return share.detach(), list(got[:k]), direct, None
    except Exception as err:  # joined as failed (with a sync), then re-raised
        return share, [None] * len(leaves.floating), [], err


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
