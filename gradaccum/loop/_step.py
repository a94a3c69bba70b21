"""``gradaccum.loop.Step``: a module's micro-steps and its boundary, one optimizer step a window.

``Step`` is the plain PyTorch accumulation loop (each micro-batch's loss scaled by its share of
the window, ``backward()``, one ``optimizer.step()``, ``scheduler.step()``,
``zero_grad(set_to_none=True)``) run on an [`Accumulator`][gradaccum.Accumulator]. What the
plain loop decides from ``.grad`` travels in the boundary collective that already carries the
window's weight, as metrics (no collective of its own, no host sync per micro-batch):

- ``used``: per trainable parameter, a count that is 0 exactly when no micro-batch reached it (a
  1-D metric): on the fast path 1 per rank whose window reached it (a hook per parameter, removed
  once a backward reaches it), on the generic path the micro-batches that reached it. A
  parameter with a count of 0 over every rank keeps ``.grad`` ``None``, as in the plain loop
  (and under DDP, for a parameter unused on every rank): weight decay and momentum leave it,
  and the optimizer grows no state for it.
- ``saves``: ``[1, c, c**2]`` for the ``c`` calls of ``loop.save`` on the rank since the last
  boundary. Summed over the ranks, ``ranks * sum(c**2) == sum(c)**2`` exactly when every rank
  saved as often, which every rank reads from the same totals, so all of them raise together.
- ``loss``, ``micro_batches``: the window's statistics (``StepStats``).

The fast path (every sum in its parameter's dtype): ``add`` runs ``backward()`` into the window
that ``Accumulator._live`` opened at the window's first micro-batch. That backward's gradients
become the sums (``Window.adopt``, from a hook as each is produced: into the flat buckets under
``all_reduce()``), the parameters' ``.grad`` point at them, and the later backwards add in place.
``apply()`` closes that same window (``Accumulator._close(..., live)``). Other sums (another
dtype) take the generic path: ``torch.autograd.grad``, then ``Accumulator.add``.
"""

from __future__ import annotations

import functools
import inspect
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch

from .. import _metrics, _reduce, _tree
from .._autograd import backward, grad_on, plain_tensors
from .._checks import positive
from .._core.accumulator import Accumulator
from .._core.protocol import Window, check_sync
from .._core.state import AccumState, pass_on
from .._errors import GradAccumError, describe
from .._kinds import Mean, Sum
from .._layout import check_grads
from ..boundary import clip_by_global_norm
from ._coupled import Coupled, WindowStats, add_window, join_failed
from ._data import Windows
from ._plan import DataWindow
from ._source import run_token
from ._state import kind, optimizer_params, prepare

__all__ = ["FORMAT", "Step", "StepStats"]

FORMAT = "gradaccum.loop.Step/2"
OPEN = 2**31 - 1  # the windows end where the data says (Step.apply), not at a fixed n
_MASKS = 256  # the used-patterns kept on the device (each one is copied there once)


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


def _rows(where: str, batch: Any, reduction: str) -> int:
    """A micro-batch's rows: the size of dim 0 shared by every tensor leaf with a dim."""
    leaves = [x for x in _tree.flatten(batch)[0] if isinstance(x, torch.Tensor) and x.dim() > 0]
    rule = f"under reduction={reduction!r} a micro-batch " + (
        "weighs its rows" if reduction == "mean" else "counts its rows (StepStats.items)"
    )
    kind = "Mean" if reduction == "mean" else "Sum"
    fix = (
        f"return gradaccum.{kind}(loss, rows) from the loss function, rows the number of "
        f"examples it covers (e.g. gradaccum.{kind}(loss, len(batch['input_ids'])))"
    )
    if not leaves:
        raise ValueError(
            f"{where}: {rule}, the size of dim 0 of its tensors, but this one has no tensor "
            f"with a dim; {fix}."
        )
    rows = leaves[0].shape[0]
    if all(x.shape[0] == rows for x in leaves):
        return int(rows)
    paths, values, _ = _tree.flatten_with_paths(batch)
    sized = [
        (k, x.shape[0])
        for k, x in zip(paths, values)
        if isinstance(x, torch.Tensor) and x.dim() > 0
    ]
    (pa, ra), (pb, rb) = sized[0], next(kr for kr in sized if kr[1] != rows)
    raise ValueError(
        f"{where}: {rule}, the size of dim 0 shared by its tensors, but they disagree: "
        f"batch{pa} has {ra} along dim 0 and batch{pb} has {rb}, so the rows are not known; "
        f"{fix}."
    )


