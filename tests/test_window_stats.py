"""window_stats(): an MoE load-balancing loss, exact over micro-batches and ranks, in float64.

The balance loss is ``E * sum_e f_e * P_e``: ``f_e`` the fraction of the window's tokens routed to
expert ``e`` (a count, no gradient), ``P_e`` the window's mean router probability for ``e``. The
reference runs every rank's micro-batches with a graph (the same dropout masks: the same seeds),
counts the routes over all of them, and differentiates the whole window's loss once.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp

import gradaccum
from tests.dist import run, values

TOL = 1e-12
DT = torch.float64
E, SEQ, D = 4, 3, 5


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "router": torch.randn(D, E, generator=g, dtype=DT),
        "experts": torch.randn(E, D, D, generator=g, dtype=DT) / 2,
        "head": torch.randn(D, generator=g, dtype=DT),
    }


def _forward(
    p: dict[str, torch.Tensor], x: torch.Tensor, drop: float, ckpt: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-1 MoE over ``[rows, SEQ, D]`` tokens: (prediction per row, router probs, routes)."""
    h = F.dropout(x, drop, training=True) if drop else x
    probs = (h @ p["router"]).softmax(-1)  # [rows, SEQ, E]
    route = probs.argmax(-1)  # [rows, SEQ]

    def experts(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.einsum("rsd,rsde->rse", h, w[route])
        return F.dropout(torch.tanh(out), drop, training=True) if drop else torch.tanh(out)

    if ckpt:
        out = cp.checkpoint(experts, h, p["experts"], use_reentrant=False)
    else:
        out = experts(h, p["experts"])
    gate = probs.gather(-1, route[..., None])
    return ((out * gate) @ p["head"]).mean(-1), probs, route


def _counts(route: torch.Tensor) -> torch.Tensor:
    return F.one_hot(route.reshape(-1), E).sum(0)


def _make(drop: float, ckpt: bool) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def stats(p: Any, mb: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        _, _, route = _forward(p, mb[0], drop, ckpt)
        return {"counts": _counts(route), "tokens": torch.tensor(route.numel())}

    def loss(p: Any, mb: tuple[torch.Tensor, torch.Tensor], window: Any) -> torch.Tensor:
        pred, probs, _ = _forward(p, mb[0], drop, ckpt)
        frac = window["counts"] / window["tokens"]
        balance = E * (frac * probs.reshape(-1, E).mean(0)).sum()
        return ((pred - mb[1]) ** 2).mean() + 0.1 * balance

    return stats, loss


def _rows_of(rank: int) -> int:
    return 5 + rank


def _data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    total = sum(_rows_of(r) for r in range(world))
    g = torch.Generator().manual_seed(1)
    return torch.randn(total, SEQ, D, generator=g, dtype=DT), torch.randn(
        total, generator=g, dtype=DT
    )


def _mine(data: tuple[torch.Tensor, torch.Tensor], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    start = sum(_rows_of(r) for r in range(rank))
    return data[0][start : start + _rows_of(rank)], data[1][start : start + _rows_of(rank)]


def _sizes(rows: int, n: int) -> list[int]:
    k = min(n, rows)
    return [rows // k + (1 if i < rows % k else 0) for i in range(k)]


def _reference(
    world: int, n: int, drop: float, ckpt: bool
) -> tuple[dict[str, torch.Tensor], float]:
    p = {k: v.detach().requires_grad_() for k, v in _params().items()}
    data = _data(world)
    preds, ys, probs, routes = [], [], [], []
    for r in range(world):
        torch.manual_seed(10 + r)
        x, y = _mine(data, r)
        at = 0
        for s in _sizes(_rows_of(r), n):
            pred, pr, route = _forward(p, x[at : at + s], drop, ckpt)
            preds.append(pred)
            ys.append(y[at : at + s])
            probs.append(pr.reshape(-1, E))
            routes.append(route.reshape(-1))
            at += s
    route = torch.cat(routes)
    frac = _counts(route) / route.numel()
    balance = E * (frac * torch.cat(probs).mean(0)).sum()
    total = ((torch.cat(preds) - torch.cat(ys)) ** 2).mean() + 0.1 * balance
    grads = torch.autograd.grad(total, list(p.values()))
    return dict(zip(p, grads)), float(total.detach())


def _cases(rank: int, world: int, sync_of: Callable[[], Any]) -> dict[str, float]:
    out = {}
    x, y = _mine(_data(world), rank)
    for drop, ckpt in ((0.0, False), (0.3, False), (0.3, True)):
        stats, loss = _make(drop, ckpt)
        torch.manual_seed(10 + rank)
        grads, value = gradaccum.window_stats(stats, loss, 3, sync=sync_of())((_params()), (x, y))
        want, total = _reference(world, 3, drop, ckpt)
        name = f"drop={drop} checkpoint={ckpt}"
        out[name] = max(float((grads[k] - want[k]).abs().max()) for k in want)
        if world == 1:  # the value is this rank's (as accumulate's aux): the whole loss in one
            out[name + ": value"] = abs(float(value) - total)
    return out


def test_one_process_matches_the_whole_window() -> None:
    out = _cases(0, 1, lambda: None)
    bad = {k: v for k, v in out.items() if not v < TOL}
    assert not bad, bad


def test_plain_accumulation_of_the_balance_loss_is_not_the_objective() -> None:
    # Per micro-batch counts (each micro-batch's own fractions) give another gradient.
    _, loss = _make(0.0, False)

    def per_micro(p: Any, mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        _, _, route = _forward(p, mb[0], 0.0, False)
        return loss(p, mb, {"counts": _counts(route), "tokens": torch.tensor(route.numel())})

    naive = gradaccum.accumulate(gradaccum.grad(per_micro), 3)(_params(), _data(1))
    want, _ = _reference(1, 3, 0.0, False)
    assert max(float((naive[k] - want[k]).abs().max()) for k in want) > 1e-4


def _across(rank: int, world: int) -> dict[str, float]:
    out = _cases(rank, world, gradaccum.all_reduce)
    # Sharded params: pass 1 gathers them once, pass 2 as the sync does; this rank's shards.
    stats, loss = _make(0.3, True)
    sp = gradaccum.shard(_params(), bucket_mb=1e-4)
    back = gradaccum.shard(_params(), bucket_mb=1e-4)
    torch.manual_seed(10 + rank)
    step = gradaccum.window_stats(stats, loss, 3, sync=gradaccum.reduce_scatter(sp))
    shards, _ = step(sp, _mine(_data(world), rank))
    with torch.no_grad():
        for s, g in zip(back.shards, shards, strict=True):
            s.copy_(g)
    full = back.gather()
    want, _ = _reference(world, 3, 0.3, True)
    out["sharded"] = max(float((full[k] - want[k]).abs().max()) for k in want)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_match_the_whole_window(world: int) -> None:
    for rank, out in enumerate(values(run(_across, world=world, timeout=240), world=world)):
        bad = {k: v for k, v in out.items() if not v < TOL}
        assert not bad, (rank, bad)


def test_bad_input_is_refused() -> None:
    stats, loss = _make(0.0, False)
    with pytest.raises(TypeError, match=re.escape("window_stats(stats, loss, n): stats must be a")):
        gradaccum.window_stats(None, loss, 2)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=re.escape("reduction must be 'mean' or 'sum', got 'count'")
    ):
        gradaccum.window_stats(stats, loss, 2, reduction="count")
    step = gradaccum.window_stats(lambda p, mb: [mb[0].sum(), "x"], loss, 2)
    with pytest.raises(
        TypeError, match=re.escape("stats returned a non-tensor leaf [1] (str 'x')")
    ):
        step(_params(), _data(1))
    flip = gradaccum.window_stats(lambda p, mb: mb[0].sum((1, 2)), loss, 2)
    with pytest.raises(
        ValueError, match=re.escape("stats for micro-batch 1 differ from micro-batch 0's")
    ):
        flip(_params(), (_data(1)[0][:5], _data(1)[1][:5]))


def _faults(rank: int, world: int) -> dict[str, str]:
    x, y = _mine(_data(world), rank)
    stats, loss = _make(0.0, False)
    out = {}

    def stats_fails(p: Any, mb: Any) -> Any:
        if rank == 1:
            raise RuntimeError("stats broke on rank 1")
        return stats(p, mb)

    def stats_differs(p: Any, mb: Any) -> Any:
        s = stats(p, mb)
        return s if rank == 0 else {**s, "extra": s["tokens"]}

    bad = (x, y) if rank == 0 else (x, y[1:])  # rank 1's batch does not split
    for name, fn, b in (
        ("stats", stats_fails, (x, y)),
        ("layout", stats_differs, (x, y)),
        ("batch", stats, bad),
    ):
        try:
            gradaccum.window_stats(fn, loss, 2, sync=gradaccum.all_reduce())(_params(), b)
            out[name] = "no error"
        except Exception as err:  # noqa: BLE001 - the test reads what each rank raised
            out[name] = f"{type(err).__name__}: {err}"
    grads, _ = gradaccum.window_stats(stats, loss, 3, sync=gradaccum.all_reduce())(
        _params(), (x, y)
    )
    want, _ = _reference(world, 3, 0.0, False)
    out["after"] = str(max(float((grads[k] - want[k]).abs().max()) for k in want))
    return out


@pytest.mark.distributed
def test_a_fault_on_one_rank_ends_in_an_error_on_every_rank() -> None:
    r0, r1 = values(run(_faults, timeout=120))
    assert r1["stats"] == "RuntimeError: stats broke on rank 1"
    assert r0["stats"].startswith(
        "GradAccumError: window_stats(stats_fails, loss, n=2)(params, batch): rank(s) [1] failed "
        "before the statistics were exchanged (in stats, or at its output's checks)"
    ), r0["stats"]
    assert r1["batch"].startswith("ValueError: window_stats(stats, loss, n=2)(params, batch)")
    assert r0["batch"].startswith(
        "GradAccumError: window_stats(stats, loss, n=2)(params, batch): rank(s) [1] failed"
    ), r0["batch"]
    for r in (r0, r1):
        assert "the ranks' statistics differ in key paths, dtypes or shapes" in r["layout"]
        assert float(r["after"]) < TOL


def _narrow(rank: int, world: int) -> dict[str, Any]:
    """A uint8 statistic of 200 per micro-batch: 200 + 200 wraps to 144 in uint8.

    Integer and bool statistics come back as ``torch.sum`` returns their sum: int64.
    """
    seen: list[torch.Tensor] = []

    def stats(p: Any, x: torch.Tensor) -> Any:
        return {"big": torch.tensor(200, dtype=torch.uint8), "flag": (x > 0).any()}

    def loss(p: Any, x: torch.Tensor, window: Any) -> torch.Tensor:
        seen.extend((window["big"], window["flag"]))
        return (x * p["w"]).sum() / window["big"]

    x = torch.arange(1.0, 5.0, dtype=DT) + 4 * rank
    sync = gradaccum.all_reduce() if world > 1 else None
    grads, _ = gradaccum.window_stats(stats, loss, 2, sync=sync, reduction="sum")(
        {"w": torch.tensor(1.0, dtype=DT)}, x
    )
    total = 200 * 2 * world
    every = torch.arange(1.0, 4 * world + 1, dtype=DT)
    return {
        "counts": [(int(c), str(c.dtype)) for c in seen],
        "diff": float((grads["w"] - every.sum() / total).abs()),
        "total": total,
    }


def test_a_narrow_integer_statistic_is_summed_exactly() -> None:
    out = _narrow(0, 1)
    assert out["counts"] == [(400, "torch.int64"), (2, "torch.int64")] * 2  # not uint8 144
    assert out["diff"] < TOL


@pytest.mark.distributed
def test_a_narrow_integer_statistic_is_summed_exactly_over_ranks() -> None:
    for out in values(run(_narrow, timeout=120)):
        assert out["counts"] == [(800, "torch.int64"), (4, "torch.int64")] * 2
        assert out["diff"] < TOL


def _empty_rank(rank: int, world: int) -> float:
    # Rank 1 has no micro-batch: it adds zeros to the statistics and nothing to the gradient.
    stats, loss = _make(0.0, False)
    batch: Any = _mine(_data(1), 0) if rank == 0 else gradaccum.MicroBatches([])
    step = gradaccum.window_stats(stats, loss, 3, sync=gradaccum.all_reduce())
    grads, value = step(_params(), batch)
    want, total = _reference(1, 3, 0.0, False)
    diff = max(float((grads[k] - want[k]).abs().max()) for k in want)
    return max(diff, abs(float(value) - total)) if rank == 0 else diff  # value: this rank's


@pytest.mark.distributed
def test_a_rank_with_no_micro_batch_adds_nothing_exactly() -> None:
    assert all(d < TOL for d in values(run(_empty_rank, timeout=120)))
