"""A ``loop.Step``'s boundary: what ``Step.apply()`` decides, and the ``StepStats`` it reports.

``close`` closes the window (``Accumulator._close``: one collective under a sync, which also
carries the window's metrics), then decides from its totals, the same on every rank: the ranks
saved alike (the ``saves`` metric), the window has items, the global norm and clipping, which
parameters get a ``.grad`` (the ``used`` metric: a parameter no micro-batch of any rank reached
keeps ``None``, as in the plain loop), one ``optimizer.step()``, one ``scheduler.step()``
(with the window's loss for one that takes a metric) and ``zero_grad(set_to_none=True)``.

- ``saves``: ``[1, c, c**2]`` for the ``c`` calls of ``loop.save`` on the rank since the last
  boundary. Summed over the ranks, ``ranks * sum(c**2) == sum(c)**2`` exactly when every rank
  saved as often, which every rank reads from the same totals, so all of them raise together.
"""

from __future__ import annotations

import inspect
import math
import time
from typing import Any, NamedTuple

import torch

from .. import _metrics, _tree
from .._core.state import pass_on
from .._errors import GradAccumError
from ..boundary import clip_by_global_norm
from ._feed import again

__all__ = ["StepStats", "abort", "close", "rollback", "takes_metric", "with_saves"]


class StepStats(NamedTuple):
    """What [`Step.apply()`][gradaccum.loop.Step.apply] reports about the window it closed.

    The sums are over every micro-batch of every rank, read from the boundary collective that
    already reduces the gradients. After a deferred boundary (``sync=all_reduce(defer=True)``)
    nothing is read: ``loss``, ``items`` and ``grad_norm`` are 0-dim float64 (``grad_norm``:
    the gradients' dtype) tensors on the gradients' device, ``micro_batches`` an int64 one
    (and ``lr`` a tensor when the optimizer's is), read only where they are used:
    ``float(stats.loss)`` and ``int(stats.micro_batches)`` give the default boundary's numbers,
    and a format spec reads them (``f"{stats.loss:.4f}"``). They are tensors otherwise:
    ``str()`` shows ``tensor(...)``, a comparison gives a tensor, ``round()`` and
    ``json.dumps`` want ``float(...)`` first
    ([The deferred boundary](../loop.md#the-deferred-boundary)).

    Attributes:
        window: The index of the window (the optimizer step), from 0.
        loss: The window's global loss, its objective: the mean over its items (the rows of
            a bare loss, the ``n`` of a ``gradaccum.Mean`` or ``gradaccum.Sum``: e.g. tokens)
            under ``"mean"`` and ``"count"``, whatever kinds the micro-batches returned; the
            sum under ``"sum"``.
        items: The window's items: the rows of each bare loss and the ``n`` of each ``Mean``
            or ``Sum``, over every micro-batch and rank.
        micro_batches: The window's micro-batches, all ranks together.
        grad_norm: The global 2-norm of the window's gradient, before clipping.
        lr: The learning rate of the optimizer's first parameter group for this step.
        seconds: Wall time since the previous window closed (or the first micro-batch).

    Examples:
        >>> from gradaccum.loop import StepStats
        >>> stats = StepStats(3, 2.5, 1000.0, 8, 0.9, 1e-3, 0.5)
        >>> stats.items_per_s
        2000.0
    """

    window: int
    loss: float | torch.Tensor
    items: float | torch.Tensor
    micro_batches: int | torch.Tensor
    grad_norm: float | torch.Tensor
    lr: float | torch.Tensor
    seconds: float

    @property
    def items_per_s(self) -> float | torch.Tensor:
        """Throughput: ``items`` (rows, or tokens when the loss says so) per second."""
        return self.items / self.seconds if self.seconds > 0 else math.inf


def clipped(step: Any, grads: Any) -> tuple[Any, torch.Tensor]:
    """The window's gradients, clipped if the step clips, and their global norm (on the device)."""
    if step.clip is not None:
        return clip_by_global_norm(grads, step.clip)
    leaves = _tree.flatten(grads)[0]
    wide = torch.float64 if torch.float64 in {g.dtype for g in leaves} else torch.float32
    norms = [x.to(wide) for x in torch._foreach_norm(leaves)]
    return grads, torch.linalg.vector_norm(torch.stack(norms))


