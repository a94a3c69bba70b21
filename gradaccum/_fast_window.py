"""The fast path of ``accumulate``: a window of a ``gradaccum.grad`` step function.

Each micro-batch's backward accumulates into ``.grad`` (or into the sync's buckets), seeded with
the micro-batch's weight, as a hand-written ``loss.backward()`` loop does: no gradient tree is
made per micro-batch, and the loop has no host sync.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from . import _reduce, _sums, _tree
from ._autograd import GradFn
from ._sync import AllReduce

__all__ = ["Progress", "check_fast", "fast_window"]


class Progress:
    """What a call has reached, so that the error path can join the boundary consistently."""

    state: _sums.AccumState[Any] | None = None
    pending: Any = None  # a boundary opened during the last backward (some buckets in flight)


def check_fast(where: str, fast: GradFn, argnums: object, has_aux: bool) -> None:
    if fast.argnums != argnums:
        raise ValueError(
            f"{where}: step_fn differentiates argnums={fast.argnums!r} but accumulate was given "
            f"argnums={argnums!r}; pass the same argnums to both."
        )
    if fast.returns_aux != has_aux:
        out = "(grads, value)" if fast.with_value else "(grads, aux)" if fast.has_aux else "grads"
        raise ValueError(
            f"{where}: step_fn ({fast!r}) returns {out}, so accumulate needs "
            f"has_aux={fast.returns_aux}, got has_aux={has_aux}; pass has_aux={fast.returns_aux}."
        )


@torch.compiler.disable  # type: ignore[untyped-decorator]  # hooks, .grad writes: eager
def fast_window(
    call: str,
    fn: GradFn,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    batch_argnum: int,
    micro: list[tuple[Any, int]],
    win: Progress,
    aux_acc: _reduce.AuxAccumulator | None,
    *,
    reduction: _reduce.Reduction,
    count: Callable[[Any], Any] | None,
    sync: AllReduce | None,
    prescale_ok: bool = True,
) -> None:
    """The window of a torch.autograd step function: backward straight into the accumulator.

    The differentiated arguments become autograd leaves sharing the params' storage, and each
    backward accumulates into their ``.grad``, seeded with the micro-batch's weight, as a
    hand-written ``loss.backward()`` loop does:

    - one process: ``.grad`` is the running sum (the first backward's gradient is kept as is,
      the later ones are added into it in place);
    - under a sync: after the first backward, each gradient is copied into its view of a
      boundary bucket, which becomes ``.grad``, so the later backwards add into the buckets;
      with ``sync.overlap``, each bucket's all-reduce starts during the last backward, as soon
      as all of its leaves have their final sum;
    - low-precision params with a wider accumulator: a hook adds each gradient, scaled, into the
      (zeroed) sums and drops it.
    """
    state = win.state
    assert state is not None
    lay = state.layout
    new_args, leaves, _ = fn.alias(call, args)
    direct = lay.accum_dtypes == lay.dtypes
    sums: list[torch.Tensor] | None = None
    if not direct:
        sums = _sums.allocate(lay, sync)
    elif sync is not None:
        sums = sync._allocate(lay)  # uninitialised: the first backward's gradients go in
    if sums is not None:
        win.state = state = state._replace(sums=_tree.unflatten(lay.spec, sums))
    alpha_now: list[float] = [1]
    handles: list[Any] = []
    first: list[Any] = []  # the hooks that move the first gradients into the buckets
    moved: set[int] = set()
    seeds: dict[tuple[float, torch.dtype, torch.device], torch.Tensor] = {}

    def add_hook(s: torch.Tensor, leaf: torch.Tensor) -> None:
        s.add_(leaf.grad, alpha=alpha_now[0])  # type: ignore[arg-type]
        leaf.grad = None

    def move_hook(i: int, leaf: torch.Tensor) -> None:
        assert sums is not None
        assert leaf.grad is not None
        sums[i].copy_(leaf.grad)
        leaf.grad = sums[i]
        moved.add(i)

    def hook(leaf: torch.Tensor, fn: Callable[..., None], *args: Any) -> Any:
        return leaf.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
            functools.partial(fn, *args)
        )

    try:
        if not direct:
            handles.extend(hook(leaf, add_hook, s) for s, leaf in zip(sums or [], leaves))
        elif sums is not None:
            first.extend(hook(leaf, move_hook, i) for i, leaf in enumerate(leaves))
        last = len(micro) - 1
        # One process, mean: seed each backward with rows / total rows (as a hand-written loop
        # scales its loss), so the sums are the mean already and the boundary divides by 1.
        prescale = (
            sum(rows for _, rows in micro)
            if sync is None and prescale_ok and reduction == "mean"
            else 0
        )
        for j, (mb, rows) in enumerate(micro):
            new_args[batch_argnum] = mb
            value, aux = fn.forward(call, new_args, kwargs)
            raw, items, alpha, weight = _sums.weigh(call, reduction, count, rows, aux)
            scale: float = alpha / prescale if prescale else alpha
            if j == last and sync is not None and sync.overlap:
                # Open the boundary before the last backward: its hooks launch each bucket's
                # all-reduce as soon as all of the bucket's leaves have their final sum.
                assert sums is not None
                win.pending = pending = sync._begin(call, reduction, lay, sums)
                handles.extend(hook(leaf, pending.leaf_ready, i) for i, leaf in enumerate(leaves))
            if leaves and value.requires_grad:
                if direct:
                    key = (scale, value.dtype, value.device)
                    seed = seeds.get(key)
                    if seed is None:
                        seed = torch.full((), scale, dtype=value.dtype, device=value.device)
                        seeds[key] = seed
                else:
                    alpha_now[0] = scale
                    seed = None
                torch.autograd.backward(value, seed, inputs=leaves)
            if j == 0 and first:
                for h in first:
                    h.remove()
                first.clear()
                assert sums is not None
                for i, leaf in enumerate(leaves):
                    if i not in moved:  # no gradient in this micro-batch: start from zero
                        sums[i].zero_()
                        leaf.grad = sums[i]
            win.state = state = state._replace(
                weight=state.weight + weight, micro_step=state.micro_step + 1
            )
            if aux_acc is not None:
                aux_acc.add(aux, rows, items, raw)
            del value, aux, raw, mb
        if sums is None:  # one process, in place: the leaves' .grad are the sums
            out = [
                leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves
            ]
            win.state = state = state._replace(sums=_tree.unflatten(lay.spec, out))
        if prescale:  # the sums are the mean already
            win.state = state._replace(weight=1)
    finally:
        for h in handles + first:
            h.remove()
        for leaf in leaves:
            leaf.grad = None
