"""``gradaccum.loop.Step``: a module's micro-steps and its boundary, one optimizer step a window.

``Step`` is the plain PyTorch accumulation loop (each micro-batch's loss scaled by its share of
the window, ``backward()``, one ``optimizer.step()``, ``scheduler.step()``,
``zero_grad(set_to_none=True)``) run on an [`Accumulator`][gradaccum.Accumulator]. What the
plain loop decides from ``.grad`` travels in the boundary collective that already carries the
window's weight, as metrics (no collective of its own, no host sync per micro-batch).

``Step`` holds the options and the window's state (``state``, its ``AccumState``) and composes
the concerns, each in its own module:

- ``_loss``: what the loss returned (a bare mean over rows, a ``Mean``, a ``Sum``), read into
  the window's weight, loss sum and backward seed.
- ``_micro``: ``MicroSteps``, the trainable parameters and each micro-batch's backward into the
  window's sums (the fast path through ``.grad``, or the generic one), the ``used`` metric.
- ``_boundary``: ``apply()``'s boundary and what it decides; ``StepStats``.
- ``_state``: ``state_dict()`` / ``load_state_dict()`` (``FORMAT``), checked whole first.
- ``_feed``: ``add_window()`` for a ``Coupled`` or ``WindowStats`` loss (``_coupled``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from .. import _reduce
from .._autograd import grad_on
from .._checks import positive
from .._core.accumulator import Accumulator
from .._core.protocol import check_sync
from .._core.state import AccumState
from .._errors import describe
from ._boundary import StepStats, abort, close, rollback, takes_metric
from ._coupled import Coupled, WindowStats
from ._data import Windows
from ._feed import Feed, add_window, join_failed
from ._loss import one, scaled, split
from ._micro import MicroSteps
from ._source import run_token
from ._state import checkpoint, restore

__all__ = ["Step", "StepStats"]

OPEN = 2**31 - 1  # the windows end where the data says (Step.apply), not at a fixed n


class Step:
    """One training step of a ``torch.nn.Module``, accumulated over a window of micro-batches.

    [`add(batch)`][gradaccum.loop.Step.add] runs one micro-batch: ``loss(model, batch)``, its
    backward (into the window's running sums of an [`Accumulator`][gradaccum.Accumulator],
    through the parameters' ``.grad`` when the sums have their dtype), and the loss into the
    window's statistics. [`apply()`][gradaccum.loop.Step.apply] closes the
    window: the boundary (one collective under a sync, which also carries the statistics),
    clipping, ``.grad``, ``optimizer.step()``, exactly one ``scheduler.step()``, and the
    gradients set to ``None``.

    The model and optimizer end up as the plain PyTorch loop over the same micro-batches leaves
    them (in one process over the whole window of every rank): each micro-batch's loss scaled
    by its share of the window, ``backward()``, then ``clip_grad_norm_``, ``optimizer.step()``,
    ``scheduler.step()`` and ``zero_grad(set_to_none=True)``. That holds for any module,
    BatchNorm and dropout included (the forwards are the same, in the same order), and for:

    - **Unused parameters.** A parameter that no micro-batch of any rank reached keeps ``.grad``
      ``None`` (as under DDP for a globally unused one), so the optimizer skips it: no weight
      decay, no momentum, no state. One that some micro-batch reached gets its exact gradient
      on every rank.
    - **What the loss returns says what it is.** The objective is the mean over the window's
      items (every micro-batch, every rank). A bare 0-dim tensor is a mean over the
      micro-batch's rows: the size of dim 0 shared by every tensor in it that has a dim (``x``
      and ``y`` alike); a batch whose tensors disagree on dim 0 (a per-class weight of another
      length), or that has no tensor with a dim, is refused. For other items (tokens), return
      [`gradaccum.Mean(loss, n)`][gradaccum.Mean] (a mean over ``n`` items) or
      [`gradaccum.Sum(loss, n)`][gradaccum.Sum] (a sum over ``n`` items); the two may be
      mixed. A plain tuple ``(loss, k)`` is refused: ``(loss, rows)`` and
      ``(summed_loss, count)`` look the same. A token-mean loss
      (``F.cross_entropy(..., ignore_index=-100)``) returned bare is weighted by rows, not
      tokens (a bare token mean cannot be told from a per-row mean): return
      ``gradaccum.Mean(loss, (labels != -100).sum())``.
    - **Schedulers that take a metric** (``ReduceLROnPlateau``, or any ``step`` with a required
      argument) are stepped with the window's global loss, ``StepStats.loss``.
    - **Parameters frozen or unfrozen** (``requires_grad``) between windows: each window trains
      the parameters trainable when it starts. Changing ``requires_grad`` in the middle of a
      window is refused at the next ``add``. Ranks that disagree raise at the boundary.
      (Parameters added to the model after the ``Step`` was built are not seen: build a new
      one.)

    Args:
        model: The module to train, not wrapped in ``DistributedDataParallel`` (the sync does
            what DDP would). Its trainable parameters are those with ``requires_grad``.
        loss: ``loss(model, batch)``: the micro-batch's loss from a forward of ``model``.
            Or a [`Coupled`][gradaccum.loop.Coupled] loss (in-batch negatives: a loss that
            compares the window's examples with each other): the step then takes whole
            windows, [`add_window(window)`][gradaccum.loop.Step.add_window], and its gradient
            is that of the loss over the global window, exactly. Or a
            [`WindowStats`][gradaccum.loop.WindowStats] loss (statistics of the whole window, as
            an MoE load-balancing loss needs), which takes whole windows too.
            It returns a 0-dim tensor, the mean over the micro-batch's rows, or a
            [`gradaccum.Mean`][gradaccum.Mean] or [`gradaccum.Sum`][gradaccum.Sum] over its
            items (see above): the window's gradient is then that of the per-item losses summed
            over all micro-batches and ranks, divided by the total items.
        optimizer: A ``torch.optim.Optimizer`` over the model's parameters.
        data: The [`Windows`][gradaccum.loop.Windows] that feed this step, or ``None``. Its
            sync is then the step's (``sync=`` may be left out), and an error while reading a
            micro-batch on one rank makes this rank join the boundary flagged as failed, so
            that every other rank raises [`GradAccumError`][gradaccum.GradAccumError] in
            ``apply()`` instead of waiting for the process group's timeout. A ``Windows``
            feeds one step: the last one built with it.
        scheduler: An LR scheduler of ``optimizer``, stepped once per window (with the
            window's loss if its ``step`` takes a metric); or ``None``.
        clip: Clip the window's gradient to this global 2-norm
            ([`clip_by_global_norm()`][gradaccum.boundary.clip_by_global_norm]); ``None``: no
            clipping.
        reduction: ``"mean"`` (the default): the mean over the window's items, each
            micro-batch returning a bare loss, a ``Mean`` or a ``Sum`` (see above). ``"count"``:
            the same objective, every micro-batch returning ``Sum(summed_loss, count)`` (a bare
            loss or a ``Mean`` is refused; kept for code written before ``Sum``: the keyword
            may be dropped in new runs, but a checkpoint saved under ``"count"`` resumes only
            under ``"count"``). ``"sum"``: the plain sum of the micro-batches' gradients, nothing
            divided; a bare loss or a ``Sum``, whose ``n`` counts ``StepStats.items`` (a
            ``Mean`` is refused). The same words as [`accumulate`][gradaccum.accumulate]'s. A
            ``Coupled`` loss's shares are summed (``"sum"``, its default and only choice).
        sync: ``None`` (one process, or ``data``'s sync), [`all_reduce()`][gradaccum.all_reduce],
            a [`custom_reduce()`][gradaccum.custom_reduce] (compression, DP noise), or your own
            sync whose boundary returns whole gradients. Not a
            [`reduce_scatter()`][gradaccum.reduce_scatter]: it returns shards.
        accum_dtype: The dtype of the running sums (default as for ``Accumulator``).

    Raises:
        TypeError: An argument has the wrong type (a ``DistributedDataParallel`` model, a loss
            that is not callable, a sync that is not one, ``data`` that is not a ``Windows``).
        ValueError: ``clip`` is not positive, ``reduction`` is not one of the three, the
            scheduler is not ``optimizer``'s, the model has no trainable parameters, the sync
            is a reduce-scatter, or ``sync`` and ``data``'s sync are different objects.

    Examples:
        >>> import torch, gradaccum
        >>> from gradaccum.loop import Step
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> model = torch.nn.Linear(3, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> def mse(model, batch):
        ...     x, y = batch
        ...     return torch.nn.functional.mse_loss(model(x), y)
        >>> step = Step(model, mse, opt, clip=1.0)
        >>> x, y = torch.randn(6, 3), torch.randn(6, 1)
        >>> before = mse(model, (x, y)).item()  # the whole batch's loss
        >>> for rows in (slice(0, 4), slice(4, 6)):  # micro-batches of 4 and 2 rows
        ...     step.add((x[rows], y[rows]))
        >>> stats = step.apply()
        >>> stats.window, stats.items, stats.micro_batches, abs(stats.loss - before) < 1e-6
        (0, 6.0, 2, True)

        With the data: ``data = gradaccum.loop.windows(loader, 4, sync=sync)`` and
        ``Step(model, mse, opt, data=data)``, then ``for window in data: ...``.
    """

    state: AccumState[dict[str, torch.Tensor]]  # the Accumulator's window in progress

    def __init__(
        self,
        model: torch.nn.Module,
        loss: Callable[[torch.nn.Module, Any], Any] | Coupled,
        optimizer: torch.optim.Optimizer,
        *,
        data: Any = None,
        scheduler: Any = None,
        clip: float | None = None,
        reduction: _reduce.Reduction | None = None,
        sync: Any = None,
        accum_dtype: torch.dtype | None = None,
    ) -> None:
        where = "Step(model, loss, optimizer, ...)"
        coupled = loss if isinstance(loss, (Coupled, WindowStats)) else None
        if isinstance(loss, Coupled) and reduction not in (None, "sum"):
            raise ValueError(
                f"{where}: a Coupled loss returns this rank's share of the window's objective, "
                f"and the shares are summed: reduction must be left out (or 'sum'), got "
                f"reduction={reduction!r}; normalise inside the loss (divide by rows.total)."
            )
        if reduction is None:
            reduction = "sum" if isinstance(loss, Coupled) else "mean"
        if not isinstance(reduction, str) or reduction not in _reduce.REDUCTIONS:
            raise ValueError(
                f"{where}: reduction must be one of 'mean', 'sum', 'count', got "
                f"{describe(reduction)}; leave it out for the mean over the window's items (a "
                f"bare loss is a mean over its rows; gradaccum.Mean or gradaccum.Sum say over "
                f"which items), pass 'sum' to add the gradients as they come, or 'count' when "
                f"every micro-batch returns gradaccum.Sum(summed_loss, count)."
            )
        if not isinstance(model, torch.nn.Module) or hasattr(model, "no_sync"):
            raise TypeError(
                f"{where}: model must be a torch.nn.Module that is not wrapped in "
                f"DistributedDataParallel, got {describe(model)}; pass the module itself "
                f"(model.module of a DDP model) and sync=gradaccum.all_reduce()."
            )
        if not callable(loss) and coupled is None:
            raise TypeError(
                f"{where}: loss must be a function loss(model, batch) (or a "
                f"gradaccum.loop.Coupled), got {describe(loss)}; "
                f"pass e.g. lambda model, batch: F.mse_loss(model(batch[0]), batch[1])."
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"{where}: optimizer must be a torch.optim.Optimizer, got "
                f"{describe(optimizer)}; pass e.g. torch.optim.AdamW(model.parameters())."
            )
        if data is not None and not isinstance(data, Windows):
            raise TypeError(
                f"{where}: data must be None or what gradaccum.loop.windows(...) returned, got "
                f"{describe(data)}; pass data=gradaccum.loop.windows(loader, n, sync=sync)."
            )
        if scheduler is not None and not callable(getattr(scheduler, "step", None)):
            raise TypeError(
                f"{where}: scheduler must be None or an LR scheduler (with a step() method), "
                f"got {describe(scheduler)}; pass e.g. torch.optim.lr_scheduler.LambdaLR(...)."
            )
        if scheduler is not None and getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise ValueError(
                f"{where}: the scheduler is not the optimizer's (scheduler.optimizer is another "
                f"optimizer), so it would not change this optimizer's learning rate; build it "
                f"on the optimizer given here."
            )
        if clip is not None and not positive(clip):
            raise ValueError(
                f"{where}: clip must be None or a positive, finite number (the largest global "
                f"gradient norm), got {describe(clip)}; pass e.g. clip=1.0."
            )
        given = getattr(data, "sync", None)
        if sync is None:
            sync = given
        elif given is not None and given is not sync:
            raise ValueError(
                f"{where}: sync= and data= name different syncs: sync is {describe(sync)} at "
                f"{id(sync):#x}, data.sync (the sync given to windows(...)) is "
                f"{describe(given)} at {id(given):#x}; pass the same sync object to both, or "
                f"leave out sync= here (the step then takes data's)."
            )
        check_sync(where, sync)
        if sync is not None and sync.defer and coupled is not None:
            raise ValueError(
                f"{where}: sync was made with defer=True, and a {type(loss).__name__} loss "
                f"exchanges and reads its window's statistics on the host; pass "
                f"gradaccum.all_reduce(...) without defer=True for it."
            )
        if sync is not None and sync.defer:  # a bad window is skipped by the fused step
            try:
                sync.guard(optimizer)
            except (TypeError, ValueError) as err:
                raise type(err)(f"{where}: sync was made with defer=True: {err}") from err
        if sync is not None and sync.shards:
            raise ValueError(
                f"{where}: sync is a reduce_scatter, whose boundary returns this rank's "
                f"gradient shards, which Step cannot write into the module's .grad; use "
                f"gradaccum.Accumulator with the Sharded (docs/sharded.md), or "
                f"sync=gradaccum.all_reduce()."
            )
        self.model = model
        self.loss: Any = loss  # a Coupled's pass 2 swaps in its surrogate (loop/_feed.py)
        self._feed = None if coupled is None else Feed(coupled)  # what serves add_window
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.clip = clip
        self.reduction = reduction
        self.sync = sync
        self.data = data
        # Under "mean" the window's weight is its items: rows (a bare loss) or a Mean's or Sum's
        # n, a number or a tensor; the sums are divided by it as under "count".
        self.acc = Accumulator(OPEN, "sum" if reduction == "sum" else "count", accum_dtype, sync)
        # In the fingerprint: ranks built with another clip, reduction (the accumulator's is
        # "count" for both "mean" and "count") or loss kind would step apart.
        kind_of_loss = {Coupled: "a coupled", WindowStats: "a window-statistics"}.get(
            type(loss), "a per-micro-batch"
        )
        options = (
            f"Step(clip={clip!r}) with {kind_of_loss} loss",
            f"Step(reduction={reduction!r})",
        )
        object.__setattr__(self.acc, "_options", options)
        if sync is not None:
            run_token()  # the checkpoints' run token, read while every rank is surely there
        self._plateau = scheduler is not None and takes_metric(scheduler)
        self._saves = 0  # loop.save calls since the last boundary (carried in its exchange)
        self._undo: Any = None  # deferred: the scheduler as before the last window's step
        if sync is not None and sync.defer:
            sync._on_bad(self._rollback)
        self._since: float | None = None
        self._micro = MicroSteps(self.acc, model)  # the trainable parameters, the backwards
        self.state = self._micro.train(where, None)
        hooks = getattr(data, "_on_error", None)
        if isinstance(hooks, list):  # one step per data: a step built before is let go
            hooks[:] = [h for h in hooks if not isinstance(getattr(h, "__self__", None), Step)]
            hooks.append(self._failed_data)

    def _rollback(self, pending: Any) -> None:
        """A deferred sync read a bad window: put back what this rank's apply() stepped."""
        rollback(self, pending)

    @property
    def window(self) -> int:
        """The index of the window in progress (the optimizer steps taken so far)."""
        return self.state.window

    @property
    def micro_step(self) -> int:
        """The micro-batches this rank added to the window in progress."""
        return self.state.micro_step

    @grad_on  # exact under torch.no_grad() and torch.inference_mode(), as torch.func.grad is
    def add(self, batch: Any) -> None:
        """Run one micro-batch: the loss, its backward into the window's sums, its statistics.

        On an error (in the loss, say) under a sync, this rank joins the window's boundary
        flagged as failed, so that every other rank raises instead of waiting, and the error
        is re-raised. Without a sync the micro-batch is left out and the window goes on; but
        on the fast path a backward that raised part-way (a tensor hook's error) has added into
        some of the window's sums already, so the window's micro-batches so far are dropped
        with it (its index stays).

        Raises:
            TypeError: The loss function returned the wrong kind (see ``loss`` of
                [`Step`][gradaccum.loop.Step]): a plain tuple, a ``Mean`` under ``"count"``
                or ``"sum"``, a bare loss under ``"count"``, not a 0-dim tensor.
            ValueError: The loss does not require grad, its rows are not known (the batch's
                tensors disagree on dim 0), or a parameter was frozen or unfrozen in the
                middle of the window. (A bad ``n`` is refused where the ``Mean`` or ``Sum`` is
                built, in the loss function.)
        """
        feed = self._feed
        if feed is None:
            where = "Step.add(batch)"
        elif feed.feeding:  # add_window's pass 2 (a Coupled or WindowStats loss): named after it
            where = "Step.add_window(batches)"
        else:
            raise TypeError(
                f"Step.add(batch): this step's loss is {feed.loss!r}, which needs the whole "
                f"window at once (its examples are compared with each other); pass the window's "
                f"micro-batches together: step.add_window(window), then step.apply()."
            )
        if self._since is None:
            self._since = time.perf_counter()
        micro = self._micro
        if self.state.micro_step == 0 and self.sync is not None and self.sync.defer:
            # The last window's checks, before anything of this one: every rank reads them at
            # its first add() (or apply(), if it has none), and raises there for a bad window.
            self.sync._settle(where)
        began = False
        try:
            self.state = state = micro.follow(where, self.state)
            value, scale, items = split(where, self.loss(self.model, batch), batch, self.reduction)
            summed = value.detach() if one(scale) else scaled(value.detach(), scale)
            metrics = {
                "loss": summed,
                "micro_batches": 1,
                "saves": micro.on_device("no saves", (0.0, 0.0, 0.0)),
                "used": micro.on_device("no new use", (0.0,) * len(micro.params)),
            }
            self.acc._check_add(state, metrics)
            if micro.fast:
                window = micro.open(where, state)
                began = True
                metrics["used"] = micro.backward(window, value, scale)
            else:
                window, metrics["used"] = micro.generic(where, state, value, scale)
            self.state = self.acc._counted(state, window, items, metrics)
        except BaseException:
            if self.sync is not None:
                abort(self)
            elif began:  # the backward raised part-way: the sums it was adding into are partial
                index = self.state.window
                self.state = self.acc._abort(self.state, micro.win)._replace(window=index)
                micro.drop()
            raise

    @grad_on
    def add_window(self, batches: Any) -> None:
        """Add a whole window at once, for a loss that needs all of its micro-batches.

        For a [`Coupled`][gradaccum.loop.Coupled] or [`WindowStats`][gradaccum.loop.WindowStats]
        loss. ``batches``: an iterable of micro-batches (a
        [`DataWindow`][gradaccum.loop.DataWindow], or a list). A ``Coupled`` loss: both passes
        of [`coupled()`][gradaccum.coupled], every
        micro-batch embedded without a graph, the representations of every rank gathered, the
        loss once on all of them, then each micro-batch again into the window's sums. Then
        call [`apply()`][gradaccum.loop.Step.apply] as usual; ``StepStats.loss`` is the
        objective (the sum of the ranks' shares), ``StepStats.items`` the window's rows. A
        ``WindowStats`` loss: its statistics over the window and the ranks first (without a
        graph), then each micro-batch's loss with them, as ``add`` would run it.

        Raises:
            TypeError: The step's loss is neither (use ``add``), or the
                representations or the loss are of the wrong kind (see
                [`coupled()`][gradaccum.coupled]).
            ValueError: Micro-batches were added to this window already.
            GradAccumError: Under a sync: another rank failed in its first pass or its loss
                (every rank raises together, before any gradient is added), the ranks disagree
                on the representations or the window, or a rank has no rows.
        """
        add_window(self, batches)

    def _failed_data(self, err: BaseException) -> None:
        """``data``'s callback: reading a micro-batch raised ``err`` on this rank.

        Under a sync this rank joins the window's boundary flagged as failed (the other ranks
        raise in ``apply()``); ``data`` re-raises ``err`` after.
        """
        if self.sync is not None and self._feed is not None:
            join_failed(self, err)  # the other ranks are in add_window's first collective
        elif self.sync is not None:
            abort(self)

    @grad_on
    def apply(self) -> StepStats:
        """Close the window: boundary, clip, ``.grad``, one optimizer and scheduler step.

        Every rank calls it once per window (under a sync, a rank whose window is empty too).
        A parameter that no micro-batch of any rank reached keeps ``.grad`` ``None``.

        Returns:
            The window's [`StepStats`][gradaccum.loop.StepStats].

        Raises:
            ValueError: The window is empty (in one process: no micro-batch was added; under a
                sync: on every rank), or its items add up to 0.
            GradAccumError: Under a sync: the ranks disagree (on the trainable parameters, or
                on how many times they called ``loop.save`` in the window: then the optimizer
                has not stepped on any rank), another rank failed, or a collective failed or
                timed out (see ``Accumulator.finalize``).
        """
        return close(self)

    def state_dict(self) -> dict[str, Any]:
        """The model, optimizer, scheduler and the window in progress (its running sums).

        Besides their state dicts it records what a resume must match: the optimizer's and the
        scheduler's classes, the model's parameter names in each optimizer group, and the
        reduction. Safe for ``torch.load(..., weights_only=True)``; tensors are copies or the
        module's own (``model.state_dict()``), as ``torch.save`` expects.
        """
        return checkpoint(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what [`state_dict()`][gradaccum.loop.Step.state_dict] saved (bit-identical).

        All or nothing: everything is checked against this step (and the window in progress
        rebuilt) before the model, optimizer, scheduler or window change; a refused state
        changes none of them.

        Raises:
            ValueError: The state is not a ``Step.state_dict()`` of this version, or its model
                (names, shapes, dtypes), optimizer (class, parameter groups), scheduler or
                reduction is not this step's; the message names the difference.
            GradAccumError: The state is damaged, or its window in progress does not load.
        """
        restore(self, state_dict)
