"""The window loop of ``accumulate``: micro-batches through the step function into a window.

One call of an accumulated function is one ``WindowRun``: it opens the sync's window, runs
every micro-batch of the call into it, and closes it at the boundary (or, if anything raised,
joins the boundary flagged as failed, so that the other ranks raise instead of waiting). Its
attributes are what the call has reached (the window, the weight and micro-steps counted so
far) and, on the fast path, what the backward hooks share; its methods are those hooks.

Two paths run the micro-batches:

- the fast path, for a [`grad()`][gradaccum.grad] step function (or one that
  ``torch.func.grad`` returned): each backward adds straight into the window's storage, through
  ``.grad`` for a leaf that accumulates in its own dtype (autograd sums it in place) and through
  ``Window.grad`` (a hook) for any other;
- the generic path, for any other step function: it returns a gradient tree, which is checked
  and added with ``Window.add``.

Both are step 3 of "One window's life" in ``docs/architecture.md``; nothing here knows which
sync it is: the window's ``hint`` / ``prescale`` / ``overlap`` and ``streams(i)`` are read, not
sniffed.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _hooks, _reduce, _tree
from .._autograd import (
    CheckpointGuard,
    GradFn,
    explain_checkpoint,
    holds_inference,
    plain_tensors,
)
from .._errors import describe
from .._layout import Layout, check_grads, weigh
from .protocol import Sync, Window, WindowSpec

__all__ = ["RunOptions", "WindowRun", "check_nesting"]

# The accumulated calls whose micro-batches run in this thread, outermost first: (call, reduction).
# A gradaccum call made by a step function is nested in the last one (check_nesting).
_running = threading.local()


def _calls() -> list[tuple[str, str]]:
    calls: list[tuple[str, str]] | None = getattr(_running, "calls", None)
    if calls is None:
        calls = _running.calls = []
    return calls


def check_nesting(call: str, reduction: str | None) -> None:
    """Refuse a call made inside an accumulated call's micro-batch loop that would be wrong there.

    ``reduction``: the nested ``accumulate``'s; ``None`` for a transform over a whole window
    (``coupled``, ``window_stats``), which a micro-batch loop would run on each part of the
    window alone. A nested ``accumulate`` is exact under ``mean`` and ``sum``: only ``count``,
    on either, is refused (the outer loop would weigh the inner result, already divided by its
    own count, as a summed gradient).
    """
    calls = _calls()
    if not calls:
        return
    outer, outer_reduction = calls[-1]
    if reduction is None:
        raise ValueError(
            f"{call}: called inside {outer}'s micro-batch loop, which runs it on each of its "
            f"micro-batches alone: its loss would see only that part's examples and "
            f"statistics, not the window's, and the result is not the gradient of the "
            f"objective. Call it on the whole batch instead: it splits the window into "
            f"micro-batches itself (pass a larger n for more of them)."
        )
    if "count" in (reduction, outer_reduction):
        raise ValueError(
            f"{call}: an accumulate with reduction={reduction!r} called inside {outer}'s "
            f"micro-batch loop, whose reduction is {outer_reduction!r}: under 'count' a gradient "
            f"is weighed by the items its summed loss covers, but an inner accumulate returns "
            f"its gradient already divided by its own weight, so the result is not the gradient "
            f"of the item mean. Use one accumulate over all the micro-batches (n the product of "
            f"the two, reduction='count'); nesting is exact under 'mean' and 'sum'."
        )


@dataclass(frozen=True)
class RunOptions:
    """How every call of one accumulated function runs: built once, when ``accumulate`` is called.

    Attributes:
        step_fn: The step function as given.
        fast: Its torch.autograd twin (a ``GradFn``) when it takes the fast path, else None.
        traceable: ``fast`` came from a torch.func function, which Dynamo traces on the generic
            path when the accumulated function is being compiled.
        sync: The sync (``LOCAL`` for ``sync=None``).
        n: The number of micro-batches.
        batch_argnum: The position of the batch argument.
        argnum: The position of the params for an int ``argnums``; None for a tuple.
        reduction: ``"mean"``, ``"sum"`` or ``"count"``.
        count: With ``reduction="count"``, the function from a micro-batch's aux to its count.
        has_aux: The step function returns ``(grads, aux)``.
        aux_reduction: How the aux combines over micro-batches (see ``accumulate``).
        micro_transform: The function applied to each micro-batch's gradient tree, or None.
        summed: Derived: under ``mean``, ``micro_transform`` returns a sum over the micro-batch's
            rows (``sums_rows = True``), added unweighted: the boundary divides by the window's
            rows.
    """

    step_fn: Callable[..., Any]
    fast: GradFn | None
    traceable: bool
    sync: Sync
    n: int
    batch_argnum: int
    argnum: int | None
    reduction: _reduce.Reduction
    count: Callable[[Any], Any] | None
    has_aux: bool
    aux_reduction: Any
    micro_transform: Callable[[Any], Any] | None
    summed: bool = field(init=False)

    def __post_init__(self) -> None:
        sums_rows = getattr(self.micro_transform, "sums_rows", False) is True
        object.__setattr__(self, "summed", self.reduction == "mean" and sums_rows)


class WindowRun:
    """One call of an accumulated function: its window, from ``open`` to ``finish`` (or ``abort``).

    Use: ``run = WindowRun(...)``; ``run.open(layout)``; ``run.run(micro_batches)``;
    ``grads = run.finish()``; on any error in between, ``run.abort(layout)`` and re-raise.

    The scale policy: each micro-batch's gradient is weighted by ``alpha`` (its rows under
    ``mean``, else 1) divided by ``divisor`` when that is set: the window's ``hint`` (under a
    sync, the ranks' agreed guess of the global total, which its ``finish`` corrects) or, for a
    ``prescale`` window on the fast path, this call's total rows, so that the sums are the mean
    already (the weight the boundary divides by is then 1). Only under ``mean`` with float32/64
    sums: a float16/bfloat16 sum would round otherwise than a sync.

    Attributes:
        window: The sync's window, once opened.
        opening: ``Sync.open`` was called (if it raised, ``abort`` does not call it again).
        weight: The weight counted so far: rows (``mean``, ``sum``) or counts (``count``).
        micro_steps: The micro-batches counted so far.
        aux: The aux accumulator (``has_aux``), else None.
        divisor: The scale policy's divisor (0: none).
        native: Per leaf, on the fast path: autograd accumulates its gradient in place into the
            window's running sum (its ``.grad``); else a hook hands it to ``Window.grad``.
        alpha: The scale that the ``Window.grad`` hooks apply to the running backward.
        seeds: The backward seeds by ``(scale, dtype, device)``, made once per call.
        leaves: The autograd leaves aliasing the params of the running micro-batch.
    """

    def __init__(
        self,
        call: str,
        opts: RunOptions,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        target: Any,
        index: int,
    ) -> None:
        self.call, self.opts, self.args, self.kwargs = call, opts, args, kwargs
        self.target, self.index = target, index
        self.window: Window | None = None
        self.opening = False
        self.weight: _reduce.Weight = 0
        self.micro_steps = 0
        self.aux = (
            _reduce.AuxAccumulator(call, opts.aux_reduction, opts.reduction)
            if opts.has_aux
            else None
        )
        self.divisor: float = 0
        # The fast path's backward state, shared with its hooks.
        self.native: list[bool] = []
        self.alpha: float = 1
        self.seeds: dict[tuple[float, torch.dtype, torch.device], torch.Tensor] = {}
        self.leaves: list[torch.Tensor] = []
        self.plain = False  # plain_tensors(self.leaves)
        self.adopted: set[int] = set()
        self.hooks: list[Any] = []  # the hooks removed when the leaves are re-aliased
        self.first: dict[int, Any] = {}  # the hooks that hand the first gradients to the window
        self.reporting = False  # the last backward runs, with overlap: report ready leaves
        self.zeroed = False  # the sums take the first backward in place (Window.prepare)
        self.seeded = True  # the backward's seed carries the scale (see _backward)

    # -- the window's life -----------------------------------------------------------------------

    def spec(self, lay: Layout) -> WindowSpec:
        """The spec of this call's window for gradients of ``lay``."""
        opts = self.opts
        return WindowSpec(
            where=self.call,
            layout=lay,
            reduction=opts.reduction,
            n=opts.n,
            state=opts.sync.state,
            params=self.target,
            fast=opts.fast is not None,  # the same on every rank: ready() order can be agreed on
            index=self.index,
        )

    def open(self, lay: Layout) -> None:
        """Open the sync's window for gradients of ``lay``."""
        self.opening = True
        self.window = self.opts.sync.open(self.spec(lay))

    def run(self, micro: list[tuple[Any, int]]) -> None:
        """Run the micro-batches ``(batch, rows)`` of the call into the open window."""
        window, opts = self.window, self.opts
        assert window is not None
        window.begin(len(micro))
        if not micro:  # an empty batch runs nothing; the boundary still joins
            return
        mean_wide = opts.reduction == "mean" and window.layout.wide
        # Compiled, a torch.func step function is traced as it is; inference tensors cannot be
        # autograd leaves nor saved for backward: torch.func.grad differentiates through them.
        fast = (
            opts.fast is not None
            and not (opts.traceable and torch.compiler.is_compiling())
            and not holds_inference((self.args, self.kwargs))
        )
        if mean_wide and window.hint:
            self.divisor = window.hint
        elif mean_wide and window.prescale and fast:
            self.divisor = sum([rows for _, rows in micro])
        if torch.compiler.is_compiling():  # traced: the generic path, nothing nested to see
            self._generic(micro)
            return
        calls = _calls()
        calls.append((self.call, opts.reduction))
        try:
            if fast:
                self._fast(micro)
            else:
                self._generic(micro)
        finally:
            calls.pop()

    def finish(self) -> Any:
        """The boundary: the one place that communicates (with ``sync=``); the call's result."""
        window = self.window
        assert window is not None
        grads = window.finish(self.weight)
        self.opts.sync.load_state(window.state)
        if self.aux is None:
            return grads
        return grads, (self.aux.result() if self.micro_steps else None)

    def abort(self, lay: Layout | None) -> None:
        """Join the window's boundary flagged as failed: the other ranks raise instead of waiting.

        Without an open window, one is opened for ``lay`` (``None``: nothing to join). Errors
        while joining are dropped: the caller re-raises its own.
        """
        with contextlib.suppress(Exception):
            window = self.window
            if window is None and lay is not None and not self.opening:
                window = self.opts.sync.open(self.spec(lay))
            if window is not None:
                window.abort(self.weight)

    def _count(self, weight: _reduce.Weight, aux: Any, rows: int, items: Any, raw: Any) -> None:
        """Count one micro-batch: its weight, and its aux."""
        self.weight += weight
        self.micro_steps += 1
        if self.aux is not None:
            self.aux.add(aux, rows, items, raw)

    # -- the generic path ------------------------------------------------------------------------

    def _generic(self, micro: list[tuple[Any, int]]) -> None:
        """Any step function: each micro-batch's gradient tree is checked and added."""
        window, opts, call = self.window, self.opts, self.call
        assert window is not None
        argnum, batch_argnum, transform = opts.argnum, opts.batch_argnum, opts.micro_transform
        given = self.args[argnum] if argnum is not None else None
        what = call if transform is None else f"{call} after micro_transform"
        for j, (mb, rows) in enumerate(micro):
            cur = _with_params(self.args, argnum, window.params(j, given), given)
            try:
                out = opts.step_fn(*cur[:batch_argnum], mb, *cur[batch_argnum + 1 :], **self.kwargs)
            except RuntimeError as err:  # torch.func over torch.utils.checkpoint: say the fix
                clear = explain_checkpoint(call, err)
                if clear is None:
                    raise
                raise clear from err
            grads, aux = _unpack(call, out) if opts.has_aux else (out, None)
            if opts.summed:
                _check_samples(call, transform, grads, rows)
            if transform is not None:
                grads = transform(grads)
            raw, items, alpha, weight = weigh(call, opts.reduction, opts.count, rows, aux)
            if opts.summed:  # a sum over the rows already: the boundary divides by the total rows
                alpha = 1
            scale = alpha / self.divisor if self.divisor else alpha
            window.add(check_grads(what, window.layout, grads), scale)
            window.step()
            self._count(weight, aux, rows, items, raw)
            # Drop this micro-batch's outputs (and any graph they hold) before the next.
            del out, mb, grads, aux, raw, cur

    # -- the fast path ---------------------------------------------------------------------------

    @torch.compiler.disable  # type: ignore[untyped-decorator]  # hooks, .grad writes: eager
    def _fast(self, micro: list[tuple[Any, int]]) -> None:
        """A torch.autograd step function: backward straight into the window.

        A native leaf has its running sum as ``.grad``, into which the backwards add in place;
        any other goes through ``Window.grad`` (a hook). The sum is the window's zeroed storage
        when ``Window.prepare`` says so (flat buckets: no hook at all); else, when the window
        allocates uninitialised storage up front, each first gradient is moved into it by a hook
        as autograd produces it, so that it is freed at once; otherwise the first gradients are
        adopted as the sums after the first backward. With ``overlap``, a hook reports each leaf
        ready during the last backward.
        """
        window, opts, call = self.window, self.opts, self.call
        assert window is not None
        assert opts.fast is not None
        fn, lay, batch_argnum = opts.fast, window.layout, opts.batch_argnum
        # Per leaf: a leaf that accumulates in its own dtype takes its gradient in place, whatever
        # the other leaves' dtypes; only the others (and streamed ones) run a hook per backward.
        # (streams(i) asked only of a window that overrides it: no Python call per leaf else)
        asks = type(window).streams is not Window.streams
        self.native = native = [
            acc == dt and not (asks and window.streams(i))
            for i, (acc, dt) in enumerate(zip(lay.accum_dtypes, lay.dtypes))
        ]
        self.seeded = lay.same_dtypes or any(native)
        self.zeroed = window.prepare(zero=not all(native))
        argnum = opts.argnum
        given = self.args[argnum] if argnum is not None else None
        guard = CheckpointGuard(call)
        last, params = len(micro) - 1, None
        new_args: list[Any] = []
        try:
            for j, (mb, rows) in enumerate(micro):
                p = window.params(j, given)
                if j == 0 or p is not params:  # (re-)alias the params as autograd leaves
                    params = p
                    new_args = self._alias(j, _with_params(self.args, argnum, p, given))
                new_args[batch_argnum] = mb
                value, aux = fn.forward(call, new_args, self.kwargs)
                raw, items, alpha, weight = weigh(call, opts.reduction, opts.count, rows, aux)
                scale: float = alpha / self.divisor if self.divisor else alpha
                if j == last:
                    # Counted before the backward, so that nothing that can fail runs after it:
                    # a sync may send the weight (and "no failure") during it (Window.seal).
                    self._count(weight, aux, rows, items, raw)
                    window.last()  # a sync may open its boundary before the last backward
                    window.seal(self.weight)
                    if window.overlap:
                        self._report_ready()
                if self.leaves and value.requires_grad:
                    self._backward(guard, value, scale, new_args)
                if j == 0:
                    self._adopt_first()
                window.step()
                if j != last:
                    self._count(weight, aux, rows, items, raw)
                del value, aux, raw, mb
            if self.divisor and not window.hint:  # prescale: the sums are the mean already
                self.weight = 1
        finally:
            _hooks.remove(self.hooks)
            _hooks.remove(self.first.values())
            for leaf in self.leaves:
                leaf.grad = None

    def _backward(
        self, guard: CheckpointGuard, value: torch.Tensor, scale: float, args: list[Any]
    ) -> None:
        """Backward of ``value`` into the leaves, its gradient scaled by ``scale``.

        When any leaf accumulates in place (in its own dtype), the seed carries the scale, as
        ``(loss * scale).backward()`` would, and the ``Window.grad`` hooks of the other leaves
        add with ``alpha`` 1. When none does (every leaf is low-precision with a wider
        accumulation dtype), the seed is 1 and the hooks apply the scale in the wider dtype, so
        that no scale is rounded into a float16/bfloat16 gradient.
        """
        seed = None
        if self.seeded:
            key = (scale, value.dtype, value.device)
            seed = self.seeds.get(key)
            if seed is None:
                seed = torch.full((), scale, dtype=value.dtype, device=value.device)
                self.seeds[key] = seed
        else:
            self.alpha = scale
        guard.backward(value, seed, self.leaves, (args, self.kwargs), self.plain)

    def _alias(self, j: int, args: list[Any]) -> list[Any]:
        """Fresh autograd leaves for micro-step ``j``'s params; the args that hold them."""
        window, native = self.window, self.native
        assert window is not None
        _hooks.remove(self.hooks)
        self.hooks.clear()
        for leaf in self.leaves:
            leaf.grad = None
        assert self.opts.fast is not None
        new_args, leaves, _ = self.opts.fast.alias(self.call, args)
        self.leaves = leaves
        self.plain = plain_tensors(leaves)
        other = [i for i, on in enumerate(native) if not on]
        if other:
            self.hooks += _hooks.register(
                [leaves[i] for i in other], [functools.partial(self._on_grad, i) for i in other]
            )
        if j == 0 and not self.zeroed:
            if window.sums is not None:  # storage up front: move each first gradient into it
                firsts = [i for i, on in enumerate(native) if on]
                removers = _hooks.register(
                    [leaves[i] for i in firsts],
                    [functools.partial(self._on_first, i) for i in firsts],
                )
                self.first.update(zip(firsts, removers))
        else:  # autograd adds into the running sums (zeros before the first backward)
            if j == 0:
                self.adopted.update([i for i, on in enumerate(native) if on])
            sums = window.sums
            assert sums is not None
            for i, leaf in enumerate(leaves):
                if native[i]:
                    leaf.grad = sums[i]
        return new_args

    def _report_ready(self) -> None:
        """The coming backward is the last: report each leaf's running sum final (overlap).

        A leaf whose first-gradient hook is still in place (a window of one micro-batch) has it
        report, after moving the gradient.
        """
        first = self.first
        self.reporting = True
        report = [i for i in range(len(self.leaves)) if i not in first]
        hooks = self.window.ready_hooks(report)  # type: ignore[union-attr]
        if hooks is None:
            hooks = [functools.partial(self._on_ready, i) for i in report]
        self.hooks += _hooks.register([self.leaves[i] for i in report], hooks)

    def _adopt_first(self) -> None:
        """After the first backward: the native leaves' gradients become the running sums."""
        window = self.window
        assert window is not None
        _hooks.remove(self.first.values())
        self.first.clear()
        native, adopted = self.native, self.adopted
        for i, leaf in enumerate(self.leaves):
            if native[i] and i not in adopted:  # not moved by a hook, or no gradient
                leaf.grad = window.adopt(i, leaf.grad)

    # The backward hooks (post-accumulate-grad hooks on the leaves).

    def _on_grad(self, i: int, leaf: torch.Tensor) -> None:
        """A leaf that is not native: hand its gradient to the window, scaled."""
        self.window.grad(i, leaf.grad, self.alpha)  # type: ignore[union-attr, arg-type]
        leaf.grad = None

    def _on_first(self, i: int, leaf: torch.Tensor) -> None:
        """A native leaf's first gradient: move it into the window's storage."""
        window = self.window
        assert window is not None
        leaf.grad = window.adopt(i, leaf.grad)
        self.adopted.add(i)
        if self.reporting:  # a window of one micro-batch: its last backward is this one
            window.ready(i)

    def _on_ready(self, i: int, _leaf: torch.Tensor) -> None:
        """During the last backward: leaf ``i``'s running sum is final."""
        self.window.ready(i)  # type: ignore[union-attr]


