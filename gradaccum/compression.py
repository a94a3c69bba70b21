"""Built-in boundary reductions that send fewer bytes: low precision, top-k, PowerSGD.

Each is a `custom_reduce()` whose function gets this rank's share (already divided by the global
weight, in the accumulation dtype) and returns the estimated sum over the group.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from . import _tree
from ._dist import inflight
from ._dist.mesh import axis
from ._dist.record import record
from ._errors import describe, dtype_name
from .sync._custom import CustomReduce, custom_reduce

__all__ = ["compressed_all_reduce", "powersgd", "topk_all_reduce"]


def _groups(leaves: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Leaf indices by (device, dtype), in flat order (the same on every rank)."""
    out: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, g in enumerate(leaves):
        out.setdefault((g.device, g.dtype), []).append(i)
    return out


def _copy_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy the consecutive pieces of the 1-D ``flat`` into ``tensors``."""
    for t, part in zip(tensors, torch.split(flat, [t.numel() for t in tensors])):
        t.copy_(part.view_as(t))


def finite_number(value: object, low: float, *, strict: bool) -> bool:
    """Whether ``value`` is an int or float (not a bool), finite, and above (or at) ``low``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return (low < value if strict else low <= value) and value < math.inf  # NaN fails both


def check_seed(where: str, seed: object) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(
            f"{where}: seed must be an int, the same on every rank, got {describe(seed)}; pass "
            f"e.g. seed=0."
        )


def sum_flat(tensors: list[torch.Tensor], pg: Any, purpose: str, dim: str | None = None) -> None:
    """Sum ``tensors`` over ``pg`` in place: one ``all_reduce`` per (device, dtype), flat."""
    if pg is None:
        return
    for idx in _groups(tensors).values():
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        record("all_reduce", pg, flat.dtype, flat.numel(), purpose, dim)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=pg, async_op=True)
        work.wait()
        inflight.forget(pg, work)  # kept, so that the gloo worker never frees it (see inflight)
        _copy_back(flat, [tensors[i] for i in idx])


def compressed_all_reduce(
    dtype: torch.dtype = torch.bfloat16,
    *,
    group: Any = None,
    bucket_mb: float = 25.0,
    timeout: float | None = None,
) -> CustomReduce:
    """All-reduce the window's gradient in bfloat16 or float16: half the bytes of float32.

    DDP's ``bf16_compress_hook`` / ``fp16_compress_hook`` as a pure boundary reduction: the sums
    stay in float32 (or wider); at the boundary this rank's share is cast to ``dtype``, summed
    with one ``all_reduce`` per bucket, and cast back. Prefer bfloat16 unless you know the
    gradient's range (float16 overflows above 65504); the rounding error and the two types'
    ranges are in [Built-in reductions](../reductions.md#built-in-reductions).

    Args:
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        group: The process group or a 1-D ``DeviceMesh``; ``None`` for the default group.
        bucket_mb: Bucket size in MiB of ``dtype``: one ``all_reduce`` per bucket.
        timeout: As in [`custom_reduce()`][gradaccum.custom_reduce].

    Returns:
        A [`CustomReduce`][gradaccum.sync.CustomReduce] to pass as ``sync=``. It keeps no state.

    Raises:
        ValueError: ``dtype`` is not bfloat16 or float16, or ``bucket_mb`` is not a positive,
            finite number.

    Examples:
        >>> import torch, torch.distributed as dist, gradaccum
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> sync = gradaccum.compression.compressed_all_reduce(torch.bfloat16)
        >>> step = gradaccum.accumulate(lambda p, x: {"w": x.mean(0)}, 2, sync=sync)
        >>> with gradaccum.sync.record_collectives() as log:
        ...     grads = step({"w": torch.zeros(3)}, torch.tensor([[1.0, 2.0, 1.001]] * 4))
        >>> grads["w"]  # 1.001 is not a bfloat16 number: it comes back rounded
        tensor([1., 2., 1.])
        >>> [(c.kind, c.dtype, c.nbytes, c.purpose) for c in log]  # doctest: +NORMALIZE_WHITESPACE
        [('all_reduce', torch.float64, 32, 'weight'),
         ('all_reduce', torch.bfloat16, 6, 'gradients')]
        >>> dist.destroy_process_group()
    """
    where = "compressed_all_reduce(dtype, group=..., bucket_mb=...)"
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"{where}: dtype must be torch.bfloat16 or torch.float16, got {describe(dtype)}; "
            f"for an exact reduction use gradaccum.all_reduce()."
        )
    if not finite_number(bucket_mb, 0, strict=True):
        raise ValueError(
            f"{where}: bucket_mb must be a positive, finite number of MiB, got "
            f"{describe(bucket_mb)}; pass e.g. bucket_mb=25 (DDP's default)."
        )
    cap = max(1, int(bucket_mb * 2**20) // dtype.itemsize)
    dim = axis(where, group).dim

    def low_precision_sum(grads: Any, state: Any, pg: Any) -> tuple[Any, Any]:
        if pg is None:  # one process: nothing to send
            return grads, state
        leaves, spec = _tree.flatten(grads)
        works = []
        for idx in _groups(leaves).values():
            start = 0
            while start < len(idx):  # leaves are never split: a bucket closes once it holds cap
                run: list[int] = []
                size = 0
                while start < len(idx) and (not run or size < cap):
                    run.append(idx[start])
                    size += leaves[idx[start]].numel()
                    start += 1
                flat = torch.cat([leaves[i].reshape(-1).to(dtype) for i in run])
                record("all_reduce", pg, dtype, flat.numel(), "gradients", dim)
                work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=pg, async_op=True)
                works.append((work, flat, run))
        for work, flat, run in works:
            work.wait()
            inflight.forget(pg, work)  # kept: see sum_flat
            _copy_back(flat, [leaves[i] for i in run])
        return _tree.unflatten(spec, leaves), state

    low_precision_sum.__name__ = f"compressed_all_reduce({dtype_name(dtype)})"
    return custom_reduce(low_precision_sum, group=group, timeout=timeout)