def takes_metric(scheduler: Any) -> bool:
    """Whether ``scheduler.step`` needs a value (``ReduceLROnPlateau.step(metrics)``)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return True
    try:
        params = inspect.signature(scheduler.step).parameters.values()
    except (TypeError, ValueError):  # no signature to read: stepped without one
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(p.kind in positional and p.default is inspect.Parameter.empty for p in params)


def with_saves(step: Any, state: Any, saves: int) -> Any:
    """``state`` with this rank's ``[1, saves, saves**2]`` in its sums, for the boundary."""
    c = float(saves)
    sums = dict(state.metrics or {})
    sums["saves"] = step._micro.on_device(("saves", c), (1.0, c, c * c))
    return state._replace(metrics=dict(sorted(sums.items())))


def abort(step: Any) -> None:
    """Join the window's boundary flagged as failed (the other ranks raise in ``apply()``)."""
    state = with_saves(step, step.state, step._saves)
    step._saves = 0
    try:
        step.state = step.acc._abort(state, step._micro.win)
    finally:
        step._micro.drop()


def close(step: Any) -> StepStats:
    """``Step.apply()``: the boundary, then what it decides (see the module notes)."""
    where = "Step.apply()"
    micro = step._micro
    if step.state.micro_step == 0 and step.sync is None:  # one process: nothing to apply
        add = "step.add_window(window)" if step._feed is not None else "step.add(batch)"
        raise ValueError(
            f"{where}: no micro-batch was added in window {step.window}, so there is no "
            f"gradient to apply; add the window's micro-batches first ({add}), then call "
            f"step.apply()."
        )
    if step.sync is not None and step.sync.defer:  # read at the first add(), else here
        step.sync._settle(where)
    if step.state.micro_step == 0:  # an empty window trains what the other ranks' do
        step.state = micro.follow(where, step.state)
    saves, names, params = step._saves, micro.names, micro.params
    step._saves = 0
    if step._feed is not None:
        step._feed.kept = None
    deferred = step.sync is not None and step.sync.defer
    # Every parameter's first-backward hook fired: this rank reached them all in the window.
    first = micro._first
    reached_all = bool(first) and first.count(None) == len(first)
    try:
        # Accumulator.boundary, its errors named after this call (not Accumulator(n=...)).
        state, live = with_saves(step, step.state, saves), micro.win
        micro.drop()
        grads, step.state, totals = step.acc._close(
            where, state, "apply()", True, live, raw=deferred
        )
    except GradAccumError:
        if step._feed is not None:  # a window taken whole is dropped whole: add it again
            again(step, state)
        raise
    except ValueError as err:
        if step.sync is not None and "no mean to divide by" in str(err):
            # The window's items add up to 0 over the ranks: every rank raises here, after its
            # collectives; the window is dropped on every rank and the next one goes on, as in
            # one process (its sums and micro-batches must not flow into the next window).
            sig = _metrics.signature(state.metrics)
            step.state = pass_on(state, step.acc._next(state, state.reduce_state, sig), "apply()")
        raise
    except TypeError as err:
        if "did not report the window's totals" not in str(err):
            raise
        raise TypeError(
            "Step.apply(): the sync's window reports no totals at the boundary, so the "
            "window's loss and tokens are not known: in your sync's Window, exchange the "
            "weight through self.connect(...) (see gradaccum.sync.Window.connect), or use "
            "gradaccum.Accumulator with finalize()."
        ) from err
    if deferred:
        return close_deferred(step, grads, totals, reached_all)
    # The metrics by name (numbers, and lists for the 1-D ones), read without typing.cast: a
    # Python call each, once a window.
    m: dict[str, Any] = totals.metrics
    ranks, calls, squares = m["saves"]
    if ranks * squares != calls * calls:
        raise GradAccumError(
            f"{where}: the ranks called gradaccum.loop.save a different number of times in "
            f"window {totals.window} (this rank {saves}; {calls:g} calls over {ranks:g} "
            f"ranks), so the checkpoint is not the same point on every rank. Every rank "
            f"must reach each save: decide it from the window alone (if window.index == "
            f"save_at: loop.save(path, step)). The optimizer did not step, on any rank."
        )
    items, loss_sum = totals.weight, m["loss"]
    micro_batches = round(m["micro_batches"])
    if step.reduction != "sum" and not items > 0:  # in one process: tensor n, not read before
        raise ValueError(
            f"{where}: the items of window {totals.window} add up to {items:g} (every "
            f"micro-batch's n is 0: all padding?), so there is no mean over them to take; "
            f"the window was dropped, nothing was applied (the parameters' .grad stay None) "
            f"and the next window goes on. Skip windows with no items, or use "
            f"reduction='sum'."
        )
    grads, norm = clipped(step, grads)
    for k, p, count in zip(names, params, m["used"]):
        if count == 0:
            p.grad = None  # unused in every micro-batch of every rank, as in the plain loop
        else:
            p.grad = grads[k].to(p.dtype)  # the same tensor when it has the dtype already
    optimizer, scheduler = step.optimizer, step.scheduler
    lr = float(optimizer.param_groups[0]["lr"])
    loss = loss_sum if step.reduction == "sum" else loss_sum / items
    optimizer.step()
    if scheduler is not None:
        if step._plateau:
            scheduler.step(loss)
        else:
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    now = time.perf_counter()
    seconds, step._since = now - (step._since or now), now
    # Read once the optimizer's step is queued behind it: on a device the host then waits
    # for the norm alone, and the device still has the step to run (no drained queue).
    grad_norm = float(norm)
    return StepStats(totals.window, loss, items, micro_batches, grad_norm, lr, seconds)