def _with_params(args: tuple[Any, ...], argnum: int | None, params: Any, given: Any) -> Any:
    """``args`` with ``params`` at ``argnum`` (as a list), or ``args`` if nothing changed."""
    if argnum is None or params is given:
        return list(args)
    new = list(args)
    new[argnum] = params
    return new


def _check_samples(call: str, transform: Any, grads: Any, rows: int) -> None:
    """Under ``mean``, a transform that sums over samples must get one sample per row."""
    leaves, _ = _tree.flatten(grads)
    first = leaves[0] if leaves else None
    if isinstance(first, torch.Tensor) and first.dim() and first.shape[0] != rows:
        name = getattr(transform, "__name__", None) or repr(transform)
        raise ValueError(
            f"{call}: with reduction='mean', micro_transform={name} sums over the "
            f"micro-batch's samples, one per row, so the window's gradient is their mean over "
            f"the rows; but step_fn returned gradients with {first.shape[0]} samples (leading "
            f"dim) for a micro-batch of {rows} rows. Return one gradient per row, e.g. "
            f"torch.func.vmap(torch.func.grad(loss_of_one), in_dims=(None, 0)), or pass "
            f"reduction='sum' (the clipped sum) and divide it yourself."
        )


def _unpack(call: str, out: Any) -> tuple[Any, Any]:
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError(
            f"{call}: with has_aux=True, step_fn must return a pair (grads, aux), got "
            f"{describe(out)}"
            f"{' of length ' + str(len(out)) if isinstance(out, (tuple, list)) else ''}; return "
            f"(grads, aux), as torch.func.grad_and_value does, or pass has_aux=False."
        )
    return out[0], out[1]
