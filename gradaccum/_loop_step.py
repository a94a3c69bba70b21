"""``gradaccum.loop.Step``: a module's micro-steps and its boundary, one optimizer step a window."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import _loop_state, _reduce, _tree
from ._boundary import clip_by_global_norm
from ._comm import positive
from ._errors import describe
from ._module import write_grads
from ._state import Accumulator
from ._window import check_sync

__all__ = ["FORMAT", "Step", "StepStats"]

FORMAT = "gradaccum.loop.Step/2"
OPEN = 2**31 - 1  # the windows end where the data says (Step.apply), not at a fixed n
METRICS = ("loss", "micro_batches")  # summed in the boundary collective, with the weight


class StepStats(NamedTuple):
    """What [`Step.apply()`][gradaccum.loop.Step.apply] reports about the window it closed.

    The sums are over every micro-batch of every rank, read from the boundary collective that
    already reduces the gradients.

    Attributes:
        window: The index of the window (the optimizer step), from 0.
        loss: The window's global loss: the mean over its rows (``reduction="mean"``), over
            its counted items (``"count"``: e.g. tokens), or the sum (``"sum"``).
        items: The rows (``"mean"``, ``"sum"``) or counted items (``"count"``) of the window.
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
        """Throughput: ``items`` (tokens under ``"count"``) per second of the window."""
        return self.items / self.seconds if self.seconds > 0 else math.inf