def topk_all_reduce(
    ratio: float = 0.01,
    *,
    group: Any = None,
    timeout: float | None = None,
) -> CustomReduce:
    """Send only the largest ``ratio`` of the gradient's elements, with error feedback.

    Each rank adds its error-feedback buffer to its share, all-gathers the values and int64
    indices of its ``k = ceil(ratio * numel)`` largest elements (over all leaves of a dtype) and
    sums what every rank sent; what it did not send stays in the buffer for the next window
    (Stich et al. 2018), so nothing is lost, only delayed. ``ratio=1`` is exact up to summation
    order. The state is the buffers, one per leaf in the accumulation dtype (with
    [`Accumulator`][gradaccum.Accumulator], in ``AccumState.reduce_state``). Bytes
    (``W k (itemsize + 8)`` received per rank) and accuracy:
    [Built-in reductions](../reductions.md#built-in-reductions).

    Args:
        ratio: The fraction of elements to send, in ``(0, 1]``.
        group: The process group or a 1-D ``DeviceMesh``; ``None`` for the default group.
        timeout: As in [`custom_reduce()`][gradaccum.custom_reduce].

    Returns:
        A [`CustomReduce`][gradaccum.sync.CustomReduce] to pass as ``sync=``.

    Raises:
        ValueError: ``ratio`` is not in ``(0, 1]``.

    Examples:
        >>> import torch, torch.distributed as dist, gradaccum
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> sync = gradaccum.compression.topk_all_reduce(ratio=0.5)
        >>> step = gradaccum.accumulate(lambda p, x: {"w": x.mean(0)}, 1, sync=sync)
        >>> step({"w": torch.zeros(4)}, torch.tensor([[4.0, -3.0, 2.0, 1.0]]))["w"]
        tensor([ 4., -3.,  0.,  0.])
        >>> sync.state["w"]  # not sent yet: added to the next window's gradient
        tensor([0., 0., 2., 1.])
        >>> step({"w": torch.zeros(4)}, torch.tensor([[0.0, 0.0, 0.0, 0.0]]))["w"]
        tensor([0., 0., 2., 1.])
        >>> dist.destroy_process_group()
    """
    where = "topk_all_reduce(ratio, group=...)"
    if not finite_number(ratio, 0, strict=True) or ratio > 1:
        raise ValueError(
            f"{where}: ratio must be a fraction in (0, 1], got {describe(ratio)}; pass e.g. "
            f"ratio=0.01 to send 1% of the elements."
        )

    dim = axis(where, group).dim

    def topk_sum(grads: Any, errors: Any, pg: Any) -> tuple[Any, Any]:
        leaves, spec = _tree.flatten(grads)
        errs = _tree.flatten(errors)[0]
        for idx in _groups(leaves).values():
            flat = torch.cat([(leaves[i] + errs[i]).reshape(-1) for i in idx])
            k = max(1, math.ceil(ratio * flat.numel()))
            top = torch.topk(flat.abs(), k, sorted=False).indices
            values = flat[top]
            flat.index_fill_(0, top, 0)  # the error: what is not sent now
            if pg is None:  # one process: what is sent is what arrives
                got_v, got_i = values, top
            else:
                size = dist.get_world_size(pg) * k
                got_v = torch.empty(size, dtype=values.dtype, device=values.device)
                got_i = torch.empty(size, dtype=torch.int64, device=values.device)
                record("all_gather", pg, values.dtype, size, "gradients (top-k values)", dim)
                record("all_gather", pg, torch.int64, size, "gradients (top-k indices)", dim)
                gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
                w1 = gather(got_v, values, group=pg, async_op=True)
                w2 = gather(got_i, top, group=pg, async_op=True)
                for w in (w1, w2):
                    w.wait()
                    inflight.forget(pg, w)  # kept: see sum_flat
            _copy_back(torch.zeros_like(flat).index_add_(0, got_i, got_v), [leaves[i] for i in idx])
            _copy_back(flat, [errs[i] for i in idx])
        return _tree.unflatten(spec, leaves), errors

    topk_sum.__name__ = f"topk_all_reduce(ratio={ratio:g})"
    return custom_reduce(topk_sum, init=lambda zeros: zeros, group=group, timeout=timeout)


