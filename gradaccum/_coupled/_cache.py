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
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _split, _tree
from .._autograd import check_no_transform, grad, grad_on
from .._checks import check_bool
from .._core.accumulate import accumulate_as
from .._core.engine import check_nesting
from .._core.protocol import LOCAL, Sync, check_sync
from .._errors import describe
from .._layout import check_n
from ._exchange import Rows
from ._replay import RandomStates, check_generators, reraise
from ._window import cache, name_of, open_call, second_pass

__all__ = ["coupled"]


class _Pass2:
    """What the surrogate loss of one call's pass 2 reads: set per call, read per micro-batch."""

    def __init__(self, embed: Callable[..., Any], check_replay: bool) -> None:
        self.embed = embed
        self.check_replay = check_replay
        self.rng = RandomStates()
        self.floating: tuple[int, ...] = ()
        self.direct: list[tuple[int, torch.Tensor]] = []
        self.next = 0
        self.done: Any = None

    def surrogate(self, params: Any, item: Any) -> torch.Tensor:
        """``sum(reps * grad_reps)`` for one micro-batch: its backward is the wanted VJP."""
        batch, grads = item
        j, self.next = self.next, self.next + 1
        if j == 0:
            self.done.check()
        self.rng.replay(j)
        leaves = _tree.flatten(self.embed(params, batch))[0]
        if self.check_replay:
            self.done.replay.compare(j, [leaves[i] for i in self.floating])
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
    generators: Sequence[Any] = (),
    check_replay: bool = True,
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

    The random numbers replayed are those of torch's CPU and CUDA generators, Python's
    ``random``, NumPy's global generator, and the explicit generators given in ``generators``.
    Step 4 checks that it recomputed the representations of step 1: where they differ beyond
    rounding (randomness from elsewhere, state changed between the passes), the call raises
    [`GradAccumError`][gradaccum.GradAccumError] (with a sync, on every rank) and returns no
    gradient.

    It costs about one more forward per micro-batch. Module buffers that the second forward
    changes (BatchNorm's running statistics) are put back as the first one left them, and the
    random state ends as after one forward per micro-batch. Under ``torch.compile`` it runs
    eagerly (a graph break): compile ``embed`` instead,
    ``coupled(torch.compile(embed), loss, n)``. See the page "Coupled losses"
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
        generators: Explicit random generators ``embed`` draws from (``torch.Generator``,
            ``random.Random``, ``numpy.random.Generator`` or ``RandomState``): their states are
            replayed in step 4 too, and left as after one forward per micro-batch. Global
            generators need no mention.
        check_replay: ``True`` (default): compare step 4's representations with step 1's, one
            host read per call. ``False`` skips the comparison; only for an ``embed`` that is
            nondeterministic beyond rounding by design, whose gradient is then that of other
            representations than the loss saw.

    Returns:
        A function ``(params, batch) -> (grads, loss)``: the gradient of the objective over the
        global window (with a ``reduce_scatter`` sync, this rank's shards) and the objective
        (the sum of the ranks' shares, the same on every rank), a 0-dim tensor.

    Raises:
        TypeError: ``embed`` or ``loss`` is not callable; (when called) ``embed`` returned a
            non-tensor leaf or no floating leaf, or ``loss`` did not return a 0-dim floating
            tensor.
        ValueError: ``n < 1``; (when called) a call inside an accumulated function's
            micro-batch loop (``accumulate(coupled(...), n)``: call it on the whole batch), a
            representation whose dim 0 is not the micro-batch's rows, or micro-batches whose
            representations differ in tree, dtype or shape.
        GradAccumError: Step 4 did not reproduce step 1's representations (see above). With
            a sync: another rank failed, the ranks disagree on the representations' layout or
            on the window, or a collective failed.

    Examples:
        >>> import torch, gradaccum
        >>> def embed(p, x):
        ...     return torch.nn.functional.normalize(x @ p["w"], dim=-1)
        >>> def info_nce(p, z, rows):  # rows 2i and 2i+1 are a positive pair
        ...     sim = z[rows.local] @ z.T / 0.1
        ...     sim = sim - 1e9 * torch.eye(len(z), dtype=z.dtype)[rows.local]  # no self-match
        ...     target = rows.arange() ^ 1
        ...     return torch.nn.functional.cross_entropy(sim, target, reduction="sum") / rows.total
        >>> _ = torch.manual_seed(0)
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
    where = f"coupled({name_of(embed)}, {name_of(loss)}, n={n!r})"
    check_n(where, n)
    check_sync(where, sync)
    gens = check_generators(where, generators)
    check_bool(where, "check_replay", check_replay)
    kind = sync if sync is not None else LOCAL
    ctx = _Pass2(embed, check_replay)
    call = f"{where}(params, batch)"
    # Pass 2's accumulate: its errors name the user's call, never accumulate(surrogate, ...).
    inner = accumulate_as(call, grad(ctx.surrogate), n, reduction="sum", sync=sync)
    opened = [0]

    @grad_on  # exact under torch.no_grad() and torch.inference_mode(), as torch.func.grad is
    def step(params: Any, batch: Any) -> tuple[Any, torch.Tensor]:
        check_no_transform(call)
        check_nesting(call, None)
        index, opened[0] = opened[0], opened[0] + 1
        start = open_call(call, kind, params, batch, n, "embed")
        full = start.params
        forwards: list[tuple[Callable[[], Any], int | None]]
        forwards = [(functools.partial(embed, full, mb), r) for mb, r in start.micro]
        if start.failure is not None:
            forwards = [(functools.partial(reraise, start.failure), None)]
        # The loss's own params: leaves of their own, for its direct gradient (a temperature);
        # an inference tensor cannot be one: a plain copy stands for it.
        pflat, pspec = _tree.flatten(full)
        mine = [
            (t.clone() if t.is_inference() else t.detach()).requires_grad_()
            if isinstance(t, torch.Tensor) and t.is_floating_point()
            else t
            for t in pflat
        ]
        at = [i for i, t in enumerate(mine) if isinstance(t, torch.Tensor) and t.requires_grad]
        rng = RandomStates(gens)
        done = cache(
            call,
            forwards,
            lambda reps, rows: loss(_tree.unflatten(pspec, mine), reps, rows),
            [mine[i] for i in at],
            rng,
            start.exchange,
            index,
            start.device,
        )
        # Pass 2: each micro-batch again, with its slice of the representations' gradient.
        items = [(mb, g) for (mb, _), g in zip(start.micro, done.slices)]
        ctx.rng, ctx.floating, ctx.next, ctx.done = rng, done.leaves.floating, 0, done
        ctx.direct = [(at[k], g) for k, g in done.direct]
        try:
            grads = second_pass(rng, lambda: inner(params, _split.MicroBatches(items)))
        finally:
            ctx.direct, ctx.done = [], None
        return grads, done.value

    # Its two passes, random states and exchange are not traceable (Dynamo failed inside on a
    # dict of representations): under torch.compile the call runs eagerly, through a clean graph
    # break here. Compile embed and loss instead: coupled(torch.compile(embed), loss, n).
    # (torch.compile of a disabled function would compile the function it wraps: hence run.)
    eager = torch.compiler.disable(step)  # type: ignore[no-untyped-call]

    def run(params: Any, batch: Any) -> tuple[Any, torch.Tensor]:
        if torch.compiler.is_compiling():
            return eager(params, batch)  # type: ignore[no-any-return]
        return step(params, batch)

    return functools.wraps(embed)(run) if not torch.compiler.is_compiling() else run
