"""The fast path under a sync, on 2 gloo processes (127.0.0.1): gradaccum.grad / grad_and_value
write each backward into the boundary buckets, and with overlap each bucket's all-reduce starts
during the last backward. Equivalence with one process on the global batch, when collectives
are issued, and failures in the middle of the overlapped backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist import run, values
from models import (
    max_diff,
    mean_loss,
    mlp_params,
    regression_batch,
    sum_loss,
    token_batch,
    token_mean_loss,
    token_sum_loss,
)
from test_distributed import SPLIT, _reversed_dict, _shard
from torch.func import grad

import gradaccum
from gradaccum._dist import comm as _comm  # the transport: every collective starts there

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def _fast_equivalence(rank: int, world: int) -> dict[str, float]:
    params = mlp_params(kind="dict")
    mine = _reversed_dict(params) if rank == 1 else params
    reg, tok = regression_batch(sum(SPLIT)), token_batch(sum(SPLIT))
    ref = {
        "mean": grad(mean_loss)(params, reg),
        "sum": grad(sum_loss)(params, reg),
        "count": grad(token_mean_loss)(params, tok),
    }
    diffs: dict[str, float] = {}
    for overlap in (True, False):
        for mb in (1e-5, 25):  # several buckets, or one
            sync = gradaccum.all_reduce(bucket_mb=mb, overlap=overlap)
            for n in (1, 3, 4):
                key = f"overlap={overlap} bucket_mb={mb} n={n}"
                step = gradaccum.accumulate(
                    gradaccum.grad_and_value(mean_loss), n, has_aux=True, sync=sync
                )
                g, _ = step(mine, _shard(reg, rank))
                diffs[f"mean {key}"] = max_diff(g, ref["mean"])
                step = gradaccum.accumulate(gradaccum.grad(sum_loss), n, reduction="sum", sync=sync)
                diffs[f"sum {key}"] = max_diff(step(mine, _shard(reg, rank)), ref["sum"])
                step = gradaccum.accumulate(
                    gradaccum.grad(token_sum_loss, has_aux=True),
                    n,
                    has_aux=True,
                    reduction="count",
                    count=lambda aux: aux,
                    sync=sync,
                )
                g, _ = step(mine, _shard(tok, rank))
                diffs[f"count {key}"] = max_diff(g, ref["count"])
    # A leaf without a gradient (zeros, as torch.func gives), alone in its bucket or not.
    extra = {**mine, "unused": torch.ones(3, dtype=torch.float64)}
    for mb in (1e-5, 25):
        for n in (1, 3):
            step = gradaccum.accumulate(
                gradaccum.grad(mean_loss), n, sync=gradaccum.all_reduce(bucket_mb=mb)
            )
            g = step(extra, _shard(reg, rank))
            unused = g.pop("unused")
            diffs[f"unused leaf bucket_mb={mb} n={n}"] = max(
                max_diff(g, ref["mean"]), float(unused.abs().max())
            )
    sync = gradaccum.all_reduce(bucket_mb=1e-5)
    step = gradaccum.accumulate(gradaccum.grad(mean_loss), 4, sync=sync)
    only0 = (sum(SPLIT), 0)  # rank 1 empty
    diffs["mean, rank 1 empty"] = max_diff(step(mine, _shard(reg, rank, only0)), ref["mean"])
    whole = regression_batch(sum(SPLIT))
    mbs = gradaccum.MicroBatches(
        [(whole[0][:5], whole[1][:5]), (whole[0][5:], whole[1][5:])] if rank == 0 else []
    )
    diffs["mean, rank 1 an empty MicroBatches"] = max_diff(step(mine, mbs), ref["mean"])
    short = (sum(SPLIT) - 2, 2)  # rank 1 shorter than n
    diffs["mean, rank 1 short"] = max_diff(step(mine, _shard(reg, rank, short)), ref["mean"])
    return diffs


def test_fast_path_equals_one_process_on_the_global_batch() -> None:
    for diffs in values(run(_fast_equivalence)):
        assert len(diffs) == 2 * 2 * 3 * 3 + 4 + 3
        bad = {k: v for k, v in diffs.items() if not v < 1e-12}
        assert not bad, bad


def _when(rank: int, world: int, overlap: bool) -> dict[str, Any]:
    """Record, for every all_reduce, how many forwards had run and whether autograd was running."""
    forwards = [0]
    seen: list[tuple[int, bool, int]] = []
    real = _comm.all_reduce

    def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append((forwards[0], torch._C._current_graph_task_id() != -1, tensor.numel()))
        return real(tensor, *args, **kwargs)

    def loss_fn(p: Any, b: Any) -> torch.Tensor:
        forwards[0] += 1
        return mean_loss(p, b)

    _comm.all_reduce = spy  # type: ignore[assignment]
    try:
        params = mlp_params(kind="dict")
        sync = gradaccum.all_reduce(bucket_mb=1e-5, overlap=overlap)
        step = gradaccum.accumulate(gradaccum.grad(loss_fn), 4, sync=sync)
        windows = []
        for w in range(3):
            plan = sync.plan(params)  # the buckets this window uses
            forwards[0] = 0
            seen.clear()
            with gradaccum.sync.record_collectives() as log:
                g = step(params, _shard(regression_batch(sum(SPLIT), seed=w), rank))
            windows.append(
                {
                    "plan": [(b.numel, b.tail, b.paths) for b in plan],
                    "seen": list(seen),
                    "log": [(c.purpose, c.numel) for c in log],
                    "diff": max_diff(
                        g, grad(mean_loss)(params, regression_batch(sum(SPLIT), seed=w))
                    ),
                }
            )
    finally:
        _comm.all_reduce = real  # type: ignore[assignment]
    return {"windows": windows, "leaves": len(params)}


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_launches_buckets_during_the_last_backward_only(overlap: bool) -> None:
    outs = values(run(_when, overlap))
    plans = [[w["plan"] for w in o["windows"]] for o in outs]
    assert plans[0] == plans[1]  # the same buckets on both ranks, in every window
    for out in outs:
        plans = [w["plan"] for w in out["windows"]]
        # With overlap the first window agrees on the ready order; the later ones follow it.
        assert (plans[1] != plans[0]) is overlap
        assert plans[2] == plans[1]
        for w, window in enumerate(out["windows"]):
            plan = window["plan"]
            assert len(plan) >= 3
            tail = [numel for numel, is_tail, _ in plan if is_tail]
            order = [numel for numel, is_tail, _ in plan if not is_tail] + tail  # the tail last
            if overlap and w == 0:  # the order: one number per leaf, once, after the tail
                order.append(out["leaves"])
            assert window["diff"] < 1e-12
            grads = window["seen"]
            # The fingerprint, in every window: with the window, before its first forward (it
            # is read before the last backward: issue 28, no host wait inside a backward).
            assert grads[0] == (0, False, 2)
            grads = grads[1:]
            assert [s[2] for s in grads] == order  # one all_reduce per bucket, in plan order
            assert all(s[0] == 4 for s in grads)  # nothing else before the last micro-batch
            inside = [s[1] for s in grads[: len(plan)]]
            if overlap:  # every bucket during the last backward, the one with the weight too
                assert all(inside), inside  # (the weight is final before that backward)
            else:
                assert not any(inside)
            assert [n for _, n in window["log"]] == [s[2] for s in window["seen"]]


class _Mark(torch.autograd.Function):
    """Identity that counts the backwards that reached it (the first layer's input)."""

    calls = [0]

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        _Mark.calls[0] += 1
        return g


def _ready_order(rank: int, world: int) -> dict[str, Any]:
    """Key paths that put the first layer's weight (ready last) in the first bucket."""
    gen = torch.Generator().manual_seed(0)
    params = {
        "z_first": torch.randn(16, 32, generator=gen, dtype=torch.float64),
        "b_head": torch.randn(3, generator=gen, dtype=torch.float64),
        "a_head": torch.randn(32, 3, generator=gen, dtype=torch.float64),
    }
    x = torch.randn(24, 16, generator=gen, dtype=torch.float64)
    y = torch.randn(24, 3, generator=gen, dtype=torch.float64)

    def loss_fn(p: Any, b: Any) -> torch.Tensor:
        h = torch.tanh(_Mark.apply(b[0] @ p["z_first"]))
        return ((h @ p["a_head"] + p["b_head"] - b[1]) ** 2).mean()

    launched: list[tuple[int, int]] = []
    real = _comm.all_reduce

    def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        launched.append((_Mark.calls[0], tensor.numel()))
        return real(tensor, *args, **kwargs)

    sync = gradaccum.all_reduce(bucket_mb=1e-5)
    step = gradaccum.accumulate(gradaccum.grad(loss_fn), 3, sync=sync)
    out: dict[str, Any] = {"plans": [], "launched": [], "diff": 0.0}
    mine = (x[rank * 12 : (rank + 1) * 12], y[rank * 12 : (rank + 1) * 12])
    _comm.all_reduce = spy  # type: ignore[assignment]
    try:
        for _ in range(3):
            out["plans"].append([b.paths for b in sync.plan(params)])
            launched.clear()
            _Mark.calls[0] = 0
            g = step(params, mine)
            out["launched"].append(list(launched))
            ref = gradaccum.grad(loss_fn)(params, (x, y))
            out["diff"] = max(out["diff"], max_diff(g, ref))
    finally:
        _comm.all_reduce = real  # type: ignore[assignment]
    return out


def test_buckets_follow_the_gradient_ready_order_after_the_first_window() -> None:
    outs = values(run(_ready_order))
    assert outs[0]["plans"] == outs[1]["plans"]
    for out in outs:
        assert out["diff"] < 1e-12
        first, second, third = out["plans"]
        # Key-path order first: the first layer's weight, ready last, fills the first bucket.
        assert first == [("['z_first']",), ("['b_head']",), ("['a_head']",)]
        # Then the order the gradients became final: the head's first, the weight (and the
        # tail) last.
        assert second[-1] == ("['z_first']",)
        assert set(second[:2]) == {("['b_head']",), ("['a_head']",)}
        assert third == second
        for w, window in enumerate(out["launched"]):
            assert window[0] == (0, 2)  # the fingerprint: with the window, before any forward
            if w == 0:  # the first bucket waits for the first layer's gradient ...
                assert window[1][0] == 3
                assert window[-1][1] == 3  # ... and the order (a number per leaf) comes last
            else:  # then the first bucket starts before the last backward reaches that layer
                assert window[1][0] == 2
                assert len(window) == 1 + 3  # the fingerprint, an all-reduce per bucket


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in the last backward")


def _fails_mid_backward(rank: int, world: int) -> dict[str, Any]:
    forwards = [0]

    def loss_fn(p: Any, b: Any) -> torch.Tensor:
        forwards[0] += 1
        if rank == 1 and forwards[0] == 3:  # the last micro-batch; w1's gradient comes last
            p = {**p, "w1": _Boom.apply(p["w1"])}
        return mean_loss(p, b)

    params = mlp_params(kind="dict")
    sync = gradaccum.all_reduce(bucket_mb=1e-5, timeout=30)
    launched: list[int] = []
    real = _comm.all_reduce

    def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if torch._C._current_graph_task_id() != -1:
            launched.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    _comm.all_reduce = spy  # type: ignore[assignment]
    step = gradaccum.accumulate(gradaccum.grad(loss_fn), 3, sync=sync)
    out: dict[str, Any] = {}
    try:
        step(params, _shard(regression_batch(sum(SPLIT)), rank))
        out["first"] = "returned"
    except Exception as err:  # noqa: BLE001 - sent back to the test
        out["first"] = f"{type(err).__name__}: {err}"
    finally:
        _comm.all_reduce = real  # type: ignore[assignment]
    out["launched_in_backward"] = launched
    forwards[0] = 10  # no more failures: the group is still usable for the next window
    g = step(params, _shard(regression_batch(sum(SPLIT)), rank))
    out["after"] = max_diff(g, grad(mean_loss)(params, regression_batch(sum(SPLIT))))
    return out


def test_an_error_in_the_overlapped_backward_fails_every_rank() -> None:
    r0, r1 = values(run(_fails_mid_backward))
    assert r1["launched_in_backward"], "a bucket should be in flight when the error comes"
    assert r1["first"].startswith("RuntimeError: boom in the last backward"), r1["first"]
    assert r0["first"].startswith(
        "GradAccumError: accumulate(loss_fn, n=3)(...): 1 other rank(s) of the 2 in the group "
        "raised an error during this window (rank 0 did not)"
    ), r0["first"]
    assert r0["after"] < 1e-12
    assert r1["after"] < 1e-12


def _reuse(rank: int, world: int) -> dict[str, Any]:
    """The sync keeps its flat buckets between windows and reuses them only when nothing else
    holds them: a gradient, a view or detached copy of one, or a .grad that write_grads set."""
    params = mlp_params(kind="dict")
    step = gradaccum.accumulate(gradaccum.grad(mean_loss), 2, sync=gradaccum.all_reduce())
    batches = [regression_batch(sum(SPLIT), seed=s) for s in range(6)]
    refs = [grad(mean_loss)(params, b) for b in batches]

    def ptr(g: dict[str, torch.Tensor]) -> int:
        return g["w1"].untyped_storage().data_ptr()

    out: dict[str, Any] = {}
    step(params, _shard(batches[5], rank))  # the first window settles the bucket order (plan)
    g0 = step(params, _shard(batches[0], rank))
    g1 = step(params, _shard(batches[1], rank))  # g0 held: another buffer
    kept = g1["w1"].detach()  # a detached copy holds g1's buffer too
    p0, p1 = ptr(g0), ptr(g1)
    del g1
    g2 = step(params, _shard(batches[2], rank))  # both held: a third buffer
    out["three buffers"] = len({p0, p1, ptr(g2)}) == 3
    out["held ones unchanged"] = max(
        max_diff(g0, refs[0]), float((kept - refs[1]["w1"]).abs().max()), max_diff(g2, refs[2])
    )
    del g0
    g3 = step(params, _shard(batches[3], rank))  # g0's buffer is free again
    out["reused the free one"] = ptr(g3) == p0
    out["after reuse"] = max(
        max_diff(g3, refs[3]), float((kept - refs[1]["w1"]).abs().max()), max_diff(g2, refs[2])
    )
    # A .grad set by write_grads holds the buffer after the gradients are dropped.
    model = torch.nn.Linear(3, 2)
    mparams = gradaccum.params_of(model)
    mstep = gradaccum.accumulate(
        gradaccum.grad(lambda p, b: torch.func.functional_call(model, p, (b,)).pow(2).mean()),
        1,
        sync=gradaccum.all_reduce(),
    )
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
    g = mstep(mparams, x)
    gradaccum.write_grads(model, g)
    before = model.weight.grad.clone()
    del g
    ptrs = set()
    for _ in range(3):
        g = mstep(mparams, 2 * x)
        ptrs.add(ptr({"w1": g["weight"]}))
        del g
    out["a .grad is never overwritten"] = torch.equal(model.weight.grad, before)
    out["released buffers cycle"] = len(ptrs)
    return out


def test_buckets_are_reused_only_when_nothing_else_holds_them() -> None:
    for out in values(run(_reuse)):
        assert out["three buffers"], out
        assert out["reused the free one"], out
        assert out["held ones unchanged"] < 1e-12, out
        assert out["after reuse"] < 1e-12, out
        assert out["a .grad is never overwritten"], out
        assert out["released buffers cycle"] == 1, out  # the one free set, every time


def _hinted(rank: int, world: int) -> dict[str, Any]:
    """Under "mean", the fast path divides each backward by the last window's global rows (the
    same number on every rank), so the boundary makes no pass over the gradients while the global
    batch keeps its size, and scales by hint / total when it changes."""
    params = mlp_params(kind="dict")
    sync = gradaccum.all_reduce(bucket_mb=1e-5)
    step = gradaccum.accumulate(gradaccum.grad(mean_loss), 3, sync=sync)
    passes = [0]
    real = torch._foreach_div_

    def spy(*args: Any, **kwargs: Any) -> Any:
        passes[0] += 1
        return real(*args, **kwargs)

    out: dict[str, Any] = {}
    splits = [(11, 6), (11, 6), (11, 6), (4, 3), (0, 9), (9, 0), (12, 12), (12, 12)]
    torch._foreach_div_ = spy  # type: ignore[assignment]
    try:
        for w, split in enumerate(splits):
            batch = regression_batch(sum(split), seed=w)
            passes[0] = 0
            g = step(params, _shard(batch, rank, split))
            out[f"window {w} {split}"] = (
                max_diff(g, grad(mean_loss)(params, batch)),
                passes[0],
            )
    finally:
        torch._foreach_div_ = real  # type: ignore[assignment]
    return out


def test_mean_windows_are_exact_when_the_global_batch_changes() -> None:
    for out in values(run(_hinted)):
        assert len(out) == 8, out
        assert all(diff < 1e-12 for diff, _ in out.values()), out
        passes = [p for _, p in out.values()]
        # A pass where the global rows differ from the last window's (or there is none).
        assert passes == [1, 0, 0, 1, 1, 0, 1, 0], out


def _aux_fails_last(rank: int, world: int) -> dict[str, Any]:
    """The last micro-batch's aux is counted before its backward, whose hooks may send the
    bucket with the weight and "no failure": an error there still reaches every rank."""
    forwards = [0]

    def loss_fn(p: Any, b: Any) -> tuple[torch.Tensor, Any]:
        forwards[0] += 1
        loss = mean_loss(p, b)
        if rank == 1 and forwards[0] == 3:  # the last micro-batch: an aux of another structure
            return loss, {"loss": loss.detach(), "extra": loss.detach()}
        return loss, {"loss": loss.detach()}

    params = mlp_params(kind="dict")
    sync = gradaccum.all_reduce(bucket_mb=1e-5, timeout=30)
    step = gradaccum.accumulate(gradaccum.grad(loss_fn, has_aux=True), 3, has_aux=True, sync=sync)
    batch = regression_batch(sum(SPLIT))
    out: dict[str, Any] = {}
    try:
        step(params, _shard(batch, rank))
        out["first"] = "returned"
    except Exception as err:  # noqa: BLE001 - sent back to the test
        out["first"] = f"{type(err).__name__}: {err}"
    forwards[0] = 10  # no more failures: the group is still usable for the next window
    g, _ = step(params, _shard(batch, rank))
    out["after"] = max_diff(g, grad(mean_loss)(params, batch))
    return out


def test_an_error_in_the_last_micro_batchs_aux_fails_every_rank() -> None:
    r0, r1 = values(run(_aux_fails_last))
    assert r1["first"].startswith("ValueError"), r1["first"]
    assert "aux" in r1["first"], r1["first"]
    assert r0["first"].startswith("GradAccumError"), r0["first"]
    assert "1 other rank(s) of the 2 in the group raised" in r0["first"], r0["first"]
    assert r0["after"] < 1e-12
    assert r1["after"] < 1e-12
