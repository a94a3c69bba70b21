"""``Accumulator``: streaming accumulation (optax ``MultiSteps``-style) over an ``AccumState``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from . import _reduce, _tree
from ._accum_state import AccumState, check_live, check_state, pass_on
from ._layout import check_accum_dtype, check_grads, check_n, micro_weight
from ._window import LOCAL, Sync, Window, WindowSpec, check_sync

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

    The running sums are updated in place: after ``add(state, ...)`` and ``finalize(state)``,
    use only the state they return. A state that was passed to them is consumed: ``add``,
    ``finalize`` and ``state_dict`` refuse it with a ``ValueError`` (it would otherwise change
    gradients already returned, since those alias the running sums). A state without running sums
    (from ``init``, or returned by ``finalize``) may be reused.

    Args:
        n: Micro-batches per window: a positive int, or a schedule ``window_index -> int``
            (evaluated when a window starts; ``window_index`` counts finalized windows).
        reduction: ``"mean"`` (default; ``add`` takes ``size=``), ``"sum"``, or ``"count"``
            (``add`` takes ``count=``).
        accum_dtype: The dtype of the running sums. Default: float32 for float16/bfloat16
            gradients, the gradient dtype otherwise. Gradients come out of
            [`finalize()`][gradaccum.Accumulator.finalize] in the parameters' dtype.
        sync: ``None`` (one process), or [`all_reduce()`][gradaccum.all_reduce] to synchronise
            over a process group in [`finalize()`][gradaccum.Accumulator.finalize], the only
            place that communicates. Or [`reduce_scatter()`][gradaccum.reduce_scatter]
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

    def init(self, params: T) -> AccumState[T]:
        """An empty window for gradients shaped like ``params`` (nothing is allocated yet).

        Args:
            params: The pytree of floating tensors the gradients are taken with respect to
                (with a [`reduce_scatter()`][gradaccum.reduce_scatter] sync, the
                [`Sharded`][gradaccum.sync.Sharded] itself, or its gathered params).

        Returns:
            An [`AccumState`][gradaccum.streaming.AccumState] with no micro-batch in it.
        """
        where = "Accumulator.init(params)"
        return AccumState(None, 0, 0, 0, self._sync.layout(where, params, self.accum_dtype))

    @property
    def _sync(self) -> Sync:
        return self.sync if self.sync is not None else LOCAL

    def _window(self, where: str, state: AccumState[T], n: int) -> Window:
        """The window ``state`` is in: the live one, or one opened (and given the sums)."""
        sums = state.sums
        if isinstance(sums, Window):
            sums.at(where)
            return sums
        spec = WindowSpec(where, state.layout, self.reduction, n, True, state.reduce_state)
        window = self._sync.open(spec)
        if sums is not None:
            window.restore(_tree.flatten(sums)[0])
        return window

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

    def add(
        self,
        state: AccumState[T],
        grads: T,
        *,
        size: int | None = None,
        count: int | float | torch.Tensor | None = None,
    ) -> AccumState[T]:
        """Add one micro-batch's gradients to the window.

        Args:
            state: The current state (its running sums are updated in place).
            grads: The micro-batch's gradients, a pytree shaped like the ``params`` of
                [`init()`][gradaccum.Accumulator.init].
            size: The micro-batch's number of rows; required for ``reduction="mean"``.
            count: The number of items the micro-batch's summed loss covers (e.g. non-padding
                tokens); required for ``reduction="count"``.

        Returns:
            The new state.

        Raises:
            TypeError: A gradient leaf is not a floating tensor, or ``size``/``count`` has the
                wrong type.
            ValueError: ``grads`` does not match ``params`` (the message names the key path), or
                ``size``/``count`` is missing or out of range.
        """
        where = "Accumulator.add(state, grads)"
        check_state(where, state)
        check_live(where, state)
        alpha, weight = micro_weight(where, self.reduction, size, count)
        window = self._window(where, state, self.window_size(state))
        window.begin(1)
        window.add(check_grads(where, state.layout, grads), alpha)
        window.step()
        sums = window.tree(like=grads)
        new = state._replace(
            sums=sums, weight=state.weight + weight, micro_step=state.micro_step + 1
        )
        return pass_on(state, new, "add()")

    def finalize(self, state: AccumState[T]) -> tuple[T, AccumState[T]]:
        """Close the window: return its gradients and a fresh state for the next window.

        The accumulation boundary: with ``sync=``, every rank must call it (an empty window
        included), and the result is the gradient over all ranks' micro-batches.

        Raises:
            ValueError: The window holds no micro-batch (without ``sync``), or its counts (or,
                with ``sync``, rows) add up to 0. Without ``sync``, counts given as tensors are
                not checked (that would synchronise with the device): a zero total then gives
                non-finite gradients, which [`assert_finite()`][gradaccum.testing.assert_finite]
                reports.
            GradAccumError: With ``sync``: the ranks disagree on the gradient tree, another rank
                failed during the window, or a collective failed or timed out.
        """
        where = f"{self._where}.finalize(state)"
        check_state(where, state)
        check_live(where, state)
        window = self._window(where, state, self.window_size(state))
        grads = window.finish(state.weight)
        new = AccumState(None, 0, 0, state.window + 1, state.layout, window.state)
        return grads, pass_on(state, new, "finalize()")

    def abort(self, state: AccumState[T]) -> AccumState[T]:
        """Give up the current window after an error on this rank.

        With ``sync``, this rank joins the window's boundary collective flagged as failed, so that
        [`finalize()`][gradaccum.Accumulator.finalize] raises
        [`GradAccumError`][gradaccum.GradAccumError] on every other rank instead of waiting for
        the timeout. Call it in an ``except`` block, then re-raise. Without ``sync`` it only
        discards the window.

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
        where = f"{self._where}.abort(state)"
        check_state(where, state)
        with contextlib.suppress(Exception):  # the caller's error is the one to report
            self._window(where, state, self.window_size(state)).abort(state.weight)
        new = AccumState(None, 0, 0, state.window + 1, state.layout, state.reduce_state)
        return pass_on(state, new, "abort()")

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
        spec = WindowSpec(where, state.layout, self.reduction, n, True, state.reduce_state)
        restored = self._sync.load_state_dict(spec, state, state_dict)
        return pass_on(restored._replace(sums=None), restored, "load_state_dict()")
