"""What serves ``Step.add_window``: a ``Coupled`` or ``WindowStats`` loss over a whole window.

With a [`Coupled`][gradaccum.loop.Coupled] loss the step takes the window whole
([`Step.add_window()`][gradaccum.loop.Step.add_window]): pass 1 and the exchange
(``_coupled/_window.py``, as for [`coupled()`][gradaccum.coupled]), then pass 2 through the
step's own ``add``, one micro-batch at a time, with a surrogate loss whose backward is the
micro-batch's slice of the representations' gradient and whose value is this rank's share of
the objective (on the first micro-batch; 0 on the others), so that ``StepStats.loss`` is the
objective. A [`WindowStats`][gradaccum.loop.WindowStats] loss takes the window whole too: its
statistics first (``_coupled/_stats.py``'s ``collect``), then each micro-batch through ``add``
with them. The step's window is then what ``add`` leaves it: saves after ``add_window`` and
before ``apply()`` are exact; a save in the middle of collecting a window is refused.

A ``Feed`` is the step's state for it: the loss, whether pass 2 is adding, whether a data error
joined pass 1 flagged as failed, and the window's micro-batches kept for a retry.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import _metrics, _tree
from .._core.state import AccumState, pass_on
from .._coupled._exchange import Exchange
from .._coupled._replay import RandomStates, reraise
from .._coupled._stats import collect
from .._coupled._window import cache, second_pass
from .._kinds import Sum
from ._coupled import Coupled, WindowStats
from ._plan import DataWindow

__all__ = ["Feed", "add_window", "again", "join_failed"]


class Feed:
    """A ``Step``'s state for its whole-window loss ``loss``, between and within ``add_window``."""

    def __init__(self, loss: Coupled | WindowStats) -> None:
        self.loss = loss
        self.feeding = False  # add_window's pass 2 is adding its micro-batches
        self.joined = False  # a data error joined add_window's agreement, flagged as failed
        self.kept: tuple[Any, list[Any]] | None = None  # add_window's batches, for a retry


def _exchange(where: str, step: Any) -> Exchange | None:
    sync = step.sync
    if sync is None:
        return None
    if isinstance(step._feed.loss, WindowStats):  # each micro-batch counts as one in the agreement
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
            step._feed.joined = True


def _read(step: Any, batches: Iterable[Any]) -> tuple[list[Any], Exception | None]:
    """The window's micro-batches, or the error reading them raised (joined in pass 1).

    They are kept until the window is added whole: a retry of a window that failed passes the
    same ``batches`` again (a ``DataWindow`` is read once), and gets them back.
    """
    feed = step._feed
    kept, feed.kept = feed.kept, None
    if kept is not None and kept[0] is batches:
        return kept[1], None
    feed.joined = False
    try:
        taken = list(batches)
    except Exception as err:
        if feed.joined:  # the data's callback joined pass 1's agreement flagged already
            raise
        return [], err
    feed.kept = (batches, taken)
    return taken, None


def _stats_window(step: Any, batches: Iterable[Any]) -> None:
    """``Step.add_window`` for a ``WindowStats`` loss: the statistics, then each micro-batch."""
    where = "Step.add_window(batches)"
    ws: WindowStats = step._feed.loss
    model = step.model
    taken, failure = _read(step, batches)
    step.state = step._micro.follow(where, step.state)
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

    feed = step._feed
    kept, step.loss = step.loss, loss
    feed.feeding = True
    try:
        second_pass(rng, add_all, restore)
    finally:
        step.loss, feed.feeding = kept, False


def add_window(step: Any, batches: Iterable[Any]) -> None:
    """``Step.add_window``: both passes over the window ``batches`` (see the module notes).

    All or nothing: a window that fails anywhere is dropped whole (see ``_failed``), and the
    step stays at its index, so that the same window may be added again.
    """
    where = "Step.add_window(batches)"
    feed: Feed | None = step._feed
    if feed is None:
        raise TypeError(
            f"{where}: this step's loss is a per-micro-batch loss; add the window's "
            f"micro-batches one by one with step.add(batch), or build the step with "
            f"loss=gradaccum.loop.Coupled(embed, loss) (a loss that couples them) or "
            f"gradaccum.loop.WindowStats(stats, loss) (one that uses the window's "
            f"statistics)."
        )
    if step.micro_step:
        if isinstance(batches, DataWindow) and batches.taken == step.micro_step:
            return  # resumed from a save after add_window: the window's sums are loaded
        raise ValueError(
            f"{where}: window {step.window} already has {step.micro_step} micro-batch(es); "
            f"add_window takes a whole window once: call step.apply() first."
        )
    index = step.state.window
    try:
        if isinstance(feed.loss, WindowStats):
            _stats_window(step, batches)
        else:
            _coupled_window(step, batches)
    except BaseException:
        _failed(step, index)
        raise
    feed.kept = None


def again(step: Any, state: AccumState[Any]) -> None:
    """The boundary of the window ``state`` failed: stay at its index, to add it again whole.

    A window taken whole is dropped whole: its sums and metrics go, its index stays.
    """
    sig = _metrics.signature(state.metrics)
    fresh = step.acc._next(state, state.reduce_state, sig)._replace(window=state.window)
    step.state = pass_on(state, fresh, "apply()")


def _failed(step: Any, index: int) -> None:
    """The window ``index`` failed: drop what pass 2 added, and stay at ``index``.

    In one process the sums of the micro-batches added so far are dropped (with their
    ``.grad``). Under a sync a failure in pass 2 made ``Step.add`` join the boundary flagged as
    failed (every other rank raises in ``apply()``, which drops its window too), which moved
    the window on: it goes back to ``index``, where the other ranks stay.
    """
    micro = step._micro
    if step.sync is None and (step.state.micro_step or micro.win is not None):
        step.state = step.acc._abort(step.state, micro.win)._replace(window=index)
    micro.drop()
    step.state = step.state._replace(window=index)


def _coupled_window(step: Any, batches: Iterable[Any]) -> None:
    """``Step.add_window`` for a ``Coupled`` loss: pass 1, the exchange, the loss, pass 2."""
    where = "Step.add_window(batches)"
    coupled: Coupled = step._feed.loss
    model = step.model
    taken, failure = _read(step, batches)
    forwards: list[tuple[Callable[[], Any], int | None]] = [
        (functools.partial(coupled.embed, model, mb), None) for mb in taken
    ]
    if failure is not None:
        forwards = [(functools.partial(reraise, failure), None)]
    step.state = step._micro.follow(where, step.state)
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
