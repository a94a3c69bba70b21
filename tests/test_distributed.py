"""Data-parallel sync on 2 gloo processes (127.0.0.1): equivalence with one process on the
global batch and with torch DDP + no_sync, collective counts, uneven and empty windows, faults.

Each test spawns the 2 ranks once and runs several checks there (a spawn costs seconds); the
ranks send back numbers and the assertions run here.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist import run, values
from models import (
    F64,
    max_diff,
    mean_loss,
    mlp_params,
    regression_batch,
    sum_loss,
    token_batch,
    token_count_step,
    token_mean_loss,
    token_sum_loss,
)
from torch.func import grad, grad_and_value

import gradaccum

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

# Rows of the global batch held by each rank: deliberately unequal.
SPLIT = (11, 6)


def _shard(batch: Any, rank: int, split: tuple[int, ...] = SPLIT) -> Any:
    start = sum(split[:rank])
    return (
        {k: v[start : start + split[rank]] for k, v in batch.items()}
        if isinstance(batch, dict)
        else tuple(v[start : start + split[rank]] for v in batch)
    )


def _reversed_dict(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(reversed(list(params.items())))


# -- equivalence with one process on the global batch -----------------------------------------


def _equivalence(rank: int, world: int) -> dict[str, Any]:
    params = mlp_params(kind="dict")
    # Rank 1 builds the same dict in the opposite insertion order: the flat order must agree.
    mine = _reversed_dict(params) if rank == 1 else params
    reg, tok = regression_batch(sum(SPLIT)), token_batch(sum(SPLIT))
    diffs: dict[str, float] = {}
    ref = {
        "mean": grad(mean_loss)(params, reg),
        "sum": grad(sum_loss)(params, reg),
        "count": grad(token_mean_loss)(params, tok),
    }
    for n in (1, 3, 4):
        sync = gradaccum.all_reduce(bucket_mb=1e-5)  # ~10 bytes: several buckets
        step = gradaccum.accumulate(grad(mean_loss), n, sync=sync)
        diffs[f"mean n={n}"] = max_diff(step(mine, _shard(reg, rank)), ref["mean"])
        step = gradaccum.accumulate(grad(sum_loss), n, reduction="sum", sync=sync)
        diffs[f"sum n={n}"] = max_diff(step(mine, _shard(reg, rank)), ref["sum"])
        step = token_count_step(n, sync=sync)
        g, _ = step(mine, _shard(tok, rank))
        diffs[f"count n={n}"] = max_diff(g, ref["count"])

    # Streaming, uneven windows: rank 0 feeds 3 micro-batches of its 11 rows, rank 1 one short one.
    acc = gradaccum.Accumulator(n=3, reduction="count", sync=gradaccum.all_reduce())
    state = acc.init(mine)
    local = _shard(tok, rank)
    cuts = [(0, 4), (4, 9), (9, 11)] if rank == 0 else [(0, 6)]
    for a, b in cuts:
        mb = {k: v[a:b] for k, v in local.items()}
        g, (_, count) = grad_and_value(token_sum_loss, has_aux=True)(mine, mb)
        state = acc.add(state, g, count=count)
    g, state = acc.finalize(state)
    diffs["stream count uneven"] = max_diff(g, ref["count"])
    assert state.window == 1
    assert state.sums is None

    # An empty rank: rank 1 has no rows at all, in accumulate and in the streaming form.
    only0 = (sum(SPLIT), 0)
    step = gradaccum.accumulate(grad(mean_loss), 4, sync=gradaccum.all_reduce())
    diffs["mean, rank 1 empty"] = max_diff(step(mine, _shard(reg, rank, only0)), ref["mean"])
    step = token_count_step(4, sync=gradaccum.all_reduce())
    g, aux = step(mine, _shard(tok, rank, only0))
    diffs["count, rank 1 empty"] = max_diff(g, ref["count"])
    aux_is_none = aux is None
    acc = gradaccum.Accumulator(n=2, sync=gradaccum.all_reduce())
    state = acc.init(mine)
    if rank == 0:
        state = acc.add(state, grad(mean_loss)(mine, reg), size=sum(SPLIT))
    g, _ = acc.finalize(state)
    diffs["stream mean, rank 1 empty"] = max_diff(g, ref["mean"])

    # Short batch (fewer rows than n) on one rank: one micro-batch per row there.
    short = (sum(SPLIT) - 2, 2)
    step = gradaccum.accumulate(grad(mean_loss), 4, sync=gradaccum.all_reduce())
    diffs["mean, rank 1 shorter than n"] = max_diff(
        step(mine, _shard(reg, rank, short)), ref["mean"]
    )
    return {"diffs": diffs, "aux_is_none": aux_is_none}


def test_equivalence_with_one_process_on_the_global_batch() -> None:
    r0, r1 = values(run(_equivalence))
    for r in (r0, r1):
        bad = {k: v for k, v in r["diffs"].items() if not v < 1e-12}
        assert not bad, bad
        assert len(r["diffs"]) == 14
    assert r0["aux_is_none"] is False
    assert r1["aux_is_none"] is True


# -- visibility: nothing inside the window, one collective per bucket at the boundary ----------


def _counts(rank: int, world: int) -> dict[str, Any]:
    # the transport: every collective of gradaccum starts there
    from gradaccum._dist import comm as _comm

    calls: list[str] = []
    real = _comm.all_reduce

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append("all_reduce")
        return real(*args, **kwargs)

    _comm.all_reduce = spy  # type: ignore[assignment]
    params = mlp_params(kind="nested")
    seen_inside: list[int] = []

    def step_fn(p: Any, b: Any) -> Any:
        seen_inside.append(len(calls))
        return grad(mean_loss)(p, b)

    sync = gradaccum.all_reduce(bucket_mb=1e-5)
    plan = sync.plan(params)
    step = gradaccum.accumulate(step_fn, 4, sync=sync)
    out: dict[str, Any] = {"plan": [(str(b.dtype), b.numel, b.nbytes, b.tail) for b in plan]}
    windows = []
    for w in range(3):
        before = len(calls)
        seen_inside.clear()
        with gradaccum.sync.record_collectives() as log:
            step(params, _shard(regression_batch(sum(SPLIT), seed=w), rank))
        windows.append(
            {
                "inside": [c - before for c in seen_inside],
                "calls": len(calls) - before,
                "log": [(c.kind, c.purpose, str(c.dtype), c.numel, c.nbytes) for c in log],
                "group_is_world": all(c.group is dist.group.WORLD for c in log),
            }
        )
    out["windows"] = windows
    n1 = gradaccum.accumulate(grad(mean_loss), 1, sync=sync)
    out["n1"] = []
    for _ in range(2):  # the fast path: the first window also agrees on the bucket order
        with gradaccum.sync.record_collectives() as log:
            n1(params, _shard(regression_batch(sum(SPLIT)), rank))
        out["n1"].append([c.purpose for c in log])
    out["n1 plan"] = len(sync.plan(params))
    # A subgroup (here: both ranks, but not the default group object) is used as given.
    sub = dist.new_group([0, 1])
    step = gradaccum.accumulate(grad(mean_loss), 2, sync=gradaccum.all_reduce(sub))
    with gradaccum.sync.record_collectives() as log:
        g = step(params, _shard(regression_batch(sum(SPLIT)), rank))
    # The fingerprint, one bucket, and (first window, fast path) the bucket order.
    out["subgroup"] = all(c.group is sub for c in log) and len(log) == 3
    out["subgroup diff"] = max_diff(g, grad(mean_loss)(params, regression_batch(sum(SPLIT))))
    # A group without this rank is refused before any collective; rank 0 syncs alone.
    solo = dist.new_group([0])
    step = gradaccum.accumulate(grad(mean_loss), 2, sync=gradaccum.all_reduce(solo))
    try:
        g = step(params, regression_batch(4))
        out["solo"] = max_diff(g, grad(mean_loss)(params, regression_batch(4)))
    except ValueError as err:
        out["solo"] = str(err)
    out["grad_bytes"] = sum(p.numel() * p.element_size() for p in _leaves(params))
    _comm.all_reduce = real  # type: ignore[assignment]
    return out


def _leaves(tree: Any) -> list[torch.Tensor]:
    import optree

    return optree.tree_leaves(tree)


def test_collectives_only_at_the_boundary_one_per_bucket() -> None:
    outs = values(run(_counts))
    for out in outs:
        plan = out["plan"]
        assert len(plan) >= 3  # the tiny cap splits the MLP into several buckets
        assert sum(b[3] for b in plan) == 1  # one bucket carries the weight
        for window in out["windows"]:
            assert window["inside"] == [0, 0, 0, 0]  # no collective before any micro-batch
            grads = [c for c in window["log"] if c[1] == "gradients"]
            assert [(c[2], c[3], c[4]) for c in grads] == [(b[0], b[1], b[2]) for b in plan]
            assert sum(c[4] for c in grads) == out["grad_bytes"] + 2 * 8  # + weight and flag
            checks = [c for c in window["log"] if c[1] == "fingerprint"]
            assert len(checks) == 1  # check="fingerprint": every window, before its buckets
            assert window["calls"] == len(window["log"])  # the log misses nothing
            assert window["group_is_world"]
        # n=1 still syncs: the fingerprint, then the buckets (and once, the bucket order).
        assert out["n1"][0] == ["fingerprint"] + ["gradients"] * len(plan) + ["bucket order"]
        assert out["n1"][1] == ["fingerprint"] + ["gradients"] * out["n1 plan"]
        assert out["subgroup"]
        assert out["subgroup diff"] < 1e-12
    assert outs[0]["solo"] < 1e-15
    assert outs[1]["solo"] == (
        "accumulate(mean_loss, n=2)(...): this process (global rank 1) is not a member of the "
        "sync group (dist.new_group returned GroupMember.NON_GROUP_MEMBER here); build the sync "
        "with a group this rank belongs to (every rank must call dist.new_group with the same "
        "ranks)."
    )


# -- equivalence with torch DDP + no_sync -----------------------------------------------------


def _ddp(rank: int, world: int, n: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = model.to(F64)
    twin = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    twin = twin.to(F64)
    twin.load_state_dict(model.state_dict())
    ddp = DDP(model)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    opt_ga = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)

    def loss_fn(params: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        out = torch.func.functional_call(twin, params, (x,))
        return ((out.squeeze(-1) - y) ** 2).mean()

    step = gradaccum.accumulate(grad(loss_fn), n, sync=gradaccum.all_reduce())
    rows = 8 * n
    for w in range(4):
        x, y = regression_batch(rows * world, seed=10 + w)
        x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
        # DDP + no_sync, done right: forward and backward inside no_sync, loss / n.
        opt_ddp.zero_grad()
        for i, (xb, yb) in enumerate(zip(x.chunk(n), y.chunk(n))):
            ctx = ddp.no_sync() if i < n - 1 else _null()
            with ctx:
                loss = ((ddp(xb).squeeze(-1) - yb) ** 2).mean() / n
                loss.backward()
        opt_ddp.step()
        # gradaccum: one call per window.
        grads = step(gradaccum.params_of(twin), (x, y))
        gradaccum.write_grads(twin, grads)
        opt_ga.step()
    return {
        "diff": max(
            float((a - b).detach().abs().max())
            for a, b in zip(model.parameters(), twin.parameters(), strict=True)
        ),
    }


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("n", [1, 4])
def test_equivalence_with_ddp_no_sync(n: int) -> None:
    for out in values(run(_ddp, n)):
        assert out["diff"] < 1e-12, out


# -- faults: mismatched trees, a failing rank, a killed or hanging peer ------------------------


def _mismatch(rank: int, world: int, what: str) -> Any:
    params = mlp_params(kind="dict")
    if what == "shape" and rank == 1:
        params = mlp_params(kind="dict", d_hidden=8)
    if what == "leaf" and rank == 1:
        params = {**params, "extra": torch.zeros(3, dtype=F64)}
    reduction = "sum" if what == "reduction" and rank == 1 else "mean"

    def loss(p: Any, b: Any) -> torch.Tensor:
        extra = sum(v.sum() for k, v in p.items() if k == "extra")
        return mean_loss({k: p[k] for k in ("w1", "b1", "w2", "b2")}, b) + extra

    x, y = regression_batch(8)
    step = gradaccum.accumulate(grad(loss), 2, reduction=reduction, sync=gradaccum.all_reduce())
    return step(params, (x, y))


def _leaf_line(hidden: int) -> str:
    return f"params leaf ['b1'] of shape [{hidden}] float64 accumulated in float64"


@pytest.mark.parametrize("what", ["shape", "leaf", "reduction"])
def test_mismatched_trees_raise_on_every_rank(what: str) -> None:
    results = run(_mismatch, what, timeout=90)
    assert sorted(results) == [0, 1], results
    for rank, result in results.items():
        assert result[:2] == ("err", "GradAccumError"), result
        other = 1 - rank
        if what == "shape":
            mine, theirs = (_leaf_line(7), _leaf_line(8))[:: 1 if rank == 0 else -1]
            detail = f"rank {rank} has {mine} but rank {other} has {theirs}"
        elif what == "leaf":  # sorted keys: rank 1's 'extra' sits where rank 0 has 'w1'
            w1 = "params leaf ['w1'] of shape [5, 7] float64 accumulated in float64"
            extra = "params leaf ['extra'] of shape [3] float64 accumulated in float64"
            mine, theirs = (w1, extra)[:: 1 if rank == 0 else -1]
            detail = f"rank {rank} has {mine} but rank {other} has {theirs}"
        else:
            mine, theirs = ("'mean'", "'sum'")[:: 1 if rank == 0 else -1]
            detail = f"rank {rank} has reduction={mine} but rank {other} has reduction={theirs}"
        assert result[2] == (
            f"accumulate(loss, n=2)(...): the ranks disagree on the gradients to synchronise: "
            f"{detail}. Every rank must pass params with the same key paths, shapes and dtypes, "
            f"and the same reduction, sync options and (where it sets the collectives) n; "
            f"nothing was reduced."
        )


def _failing_rank(rank: int, world: int) -> Any:
    params = mlp_params(kind="dict")
    calls = {"n": 0}

    def step_fn(p: Any, b: Any) -> Any:
        calls["n"] += 1
        if rank == 1 and calls["n"] == 6:  # second window, second micro-batch
            raise FloatingPointError("loss is nan on rank 1")
        return grad(mean_loss)(p, b)

    step = gradaccum.accumulate(step_fn, 4, sync=gradaccum.all_reduce(timeout=30))
    for w in range(3):
        step(params, regression_batch(8, seed=w))
    return "finished"


def test_an_error_on_one_rank_fails_every_rank_instead_of_hanging() -> None:
    start = time.monotonic()
    results = run(_failing_rank, timeout=90)
    assert time.monotonic() - start < 60
    assert results[1][:3] == ("err", "FloatingPointError", "loss is nan on rank 1")
    assert results[0][0:2] == ("err", "GradAccumError"), results[0]
    assert results[0][2] == (
        "accumulate(step_fn, n=4)(...): 1 other rank(s) of the 2 in the group raised an error "
        "during this window (rank 0 did not); no gradient is returned on any rank. The cause is "
        "in the failing rank's traceback."
    )


def _failing_stream_and_params(rank: int, world: int) -> dict[str, str]:
    params = mlp_params(kind="dict")
    out = {}
    # Streaming: rank 1's loop raises; it aborts (joining the boundary) and re-raises.
    acc = gradaccum.Accumulator(n=2, sync=gradaccum.all_reduce(timeout=30))
    state = acc.init(params)
    try:
        for i in range(2):
            if rank == 1 and i == 1:
                raise KeyError("bad record in shard 1")
            state = acc.add(state, grad(mean_loss)(params, regression_batch(4, seed=i)), size=4)
        acc.finalize(state)
        out["stream"] = "finished"
    except KeyError as err:
        acc.abort(state)
        out["stream"] = f"KeyError {err}"
    except gradaccum.GradAccumError as err:
        out["stream"] = f"GradAccumError {err}"
    # accumulate: rank 1 passes params it cannot even describe on its second window.
    step = gradaccum.accumulate(grad(mean_loss), 2, sync=gradaccum.all_reduce(timeout=30))
    step(params, regression_batch(4))
    bad = {**params, "b1": "not a tensor"} if rank == 1 else params
    try:
        step(bad, regression_batch(4))
        out["init"] = "finished"
    except (TypeError, gradaccum.GradAccumError) as err:
        out["init"] = f"{type(err).__name__} {err}"
    return out


def test_errors_in_a_streaming_loop_or_before_the_window_fail_every_rank() -> None:
    start = time.monotonic()
    r0, r1 = values(run(_failing_stream_and_params, timeout=90))
    assert time.monotonic() - start < 60
    assert r1["stream"] == "KeyError 'bad record in shard 1'"
    assert r0["stream"] == (
        "GradAccumError Accumulator(n=2).finalize(state): 1 other rank(s) of the 2 in the group "
        "raised an error during this window (rank 0 did not); no gradient is returned on any "
        "rank. The cause is in the failing rank's traceback."
    )
    assert r1["init"].startswith("TypeError accumulate(mean_loss, n=2)(...): params leaf ['b1']")
    assert r0["init"].startswith(
        "GradAccumError accumulate(mean_loss, n=2)(...): 1 other rank(s) of the 2"
    )


def _dead_peer(rank: int, world: int, how: str) -> Any:
    params = mlp_params(kind="dict")
    step = gradaccum.accumulate(grad(mean_loss), 2, sync=gradaccum.all_reduce(timeout=3))
    step(params, regression_batch(8))
    if rank == 1:
        if how == "killed":
            os._exit(17)
        time.sleep(8)  # alive, but never reaches the next boundary
        return "slept"
    start = time.monotonic()
    try:
        step(params, regression_batch(8, seed=5))
    except gradaccum.GradAccumError as err:
        return ("GradAccumError", str(err), time.monotonic() - start)
    return "no error"


@pytest.mark.parametrize("how", ["killed", "hanging"])
def test_a_dead_or_stuck_peer_is_a_clear_error_within_the_timeout(how: str) -> None:
    results = run(_dead_peer, how, timeout=60)
    kind, message, took = results[0][1]
    assert kind == "GradAccumError"
    # The window's first collective is the fingerprint exchange, before any bucket.
    assert message.startswith(
        "accumulate(mean_loss, n=2)(...): the fingerprint exchange with the other ranks failed "
        "on rank 0: "
    ), message
    assert (
        "A peer process died, failed before the boundary, or did not reach it in time (timeout: "
        "3 s); every rank must call the accumulated function the same number of times."
    ) in message
    assert "destroy it and restart from a checkpoint" in message
    assert took < 3 + 5
    if how == "killed":
        assert 1 not in results


# -- boundary transforms across ranks ----------------------------------------------------------


def _boundary(rank: int, world: int) -> dict[str, Any]:
    params = mlp_params(kind="dict")
    out: dict[str, Any] = {}
    # Loss scaling: rank 1's window overflows; the all-reduced gradient is non-finite on both
    # ranks, so both skip. With group=, ranks agree even on gradients that were never synced.
    scaler = gradaccum.boundary.LossScale(init_scale=2.0**10)
    state = scaler.init()

    def scaled(p: Any, b: Any, scale: float) -> torch.Tensor:
        loss = mean_loss(p, b) * scale
        return loss * (float("inf") if rank == 1 and b[1].numel() == 3 else 1.0)

    step = gradaccum.accumulate(grad(scaled), 2, sync=gradaccum.all_reduce())
    g, finite, state = scaler.unscale(step(params, regression_batch(6), state.scale), state)
    out["synced finite"] = finite
    out["scale after"] = state.scale
    local = {k: v * (float("inf") if rank == 1 else 1.0) for k, v in params.items()}
    with gradaccum.sync.record_collectives() as log:
        _, finite_local, _ = scaler.unscale(local, scaler.init(), group=dist.group.WORLD)
        _, finite_alone, _ = scaler.unscale(local, scaler.init())
    out["group finite"] = finite_local
    out["alone finite"] = finite_alone
    out["found_inf log"] = [(c.kind, c.purpose, c.nbytes) for c in log]
    # Clip by global norm after the sync equals torch's clip_grad_norm_ on the same gradient.
    step = gradaccum.accumulate(grad(mean_loss), 3, sync=gradaccum.all_reduce())
    g = step(params, _shard(regression_batch(sum(SPLIT)), rank))
    clipped, norm = gradaccum.boundary.clip_by_global_norm(g, 0.05)
    ref = {k: v.clone() for k, v in g.items()}
    tensors = list(ref.values())
    for t in tensors:
        t.grad = t.clone()
    torch_norm = torch.nn.utils.clip_grad_norm_(tensors, 0.05)
    out["clip diff"] = max(float((clipped[k] - ref[k].grad).abs().max()) for k in ref)
    out["norm diff"] = float((norm - torch_norm).abs())
    out["norm"] = float(norm)
    return out


def test_boundary_transforms_agree_across_ranks() -> None:
    r0, r1 = values(run(_boundary))
    for r in (r0, r1):
        assert r["synced finite"] is False
        assert r["scale after"] == 2.0**9
        assert r["group finite"] is False
        assert r["found_inf log"] == [("all_reduce", "found_inf", 4)]
        assert r["clip diff"] < 1e-15
        assert r["norm diff"] < 1e-15
        assert r["norm"] > 0.05
    assert r0["alone finite"] is True
    assert r1["alone finite"] is False
    assert r0["norm"] == r1["norm"]


# -- a law over random splits: any rows per rank, any n per rank, same global gradient ---------


def _random_splits(rank: int, world: int, cases: int) -> list[tuple[str, float]]:
    params = mlp_params(kind="dict")
    rng = torch.Generator().manual_seed(1234)  # the same draws on both ranks
    sync = gradaccum.all_reduce()
    out = []
    for _ in range(cases):
        rows = int(torch.randint(1, 30, (), generator=rng))
        cut = int(torch.randint(0, rows + 1, (), generator=rng))
        ns = [int(x) for x in torch.randint(1, 6, (2,), generator=rng)]
        reduction = ("mean", "sum", "count")[int(torch.randint(0, 3, (), generator=rng))]
        split = (cut, rows - cut)
        seed = int(torch.randint(0, 10_000, (), generator=rng))
        if reduction == "count":
            batch: Any = token_batch(rows, seed=seed)
            ref = grad(token_mean_loss)(params, batch)
            step = token_count_step(ns[rank], sync=sync)
            g = step(params, _shard(batch, rank, split))[0]
        else:
            batch = regression_batch(rows, seed=seed)
            loss = mean_loss if reduction == "mean" else sum_loss
            ref = grad(loss)(params, batch)
            step = gradaccum.accumulate(grad(loss), ns[rank], reduction=reduction, sync=sync)
            g = step(params, _shard(batch, rank, split))
        out.append((f"{reduction} rows={split} n={ns}", max_diff(g, ref)))
    return out


def test_any_split_over_ranks_and_micro_batches_gives_the_global_gradient() -> None:
    for cases in values(run(_random_splits, 40)):
        assert len(cases) == 40
        bad = [c for c in cases if not c[1] < 1e-12]
        assert not bad, bad