def _rows(where: str, batch: Any) -> int:
    leaves = [x for x in _tree.flatten(batch)[0] if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not leaves:
        raise ValueError(
            f"{where}: the micro-batch has no tensor with a dim 0 to count its rows; return "
            f"(loss, rows) from the loss function."
        )
    return int(leaves[0].shape[0])


class Step:
    """One training step of a ``torch.nn.Module``, accumulated over a window of micro-batches.

    [`add(batch)`][gradaccum.loop.Step.add] runs one micro-batch: ``loss(model, batch)``, its
    backward (into the window's running sums of an [`Accumulator`][gradaccum.Accumulator]), and
    the loss into the window's statistics. [`apply()`][gradaccum.loop.Step.apply] closes the
    window: the boundary (one collective under a sync, which also carries the statistics),
    clipping, [`write_grads()`][gradaccum.write_grads], ``optimizer.step()``, exactly one
    ``scheduler.step()``, and the gradients set to ``None``. The update equals the one from the
    whole window's loss in one backward (over all ranks), whatever the micro-batch sizes.

    Args:
        model: The module to train, not wrapped in ``DistributedDataParallel`` (the sync does
            what DDP would). Its trainable parameters are those with ``requires_grad``.
        loss: ``loss(model, batch)``: the micro-batch's loss from a forward of ``model``.
            Under ``reduction="mean"``, the mean over the micro-batch's rows (dim 0 of its first
            tensor; or return ``(loss, rows)``); under ``"sum"``, the sum; under ``"count"``,
            ``(summed_loss, count)``, e.g. the summed token loss and the number of tokens: the
            window's gradient is then that of the loss summed over all micro-batches and ranks
            divided by the total count.
        optimizer: A ``torch.optim.Optimizer`` over the model's parameters.
        scheduler: An LR scheduler of ``optimizer``, stepped once per window; or ``None``.
        clip: Clip the window's gradient to this global 2-norm
            ([`clip_by_global_norm()`][gradaccum.boundary.clip_by_global_norm]); ``None``: no
            clipping.
        reduction: ``"mean"``, ``"sum"`` or ``"count"``, as for
            [`Accumulator`][gradaccum.Accumulator].
        sync: ``None`` (one process), [`all_reduce()`][gradaccum.all_reduce], a
            [`custom_reduce()`][gradaccum.custom_reduce] (compression, DP noise), or your own
            sync whose boundary returns whole gradients. Not a
            [`reduce_scatter()`][gradaccum.reduce_scatter]: it returns shards.
        accum_dtype: The dtype of the running sums (default as for ``Accumulator``).

    Raises:
        TypeError: An argument has the wrong type (a ``DistributedDataParallel`` model, a loss
            that is not callable, a sync that is not one).
        ValueError: ``clip`` is not positive, the scheduler is not ``optimizer``'s, the model
            has no trainable parameters, or the sync is a reduce-scatter.

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
        >>> step = Step(model, mse, optimizer=opt, clip=1.0)
        >>> x, y = torch.randn(6, 3), torch.randn(6, 1)
        >>> before = mse(model, (x, y)).item()  # the whole batch's loss
        >>> for rows in (slice(0, 4), slice(4, 6)):  # micro-batches of 4 and 2 rows
        ...     step.add((x[rows], y[rows]))
        >>> stats = step.apply()
        >>> stats.window, stats.items, stats.micro_batches, abs(stats.loss - before) < 1e-6
        (0, 6.0, 2, True)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss: Callable[[torch.nn.Module, Any], Any],
        *,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        clip: float | None = None,
        reduction: _reduce.Reduction = "mean",
        sync: Any = None,
        accum_dtype: torch.dtype | None = None,
    ) -> None:
        where = "Step(model, loss, optimizer=...)"
        if not isinstance(model, torch.nn.Module) or hasattr(model, "no_sync"):
            raise TypeError(
                f"{where}: model must be a torch.nn.Module that is not wrapped in "
                f"DistributedDataParallel, got {describe(model)}; pass the module itself "
                f"(model.module of a DDP model) and sync=gradaccum.all_reduce()."
            )
        if not callable(loss):
            raise TypeError(
                f"{where}: loss must be a function loss(model, batch), got {describe(loss)}."
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"{where}: optimizer must be a torch.optim.Optimizer, got "
                f"{describe(optimizer)}; pass e.g. torch.optim.AdamW(model.parameters())."
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
        check_sync(where, sync)
        if hasattr(sync, "sharded"):
            raise ValueError(
                f"{where}: sync is a reduce_scatter, whose boundary returns this rank's "
                f"gradient shards, which Step cannot write into the module's .grad; use "
                f"gradaccum.Accumulator with the Sharded (docs/sharded.md), or "
                f"sync=gradaccum.all_reduce()."
            )
        self.model, self.loss, self.optimizer, self.scheduler = model, loss, optimizer, scheduler
        self.clip, self.reduction, self.sync = clip, reduction, sync
        self.acc = Accumulator(OPEN, reduction, accum_dtype, sync)
        named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                f"{where}: the model has no trainable parameters (none with requires_grad); "
                f"unfreeze what you mean to train."
            )
        self._names = [k for k, _ in named]
        self._params = [p for _, p in named]
        self.state = self.acc.init({k: p.detach() for k, p in named}, metrics=METRICS)
        self._since: float | None = None

    @property
    def window(self) -> int:
        """The index of the window in progress (the optimizer steps taken so far)."""
        return self.state.window

    @property
    def micro_step(self) -> int:
        """The micro-batches this rank added to the window in progress."""
        return self.state.micro_step

    def _split(self, where: str, out: Any, batch: Any) -> tuple[torch.Tensor, Any]:
        """The loss to differentiate and its weight (rows or count), checked."""
        if self.reduction == "count":
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                raise TypeError(
                    f"{where}: with reduction='count' the loss function must return "
                    f"(summed_loss, count), got {describe(out)}; return e.g. "
                    f"(loss_sum, (labels != -100).sum())."
                )
            value, weight = out
        elif isinstance(out, (tuple, list)) and len(out) == 2:
            value, weight = out
        else:
            value, weight = out, _rows(where, batch)
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
        return value, weight

    def add(self, batch: Any) -> None:
        """Run one micro-batch: the loss, its backward into the window's sums, its statistics.

        On an error (in the loss, say) under a sync, this rank joins the window's boundary
        flagged as failed, so that every other rank raises instead of waiting, and the error
        is re-raised. Without a sync the micro-batch is left out and the window goes on.

        Raises:
            TypeError: The loss function returned the wrong kind (see ``loss`` of
                [`Step`][gradaccum.loop.Step]).
            ValueError: The loss does not require grad, or its rows or count are out of range.
        """
        where = "Step.add(batch)"
        if self._since is None:
            self._since = time.perf_counter()
        try:
            value, weight = self._split(where, self.loss(self.model, batch), batch)
            grads = torch.autograd.grad(
                value, self._params, allow_unused=True, materialize_grads=True
            )
            tree = dict(zip(self._names, grads))
            summed = value.detach() * weight if self.reduction == "mean" else value.detach()
            metrics = {"loss": summed, "micro_batches": 1}
            if self.reduction == "count":
                self.state = self.acc.add(self.state, tree, count=weight, metrics=metrics)
            else:
                self.state = self.acc.add(self.state, tree, size=weight, metrics=metrics)
        except BaseException:
            if self.sync is not None:
                self.state = self.acc.abort(self.state)
            raise

    def apply(self) -> StepStats:
        """Close the window: boundary, clip, ``write_grads``, one optimizer and scheduler step.

        Every rank calls it once per window (under a sync, a rank whose window is empty too).

        Returns:
            The window's [`StepStats`][gradaccum.loop.StepStats].

        Raises:
            ValueError: The window is empty on every rank, or its rows or counts add up to 0.
            GradAccumError: Under a sync: the ranks disagree, another rank failed, or a
                collective failed or timed out (see ``Accumulator.finalize``).
        """
        try:
            grads, self.state, totals = self.acc.boundary(self.state)
        except TypeError as err:
            if "did not report the window's totals" not in str(err):
                raise
            raise TypeError(
                "Step.apply(): the sync's window reports no totals at the boundary, so the "
                "window's loss and tokens are not known: in your sync's Window, exchange the "
                "weight through self.connect(...) (see gradaccum.sync.Window.connect), or use "
                "gradaccum.Accumulator with finalize()."
            ) from err
        items, loss_sum = totals.weight, totals.metrics["loss"]
        micro = round(totals.metrics["micro_batches"])
        if self.clip is not None:
            grads, norm = clip_by_global_norm(grads, self.clip)
        else:
            leaves = _tree.flatten(grads)[0]
            wide = torch.float64 if any(g.dtype == torch.float64 for g in leaves) else torch.float32
            norms = [x.to(wide) for x in torch._foreach_norm(leaves)]
            norm = torch.linalg.vector_norm(torch.stack(norms))
        write_grads(self.model, grads)
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        now = time.perf_counter()
        seconds, self._since = now - (self._since or now), now
        loss = loss_sum if self.reduction == "sum" else loss_sum / items
        return StepStats(totals.window, loss, items, micro, float(norm), lr, seconds)

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
            "optimizer_kind": _loop_state.kind(self.optimizer),
            "optimizer_params": _loop_state.optimizer_params(self.model, self.optimizer),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "scheduler_kind": None if self.scheduler is None else _loop_state.kind(self.scheduler),
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
        _loop_state.prepare(where, self, sd)()