def rollback(step: Any, pending: Any) -> None:
    """A bad window was read (wherever: ``apply``, ``add``, ``verify``, ``loop.save``).

    If this rank stepped its scheduler for that window (the fused step skipped it on the
    device), the scheduler and every hyperparameter of the optimizer's groups (``lr``, and the
    ``betas`` or ``momentum`` some schedulers set) go back to what they were before, so that
    every rank's schedule stays where the rank that failed left its own.
    """
    undo, step._undo = step._undo, None
    if undo is None or undo[0] is not pending:
        return
    scheduler_state, groups = undo[1]
    step.scheduler.load_state_dict(scheduler_state)
    for group, kept in zip(step.optimizer.param_groups, groups):
        for key, value in kept.items():
            if isinstance(value, torch.Tensor) and isinstance(group.get(key), torch.Tensor):
                group[key].copy_(value)
            else:
                group[key] = value


def hyperparameters(optimizer: Any) -> list[dict[str, Any]]:
    """Each param group's hyperparameters (all but ``params``), tensors copied."""
    return [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
        for g in optimizer.param_groups
    ]


SAVES = (
    "the ranks called gradaccum.loop.save a different number of times, so the checkpoint is "
    "not the same point on every rank. Every rank must reach each save: decide it from the "
    "window alone (if window.index == save_at: loop.save(path, step))."
)


def close_deferred(step: Any, grads: Any, raw: Any, reached_all: bool) -> StepStats:
    """``close`` after a deferred boundary (``all_reduce(defer=True)``): no host read.

    The checks become the sync's device flag, which the fused optimizer (guarded at ``Step``'s
    construction) skips on: the saves check joins it (``Deferring._fail_if``); the empty window
    is the boundary's own. ``.grad`` is set on every parameter when this rank reached them all
    (then so did the ranks together); otherwise the ``used`` map is read, on this rank only,
    and gives every rank the same decision. The stats stay on the device (0-dim tensors); a
    scheduler that takes a metric reads the loss.
    """
    index, items, flats, sig = raw
    flat = flats[0]
    at: dict[str, slice] = {}
    o = 0
    for k, shape in sig:
        width = shape[0] if shape else 1
        at[k] = slice(o, o + width)
        o += width
    saves = flat[at["saves"]]
    step.sync._fail_if(saves[0] * saves[2] != saves[1] * saves[1], SAVES)
    # In float64, as the default boundary's numbers are divided on the host.
    loss_sum, items = flat[at["loss"]][0].double(), items.double()
    micro_batches = flat[at["micro_batches"]][0].round().long()
    grads, norm = clipped(step, grads)
    micro = step._micro
    if reached_all:
        for k, p in zip(micro.names, micro.params):
            p.grad = grads[k].to(p.dtype)
    else:  # some parameter this rank did not reach: did another rank? (a read, here only)
        for k, p, count in zip(micro.names, micro.params, flat[at["used"]].tolist()):
            p.grad = None if count == 0 else grads[k].to(p.dtype)
    optimizer, scheduler = step.optimizer, step.scheduler
    lr = optimizer.param_groups[0]["lr"]
    lr = lr.detach().clone() if isinstance(lr, torch.Tensor) else float(lr)
    loss = loss_sum if step.reduction == "sum" else loss_sum / items
    optimizer.step()  # skips on the device where the window's flag is 1
    if scheduler is not None:  # what rollback() puts back, if this window turns out bad
        step._undo = (step.sync._pending(), (scheduler.state_dict(), hyperparameters(optimizer)))
        if step._plateau:
            scheduler.step(float(loss))  # a number every window: the one read it costs
        else:
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    now = time.perf_counter()
    seconds, step._since = now - (step._since or now), now
    return StepStats(index, loss, items, micro_batches, norm.detach(), lr, seconds)
