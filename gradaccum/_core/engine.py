"""The window loop of ``accumulate``: micro-batches through the step function into a window.

A [`grad()`][gradaccum.grad] step function takes the fast path (backward straight into the
window's storage); any other returns a gradient tree, which is checked and added. Both are step 3
of "One window's life" in ``docs/architecture.md``; nothing here knows which sync it is.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from .. import _reduce, _tree
from .._autograd import CheckpointGuard, GradFn, explain_checkpoint
from .._errors import describe
from .._layout import check_grads, weigh
from .protocol import Sync, Window, WindowSpec
from .state import AccumState

__all__ = ["Progress", "abort", "run"]


class Progress:
    """What a call has reached, so that the error path can join the boundary consistently."""

    state: AccumState[Any] | None = None
    window: Window | None = None
    opening = False  # the sync's open() was called (if it raised, it is not called again)


def run(
    call: str,
    step_fn: Callable[..., Any],
    fast: GradFn | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    micro: list[tuple[Any, int]],
    win: Progress,
    aux_acc: _reduce.AuxAccumulator | None,
    *,
    batch_argnum: int,
    argnum: int | None,
    reduction: _reduce.Reduction,
    count: Callable[[Any], Any] | None,
    has_aux: bool,
    micro_transform: Callable[[Any], Any] | None,
    traceable: bool = False,
) -> None:
    """Run the window's micro-batches; the state and window in ``win`` record the progress.

    ``traceable``: ``fast`` came from a torch.func function, which Dynamo traces on the generic
    path when this frame is being compiled. A ``micro_transform`` with ``sums_rows = True``
    returns a sum over the micro-batch's rows: under ``mean`` it is added unweighted (the
    window's total rows divide the sum at the boundary), not weighted by its rows.
    """
    assert win.window is not None
    win.window.begin(len(micro))
    if not micro:  # an empty batch runs nothing; the boundary still joins
        return
    if fast is not None and not (traceable and torch.compiler.is_compiling()):
        _fast(call, fast, args, kwargs, micro, win, aux_acc, batch_argnum, argnum, reduction, count)
        return
    window = win.window
    given = args[argnum] if argnum is not None else None
    hint = window.hint if window.layout.wide and reduction == "mean" else None  # as in _fast
    summed = reduction == "mean" and getattr(micro_transform, "sums_rows", False) is True
    for j, (mb, rows) in enumerate(micro):
        cur = _with_params(args, argnum, window.params(j, given), given)
        try:
            out = step_fn(*cur[:batch_argnum], mb, *cur[batch_argnum + 1 :], **kwargs)
        except RuntimeError as err:  # torch.func over torch.utils.checkpoint: say the fix
            clear = explain_checkpoint(call, err)
            if clear is None:
                raise
            raise clear from err
        grads, aux = _unpack(call, out) if has_aux else (out, None)
        if summed:
            _check_samples(call, micro_transform, grads, rows)
        if micro_transform is not None:
            grads = micro_transform(grads)
        raw, items, alpha, weight = weigh(call, reduction, count, rows, aux)
        if summed:  # a sum over the rows already: the boundary divides by the total rows
            alpha = 1
        what = call if micro_transform is None else f"{call} after micro_transform"
        window.add(check_grads(what, window.layout, grads), alpha / hint if hint else alpha)
        window.step()
        _count(win, weight)
        if aux_acc is not None:
            aux_acc.add(aux, rows, items, raw)
        # Drop this micro-batch's outputs (and any graph they hold) before the next.
        del out, mb, grads, aux, raw, cur


@torch.compiler.disable  # type: ignore[untyped-decorator]  # hooks, .grad writes: eager
def _fast(
    call: str,
    fn: GradFn,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    micro: list[tuple[Any, int]],
    win: Progress,
    aux_acc: _reduce.AuxAccumulator | None,
    batch_argnum: int,
    argnum: int | None,
    reduction: _reduce.Reduction,
    count: Callable[[Any], Any] | None,
) -> None:
    """The window of a torch.autograd step function: backward straight into the window.

    A native leaf (its own dtype accumulates, the window keeps its sum) has the adopted first
    gradient as ``.grad``, into which the later backwards add in place; any other goes through
    ``window.grad`` (a hook).
    """
    window = win.window
    assert window is not None
    lay = window.layout
    given = args[argnum] if argnum is not None else None
    direct = lay.accum_dtypes == lay.dtypes
    native = [direct and not window.streams(i) for i in range(len(lay.shapes))]
    window.prepare(zero=not all(native))
    # Storage allocated up front: each first gradient is moved into it as autograd produces it
    # (a hook), so that it is freed at once. Without, the first gradients are the sums as they are.
    moving = window.sums is not None
    alpha_now: list[float] = [1]
    hooks: list[Any] = []
    first: list[Any] = []  # the hooks that hand the first gradients to the window
    adopted: set[int] = set()
    seeds: dict[tuple[float, torch.dtype, torch.device], torch.Tensor] = {}
    leaves: list[torch.Tensor] = []
    new_args: list[Any] = []

    def on_grad(i: int, leaf: torch.Tensor) -> None:
        window.grad(i, leaf.grad, alpha_now[0])  # type: ignore[arg-type]
        leaf.grad = None

    def on_first(i: int, leaf: torch.Tensor) -> None:
        leaf.grad = window.adopt(i, leaf.grad)
        adopted.add(i)

    def on_ready(i: int, _leaf: torch.Tensor) -> None:
        window.ready(i)

    def on_first_ready(i: int, leaf: torch.Tensor) -> None:  # a window of one micro-batch
        on_first(i, leaf)
        window.ready(i)

    def hook(fn: Callable[..., None], i: int, leaf: torch.Tensor) -> Any:
        return leaf.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
            functools.partial(fn, i)
        )

    # Window.prescale (one process, mean): seed each backward with rows / total rows, so the sums
    # are the mean already. Not in float16/bfloat16, which would round otherwise than a sync.
    prescale: float = 0
    if window.prescale and lay.wide and reduction == "mean":
        prescale = sum(r for _, r in micro)
    hint = window.hint if lay.wide and reduction == "mean" else None
    if hint:  # Window.hint (a sync, mean): the ranks' agreed guess of the global total
        prescale = hint
    last, params = len(micro) - 1, None
    # One micro-batch with overlap: one hook per leaf both moves its gradient and reports it.
    both = last == 0 and moving and window.overlap
    try:
        for j, (mb, rows) in enumerate(micro):
            p = window.params(j, given)
            if j == 0 or p is not params:  # (re-)alias the params as autograd leaves
                for h in hooks:
                    h.remove()
                hooks.clear()
                for leaf in leaves:
                    leaf.grad = None
                params = p
                new_args, leaves, _ = fn.alias(call, _with_params(args, argnum, p, given))
                hooks.extend(hook(on_grad, i, x) for i, x in enumerate(leaves) if not native[i])
                if j == 0:
                    if moving:
                        on = on_first_ready if both else on_first
                        first.extend(hook(on, i, x) for i, x in enumerate(leaves) if native[i])
                else:  # the running sums carry over to the new leaves
                    assert window.sums is not None
                    for i, leaf in enumerate(leaves):
                        if native[i]:
                            leaf.grad = window.sums[i]
            new_args[batch_argnum] = mb
            value, aux = fn.forward(call, new_args, kwargs)
            raw, items, alpha, weight = weigh(call, reduction, count, rows, aux)
            scale: float = alpha / prescale if prescale else alpha
            if j == last:
                # Counted before the backward, so that nothing that can fail runs after it: a
                # sync may send the weight (and "no failure") during it (Window.seal).
                _count(win, weight)
                if aux_acc is not None:
                    aux_acc.add(aux, rows, items, raw)
                window.last()  # a sync may open its boundary before the last backward
                assert win.state is not None
                window.seal(win.state.weight)
                if window.overlap:
                    hooks.extend(
                        hook(on_ready, i, x)
                        for i, x in enumerate(leaves)
                        if not (both and native[i])
                    )
            if leaves and value.requires_grad:
                seed = None
                if direct:
                    key = (scale, value.dtype, value.device)
                    if key not in seeds:
                        seeds[key] = torch.full((), scale, dtype=value.dtype, device=value.device)
                    seed = seeds[key]
                else:
                    alpha_now[0] = scale
                with CheckpointGuard(call, leaves, (new_args, kwargs)):
                    torch.autograd.backward(value, seed, inputs=leaves)
            if j == 0:
                for h in first:
                    h.remove()
                first.clear()
                for i, leaf in enumerate(leaves):
                    if native[i] and i not in adopted:  # not moved by a hook, or no gradient
                        leaf.grad = window.adopt(i, leaf.grad)
            window.step()
            if j != last:
                _count(win, weight)
                if aux_acc is not None:
                    aux_acc.add(aux, rows, items, raw)
            del value, aux, raw, mb
        if prescale and not hint:  # the sums are the mean already
            assert win.state is not None
            win.state = win.state._replace(weight=1)
    finally:
        for h in hooks + first:
            h.remove()
        for leaf in leaves:
            leaf.grad = None


def abort(win: Progress, sync: Sync, spec: WindowSpec | None) -> None:
    """Join the window's boundary flagged as failed, so the other ranks raise instead of waiting.

    Without an open window, one is opened for ``spec`` (``None``: nothing to join). Errors while
    joining are dropped: the caller re-raises its own.
    """
    with contextlib.suppress(Exception):
        window = win.window
        if window is None and spec is not None and not win.opening:
            window = sync.open(spec)
        if window is not None:
            window.abort(win.state.weight if win.state is not None else 0)


def _count(win: Progress, weight: _reduce.Weight) -> None:
    state = win.state
    assert state is not None
    win.state = state._replace(weight=state.weight + weight, micro_step=state.micro_step + 1)


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
