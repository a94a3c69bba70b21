"""``accumulate``: the micro-batch loop as a higher-order transform.

split -> step_fn on each micro-batch -> add into the window -> boundary (the window's finish).

``accumulate`` validates its arguments once, when it is called, and bundles them in one frozen
``RunOptions``; each call of the function it returns checks its arguments, makes the layout of
the params, opens the sync's window through one ``WindowRun`` (``_core/engine.py``), splits the
batch and runs the micro-batches into the window, then closes the window at the boundary. If
anything raises, the call joins the boundary flagged as failed before re-raising, so that under a
sync the other ranks raise too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch

from .. import _reduce, _split
from .._autograd import GradFn, check_argnums, check_no_transform, from_torch_func, grad_on
from .._errors import describe
from .._layout import Layout, check_accum_dtype, check_n
from . import engine
from .protocol import LOCAL, Sync, check_sync

__all__ = ["accumulate", "accumulate_as"]

P = ParamSpec("P")
R = TypeVar("R")


def accumulate(
    step_fn: Callable[P, R],
    n: int,
    *,
    has_aux: bool | None = None,
    reduction: _reduce.Reduction = "mean",
    count: Callable[[Any], int | float | torch.Tensor] | None = None,
    aux_reduction: Any = None,
    argnums: int | tuple[int, ...] | None = None,
    batch_argnum: int = 1,
    accum_dtype: torch.dtype | None = None,
    sync: Sync | None = None,
    micro_transform: Callable[[Any], Any] | None = None,
) -> Callable[P, R]:
    """Turn a gradient function into one that accumulates over ``n`` micro-batches.

    It splits the batch argument along dim 0 into ``n`` micro-batches, calls ``step_fn`` on each,
    adds the gradients into a float32 (or wider) accumulator allocated once, and returns the
    window's gradient. Under the default ``mean`` reduction this equals ``step_fn`` on the whole
    batch (within float tolerance), whatever the micro-batch sizes, while peak memory is that of
    one micro-batch.

    Gradients are accumulated, never differentiated through: the returned function adds into
    running sums in place, outside autograd, so it refuses to run under a ``torch.func``
    transform (``jacrev``, ``jacfwd``, ``hessian``, ``grad``, ``vjp``, ``jvp``, ``vmap``,
    ``functionalize``), which would otherwise see zeros or fail. Take higher derivatives of the
    whole-batch gradient (``torch.func.hessian(loss_fn)``) and put ``vmap`` inside the step
    function (per-sample gradients); ``torch.compile`` over the returned function works. The
    returned gradients do not require grad: ``torch.autograd.functional.jacobian``, which runs
    no ``torch.func`` transform and cannot be detected, reports zeros for them under its
    default ``strict=False``, as for any such output (``strict=True`` raises). Like
    ``torch.func.grad``, it runs with autograd on whatever the caller's grad mode: under
    ``torch.no_grad()`` or ``torch.inference_mode()`` the gradients are the same, plain tensors.

    Args:
        step_fn: A function ``(params, batch, *args, **kwargs) -> grads``, or
            ``-> (grads, aux)`` with ``has_aux=True``: e.g. ``torch.func.grad(loss_fn)`` or
            ``torch.func.grad_and_value(loss_fn)``. ``grads`` must be shaped like the argument(s)
            selected by ``argnums``. A [`gradaccum.grad`][gradaccum.grad] /
            [`grad_and_value`][gradaccum.grad_and_value] function, or one that ``torch.func.grad``
            / ``grad_and_value`` returned (not nested in other transforms, nor wrapped), takes the
            fast path: each backward adds straight into the accumulator.
        n: The number of micro-batches to split each batch into. When ``n`` does not divide
            the batch, the first micro-batches get one row more (the result stays exact). A
            [`MicroBatches`][gradaccum.MicroBatches] batch is used as given, whatever ``n``.
        has_aux: ``step_fn`` returns ``(grads, aux)``; the accumulated function then returns
            ``(grads, aux)`` with aux combined per ``aux_reduction``. Default: what a ``grad()``
            / ``grad_and_value()`` step function (gradaccum's or torch.func's) returns, else False.
        reduction: What ``step_fn``'s gradient is of, as for
            [`loop.Step`][gradaccum.loop.Step]. ``"mean"`` (the default): of a mean over the
            micro-batch's rows; each is weighted by its rows, giving the gradient of the mean
            over the whole batch's rows. ``"count"``: of a *sum* over items, ``count(aux)`` of
            them (e.g. non-padding tokens), as a ``Step`` loss returning
            [`gradaccum.Sum(loss, n)`][gradaccum.Sum] says; the result is the sum of the
            gradients divided by the sum of the counts, the gradient of the mean over the whole
            batch's items. ``"sum"``: the plain sum of the gradients, nothing divided. The
            gradients alone cannot tell a mean from a sum, so a token-mean loss under
            ``"mean"`` is weighted by rows, not tokens: return the summed loss and its count,
            with ``reduction="count"``. ``count=`` without ``reduction="count"`` (or the
            other way round) is refused, so a forgotten keyword cannot change the objective.
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
            training: the result is the gradient over the *global* batch, reduced at the
            boundary (``n=1`` included). A rank's batch may then be shorter than ``n`` rows
            (one micro-batch per row), or empty (it joins with zero weight and its aux is
            ``None``). Aux outputs stay per rank. If ``step_fn`` raises on one rank, that rank
            still joins the boundary and re-raises, and every other rank raises
            [`GradAccumError`][gradaccum.GradAccumError] instead of hanging. Or
            [`reduce_scatter()`][gradaccum.reduce_scatter] for sharded params: the function
            then takes the [`Sharded`][gradaccum.sharding.Sharded] (or its gathered params) as its
            params and returns this rank's gradient shards, a tuple aligned with
            ``sharded.shards``. Or a [`custom_reduce()`][gradaccum.custom_reduce] (yours, or e.g.
            [`compressed_all_reduce()`][gradaccum.compression.compressed_all_reduce]), whose state
            between calls is [`CustomReduce.state`][gradaccum.sync.CustomReduce.state].
        micro_transform: A function applied to each micro-batch's gradients (the tree
            ``step_fn`` returns) before they are added, e.g. per-sample clipping of
            ``vmap``-ed per-sample gradients followed by their sum; it must return gradients
            shaped like the params. Its output is weighted as ``step_fn``'s would be (under
            ``"mean"``, by the micro-batch's rows), unless it has the attribute
            ``sums_rows = True``, as [`clip_per_sample()`][gradaccum.privacy.clip_per_sample]
            does: its output is then a sum over the micro-batch's rows (one sample per row,
            checked), added unweighted, so under ``"mean"`` the result is the mean over the
            window's rows (with ``sync=``, every rank's) of the per-sample results. It turns the
            fast path off (it needs each gradient tree).

    Returns:
        A function with the signature of ``step_fn`` returning the accumulated ``grads``, or
        ``(grads, aux)`` with ``has_aux=True``.

    Raises:
        TypeError: Wrong kinds of arguments (at the call of ``accumulate``), non-tensor or
            non-floating gradients, or a ``step_fn`` output of the wrong shape for ``has_aux``
            (at the call of the returned function).
        ValueError: Wrong values: ``n < 1``, a batch that cannot be split, gradients that do not
            match ``params`` (the message names the key path); a call under a ``torch.func``
            transform (the message names it and gives the fix); a call inside another
            accumulated function's micro-batch loop with ``reduction="count"`` on either (nested
            ``mean`` and ``sum`` are exact). Nothing is mutated.
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
    return accumulate_as(
        None,
        step_fn,
        n,
        has_aux=has_aux,
        reduction=reduction,
        count=count,
        aux_reduction=aux_reduction,
        argnums=argnums,
        batch_argnum=batch_argnum,
        accum_dtype=accum_dtype,
        sync=sync,
        micro_transform=micro_transform,
    )


