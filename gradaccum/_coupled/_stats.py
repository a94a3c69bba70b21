"""``window_stats``: a loss that needs statistics of the whole window, exact under accumulation.

An MoE load-balancing loss multiplies, for each expert, the fraction of the window's tokens
routed to it (a count, with no gradient) by the mean router probability (per token, with one).
Per micro-batch, the fractions are the micro-batch's, not the window's: plain accumulation
changes the objective. Pass 1 here computes the statistics of every micro-batch without a graph,
sums them over the window and the ranks (two small collectives: ``Exchange.agree`` and one
all-reduce), and pass 2 is one [`accumulate()`][gradaccum.accumulate] whose loss gets them as
constants, with pass 1's random numbers replayed per micro-batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _reduce, _tree
from .._autograd import check_no_transform, grad_and_value, grad_on
from .._core.accumulate import accumulate_as
from .._core.engine import check_nesting
from .._core.protocol import LOCAL, Sync, check_sync
from .._errors import GradAccumError, describe
from .._layout import check_n
from ._exchange import Exchange, Leaves
from ._replay import RandomStates, check_generators
from ._window import name_of, open_call, second_pass

__all__ = ["collect", "window_stats"]


class _Pass2:
    """The loss of pass 2: the window's statistics passed in, pass 1's random state replayed."""

    def __init__(self, loss: Callable[..., Any], call: str) -> None:
        self.loss = loss
        self.call = call
        self.rng = RandomStates()
        self.next = 0

    def step(self, params: Any, batch: Any, stats: Any) -> torch.Tensor:
        j, self.next = self.next, self.next + 1
        self.rng.replay_drawn(j)
        out = self.loss(params, batch, stats)
        self.rng.check_drawn(self.call)
        return out  # type: ignore[no-any-return]


def window_stats(
    stats: Callable[[Any, Any], Any],
    loss: Callable[[Any, Any, Any], torch.Tensor],
    n: int,
    *,
    sync: Sync | None = None,
    reduction: _reduce.Reduction = "mean",
    generators: Sequence[Any] = (),
) -> Callable[[Any, Any], tuple[Any, torch.Tensor]]:
    """Accumulate ``loss`` over ``n`` micro-batches, with statistics of the whole window.

    ``stats(params, micro_batch)`` runs first on every micro-batch, without a graph; its
    results are summed over the window's micro-batches and, with a sync, over the ranks. Then
    ``loss(params, micro_batch, window)`` is accumulated as by
    [`accumulate()`][gradaccum.accumulate], with ``window`` (those sums) a constant: the
    gradient is the whole-batch gradient of a loss that uses window-level statistics, such as
    an MoE load-balancing loss (each expert's fraction of the window's tokens times its mean
    router probability) or a loss normalised by the window's token count.

    Pass 2 replays pass 1's random numbers per micro-batch, so a router behind dropout routes
    as it was counted: those of torch's CPU and CUDA generators, Python's ``random``, NumPy's
    global generator, and the explicit generators given in ``generators``, each one that
    ``stats`` drew from. ``loss`` must then draw the same numbers from it (``GradAccumError``
    if it draws more or fewer). A source ``stats`` does not draw from is not replayed: a
    dropout in ``loss`` after a plain count in ``stats`` draws fresh masks per micro-batch, as
    a plain loop would. Randomness from anywhere else is not replayed, and not detected either
    (pass 2 has the statistics, not their recomputation): ``loss`` would then route other
    tokens than ``stats`` counted. Buffers
    that pass 2 changes (BatchNorm's running statistics) are put back as pass 1 left them.
    Statistics are return values, never side effects, so activation checkpointing, which runs a
    block's forward again during the backward, cannot count tokens twice. The cost is one
    forward per micro-batch without a graph. See the page "Coupled losses" (docs/coupled.md).

    Args:
        stats: ``stats(params, micro_batch) -> tree``: a pytree of tensors (counts, sums),
            shaped the same for every micro-batch and rank. They are summed in float64;
            floating ones are returned in their own dtypes, integer and bool ones as int64, as
            ``torch.sum`` returns them (a uint8 count does not wrap; counts are exact up to
            2**53).
        loss: ``loss(params, micro_batch, window) -> scalar``: the micro-batch's loss given the
            window's sums, as for ``accumulate``'s step function under ``reduction``.
        n: The number of micro-batches (or a [`MicroBatches`][gradaccum.MicroBatches] batch).
        sync: ``None`` (one process) or a sync, as for ``accumulate``; the statistics are summed
            over its data-parallel group (a process group or 1-D mesh).
        reduction: ``"mean"`` (each micro-batch's loss is a mean over its rows) or ``"sum"``.
        generators: Explicit random generators ``stats`` and ``loss`` draw from
            (``torch.Generator``, ``random.Random``, ``numpy.random.Generator`` or
            ``RandomState``): replayed in pass 2, and left as after one pass.

    Returns:
        A function ``(params, batch) -> (grads, value)``, ``value`` the window's loss as
        ``accumulate(grad_and_value(...))`` returns it.

    Raises:
        TypeError: ``stats`` or ``loss`` is not callable; (when called) ``stats`` returned a
            non-tensor leaf.
        ValueError: ``n < 1``; a call inside an accumulated function's micro-batch loop
            (``accumulate(window_stats(...), n)``: call it on the whole batch); micro-batches
            whose statistics differ in tree or shape.
        GradAccumError: With a sync: another rank failed in pass 1, or the ranks disagree on
            the statistics' layout or the window.

    Examples:
        >>> import torch, gradaccum
        >>> def stats(p, x):  # how many rows of the window are positive
        ...     return (x > 0).sum()
        >>> def loss(p, x, positives):  # mean over the rows, weighted by the window's count
        ...     return (x * p["w"]).mean() / positives
        >>> step = gradaccum.window_stats(stats, loss, n=2)
        >>> x = torch.tensor([1.0, -2.0, 3.0, 4.0], dtype=torch.float64)
        >>> grads, value = step({"w": torch.tensor(1.0, dtype=torch.float64)}, x)
        >>> grads["w"]  # d/dw of mean(x * w) / 3
        tensor(0.5000, dtype=torch.float64)
    """
    for arg, fn, shape in (
        ("stats", stats, "stats(params, micro_batch) -> tree"),
        ("loss", loss, "loss(params, micro_batch, window) -> scalar"),
    ):
        if not callable(fn):
            raise TypeError(
                f"window_stats(stats, loss, n): {arg} must be a function {shape}, got "
                f"{describe(fn)}."
            )
    where = f"window_stats({name_of(stats)}, {name_of(loss)}, n={n!r})"
    check_n(where, n)
    check_sync(where, sync)
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"{where}: reduction must be 'mean' or 'sum', got {reduction!r}; for a token mean, "
            f"count the tokens in stats and divide a summed loss by the window's count."
        )
    gens = check_generators(where, generators)
    kind = sync if sync is not None else LOCAL
    call = f"{where}(params, batch)"
    ctx = _Pass2(loss, call)
    inner = accumulate_as(call, grad_and_value(ctx.step), n, reduction=reduction, sync=sync)
    opened = [0]

    @grad_on  # exact under torch.no_grad() and torch.inference_mode(), as torch.func.grad is
    def step(params: Any, batch: Any) -> tuple[Any, torch.Tensor]:
        check_no_transform(call)
        check_nesting(call, None)
        index, opened[0] = opened[0], opened[0] + 1
        start = open_call(call, kind, params, batch, n, "stats")
        rng = RandomStates(gens)
        forwards = [(functools.partial(stats, start.params, mb), r) for mb, r in start.micro]
        window = collect(call, forwards, start.failure, rng, start.exchange, index, start.device)
        ctx.rng, ctx.next = rng, 0
        run = lambda: inner(params, batch, window)  # noqa: E731
        return second_pass(rng, run, restore=False)  # type: ignore[no-any-return]

    return functools.wraps(loss)(step) if not torch.compiler.is_compiling() else step


def collect(
    call: str,
    forwards: Sequence[tuple[Callable[[], Any], int]],
    failure: Exception | None,
    rng: RandomStates,
    exchange: Exchange | None,
    index: int,
    device: torch.device,
) -> Any:
    """Pass 1: the window's statistics, summed over its micro-batches and the ranks.

    ``forwards``: each micro-batch's ``stats`` call, and its rows; the random state before each
    is kept in ``rng``. With ``exchange``, the sums are all-reduced over the ranks.
    ``failure``: this rank failed before pass 1 (a batch that does not split); it joins the
    agreement flagged, and every rank raises there, as for a failure in pass 1 itself. A rank
    without micro-batches (others have) adds zeros and gets ``None``: it runs no loss.
    """
    sums: torch.Tensor | None = None
    spec: Any = None
    layout: Leaves | None = None
    if failure is None:
        try:
            with torch.no_grad():
                for j, (forward, _rows) in enumerate(forwards):
                    rng.capture()
                    sums, spec, layout = _add(call, j, forward(), sums, spec, layout)
        except Exception as err:  # joined as failed below, then re-raised
            failure = err
    rows = sum(r for _, r in forwards) if failure is None else 0
    at = sums.device if sums is not None else device
    if exchange is not None:
        per_rank = exchange.agree(rows, failure is not None, layout, index, at)
        if failure is None and 0 in per_rank:  # a rank without any: the others' layout
            layout = exchange.layout(layout, per_rank, at)
    if failure is not None:
        raise failure
    if layout is None:  # nothing on this rank, in one process (with a sync, agree raised)
        raise GradAccumError(
            f"{call}: the window has no micro-batch; window statistics need at least one; pass "
            f"a window with at least one micro-batch."
        )
    if sums is None:  # this rank has none (others have): it adds zeros, and runs no loss
        sums = torch.zeros(sum(layout.widths()), dtype=torch.float64, device=at)
    if exchange is not None:
        what = "the window's statistics (all_reduce)"
        exchange.comm.wait(exchange.comm.all_reduce(sums, what, "window statistics"), what)
    if spec is None:
        return None
    return _unflat(sums, spec, layout)


def _add(
    call: str, j: int, out: Any, sums: torch.Tensor | None, spec: Any, layout: Leaves | None
) -> tuple[torch.Tensor, Any, Leaves]:
    """Micro-batch ``j``'s statistics added into the float64 running sums."""
    paths, flat, tree = _tree.flatten_with_paths(out)
    for p, t in zip(paths, flat):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{call}: stats returned a non-tensor leaf {p} ({describe(t)}) for micro-batch "
                f"{j}; return a pytree of tensors (counts, sums)."
            )
        if t.is_complex():  # summed in float64, its imaginary part would be dropped
            raise TypeError(
                f"{call}: stats returned a complex leaf {p} ({describe(t)}) for micro-batch {j}; "
                f"statistics must be real: return torch.view_as_real(s) and take "
                f"torch.view_as_complex(window) in the loss."
            )
    mine = Leaves(tuple(paths), tuple(t.dtype for t in flat), tuple(tuple(t.shape) for t in flat))
    if layout is not None and (tree != spec or mine != layout):
        raise ValueError(
            f"{call}: stats for micro-batch {j} differ from micro-batch 0's: "
            f"{'; '.join(mine.lines())} against {'; '.join(layout.lines())}; return the same "
            f"tree, dtypes and shapes for every micro-batch."
        )
    if not flat:
        raise TypeError(f"{call}: stats returned no tensor; return the statistics to sum.")
    vec = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in flat])
    return (vec if sums is None else sums.add_(vec)), tree, mine


def _unflat(sums: torch.Tensor, spec: Any, layout: Leaves) -> Any:
    """The float64 sums as the statistics' tree; integer and bool sums in int64, as torch.sum."""
    out, at = [], 0
    for dtype, shape, w in zip(layout.dtypes, layout.shapes, layout.widths()):
        v = sums[at : at + w].reshape(shape)
        out.append(v.to(dtype) if dtype.is_floating_point else v.round().to(torch.int64))
        at += w
    return _tree.unflatten(spec, out)