def _tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _one(x: Any) -> bool:
    """Whether ``x`` is the number 1 (a scale that changes nothing)."""
    return isinstance(x, (int, float)) and x == 1


def _scaled(loss: torch.Tensor, n: Any) -> torch.Tensor:
    """``loss * n`` for the window's loss sum: 0 where ``n`` is 0 (a mean over no items is NaN).

    A micro-batch with no items (all padding) contributes nothing to the objective; its mean,
    ``F.cross_entropy`` over no tokens, is NaN, and NaN * 0 would make the window's loss NaN.
    A tensor ``n`` is not read on the host: ``torch.where`` picks on the device.
    """
    if isinstance(n, torch.Tensor):
        return torch.where(n == 0, torch.zeros((), dtype=loss.dtype, device=loss.device), loss * n)
    return loss * n if n != 0 else torch.zeros_like(loss)


def _takes_metric(scheduler: Any) -> bool:
    """Whether ``scheduler.step`` needs a value (``ReduceLROnPlateau.step(metrics)``)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return True
    try:
        params = inspect.signature(scheduler.step).parameters.values()
    except (TypeError, ValueError):  # no signature to read: stepped without one
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(p.kind in positional and p.default is inspect.Parameter.empty for p in params)


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
        if sync is not None and sync.defer:
            raise ValueError(
                f"{where}: sync was made with defer=True, whose boundary is read by the next "
                f"window; Step reads each boundary on the host (its stats, the LR scheduler, "
                f"unused parameters) and does not skip a bad window on the device yet, so a "
                f"window another rank failed would be applied here; pass "
                f"gradaccum.all_reduce(...) without defer=True, or use accumulate / "
                f"Accumulator with sync.guard(optimizer)."
            )
        if sync is not None and sync.shards:
            raise ValueError(
                f"{where}: sync is a reduce_scatter, whose boundary returns this rank's "
                f"gradient shards, which Step cannot write into the module's .grad; use "
                f"gradaccum.Accumulator with the Sharded (docs/sharded.md), or "
                f"sync=gradaccum.all_reduce()."
            )
        self.model = model
        self.loss: Any = loss  # a Coupled's pass 2 swaps in its surrogate (loop/_coupled.py)
        self._coupled = coupled
        self._feeding = False  # add_window's pass 2 is adding its micro-batches
        self._joined = False  # a data error joined add_window's agreement, flagged as failed
        self._kept: tuple[Any, list[Any]] | None = None  # add_window's batches, for a retry
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
        self._plateau = scheduler is not None and _takes_metric(scheduler)
        self._saves = 0  # loop.save calls since the last boundary (carried in its exchange)
        self._since: float | None = None
        self._names: list[str] = []
        self._params: list[torch.nn.Parameter] = []
        self._inputs: tuple[torch.nn.Parameter, ...] = ()
        self._plain = False
        # Every parameter of the model (as built) and its requires_grad when the window started:
        # read at each add, without walking the modules.
        self._every = list(model.named_parameters())
        self._flags = [p.requires_grad for _, p in self._every]
        self._zeros: list[torch.Tensor | None] = []
        self._masks: dict[Any, torch.Tensor] = {}
        # The fast path (every sum in its parameter's dtype): the backwards run straight into the
        # window's sums, which the trainable parameters' .grad point at.
        self._fast = False
        self._slot: list[int] = []  # each trainable parameter's leaf in the window's layout
        self._win: Window | None = None  # the window in progress, once a micro-batch opened it
        self._first: list[Any] = []  # per parameter: its hook until a backward of the window
        self._hit: list[int] = []  # the parameters those hooks saw in the running backward
        self._adopting = False  # the window's first backward: its gradients become the sums
        self._seeds: dict[tuple[float, torch.dtype, torch.device], torch.Tensor] = {}
        self._train(where, fresh=True)
        hooks = getattr(data, "_on_error", None)
        if isinstance(hooks, list):  # one step per data: a step built before is let go
            hooks[:] = [h for h in hooks if not isinstance(getattr(h, "__self__", None), Step)]
            hooks.append(self._failed_data)

    # -- the trainable parameters ----------------------------------------------------------------

    def _metric_shapes(self) -> dict[str, tuple[int, ...]]:
        """The window's metrics: see the module notes."""
        return {"loss": (), "micro_batches": (), "saves": (3,), "used": (len(self._names),)}

    def _train(self, where: str, fresh: bool) -> None:
        """Make the parameters with ``requires_grad`` now those of the window that starts."""
        named = [(k, p) for (k, p), on in zip(self._every, self._flags) if on]
        if not named:
            raise ValueError(
                f"{where}: the model has no trainable parameters (none with requires_grad); "
                f"unfreeze what you mean to train."
            )
        old = None if fresh else self.state
        if old is not None and old.reduce_state is not None:
            raise ValueError(
                f"{where}: the trainable parameters (requires_grad) changed since the last "
                f"window, but the sync keeps a state between windows shaped like the old ones "
                f"(its custom reduction's, e.g. error feedback), which would not fit; keep "
                f"requires_grad fixed with this sync, or build a new sync and Step after "
                f"changing it. Nothing was changed."
            )
        self._drop()
        self._names = [k for k, _ in named]
        self._params = [p for _, p in named]
        self._inputs = tuple(self._params)  # the backward's inputs
        self._plain = plain_tensors(self._params)
        self._zeros = [None] * len(named)
        self._masks = {}
        state = self.acc.init({k: p.detach() for k, p in named}, metrics=self._metric_shapes())
        self.state = state if old is None else state._replace(window=old.window, epoch=old.epoch)
        self._device = _metrics.device_of(self.state.layout)
        self._fast = self.state.layout.same_dtypes
        order = _tree.flatten({k: i for i, k in enumerate(self._names)})[0]  # the layout's order
        self._slot = [0] * len(named)
        for leaf, i in enumerate(order):
            self._slot[i] = leaf

    def _follow(self, where: str) -> None:
        """Before a micro-batch (or an empty window's boundary): follow ``requires_grad``.

        At a window's start the window trains the parameters trainable now; in the middle of
        one, a change is refused, naming the parameter.
        """
        flags = [p.requires_grad for _, p in self._every]
        if flags == self._flags:
            return
        if self.state.micro_step == 0:
            before = self._flags
            self._flags = flags
            try:
                self._train(where, fresh=False)
            except BaseException:
                self._flags = before
                raise
            return
        k, now = next(
            (k, now) for (k, _), now, was in zip(self._every, flags, self._flags) if now != was
        )
        raise ValueError(
            f"{where}: the parameter {k!r} was {'unfrozen' if now else 'frozen'} "
            f"(requires_grad={now}) in the middle of window {self.window}, after "
            f"{self.micro_step} micro-batch(es); change requires_grad between windows (after "
            f"step.apply()), where the step follows it as a plain loop would. This micro-batch "
            f"was not added."
        )

    # -- the window ------------------------------------------------------------------------------

    @property
    def window(self) -> int:
        """The index of the window in progress (the optimizer steps taken so far)."""
        return self.state.window

    @property
    def micro_step(self) -> int:
        """The micro-batches this rank added to the window in progress."""
        return self.state.micro_step

    def _split(self, where: str, out: Any, batch: Any) -> tuple[torch.Tensor, Any, Any]:
        """What the loss returned: ``(loss, scale, items)``, checked.

        The backward of ``loss * scale`` goes into the window's sums, ``items`` into its weight
        and ``loss * scale`` into its loss sum: a bare loss (a mean over the rows) and a ``Mean``
        are scaled by their items, a ``Sum`` is not (nor anything under ``"sum"``).
        """
        red = self.reduction
        if isinstance(out, (Mean, Sum)):
            if red != "mean" and isinstance(out, Mean):
                fix = (
                    "return gradaccum.Sum(loss * n, n) (the sum over the n items), or drop "
                    "reduction='count' (a Mean is then weighted by its n)"
                    if red == "count"
                    else "return the summed loss, gradaccum.Sum(loss * n, n), or drop "
                    "reduction='sum' to take the mean over the window's items"
                )
                raise TypeError(
                    f"{where}: the loss function returned gradaccum.Mean(loss, n), but under "
                    f"reduction={red!r} every micro-batch returns a sum over its items; {fix}."
                )
            value, scale, items = out.loss, (out.n if isinstance(out, Mean) else 1), out.n
        elif isinstance(out, (tuple, list)):
            got = ", ".join(
                "tensor" if isinstance(x, torch.Tensor) else type(x).__name__ for x in out
            )
            raise TypeError(
                f"{where}: the loss function returned a {len(out)}-{type(out).__name__} "
                f"({got}), which does not say what the loss is: (loss, rows) and (summed_loss, "
                f"count) look the same; return gradaccum.Mean(loss, n) for a mean over n items "
                f"(rows or tokens), or gradaccum.Sum(loss_sum, n) for a sum over n items."
            )
        elif red == "count":
            raise TypeError(
                f"{where}: under reduction='count' the loss function returns "
                f"gradaccum.Sum(summed_loss, count), got {describe(out)}; return e.g. "
                f"gradaccum.Sum(loss_sum, (labels != -100).sum()), or drop reduction='count' "
                f"for a mean over the micro-batch's rows."
            )
        else:
            value = out
            items = _rows(where, batch, red)
            scale = items if red == "mean" else 1
        if red == "sum":
            scale = 1
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            raise TypeError(
                f"{where}: the loss must be a 0-dim tensor, got {describe(value)}; reduce it "
                f"(loss.mean() or .sum())."
            )
        if not value.requires_grad:
            raise ValueError(
                f"{where}: the loss does not depend on the model's trainable parameters (it "
                f"does not require grad); compute it from model(...), outside torch.no_grad()."
            )
        return value, scale, items

    def _zero(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s gradient where the loss did not reach it (no memory of its own)."""
        z = self._zeros[i]
        if z is None:
            p = self._params[i]
            z = self._zeros[i] = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
        return z

    def _on_device(self, key: Any, values: tuple[float, ...]) -> torch.Tensor:
        """``values`` as a tensor on the sums' device, copied there once per ``key``.

        The copy is from pinned memory on CUDA, so it does not wait for the device either.
        """
        t = self._masks.get(key)
        if t is None:
            if len(self._masks) >= _MASKS:
                self._masks.clear()
            dtype = torch.float32 if self._device.type == "mps" else torch.float64
            host = torch.tensor(values, dtype=dtype)
            if self._device.type == "cuda":
                host = host.pin_memory()
            t = self._masks[key] = host.to(self._device, non_blocking=True)
        return t

    def _with_saves(self, state: Any, saves: int) -> Any:
        """``state`` with this rank's ``[1, saves, saves**2]`` in its sums, for the boundary."""
        c = float(saves)
        sums = dict(state.metrics or {})
        sums["saves"] = self._on_device(("saves", c), (1.0, c, c * c))
        return state._replace(metrics=dict(sorted(sums.items())))

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
        # Run by add_window's pass 2 (a Coupled or WindowStats loss), it is named after that call.
        where = "Step.add_window(batches)" if self._feeding else "Step.add(batch)"
        if self._coupled is not None and not self._feeding:
            raise TypeError(
                f"{where}: this step's loss is {self._coupled!r}, which needs the whole window at "
                f"once (its examples are compared with each other); pass the window's "
                f"micro-batches together: step.add_window(window), then step.apply()."
            )
        if self._since is None:
            self._since = time.perf_counter()
        began = False
        try:
            self._follow(where)
            value, scale, items = self._split(where, self.loss(self.model, batch), batch)
            summed = value.detach() if _one(scale) else _scaled(value.detach(), scale)
            metrics = {
                "loss": summed,
                "micro_batches": 1,
                "saves": self._on_device("no saves", (0.0, 0.0, 0.0)),
                "used": self._on_device("no new use", (0.0,) * len(self._params)),
            }
            self.acc._check_add(self.state, metrics)
            if self._fast:
                window = self._open(where)
                began = True
                metrics["used"] = self._backward(window, value, scale)
                self.state = self.acc._counted(self.state, window, items, metrics)
                return
            # A number scales the sums in their dtype (alpha), a tensor n the backward (its seed).
            seed, alpha = (self._seed(value, scale), 1) if _tensor(scale) else (None, scale)
            grads = torch.autograd.grad(value, self._params, seed, allow_unused=True)
            used = tuple(g is not None for g in grads)
            tree = {
                k: g if g is not None else self._zero(i)
                for i, (k, g) in enumerate(zip(self._names, grads))
            }
            # zeros: apply() puts this rank's count there (the same width: the buckets of the
            # window's sums hold the tail the boundary sends)
            metrics["used"] = self._on_device(used, used)
            window = self.acc._live(where, self.state)
            window.begin(1)
            window.add(check_grads(where, self.state.layout, tree), alpha)
            window.step()
            self.state = self.acc._counted(self.state, window, items, metrics)
        except BaseException:
            if self.sync is not None:
                self._abort()
            elif began:  # the backward raised part-way: the sums it was adding into are partial
                index = self.state.window
                self.state = self.acc._abort(self.state, self._win)._replace(window=index)
                self._drop()
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
        where = "Step.add_window(batches)"
        if self._coupled is None:
            raise TypeError(
                f"{where}: this step's loss is a per-micro-batch loss; add the window's "
                f"micro-batches one by one with step.add(batch), or build the step with "
                f"loss=gradaccum.loop.Coupled(embed, loss) (a loss that couples them) or "
                f"gradaccum.loop.WindowStats(stats, loss) (one that uses the window's "
                f"statistics)."
            )
        if self.micro_step:
            if isinstance(batches, DataWindow) and batches.taken == self.micro_step:
                return  # resumed from a save after add_window: the window's sums are loaded
            raise ValueError(
                f"{where}: window {self.window} already has {self.micro_step} micro-batch(es); "
                f"add_window takes a whole window once: call step.apply() first."
            )
        add_window(self, batches)

    def _abort(self) -> None:
        """Join the window's boundary flagged as failed (the other ranks raise in ``apply()``)."""
        state = self._with_saves(self.state, self._saves)
        self._saves = 0
        try:
            self.state = self.acc._abort(state, self._win)
        finally:
            self._drop()

    def _failed_data(self, err: BaseException) -> None:
        """``data``'s callback: reading a micro-batch raised ``err`` on this rank.

        Under a sync this rank joins the window's boundary flagged as failed (the other ranks
        raise in ``apply()``); ``data`` re-raises ``err`` after.
        """
        if self.sync is not None and self._coupled is not None:
            join_failed(self, err)  # the other ranks are in add_window's first collective
        elif self.sync is not None:
            self._abort()

    # -- the fast path: the backward into the window's sums --------------------------------------

    def _open(self, where: str) -> Window:
        """The window in progress, opened at its first micro-batch (or after a resume).

        A new window keeps its first backward's gradients as its sums (a bucket's view under
        ``all_reduce()``: moved there by a hook as each is produced, as ``accumulate`` does);
        restored sums (a checkpoint's window) become the parameters' ``.grad`` at once. Either
        way every trainable parameter gets a hook that tells, once per window, that a backward
        reached it (the ``used`` metric).
        """
        window = self._win
        if window is not None:
            return window
        params, state = self._params, self.state
        if state.sums is None:
            for p in params:  # (what the user left there would be added into the sums)
                p.grad = None
        window = self.acc._live(where, state)
        if state.sums is None:
            window.prepare(zero=False)
            self._adopting = True
        else:
            sums = state.sums
            for k, p in zip(self._names, params):
                p.grad = sums[k]
        self._win = window
        self._hit.clear()
        self._first = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_first, i))  # type: ignore[no-untyped-call]
            for i, p in enumerate(params)
        ]
        return window

    def _on_first(self, i: int, p: torch.Tensor) -> None:
        """A backward reached parameter ``i``, for the first time in the window."""
        if self._adopting:  # its first gradient: moved into the window's storage
            p.grad = self._win.adopt(self._slot[i], p.grad)  # type: ignore[union-attr]
        self._hit.append(i)

    def _seed(self, value: torch.Tensor, scale: Any) -> torch.Tensor:
        """``scale`` (a number, or a ``Mean``'s tensor ``n``) as the seed of ``value``'s backward.

        In ``value``'s dtype and on its device; a number's seed is made once (no copy per
        micro-batch), a tensor's is converted on the device (no host sync).
        """
        if _tensor(scale):
            return cast(torch.Tensor, scale).to(device=value.device, dtype=value.dtype)
        key = (scale, value.dtype, value.device)
        seed = self._seeds.get(key)
        if seed is None:
            if len(self._seeds) >= _MASKS:
                self._seeds.clear()
            seed = self._seeds[key] = torch.full((), scale, dtype=value.dtype, device=value.device)
        return seed

    def _backward(self, window: Window, value: torch.Tensor, scale: Any) -> torch.Tensor:
        """Backward of ``value``, scaled by ``scale``, into the sums; the ``used`` metric's mask.

        The mask has a 1 for each parameter that this backward reached first in the window, so
        its sum over the window is 1 for a parameter that any micro-batch reached (0 else).
        """
        seed = self._seed(value, scale)
        params = self._params
        window.begin(1)
        backward(value, seed, self._inputs, self._plain)
        if self._adopting:  # the parameters this first backward did not reach: a zero sum
            self._adopting = False
            for i, p in enumerate(params):
                if p.grad is None:
                    p.grad = window.adopt(self._slot[i], None)
        window.step()
        hit = self._hit
        if not hit:
            return self._on_device("no new use", (0.0,) * len(params))
        first = self._first
        for i in hit:
            first[i].remove()
            first[i] = None
        reached = tuple(sorted(hit))
        hit.clear()
        mask = [0.0] * len(params)
        for i in reached:
            mask[i] = 1.0
        return self._on_device(("used", reached), tuple(mask))

    def _drop(self) -> None:
        """Let the window in progress go (closed, aborted or replaced): its hooks too.

        The parameters' ``.grad``, its running sums, are set to ``None``: ``apply()`` sets them
        from the boundary's result, and a window that failed leaves nothing there.
        """
        if self._win is not None:
            for p in self._params:
                p.grad = None
        for h in self._first:
            if h is not None:
                h.remove()
        self._first = []
        self._hit.clear()
        self._win = None
        self._adopting = False

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
        where = "Step.apply()"
        if self.state.micro_step == 0 and self.sync is None:  # one process: nothing to apply
            add = "step.add_window(window)" if self._coupled is not None else "step.add(batch)"
            raise ValueError(
                f"{where}: no micro-batch was added in window {self.window}, so there is no "
                f"gradient to apply; add the window's micro-batches first ({add}), then call "
                f"step.apply()."
            )
        if self.state.micro_step == 0:  # an empty window trains what the other ranks' do
            self._follow(where)
        saves, names, params = self._saves, self._names, self._params
        self._saves, self._kept = 0, None
        try:
            # Accumulator.boundary, its errors named after this call (not Accumulator(n=...)).
            state, live = self._with_saves(self.state, saves), self._win
            self._drop()
            grads, self.state, totals = self.acc._close(where, state, "apply()", True, live)
        except GradAccumError:
            if self._coupled is not None:  # a window taken whole is dropped whole: add it again
                sig = _metrics.signature(state.metrics)
                fresh = self.acc._next(state, state.reduce_state, sig)._replace(window=state.window)
                self.state = pass_on(state, fresh, "apply()")
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
        m = totals.metrics
        ranks, calls, squares = cast(list[float], m["saves"])
        if ranks * squares != calls * calls:
            raise GradAccumError(
                f"{where}: the ranks called gradaccum.loop.save a different number of times in "
                f"window {totals.window} (this rank {saves}; {calls:g} calls over {ranks:g} "
                f"ranks), so the checkpoint is not the same point on every rank. Every rank "
                f"must reach each save: decide it from the window alone (if window.index == "
                f"save_at: loop.save(path, step)). The optimizer did not step, on any rank."
            )
        items, loss_sum = totals.weight, cast(float, m["loss"])
        micro = round(cast(float, m["micro_batches"]))
        if self.reduction != "sum" and not items > 0:  # in one process: tensor n, not read before
            raise ValueError(
                f"{where}: the items of window {totals.window} add up to {items:g} (every "
                f"micro-batch's n is 0: all padding?), so there is no mean over them to take; "
                f"the window was dropped, nothing was applied (the parameters' .grad stay None) "
                f"and the next window goes on. Skip windows with no items, or use "
                f"reduction='sum'."
            )
        if self.clip is not None:
            grads, norm = clip_by_global_norm(grads, self.clip)
        else:
            leaves = _tree.flatten(grads)[0]
            wide = torch.float64 if any(g.dtype == torch.float64 for g in leaves) else torch.float32
            norms = [x.to(wide) for x in torch._foreach_norm(leaves)]
            norm = torch.linalg.vector_norm(torch.stack(norms))
        for k, p, count in zip(names, params, cast(list[float], m["used"])):
            if count == 0:
                p.grad = None  # unused in every micro-batch of every rank, as in the plain loop
            else:
                p.grad = grads[k].to(p.dtype)  # the same tensor when it has the dtype already
        lr = float(self.optimizer.param_groups[0]["lr"])
        loss = loss_sum if self.reduction == "sum" else loss_sum / items
        self.optimizer.step()
        if self.scheduler is not None:
            if self._plateau:
                self.scheduler.step(loss)
            else:
                self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        now = time.perf_counter()
        seconds, self._since = now - (self._since or now), now
        # Read once the optimizer's step is queued behind it: on a device the host then waits
        # for the norm alone, and the device still has the step to run (no drained queue).
        grad_norm = float(norm)
        return StepStats(totals.window, loss, items, micro, grad_norm, lr, seconds)

    def state_dict(self) -> dict[str, Any]:
        """The model, optimizer, scheduler and the window in progress (its running sums).

        Besides their state dicts it records what a resume must match: the optimizer's and the
        scheduler's classes, the model's parameter names in each optimizer group, and the
        reduction. Safe for ``torch.load(..., weights_only=True)``; tensors are copies or the
        module's own (``model.state_dict()``), as ``torch.save`` expects.
        """
        return {
            "format": FORMAT,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "optimizer_kind": kind(self.optimizer),
            "optimizer_params": optimizer_params(self.model, self.optimizer),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "scheduler_kind": None if self.scheduler is None else kind(self.scheduler),
            "reduction": self.reduction,
            "accumulator": self.acc.state_dict(self.state),
        }

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
        sd = state_dict
        where = "Step.load_state_dict(state_dict)"
        if not isinstance(sd, dict) or sd.get("format") != FORMAT:
            got = sd.get("format") if isinstance(sd, dict) else None
            if isinstance(got, str) and got.startswith("gradaccum.loop.Step/"):
                raise ValueError(
                    f"{where}: the state has format {got!r}, but this gradaccum reads "
                    f"{FORMAT!r}; load it with the gradaccum version that saved it."
                )
            raise ValueError(
                f"{where}: expected a dict with format {FORMAT!r}, got {describe(sd)}; pass "
                f"what Step.state_dict() returned."
            )
        prepare(where, self, sd)()