def accumulate_as(
    call: str | None,
    step_fn: Callable[P, R],
    n: int,
    *,
    has_aux: bool | None = None,
    reduction: _reduce.Reduction = "mean",
    count: Callable[[Any], int | float | torch.Tensor] | None = None,
    aux_reduction: Any = None,
    argnums: int | tuple[int, ...] | None = None,
    batch_argnum: int = 1,
    accum_dtype: torch.dtype | None = None,
    sync: Sync | None = None,
    micro_transform: Callable[[Any], Any] | None = None,
) -> Callable[P, R]:
    """``accumulate``, whose calls' errors name ``call`` (``None``: ``accumulate(fn, n=...)(...)``).

    For a transform that runs one inside its own call (the second pass of ``coupled`` and
    ``window_stats``): a user who called ``coupled(embed, loss, n=4)(params, batch)`` reads that
    call in a message, not an ``accumulate`` they never wrote. Its arguments are
    [`accumulate()`][gradaccum.accumulate]'s.
    """
    name = getattr(step_fn, "__name__", None) or type(step_fn).__name__
    where = f"accumulate({name}, n={n!r})"
    named = call if call is not None else f"{where}(...)"
    if not callable(step_fn):
        raise TypeError(
            f"accumulate(step_fn, n): step_fn must be callable, got {describe(step_fn)}; pass "
            f"a gradient function such as torch.func.grad(loss_fn)."
        )
    check_n(where, n)
    reduction = _reduce.check_reduction(where, reduction)
    check_accum_dtype(where, accum_dtype)
    grad_fn = step_fn if isinstance(step_fn, GradFn) else from_torch_func(step_fn)
    if has_aux is None:  # a grad_and_value (or has_aux) step function returns a pair
        has_aux = grad_fn.returns_aux if grad_fn is not None else False
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
    check_sync(where, sync)
    if micro_transform is not None and not callable(micro_transform):
        raise TypeError(
            f"{where}: micro_transform must be None or a function from one micro-batch's "
            f"gradients to the gradients to add, got {describe(micro_transform)}; pass a "
            f"function such as gradaccum.privacy.clip_per_sample(1.0), or None."
        )
    if argnums is None:
        argnums = grad_fn.argnums if grad_fn is not None else 0
    grad_args = _check_argnums(where, argnums, batch_argnum)
    if grad_fn is not None:
        _check_fast(where, grad_fn, argnums, has_aux)
    # The fast path adds each backward straight into the sums: no gradient tree to transform.
    fast = grad_fn if micro_transform is None else None
    opts = engine.RunOptions(
        step_fn=step_fn,
        fast=fast,
        # A torch.func step function stays traceable when the accumulated function is compiled.
        traceable=fast is not None and not isinstance(step_fn, GradFn),
        sync=sync if sync is not None else LOCAL,
        n=n,
        batch_argnum=batch_argnum,
        argnum=argnums if isinstance(argnums, int) else None,
        reduction=reduction,
        count=count,
        has_aux=has_aux,
        aux_reduction=aux_reduction,
        micro_transform=micro_transform,
    )
    kind, argnum, top = opts.sync, opts.argnum, max(batch_argnum, *grad_args)
    seen: list[Layout] = []  # the last layout: a rank failing before it knows its own joins
    opened = [0]  # windows opened (failed ones too): the next window's index, on every rank

    @grad_on  # exact under torch.no_grad() and torch.inference_mode(), as torch.func.grad is
    def accumulated(*args: P.args, **kwargs: P.kwargs) -> R:
        call = named
        check_no_transform(call)  # before anything: a refused call changes nothing
        engine.check_nesting(call, reduction)
        if len(args) <= top:
            raise TypeError(
                f"{call}: expected the params at position(s) {list(grad_args)} and the batch "
                f"at position {batch_argnum}, got {len(args)} positional argument(s); pass them "
                f"positionally, e.g. step(params, batch)."
            )
        target = args[argnum] if argnum is not None else tuple(args[i] for i in grad_args)
        index = 0
        if not torch.compiler.is_compiling():  # traced, the count would recompile every call
            index = opened[0]
            opened[0] += 1
        run = engine.WindowRun(call, opts, args, kwargs, target, index)
        try:
            lay = kind.layout(call, target, accum_dtype, argnums)
            _check_not_empty(call, lay, target, argnums)
            seen[:] = [lay]
            run.open(lay)
            run.run(_split.split(call, args[batch_argnum], n, short_ok=sync is not None))
        except Exception:  # join the boundary flagged as failed (see WindowRun.abort)
            run.abort(seen[0] if seen else None)
            raise
        return run.finish()  # type: ignore[no-any-return]

    if fast is not None and not opts.traceable:
        # Autograd hooks and .grad writes cannot be traced: under torch.compile the call runs
        # eagerly, through a clean graph break here. A break inside the window (in a try block)
        # would make Dynamo skip this code object for every accumulated function in the process.
        body, eager = accumulated, torch.compiler.disable(accumulated)  # type: ignore[no-untyped-call]

        def accumulated(*args: P.args, **kwargs: P.kwargs) -> R:
            if torch.compiler.is_compiling():
                return eager(*args, **kwargs)  # type: ignore[no-any-return]
            return body(*args, **kwargs)

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
    nums = check_argnums(where, argnums)
    if batch_argnum in nums:
        raise ValueError(
            f"{where}: batch_argnum={batch_argnum} is also in argnums={argnums!r}; the batch is "
            f"split, not differentiated. Pass the position of the batch as batch_argnum."
        )
    return nums


def _check_not_empty(call: str, lay: Layout, target: Any, argnums: int | tuple[int, ...]) -> None:
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


def _check_fast(where: str, fast: GradFn, argnums: object, has_aux: bool) -> None:
    if fast.argnums != argnums:
        raise ValueError(
            f"{where}: step_fn differentiates argnums={fast.argnums!r} but accumulate was given "
            f"argnums={argnums!r}; pass the same argnums to both."
        )
    if fast.returns_aux != has_aux:
        out = "(grads, value)" if fast.with_value else "(grads, aux)" if fast.has_aux else "grads"
        raise ValueError(
            f"{where}: step_fn ({fast!r}) returns {out}, so accumulate needs "
            f"has_aux={fast.returns_aux}, got has_aux={has_aux}; pass has_aux={fast.returns_aux} "
            f"(or leave it out: it is inferred from the step function)."
        )
