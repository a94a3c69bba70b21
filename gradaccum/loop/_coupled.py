"""Losses over a whole window in the loop: ``Coupled``, ``WindowStats`` and ``Step.add_window``.

A loss that ties a window's examples together (in-batch negatives) needs the whole window at
once, where [`Step.add()`][gradaccum.loop.Step.add] takes one micro-batch. With a
[`Coupled`][gradaccum.loop.Coupled] loss the step takes the window whole
([`Step.add_window()`][gradaccum.loop.Step.add_window]): pass 1 and the exchange
(``_coupled/_window.py``, as for [`coupled()`][gradaccum.coupled]), then pass 2 through the
step's own ``add``, one micro-batch at a time, with a surrogate loss whose backward is the
micro-batch's slice of the representations' gradient and whose value is this rank's share of
the objective (on the first micro-batch; 0 on the others), so that ``StepStats.loss`` is the
objective. A [`WindowStats`][gradaccum.loop.WindowStats] loss takes the window whole too: its
statistics first (``_coupled/_stats.py``'s ``collect``), then each micro-batch through ``add``
with them. The step's window is then what ``add`` leaves it: saves after ``add_window`` and
before ``apply()`` are exact; a save in the middle of collecting a window is refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .. import _tree
from .._checks import check_bool
from .._coupled._exchange import Exchange, Rows
from .._coupled._replay import RandomStates, check_generators, reraise
from .._coupled._stats import collect
from .._coupled._window import cache, second_pass
from .._errors import describe
from .._kinds import Sum

__all__ = ["Coupled", "WindowStats", "add_window", "join_failed"]


class Coupled:
    """A loss that couples a window's examples, for [`loop.Step`][gradaccum.loop.Step].

    Pass it as the step's ``loss``; the step then takes whole windows
    ([`Step.add_window(window)`][gradaccum.loop.Step.add_window]) and computes the gradient of
    the loss over the global window exactly, as [`coupled()`][gradaccum.coupled] does for
    functional params: every micro-batch embedded without a graph, every rank's
    representations gathered, the loss once, then each micro-batch again with its slice of the
    loss's gradient (dropout masks replayed, BatchNorm statistics kept from the first pass).
    The second pass is checked against the first: representations that differ beyond rounding
    (randomness that was not replayed) raise [`GradAccumError`][gradaccum.GradAccumError] in
    ``add_window``, on every rank, and the window is dropped whole.

    Args:
        embed: ``embed(model, micro_batch) -> reps``: a pytree of tensors, dim 0 the
            micro-batch's rows (floating leaves are differentiated; others, such as labels, are
            passed to ``loss`` as they are).
        loss: ``loss(model, reps, rows) -> share``: ``reps`` holds every rank's rows (rank
            order), ``rows`` ([`Rows`][gradaccum.Rows]) says which are this rank's; it returns
            this rank's share of the objective (the shares are summed over the ranks). It may
            use the model's parameters directly (a learned temperature).
        generators: Explicit random generators ``embed`` draws from, as for
            [`coupled()`][gradaccum.coupled] (torch's, Python's and NumPy's global ones are
            replayed without mention).
        check_replay: As for [`coupled()`][gradaccum.coupled]: ``False`` skips the check.

    Raises:
        TypeError: ``embed`` or ``loss`` is not callable; ``generators`` holds something other
            than a random generator; ``check_replay`` is not a bool.

    Examples:
        >>> import torch, gradaccum
        >>> from gradaccum.loop import Coupled, Step
        >>> model = torch.nn.Linear(4, 3).double()
        >>> def embed(model, x):
        ...     return torch.nn.functional.normalize(model(x), dim=-1)
        >>> def info_nce(model, z, rows):  # rows 2i and 2i+1 are a positive pair
        ...     sim = z[rows.local] @ z.T / 0.1
        ...     sim = sim - 1e9 * torch.eye(len(z), dtype=z.dtype)[rows.local]
        ...     nll = torch.nn.functional.cross_entropy(sim, rows.arange() ^ 1, reduction="sum")
        ...     return nll / rows.total
        >>> step = Step(model, Coupled(embed, info_nce), torch.optim.SGD(model.parameters(), 0.1))
        >>> x = torch.randn(8, 4, dtype=torch.float64)
        >>> step.add_window([x[:3], x[3:6], x[6:]])  # a window of 3 micro-batches
        >>> stats = step.apply()
        >>> stats.micro_batches, stats.items
        (3, 8.0)
    """

    def __init__(
        self,
        embed: Callable[[torch.nn.Module, Any], Any],
        loss: Callable[[torch.nn.Module, Any, Rows], torch.Tensor],
        *,
        generators: Sequence[Any] = (),
        check_replay: bool = True,
    ) -> None:
        for arg, fn, shape in (
            ("embed", embed, "embed(model, micro_batch) -> reps"),
            ("loss", loss, "loss(model, reps, rows) -> share"),
        ):
            if not callable(fn):
                raise TypeError(
                    f"Coupled(embed, loss): {arg} must be a function {shape}, got {describe(fn)}."
                )
        self.embed = embed
        self.loss = loss
        self.generators = check_generators("Coupled(embed, loss)", generators)
        check_bool("Coupled(embed, loss)", "check_replay", check_replay)
        self.check_replay = check_replay

    def __repr__(self) -> str:
        name = getattr(self.loss, "__name__", type(self.loss).__name__)
        return f"Coupled({getattr(self.embed, '__name__', 'embed')}, {name})"


class WindowStats:
    """A loss that uses statistics of the whole window, for [`loop.Step`][gradaccum.loop.Step].

    Pass it as the step's ``loss``; the step then takes whole windows
    ([`Step.add_window(window)`][gradaccum.loop.Step.add_window]), as
    [`window_stats()`][gradaccum.window_stats] does for functional params: ``stats`` runs on
    every micro-batch without a graph, the results are summed over the window and the ranks,
    then each micro-batch's ``loss`` is added with those sums as constants (pass 1's random
    numbers replayed, BatchNorm statistics kept from the first pass). An MoE load-balancing
    loss (each expert's share of the window's tokens times its mean router probability) is
    then exact.

    Args:
        stats: ``stats(model, micro_batch) -> tree``: a pytree of tensors (counts, sums) of the
            same shapes for every micro-batch and rank, summed in float64 and given back in
            their floating dtypes, or as int64 for integer and bool ones (``torch.sum``'s dtype:
            a uint8 count does not wrap; counts are exact up to 2**53).
        loss: ``loss(model, micro_batch, window)``: the micro-batch's loss, as for a plain
            ``Step`` under its ``reduction`` (a 0-dim tensor: a mean over the micro-batch's
            rows; or [`gradaccum.Mean`][gradaccum.Mean] / [`gradaccum.Sum`][gradaccum.Sum] over
            its items), with ``window`` the sums.
        generators: Explicit random generators ``stats`` and ``loss`` draw from, replayed in
            the second pass, as for [`window_stats()`][gradaccum.window_stats] (randomness from
            elsewhere is neither replayed nor detected there).

    Raises:
        TypeError: ``stats`` or ``loss`` is not callable; ``generators`` holds something other
            than a random generator.

    Examples:
        >>> import torch, gradaccum
        >>> from gradaccum.loop import Step, WindowStats
        >>> model = torch.nn.Linear(3, 1).double()
        >>> def positives(model, x):  # rows of the window with a positive first feature
        ...     return (x[:, 0] > 0).sum()
        >>> def loss(model, x, count):
        ...     return model(x).pow(2).mean() / count
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> step = Step(model, WindowStats(positives, loss), opt)
        >>> x = torch.tensor([[1.0, 0, 0], [-1.0, 0, 0], [2.0, 1, 0]], dtype=torch.float64)
        >>> step.add_window([x[:2], x[2:]])
        >>> step.apply().micro_batches
        2
    """

    def __init__(
        self,
        stats: Callable[[torch.nn.Module, Any], Any],
        loss: Callable[[torch.nn.Module, Any, Any], Any],
        *,
        generators: Sequence[Any] = (),
    ) -> None:
        for arg, fn, shape in (
            ("stats", stats, "stats(model, micro_batch) -> tree"),
            ("loss", loss, "loss(model, micro_batch, window) -> loss"),
        ):
            if not callable(fn):
                raise TypeError(
                    f"WindowStats(stats, loss): {arg} must be a function {shape}, got "
                    f"{describe(fn)}."
                )
        self.stats = stats
        self.loss = loss
        self.generators = check_generators("WindowStats(stats, loss)", generators)

    def __repr__(self) -> str:
        name = getattr(self.loss, "__name__", type(self.loss).__name__)
        return f"WindowStats({getattr(self.stats, '__name__', 'stats')}, {name})"


def _exchange(where: str, step: Any) -> Exchange | None:
    sync = step.sync
    if sync is None:
        return None
    if isinstance(step._coupled, WindowStats):  # each micro-batch counts as one in the agreement
        return Exchange(where, sync.data_group(), sync.timeout, fn="stats", unit="micro-batches")
    return Exchange(where, sync.data_group(), sync.timeout, fn="embed", empty_ok=True)


def join_failed(step: Any, err: BaseException) -> None:
    """Reading the window's data raised ``err`` on this rank: join pass 1's agreement, failed."""
    exchange = _exchange("Step.add_window(batches)", step)
    if exchange is not None:
        device = next(iter(step.model.parameters())).device
        try:
            exchange.agree(0, True, None, step.window, device)
        finally:
            step._joined = True


def _read(step: Any, batches: Iterable[Any]) -> tuple[list[Any], Exception | None]:
    """The window's micro-batches, or the error reading them raised (joined in pass 1).

    They are kept until the window is added whole: a retry of a window that failed passes the
    same ``batches`` again (a ``DataWindow`` is read once), and gets them back.
    """
    kept, step._kept = step._kept, None
    if kept is not None and kept[0] is batches:
        return kept[1], None
    step._joined = False
    try:
        taken = list(batches)
    except Exception as err:
        if step._joined:  # the data's callback joined pass 1's agreement flagged already
            raise
        return [], err
    step._kept = (batches, taken)
    return taken, None


def _stats_window(step: Any, batches: Iterable[Any]) -> None:
    """``Step.add_window`` for a ``WindowStats`` loss: the statistics, then each micro-batch."""
    where = "Step.add_window(batches)"
    ws: WindowStats = step._coupled
    model = step.model
    taken, failure = _read(step, batches)
    step._follow(where)
    rng = RandomStates(ws.generators)
    device = next(iter(model.parameters())).device
    # Each micro-batch counts as one row in the agreement (its rows are the loss's business).
    forwards = [(functools.partial(ws.stats, model, mb), 1) for mb in taken]
    window = collect(where, forwards, failure, rng, _exchange(where, step), step.window, device)
    at = [0]

    def with_window(model: torch.nn.Module, mb: Any) -> Any:
        j, at[0] = at[0], at[0] + 1
        rng.replay_drawn(j)
        out = ws.loss(model, mb, window)
        rng.check_drawn(where)
        return out

    _feed(step, with_window, rng, taken, restore=False)


def _feed(
    step: Any, loss: Callable[..., Any], rng: RandomStates, items: list[Any], restore: bool = True
) -> None:
    """Pass 2: ``items`` through the step's own ``add``, with ``loss`` as its loss."""

    def add_all() -> None:
        for item in items:
            step.add(item)

    kept, step.loss = step.loss, loss
    step._feeding = True
    try:
        second_pass(rng, add_all, restore)
    finally:
        step.loss, step._feeding = kept, False


