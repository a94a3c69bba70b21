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

from .. import _tree
from .._errors import GradAccumError
from ..boundary import clip_by_global_norm
from ._feed import again

__all__ = ["StepStats", "abort", "close", "takes_metric", "with_saves"]


class StepStats(NamedTuple):
    """What [`Step.apply()`][gradaccum.loop.Step.apply] reports about the window it closed.

    The sums are over every micro-batch of every rank, read from the boundary collective that
    already reduces the gradients.

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
    loss: float
    items: float
    micro_batches: int
    grad_norm: float
    lr: float
    seconds: float

    @property
    def items_per_s(self) -> float:
        """Throughput: ``items`` (rows, or tokens when the loss says so) per second."""
        return self.items / self.seconds if self.seconds > 0 else math.inf


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
    if step.state.micro_step == 0:  # an empty window trains what the other ranks' do
        step.state = micro.follow(where, step.state)
    saves, names, params = step._saves, micro.names, micro.params
    step._saves = 0
    if step._feed is not None:
        step._feed.kept = None
    try:
        # Accumulator.boundary, its errors named after this call (not Accumulator(n=...)).
        state, live = with_saves(step, step.state, saves), micro.win
        micro.drop()
        grads, step.state, totals = step.acc._close(where, state, "apply()", True, live)
    except GradAccumError:
        if step._feed is not None:  # a window taken whole is dropped whole: add it again
            again(step, state)
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
    if step.clip is not None:
        grads, norm = clip_by_global_norm(grads, step.clip)
    else:
        leaves = _tree.flatten(grads)[0]
        wide = torch.float64 if any(g.dtype == torch.float64 for g in leaves) else torch.float32
        norms = [x.to(wide) for x in torch._foreach_norm(leaves)]
        norm = torch.linalg.vector_norm(torch.stack(norms))
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
