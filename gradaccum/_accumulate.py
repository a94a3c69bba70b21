"""``accumulate``: the micro-batch loop as a higher-order transform.

split -> step_fn on each micro-batch -> add into the accumulator -> boundary (finalize).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch

from . import _reduce, _shard_window, _split, _sums
from ._autograd import GradFn
from ._custom import CustomReduce
from ._errors import describe
from ._fast_window import Progress, check_fast, fast_window
from ._scatter import ReduceScatter
from ._sync import AllReduce

__all__ = ["accumulate"]

P = ParamSpec("P")
R = TypeVar("R")


def accumulate(
    step_fn: Callable[P, R],
    n: int,
    *,
    has_aux: bool = False,
    reduction: _reduce.Reduction = "mean",
    count: Callable[[Any], int | float | torch.Tensor] | None = None,
    aux_reduction: Any = None,
    argnums: int | tuple[int, ...] | None = None,
    batch_argnum: int = 1,
    accum_dtype: torch.dtype | None = None,
    sync: AllReduce | ReduceScatter | CustomReduce | None = None,
    micro_transform: Callable[[Any], Any] | None = None,
) -> Callable[P, R]:
    """Turn a gradient function into one that accumulates over ``n`` micro-batches.

    The returned function has the signature of ``step_fn``. It splits the batch argument along
    dim 0 into ``n`` micro-batches, calls ``step_fn`` on each, adds the gradients into a
    float32 (or wider) accumulator allocated once, and returns the window's gradient. Under the
    default ``mean`` reduction this equals ``step_fn`` on the whole batch (within float
    tolerance), whatever the micro-batch sizes, while peak memory is that of one micro-batch.

    Args:
        step_fn: A function ``(params, batch, *args, **kwargs) -> grads``, or
            ``-> (grads, aux)`` with ``has_aux=True``: e.g. ``torch.func.grad(loss_fn)`` or
            ``torch.func.grad_and_value(loss_fn)``. ``grads`` must be shaped like the argument(s)
            selected by ``argnums``. With [`gradaccum.grad`][gradaccum.grad] or
            [`gradaccum.grad_and_value`][gradaccum.grad_and_value] (the same results, by
            torch.autograd) each backward adds straight into the accumulator, no gradient tree is
            made per micro-batch, and under a sync each bucket's all-reduce starts during the
            last backward: the fast path.
        n: The number of micro-batches to split each batch into. When ``n`` does not divide
            the batch, the first micro-batches get one row more (the result stays exact). A
            [`MicroBatches`][gradaccum.MicroBatches] batch is used as given, whatever ``n``.
        has_aux: ``step_fn`` returns ``(grads, aux)``; the accumulated function then returns
            ``(grads, aux)`` with aux combined per ``aux_reduction``.
        reduction: ``"mean"``: ``step_fn`` returns the gradient of a mean loss; micro-batches are
            weighted by their rows, giving the gradient of the mean over the whole batch.
            ``"sum"``: gradients are added. ``"count"``: ``step_fn`` returns the gradient of a
            *summed* loss and ``count(aux)`` the number of items it covers (e.g. non-padding
            tokens); the result is sum of gradients / sum of counts, the gradient of the
            item mean over the whole batch.
        count: With ``reduction="count"``, a function from a micro-batch's aux to its count
            (a number or a one-element tensor), e.g. ``lambda aux: aux[1]``.
        aux_reduction: How each aux leaf combines over micro-batches: one of ``"mean"``
            (weighted by rows: a per-micro-batch mean loss becomes the whole-batch mean),
            ``"sum"``, ``"count"`` (sum divided by the total count: a summed loss becomes the
            item mean), ``"concat"`` (along dim 0), ``"stack"`` (a new leading dim) or ``"last"``;
            or a pytree prefix of the aux with those names at its leaves. Default: the
            gradient ``reduction``, so a returned loss equals the whole-batch loss; under
            ``reduction="count"``, the aux leaf that ``count`` returns as is (e.g.
            ``count=lambda aux: aux[1]``) gets ``"sum"``, so it reports the total count.
        argnums: Which positional argument(s) the gradients are taken with respect to, as in
            ``torch.func.grad``; used to check the gradients' tree and to allocate the
            accumulator. Default: ``step_fn``'s own for a [`grad()`][gradaccum.grad] /
            [`grad_and_value()`][gradaccum.grad_and_value] function, else 0.
        batch_argnum: The position of the batch argument.
        accum_dtype: Dtype of the accumulator. Default: float32 for float16/bfloat16
            gradients, the gradient dtype otherwise. Gradients are returned in the dtype of the
            parameters.
        sync: ``None`` (one process), or [`all_reduce()`][gradaccum.all_reduce] for data-parallel
            training: after the last micro-batch (never inside the window; ``n=1`` included)
            the window's sums and weight are reduced over the process group in one bucketed
            collective, and the result is the gradient over the *global* batch, exact with
            unequal rows or counts per rank. A rank's batch may then be shorter than ``n`` rows
            (one micro-batch per row), or empty (it joins with zero weight and its aux is
            ``None``). Aux outputs stay per rank. If ``step_fn`` raises on one rank, that rank
            still joins the boundary and re-raises, and every other rank raises
            [`GradAccumError`][gradaccum.GradAccumError] instead of hanging. Or
            [`reduce_scatter()`][gradaccum.reduce_scatter] for sharded params: the function
            then takes the [`Sharded`][gradaccum.sync.Sharded] (or its gathered params) as its
            params and returns this rank's gradient shards, a tuple aligned with
            ``sharded.shards``. Or a [`custom_reduce()`][gradaccum.custom_reduce] (your own
            boundary reduction, or a built-in one such as
            [`compressed_all_reduce()`][gradaccum.compression.compressed_all_reduce]); it keeps its state
            between calls in [`CustomReduce.state`][gradaccum.sync.CustomReduce.state].
        micro_transform: A function applied to each micro-batch's gradients (the tree
            ``step_fn`` returns) before they are added, e.g. per-sample clipping of
            ``vmap``-ed per-sample gradients followed by their sum; it must return gradients
            shaped like the params. With it, a [`grad()`][gradaccum.grad] step function is
            called like any other (no fast path), since each micro-batch's gradient tree is
            needed.

    Returns:
        A function with the signature of ``step_fn`` returning the accumulated ``grads``, or
        ``(grads, aux)`` with ``has_aux=True``.

    Raises:
        TypeError: Wrong kinds of arguments (at the call of ``accumulate``), non-tensor or
            non-floating gradients, or a ``step_fn`` output of the wrong shape for ``has_aux``
            (at the call of the returned function).
        ValueError: Wrong values: ``n < 1``, a batch that cannot be split, gradients that do not
            match ``params`` (the message names the key path). Nothing is mutated.
        GradAccumError: With ``sync``: the ranks disagree on the gradient tree, another rank
            failed during the window, or a collective failed or timed out.

    Examples:
        >>> import torch, gradaccum
        >>> from torch.func import grad
        >>> def loss_fn(params, batch):
        ...     x, y = batch
        ...     return ((x @ params["w"] - y) ** 2).mean()
        >>> params = {"w": torch.zeros(3, dtype=torch.float64)}
        >>> x, y = torch.randn(12, 3, dtype=torch.float64), torch.randn(12, dtype=torch.float64)
        >>> step = gradaccum.accumulate(grad(loss_fn), n=4)
        >>> torch.allclose(step(params, (x, y))["w"], grad(loss_fn)(params, (x, y))["w"])
        True

    See Also:
        [`Accumulator`][gradaccum.Accumulator] for loops fed one micro-batch at a time;
        [`compare()`][gradaccum.testing.compare] to check a step function against the whole batch.
    """
    name = getattr(step_fn, "__name__", None) or type(step_fn).__name__
    where = f"accumulate({name}, n={n!r})"
    if not callable(step_fn):
        raise TypeError(
            f"accumulate(step_fn, n): step_fn must be callable, got {describe(step_fn)}; pass "
            f"a gradient function such as torch.func.grad(loss_fn)."
        )
    _sums.check_n(where, n)
    reduction = _reduce.check_reduction(where, reduction)
    _sums.check_accum_dtype(where, accum_dtype)
    if not isinstance(has_aux, bool):
        raise TypeError(
            f"{where}: has_aux must be a bool, got {describe(has_aux)}; pass has_aux=True if "
            f"step_fn returns (grads, aux), else has_aux=False."
        )
    if reduction == "count" and (not has_aux or not callable(count)):
        raise ValueError(
            f"{where}: reduction='count' needs has_aux=True and count=, a function from a "
            f"micro-batch's aux to the number of items its summed loss covers; got "
            f"has_aux={has_aux!r}, count={describe(count) if count is not None else None}. "
            f"Pass e.g. has_aux=True, count=lambda aux: aux['tokens']."
        )
    if count is not None and reduction != "count":
        raise ValueError(
            f"{where}: count= is used only with reduction='count', got reduction={reduction!r}; "
            f"pass reduction='count' or drop count=."
        )
    if aux_reduction is not None and not has_aux:
        raise ValueError(
            f"{where}: aux_reduction= needs has_aux=True (step_fn returning (grads, aux)); pass "
            f"has_aux=True or drop aux_reduction=."
        )
    _reduce.check_aux_reduction(where, aux_reduction)
    _sums.check_sync(where, sync)
    if micro_transform is not None and not callable(micro_transform):
        raise TypeError(
            f"{where}: micro_transform must be None or a function from one micro-batch's "
            f"gradients to the gradients to add, got {describe(micro_transform)}; pass a "
            f"function such as gradaccum.privacy.clip_per_sample(1.0), or None."
        )
    grad_fn = step_fn if isinstance(step_fn, GradFn) else None
    if argnums is None:
        argnums = grad_fn.argnums if grad_fn is not None else 0
    grad_args = _check_argnums(where, argnums, batch_argnum)
    if grad_fn is not None:
        check_fast(where, grad_fn, argnums, has_aux)
    # The fast path adds each backward straight into the sums: no gradient tree to transform.
    fast = grad_fn if micro_transform is None else None
    custom = sync if isinstance(sync, CustomReduce) else None

    def accumulated(*args: P.args, **kwargs: P.kwargs) -> R:
        call = f"{where}(...)"
        if len(args) <= max(batch_argnum, *grad_args):
            raise TypeError(
                f"{call}: expected the params at position(s) {list(grad_args)} and the batch "
                f"at position {batch_argnum}, got {len(args)} positional argument(s); pass them "
                f"positionally, e.g. step(params, batch)."
            )
        scatter = sync if isinstance(sync, ReduceScatter) else None
        # Given the Sharded itself, the window gathers the params: once, after the fingerprint
        # (the gathers' sizes depend on the sharded layout), or before each micro-batch.
        sharded_in = scatter is not None and _shard_window.is_sharded_arg(
            call, scatter, args, grad_args
        )
        regather = sharded_in and scatter.gather == "micro_batch"  # type: ignore[union-attr]
        target = (
            args[grad_args[0]] if isinstance(argnums, int) else tuple(args[i] for i in grad_args)
        )
        aux_acc = _reduce.AuxAccumulator(call, aux_reduction, reduction) if has_aux else None
        head, tail = args[:batch_argnum], args[batch_argnum + 1 :]
        win = Progress()
        try:
            if sharded_in:
                lay = _sums.with_accum(scatter.sharded.layout, accum_dtype)  # type: ignore[union-attr]
            else:
                lay = _sums.make_layout(call, target, accum_dtype)
                _check_not_empty(call, lay, target, argnums)
            win.state = _sums.AccumState(None, 0, 0, 0, lay)
            window = scatter._open(call, lay, reduction, n) if scatter is not None else None
            if sharded_in and not regather:
                assert scatter is not None
                full = scatter.sharded._gather(call, scatter.timeout)
                args = _shard_window.with_params(args, grad_args[0], full)  # type: ignore[assignment]
                head, tail = args[:batch_argnum], args[batch_argnum + 1 :]
                del full
            if window is not None:
                window.regather = regather
            win.state = _sums.AccumState(
                window, 0, 0, 0, lay, custom.state if custom is not None else None
            )
            micro = _split.split(call, args[batch_argnum], n, short_ok=sync is not None)
            if window is not None and len(micro) > n:
                raise ValueError(
                    f"{call}: the batch has {len(micro)} micro-batches but n={n}; with "
                    f"sync=reduce_scatter(...) every rank runs exactly n micro-steps per window. "
                    f"Pass at most n micro-batches, or a larger n."
                )
            if fast is not None:
                if window is not None:
                    run = functools.partial(
                        _shard_window.fast_window, window=window, regather=regather, n=n
                    )
                else:
                    run = functools.partial(
                        fast_window,
                        sync=sync if isinstance(sync, AllReduce) else None,
                        prescale_ok=sync is None,
                    )
                if micro:  # an empty batch runs nothing; the boundary still joins
                    run(
                        call,
                        fast,
                        args,
                        kwargs,
                        batch_argnum,
                        micro,
                        win,
                        aux_acc,
                        reduction=reduction,
                        count=count,
                    )
            else:
                for mb, rows in micro:
                    if regather:
                        assert window is not None
                        cur = _shard_window.with_params(args, grad_args[0], window.gather_params())
                        head, tail = cur[:batch_argnum], cur[batch_argnum + 1 :]
                    out = step_fn(*head, mb, *tail, **kwargs)  # type: ignore[arg-type]
                    grads, aux = _unpack(call, out) if has_aux else (out, None)
                    if micro_transform is not None:
                        grads = micro_transform(grads)
                    raw, items, alpha, weight = _sums.weigh(call, reduction, count, rows, aux)
                    win.state = _sums.add_grads(
                        call if micro_transform is None else f"{call} after micro_transform",
                        win.state,
                        grads,
                        alpha,
                        weight,
                        sync,
                        reduction,
                    )
                    if aux_acc is not None:
                        aux_acc.add(aux, rows, items, raw)
                    # Drop this micro-batch's outputs (and any graph they hold) before the next.
                    del out, mb, grads, aux, raw
                    if regather:
                        del head, tail
        except Exception:
            # Join the boundary flagged as failed, so the other ranks raise instead of hanging.
            _sums.abort(call, reduction, win.state, sync, win.pending, n=n)
            raise
        # The boundary: the one place that communicates (with sync=).
        state = win.state
        grads, after = _sums.finalize(call, reduction, state, sync, pending=win.pending, n=n)
        if custom is not None:
            custom.load_state(after.reduce_state)
        if aux_acc is not None:
            aux_out = aux_acc.result() if state.micro_step else None
            return (grads, aux_out)  # type: ignore[return-value]
        return grads  # type: ignore[no-any-return]

    if not torch.compiler.is_compiling():
        accumulated = functools.wraps(step_fn)(accumulated)
    return accumulated


def _check_argnums(where: str, argnums: object, batch_argnum: object) -> tuple[int, ...]:
    if isinstance(batch_argnum, bool) or not isinstance(batch_argnum, int) or batch_argnum < 0:
        raise TypeError(
            f"{where}: batch_argnum must be a non-negative int (a positional index), got "
            f"{describe(batch_argnum)}; pass the position of the batch among step_fn's "
            f"positional arguments, e.g. batch_argnum=1 for step_fn(params, batch)."
        )
    if isinstance(argnums, int) and not isinstance(argnums, bool):
        nums: tuple[int, ...] = (argnums,)
    elif (
        isinstance(argnums, tuple)
        and argnums
        and all(isinstance(i, int) and not isinstance(i, bool) for i in argnums)
    ):
        nums = argnums
    else:
        raise TypeError(
            f"{where}: argnums must be an int or a non-empty tuple of ints, as in "
            f"torch.func.grad, got {describe(argnums)}; pass e.g. argnums=0, or argnums=(0, 2) "
            f"for several arguments."
        )
    if any(i < 0 for i in nums):
        raise ValueError(
            f"{where}: argnums must be non-negative, got {argnums!r}; pass the positions "
            f"counted from the first argument, e.g. argnums=0."
        )
    if batch_argnum in nums:
        raise ValueError(
            f"{where}: batch_argnum={batch_argnum} is also in argnums={argnums!r}; the batch is "
            f"split, not differentiated. Pass the position of the batch as batch_argnum."
        )
    return nums


def _check_not_empty(
    call: str, lay: _sums._Layout, target: Any, argnums: int | tuple[int, ...]
) -> None:
    """Refuse params with no tensor leaf: nothing to differentiate, nothing to accumulate."""
    if lay.paths:
        return
    at = f"position {argnums}" if isinstance(argnums, int) else f"positions {list(argnums)}"
    got = repr(target)
    got = got if len(got) <= 60 else got[:57] + "..."
    raise ValueError(
        f"{call}: the params (argnums={argnums!r}) hold no tensor leaves, got {got}, "
        f"so there is no gradient to accumulate; pass the params to differentiate (a pytree "
        f"with at least one floating tensor, e.g. gradaccum.params_of(model)) at {at}, "
        f"or point argnums= at the argument that holds them."
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