def add_window(step: Any, batches: Iterable[Any]) -> None:
    """``Step.add_window``: both passes over the window ``batches`` (see the module notes).

    All or nothing: a window that fails anywhere is dropped whole (see ``_failed``), and the
    step stays at its index, so that the same window may be added again.
    """
    index = step.state.window
    try:
        if isinstance(step._coupled, WindowStats):
            _stats_window(step, batches)
        else:
            _coupled_window(step, batches)
    except BaseException:
        _failed(step, index)
        raise
    step._kept = None


def _failed(step: Any, index: int) -> None:
    """The window ``index`` failed: drop what pass 2 added, and stay at ``index``.

    In one process the sums of the micro-batches added so far are dropped (with their
    ``.grad``). Under a sync a failure in pass 2 made ``Step.add`` join the boundary flagged as
    failed (every other rank raises in ``apply()``, which drops its window too), which moved
    the window on: it goes back to ``index``, where the other ranks stay.
    """
    if step.sync is None and (step.state.micro_step or step._win is not None):
        step.state = step.acc._abort(step.state, step._win)._replace(window=index)
    step._drop()
    step.state = step.state._replace(window=index)


def _coupled_window(step: Any, batches: Iterable[Any]) -> None:
    """``Step.add_window`` for a ``Coupled`` loss: pass 1, the exchange, the loss, pass 2."""
    where = "Step.add_window(batches)"
    coupled: Coupled = step._coupled
    model = step.model
    taken, failure = _read(step, batches)
    forwards: list[tuple[Callable[[], Any], int | None]] = [
        (functools.partial(coupled.embed, model, mb), None) for mb in taken
    ]
    if failure is not None:
        forwards = [(functools.partial(reraise, failure), None)]
    step._follow(where)
    targets = [p for p in model.parameters() if p.requires_grad]
    rng = RandomStates(coupled.generators)
    device = next(iter(model.parameters())).device
    done = cache(
        where,
        forwards,
        lambda reps, rows: coupled.loss(model, reps, rows),
        targets,
        rng,
        _exchange(where, step),
        step.window,
        device,
    )
    floating = done.leaves.floating
    direct = [(targets[k], g) for k, g in done.direct]
    at = [0]

    def surrogate(model: torch.nn.Module, item: Any) -> Sum:
        mb, grads = item
        j, at[0] = at[0], at[0] + 1
        if j == 0:
            done.check()
        rng.replay(j)
        leaves = _tree.flatten(coupled.embed(model, mb))[0]
        if coupled.check_replay:
            done.replay.compare(j, [leaves[i] for i in floating])
        total = sum((leaves[i] * g).sum() for i, g in zip(floating, grads))
        if j == 0:
            for p, d in direct:  # the loss's own use of the parameters, added once
                total = total + (p * d).sum()
        elif not total.requires_grad and direct:
            # embed reaches no trainable parameter (a frozen encoder, a trained temperature):
            # the micro-batch is counted with a backward that adds 0 to the loss's parameters.
            for p, _ in direct:
                total = total + p.sum() * 0
        value: torch.Tensor = total - total.detach()
        if j == 0:
            value = value + done.share
        return Sum(value, grads[0].shape[0])  # a share of the sum; its rows count the items

    _feed(step, surrogate, rng, list(zip(taken, done.slices)))