def powersgd(
    rank: int = 4,
    *,
    seed: int = 0,
    group: Any = None,
    timeout: float | None = None,
) -> CustomReduce:
    """PowerSGD: low-rank compression of each matrix with one power iteration and error feedback.

    Vogels et al. 2019. Each rank adds its error-feedback buffer to its share. A leaf of 2 or more
    dims, viewed as a matrix ``M`` (``n = shape[0]`` rows, ``m`` columns), is compressed where
    ``rank * (n + m) < n * m`` (the elements sent per window, against ``n * m``): the ranks
    compute ``P = sum(M_i Q)`` (one ``all_reduce`` for all matrices), orthonormalise ``P``,
    compute ``Q = sum(M_i^T P)`` (a second) and return ``P Q^T``, the sum of the ranks' matrices
    projected on ``P``. Each rank keeps what its projection missed, ``M_i - P P^T M_i``, in its
    buffer, so the returned gradients plus the buffers add up to the exact sums; ``Q`` is kept as
    the next window's warm start. Vectors and small matrices are all-reduced exactly (a third).

    Args:
        rank: The rank of the approximation, a positive int (PowerSGD's paper uses 1 to 4).
        seed: Seeds the first ``Q`` (the same on every rank).
        group: The process group or a 1-D ``DeviceMesh``; ``None`` for the default group (or
            one process).
        timeout: As in [`custom_reduce()`][gradaccum.custom_reduce].

    Returns:
        A [`CustomReduce`][gradaccum.sync.CustomReduce]; its state holds the error-feedback buffers
        (``"error"``, shaped like the params) and the ``Q`` factors (``"q"``).

    Raises:
        ValueError: ``rank`` is not a positive int, or ``seed`` is not an int.

    Examples:
        >>> import torch, gradaccum
        >>> sync = gradaccum.compression.powersgd(rank=1)
        >>> step = gradaccum.accumulate(lambda p, x: {"w": x.mean(0)}, 1, sync=sync)
        >>> g = step({"w": torch.zeros(4, 4)}, torch.ones(1, 4, 4))["w"]  # rank 1: exact
        >>> torch.allclose(g, torch.ones(4, 4)), float(sync.state["error"]["w"].abs().max()) < 1e-6
        (True, True)
    """
    where = "powersgd(rank, seed=..., group=...)"
    dim = axis(where, group).dim
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(
            f"{where}: rank must be a positive int, got {describe(rank)}; pass e.g. 4."
        )
    check_seed(where, seed)

    def shape2(g: torch.Tensor) -> tuple[int, int] | None:
        if g.dim() < 2:
            return None
        n, m = g.shape[0], g.numel() // g.shape[0]
        return (n, m) if rank * (n + m) < n * m else None

    def init(zeros: Any) -> Any:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        q = []
        for g in _tree.flatten(zeros)[0]:
            nm = shape2(g)
            q.append(
                None
                if nm is None
                else torch.randn(nm[1], rank, generator=gen, dtype=torch.float64).to(g)
            )
        return {"error": zeros, "q": q}

    def low_rank_sum(grads: Any, state: Any, pg: Any) -> tuple[Any, Any]:
        leaves, spec = _tree.flatten(grads)
        errs = _tree.flatten(state["error"])[0]
        qs = state["q"]
        mats, ps, dense = [], [], []
        for i, g in enumerate(leaves):
            g.add_(errs[i])
            if qs[i] is None:
                dense.append(g)
            else:
                mats.append(i)
                ps.append(g.reshape(g.shape[0], -1) @ qs[i])
        sum_flat(dense, pg, "gradients", dim)
        sum_flat(ps, pg, "gradients (P)", dim)
        new_q = []
        for i, p in zip(mats, ps):
            p = torch.linalg.qr(p).Q
            m = leaves[i].reshape(leaves[i].shape[0], -1)
            mine_q = m.T @ p
            errs[i].copy_((m - p @ mine_q.T).view_as(errs[i]))  # what this rank's share misses
            new_q.append((i, p, mine_q))
        sum_flat([q for _, _, q in new_q], pg, "gradients (Q)", dim)
        for i, p, q in new_q:
            leaves[i].copy_((p @ q.T).view_as(leaves[i]))
            # Warm start; a window with a zero gradient keeps the previous Q (a zero Q would
            # make the next P zero). q is the same on every rank, so is the choice.
            qs[i] = torch.where(q.abs().amax() > 0, q, qs[i])
        for i in range(len(leaves)):
            if qs[i] is None:
                errs[i].zero_()
        return _tree.unflatten(spec, leaves), state

    low_rank_sum.__name__ = f"powersgd(rank={rank})"
    return custom_reduce(low_rank_sum, init=init, group=group, timeout=timeout)
