"""``Accumulator``: streaming accumulation over an ``AccumState`` pytree.

For loops that are fed one micro-batch at a time (a DataLoader of micro-batches), in the manner of
optax's ``MultiSteps``: the micro-step counter and the running sums live in the state, which the
methods take and return, so a checkpoint taken mid-window resumes exactly. Each method opens (or
takes over) the sync's window for the state, so the same ``Window`` protocol serves
``accumulate`` and ``Accumulator``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from .. import _metrics, _reduce, _tree
from .._autograd import check_no_transform, grad_on
from .._layout import check_accum_dtype, check_grads, check_n, micro_weight
from .._metrics import WindowStats
from .protocol import LOCAL, Sync, Window, WindowSpec, check_sync
from .state import AccumState, check_live, check_state, pass_on

__all__ = ["Accumulator"]

T = TypeVar("T")


@dataclass(frozen=True)
class Accumulator:
    """Streaming gradient accumulation over a window of ``n`` micro-batches.

    The configuration is held here; the window lives in an
    [`AccumState`][gradaccum.streaming.AccumState] that the methods take and return (optax-style).

    The result of [`finalize()`][gradaccum.Accumulator.finalize] equals the gradient over all the
    window's rows (``mean``), their plain sum (``sum``) or the gradient of the summed loss divided
    by the summed counts (``count``), whatever the micro-batch sizes. A short last window (call
    [`finalize()`][gradaccum.Accumulator.finalize] before
    [`is_complete()`][gradaccum.Accumulator.is_complete]) is weighted exactly by what it holds.

    [`boundary()`][gradaccum.Accumulator.boundary] closes the window as ``finalize`` does and
    also reports its [`WindowStats`][gradaccum.streaming.WindowStats]: the window's global weight
    and the metrics given to ``add(..., metrics=...)`` (summed losses, token counts), summed over
    the micro-batches and, with ``sync``, over the ranks in the same collective as the gradients.

    The running sums are updated in place: after ``add(state, ...)`` and ``finalize(state)``,
    use only the state they return; ``add``, ``finalize`` and ``state_dict`` refuse a consumed
    one with a ``ValueError`` (it would change gradients already returned, which alias the
    sums). A state without running sums (from ``init`` or ``finalize``) may be reused.

    Args:
        n: Micro-batches per window: a positive int, or a schedule ``window_index -> int``
            (evaluated when a window starts; ``window_index`` counts finalized windows).
        reduction: ``"mean"`` (default; ``add`` takes ``size=``), ``"sum"``, or ``"count"``
            (``add`` takes ``count=``).
        accum_dtype: The dtype of the running sums. Default: float32 for float16/bfloat16
            gradients, the gradient dtype otherwise. Gradients come out of
            [`finalize()`][gradaccum.Accumulator.finalize] in the parameters' dtype.
        sync: ``None`` (one process), or [`all_reduce()`][gradaccum.all_reduce] to synchronise
            over a process group in [`finalize()`][gradaccum.Accumulator.finalize] (or
            ``boundary``), the only place that communicates. Every rank must then be at the
            same window (``state.window``, and ``state.epoch``: see ``end_epoch``): the sync
            checks it before any gradient is sent. Or [`reduce_scatter()`][gradaccum.reduce_scatter]
            for sharded params: ``finalize`` then returns this rank's gradient shards, and
            under its ``every`` policy ``add`` reduce-scatters each micro-batch (every rank
            must then call ``add`` at most ``n`` times per window). Or a
            [`custom_reduce()`][gradaccum.custom_reduce] (or a built-in compressed one):
            its state between windows travels in ``AccumState.reduce_state``.

    Examples:
        >>> import torch, gradaccum
        >>> acc = gradaccum.Accumulator(n=2)
        >>> params = {"w": torch.zeros(2)}
        >>> state = acc.init(params)
        >>> state = acc.add(state, {"w": torch.tensor([1.0, 2.0])}, size=3)
        >>> acc.is_complete(state)
        False
        >>> state = acc.add(state, {"w": torch.tensor([5.0, 6.0])}, size=1)
        >>> acc.is_complete(state)
        True
        >>> grads, state = acc.finalize(state)
        >>> grads["w"]  # (3 * [1, 2] + 1 * [5, 6]) / 4
        tensor([2., 3.])
    """

    n: int | Callable[[int], int]
    reduction: _reduce.Reduction = "mean"
    accum_dtype: torch.dtype | None = None
    sync: Sync | None = None
    # The caller's options the ranks must share (WindowSpec.options): loop.Step sets them.
    _options: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    @property
    def _where(self) -> str:
        return f"Accumulator(n={'<schedule>' if callable(self.n) else repr(self.n)})"

    def __post_init__(self) -> None:
        where = self._where
        if not callable(self.n):
            check_n(where, self.n)
        _reduce.check_reduction(where, self.reduction)
        check_accum_dtype(where, self.accum_dtype)
        check_sync(where, self.sync)

    def init(self, params: T, *, metrics: Any = ()) -> AccumState[T]:
        """An empty window for gradients shaped like ``params`` (nothing is allocated yet).

        Args:
            params: The pytree of floating tensors the gradients are taken with respect to
                (with a [`reduce_scatter()`][gradaccum.reduce_scatter] sync, the
                [`Sharded`][gradaccum.sharding.Sharded] itself, or its gathered params).
            metrics: The names of the metrics that ``add`` will be given, if a first window
                may be empty on some rank (it then sends zeros under these names, as the other
                ranks expect). Later empty windows send the names of the window before. A dict
                from names to shapes for 1-D metrics: e.g. ``{"loss": (), "per_expert": (8,)}``.

        Returns:
            An [`AccumState`][gradaccum.streaming.AccumState] with no micro-batch in it.
        """
        where = "Accumulator.init(params)"
        lay = self._sync.layout(where, params, self.accum_dtype)
        sums = _metrics.zeros(_metrics.check_names(where, metrics), _metrics.device_of(lay))
        return AccumState(sums=None, weight=0, micro_step=0, window=0, layout=lay, metrics=sums)

    @property
    def _sync(self) -> Sync:
        return self.sync if self.sync is not None else LOCAL

    def _window(self, where: str, state: AccumState[T], n: int, sig: Any = ()) -> Window:
        """The window ``state`` is in: the live one, or one opened (and given the sums)."""
        sums = state.sums
        live = self._sync.window_of(sums)
        if live is not None:
            live.at(where)
            return live
        # Read while torch.compile traces add(), the index would recompile it every window.
        traced = torch.compiler.is_compiling()
        index, epoch = (0, 0) if traced else (state.window, state.epoch)
        window = self._sync.open(self._spec(where, state, n, (index, epoch), sig))
        if sums is not None:
            window.restore(_tree.flatten(sums)[0])
        return window

    def _spec(self, where: str, state: AccumState[T], n: int, at: Any, sig: Any) -> WindowSpec:
        """``state``'s window (``n`` agreed over the ranks; ``at``: its index and epoch).

        ``sig``: the window's metrics, ``(name, shape)`` pairs sorted by name.
        """
        return WindowSpec(
            where=where,
            layout=state.layout,
            reduction=self.reduction,
            n=n,
            agree_n=True,
            state=state.reduce_state,
            index=at[0],
            epoch=at[1],
            metrics=tuple(name for name, _ in sig),
            metric_shapes=tuple(shape for _, shape in sig),
            options=self._options,
        )

    def window_size(self, state: AccumState[T]) -> int:
        """The number of micro-batches of the current window (evaluates a schedule)."""
        if not callable(self.n):
            return self.n
        n = self.n(state.window)
        check_n(f"Accumulator(n=<schedule>): the schedule's value for window {state.window}", n)
        return n

    def is_complete(self, state: AccumState[T]) -> bool:
        """Whether the window holds its ``n`` micro-batches: time to call ``finalize``."""
        check_state(f"{self._where}.is_complete(state)", state)
        return state.micro_step >= self.window_size(state)

    @grad_on  # sums made under torch.inference_mode() stay usable outside it
    def add(
        self,
        state: AccumState[T],
        grads: T,
        *,
        size: int | None = None,
        count: int | float | torch.Tensor | None = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> AccumState[T]:
        """Add one micro-batch's gradients (and metrics) to the window.

        Args:
            state: The current state (its running sums are updated in place).
            grads: The micro-batch's gradients, a pytree shaped like the ``params`` of
                [`init()`][gradaccum.Accumulator.init].
            size: The micro-batch's number of rows; required for ``reduction="mean"``.
            count: The number of items the micro-batch's summed loss covers (e.g. non-padding
                tokens); required for ``reduction="count"``.
            metrics: Numbers to sum over the window's micro-batches and over the ranks, e.g.
                ``{"loss": loss_sum.detach()}``: a dict from names to numbers or 0-dim tensors,
                or 1-D tensors (e.g. a count per expert, summed element by element), with the
                same names and shapes at every ``add`` of a window. They are added on the device,
                without a host sync, and reduced in the boundary collective that carries the
                window's weight (no collective of their own);
                [`boundary()`][gradaccum.Accumulator.boundary] returns their totals.

        Returns:
            The new state.

        Raises:
            TypeError: A gradient leaf is not a floating tensor, ``size``/``count`` has the
                wrong type, or a metric is not a real number or real tensor.
            ValueError: ``grads`` does not match ``params`` (the message names the key path),
                ``size``/``count`` is missing or out of range, a metric is a tensor of more
                than one dim, or the metrics' names or shapes differ from the window's earlier
                ones; a call under a ``torch.func`` transform (``jacrev``, ``vmap``, ...): the
                window is accumulated, never differentiated through or batched.
        """
        where = "Accumulator.add(state, grads)"
        check_no_transform(where)
        check_state(where, state)
        check_live(where, state)
        alpha, weight = micro_weight(where, self.reduction, size, count)
        first = state.micro_step == 0
        sig: Any = None  # metrics=None and none so far: nothing to do per micro-batch
        if metrics is not None or state.metrics is not None:
            sig = _metrics.check(where, state.metrics, first, metrics)
        window = self._window(where, state, self.window_size(state), sig or ())
        window.begin(1)
        window.add(check_grads(where, state.layout, grads), alpha)
        window.step()
        sums = window.tree(like=grads)
        new = state._replace(
            sums=sums, weight=state.weight + weight, micro_step=state.micro_step + 1
        )
        if sig is not None:
            new = new._replace(
                metrics=_metrics.add(
                    state.metrics, first, metrics, _metrics.device_of(state.layout)
                )
            )
        return pass_on(state, new, "add()")

    @grad_on
    def finalize(self, state: AccumState[T]) -> tuple[T, AccumState[T]]:
        """Close the window: return its gradients and a fresh state for the next window.

        The accumulation boundary: with ``sync=``, every rank must call it (an empty window
        included), and the result is the gradient over all ranks' micro-batches. It is
        [`boundary()`][gradaccum.Accumulator.boundary] without the window's statistics.

        Raises:
            ValueError: The window holds no micro-batch (without ``sync``), or its counts (or,
                with ``sync``, rows) add up to 0. Without ``sync``, counts given as tensors are
                not checked (that would synchronise with the device): a zero total then gives
                non-finite gradients, which [`assert_finite()`][gradaccum.testing.assert_finite]
                reports. A call under a ``torch.func`` transform, as in
                [`add()`][gradaccum.Accumulator.add].
            GradAccumError: With ``sync``: the ranks disagree on the gradient tree or the
                metrics' names, are at different windows (``state.window`` or ``state.epoch``),
                another rank failed in the window, or a collective failed or timed out.
        """
        grads, new, _ = self._close(f"{self._where}.finalize(state)", state, "finalize()")
        return grads, new

    @grad_on
    def boundary(self, state: AccumState[T]) -> tuple[T, AccumState[T], WindowStats]:
        """Close the window like [`finalize()`][gradaccum.Accumulator.finalize], with its stats.

        ``grads, state = acc.finalize(state)`` is ``acc.boundary(state)[:2]``. The stats come
        from the boundary collective that reduces the gradients (its tail), so they cost no
        collective of their own; reading them as numbers synchronises with the device.

        Returns:
            ``(grads, state, stats)``: the window's gradients, a fresh state for the next
            window, and a [`WindowStats`][gradaccum.streaming.WindowStats]: the index of the
            window just closed, its global weight (rows, or counts under ``count``: over all
            micro-batches of every rank) and each metric of ``add(..., metrics=...)`` summed
            over the micro-batches of every rank.

        Raises:
            ValueError: As [`finalize()`][gradaccum.Accumulator.finalize].
            GradAccumError: As [`finalize()`][gradaccum.Accumulator.finalize].
            TypeError: A sync of your own that does not report the window's totals (see
                [`Window.connect()`][gradaccum.sync.Window.connect]).

        Examples:
            >>> import torch, gradaccum
            >>> acc = gradaccum.Accumulator(n=2)
            >>> state = acc.init({"w": torch.zeros(2)})
            >>> for rows, loss in ((3, 0.5), (1, 0.25)):  # a mean loss over its rows
            ...     g = {"w": torch.full((2,), loss)}
            ...     state = acc.add(state, g, size=rows, metrics={"loss": loss * rows})
            >>> grads, state, stats = acc.boundary(state)
            >>> stats.window, stats.weight, stats.metrics["loss"] / stats.weight
            (0, 4.0, 0.4375)
        """
        return self._close(f"{self._where}.boundary(state)", state, "boundary()", stats=True)

    def _close(
        self,
        where: str,
        state: AccumState[T],
        by: str,
        stats: bool = False,
        live: Window | None = None,
        raw: bool = False,
    ) -> tuple[T, AccumState[T], Any]:
        """The boundary of ``finalize`` and ``boundary``: the stats only when asked for.

        ``live``: the window that ``state`` is in, kept by the caller (see ``_live``). ``raw``
        (with ``stats``): the window's index, its totals as the window left them (tensors on
        the device after a deferred boundary) and the signature, read by nobody here.
        """
        check_no_transform(where)
        check_state(where, state)
        check_live(where, state)
        sig = _metrics.signature(state.metrics)
        window = live or self._window(where, state, self.window_size(state), sig)
        if live is not None:
            live.at(where)
        if sig:
            window.metrics = list(state.metrics.values())
        grads = window.finish(state.weight)
        out = pass_on(state, self._next(state, window.state, sig), by)
        if not stats:
            return grads, out, None
        if window.totals is None:
            raise TypeError(
                f"{where}: the window of {type(self._sync).__name__} did not report the window's "
                f"totals (Window.totals) at the boundary, so there are no stats to return; in "
                f"the sync's Window, exchange the weight through a Comm from self.connect(...) "
                f"(or set self.totals in finish), or call finalize(state) instead."
            )
        weight, totals = window.totals
        if raw:
            return grads, out, (state.window, weight, totals, sig)
        return grads, out, WindowStats(state.window, float(weight), _metrics.unpack(sig, totals))

    def abort(self, state: AccumState[T]) -> AccumState[T]:
        """Give up the current window after an error on this rank.

        With ``sync``, this rank joins the window's boundary collective flagged as failed, so that
        [`finalize()`][gradaccum.Accumulator.finalize] raises
        [`GradAccumError`][gradaccum.GradAccumError] on every other rank instead of waiting for
        the timeout. Call it in an ``except`` block, then re-raise. Without ``sync`` it only
        discards the window. A rank whose ``finalize`` raised ``GradAccumError`` (another rank
        failed) must not call it; it goes on at the next window, as every rank does, with
        ``acc.init(params)._replace(window=state.window + 1)``.

        Returns:
            A fresh state for the next window, as [`finalize()`][gradaccum.Accumulator.finalize]
            would return.

        Examples:
            >>> import torch, gradaccum
            >>> acc = gradaccum.Accumulator(n=2)
            >>> state = acc.add(acc.init({"w": torch.zeros(2)}), {"w": torch.ones(2)}, size=1)
            >>> state = acc.abort(state)
            >>> state.sums, state.micro_step, state.window
            (None, 0, 1)
        """
        return self._abort(state)

    def _abort(self, state: AccumState[T], live: Window | None = None) -> AccumState[T]:
        """``abort``; ``live``: the window that ``state`` is in, kept by the caller (``_live``)."""
        where = f"{self._where}.abort(state)"
        check_state(where, state)
        sig = _metrics.signature(state.metrics)
        with contextlib.suppress(Exception):  # the caller's error is the one to report
            window = live or self._window(where, state, self.window_size(state), sig)
            window.abort(state.weight)
        return pass_on(state, self._next(state, state.reduce_state, sig), "abort()")

    # -- a window kept by the caller: the backward goes straight into its sums (loop.Step) ---------

    def _live(self, where: str, state: AccumState[T]) -> Window:
        """The window ``state`` is in, for a caller that keeps it until ``_close``/``_abort``.

        ``loop.Step`` runs each backward into its running sums (``prepare``, ``adopt``, and the
        params' ``.grad`` pointing at them) and tells the state with ``_counted``.
        """
        sig = _metrics.signature(state.metrics)
        return self._window(where, state, self.window_size(state), sig)

    def _weigh(self, size: int | None, count: Any) -> tuple[int, _reduce.Weight]:
        """A micro-batch's ``(alpha, weight)``, checked as ``add`` checks ``size``/``count``."""
        return micro_weight("Accumulator.add(state, grads)", self.reduction, size, count)

    def _check_add(self, state: AccumState[T], metrics: Any) -> None:
        """What ``add`` checks of ``state`` and ``metrics`` (nothing is added yet).

        Called before the backward that ``_counted`` then counts.
        """
        where = "Accumulator.add(state, grads)"
        check_state(where, state)
        check_live(where, state)
        _metrics.check(where, state.metrics, state.micro_step == 0, metrics)

    def _counted(
        self, state: AccumState[T], window: Window, weight: _reduce.Weight, metrics: Any
    ) -> AccumState[T]:
        """``add`` for a micro-batch whose gradients are in ``window``'s sums already.

        ``weight``: from ``_weigh``; ``metrics`` as for ``add``, checked by ``_check_add``. The
        window is the one of ``_live``; its sums (updated in place) are the state's.
        """
        first = state.micro_step == 0
        sums = state.sums if state.sums is not None else window.tree()
        new = state._replace(
            sums=sums,
            weight=state.weight + weight,
            micro_step=state.micro_step + 1,
            metrics=_metrics.add(state.metrics, first, metrics, _metrics.device_of(state.layout)),
        )
        return pass_on(state, new, "add()")

    def _next(self, state: AccumState[T], reduce_state: Any, sig: Any) -> AccumState[T]:
        """A fresh state for the window after ``state``'s, carrying the sync's ``reduce_state``.

        It holds zeros under the metrics' names (``sig``): what its window sends if it is empty.
        """
        return AccumState(
            sums=None,
            weight=0,
            micro_step=0,
            window=state.window + 1,
            layout=state.layout,
            reduce_state=reduce_state,
            ticket=None,
            metrics=_metrics.zeros(sig, _metrics.device_of(state.layout)),
            epoch=state.epoch,
        )

    def end_epoch(self, state: AccumState[T]) -> AccumState[T]:
        """Mark the end of an epoch: the next window is the first of the next epoch.

        The epoch goes in every window's fingerprint with its index (under a sync, ``check``
        on): ranks whose epochs hold different numbers of windows (only one rank finalized a
        short last window) then raise [`GradAccumError`][gradaccum.GradAccumError] at the next
        boundary, before any gradient is sent, instead of combining windows of different epochs.
        Nothing is communicated here. Returns the state with ``epoch`` one higher; raises
        ``ValueError`` if the window in progress holds micro-batches (finalize it first).

        Examples:
            >>> import torch, gradaccum
            >>> gradaccum.Accumulator(n=4).end_epoch(gradaccum.Accumulator(n=4).init({})).epoch
            1
        """
        where = f"{self._where}.end_epoch(state)"
        check_state(where, state)
        if state.micro_step:
            raise ValueError(
                f"{where}: the window in progress holds {state.micro_step} micro-batch(es) of "
                f"epoch {state.epoch}; call grads, state = acc.finalize(state) for this short "
                f"last window (every rank, an empty window included), then end_epoch(state)."
            )
        return state._replace(epoch=state.epoch + 1)

    def state_dict(self, state: AccumState[T]) -> dict[str, Any]:
        """The state as a dict of tensors, numbers and strings.

        It is safe to ``torch.save`` and to ``torch.load(..., weights_only=True)``, mid-window
        included. The running sums are copies: later ``add`` calls do not change it.
        """
        check_state("Accumulator.state_dict(state)", state)
        check_live("Accumulator.state_dict(state)", state)
        return self._sync.state_dict(self.reduction, state)

    def load_state_dict(self, state: AccumState[T], state_dict: dict[str, Any]) -> AccumState[T]:
        """Restore a state saved by ``state_dict``; resuming is bit-identical.

        Args:
            state: A state for the current params (from [`init()`][gradaccum.Accumulator.init]); it
                supplies the tree structure and devices, and is not modified.
            state_dict: What [`state_dict()`][gradaccum.Accumulator.state_dict] returned.

        Returns:
            The restored state.

        Raises:
            GradAccumError: The saved state is for a different gradient tree (key paths, shapes
                or dtypes differ; the message names the first difference) or reduction, or its
                fields are inconsistent: ``micro_step`` above ``n`` or negative, a ``weight``
                that is negative, NaN or infinite (or 0 after a micro-batch under ``mean`` and
                ``sum``), ``sums`` missing mid-window. The message names the field.
        """
        check_state("Accumulator.load_state_dict(state, state_dict)", state)
        saved = state_dict.get("window") if isinstance(state_dict, dict) else None
        at = saved if isinstance(saved, int) and not isinstance(saved, bool) and saved >= 0 else 0
        n = self.window_size(state._replace(window=at))
        where = "Accumulator.load_state_dict(state, state_dict)"
        saved_metrics = state_dict.get("metrics") if isinstance(state_dict, dict) else None
        sig = _metrics.saved_signature(saved_metrics)
        epoch = state_dict.get("epoch", 0) if isinstance(state_dict, dict) else 0
        epoch = epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else 0
        spec = self._spec(where, state, n, (at, max(epoch, 0)), sig)
        restored = self._sync.load_state_dict(spec, state, state_dict)
        return pass_on(restored._replace(sums=None), restored, "load_state_dict()")
