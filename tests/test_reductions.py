"""Custom boundary reductions (custom_reduce, compressed_all_reduce, topk_all_reduce) and
accumulate(micro_transform=) on 2 gloo processes (127.0.0.1) and in one process.

The protocol: at the boundary one 32-byte ``all_reduce`` of [weight, failed, h, h**2], then
this rank's
*share* (its sums divided by the global weight; the shares of all ranks add up to the exact
window gradient) goes to the user's ``fn(shares, state, group)``. An exact all-reduce must
therefore give the whole-batch gradient, whatever the reduction, the split of the rows over
ranks and micro-batches, and the step function. The state survives windows and checkpoints; a
failing rank makes every rank raise without calling ``fn``; the built-ins keep their error
bounds, byte counts and (top-k) conservation law.

Each distributed test spawns the 2 ranks once and runs many checks there (a spawn costs
seconds); the ranks send back numbers and tensors and the assertions run here.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
import torch.distributed as dist
from dist import run, values
from hypothesis import given, settings
from hypothesis import strategies as st
from models import (
    F64,
    accumulated_steps,
    max_diff,
    mean_loss,
    mlp_params,
    predict,
    regression_batch,
    sum_loss,
    token_batch,
    token_mean_loss,
    token_sum_loss,
)
from test_distributed import _shard
from torch.func import grad, vmap

import gradaccum

# Rows of the global batch held by each rank: deliberately unequal; or all on rank 0.
SPLIT = (7, 5)
EMPTY = (12, 0)
ROWS = sum(SPLIT)
NUMEL = 5 * 7 + 7 + 7 + 1  # elements of mlp_params()
TOL = 1e-12
WEIGHT = ("all_reduce", "float64", 4, 32, "weight")

# -- helpers (run in the children) ---------------------------------------------------------------


def _exact_sum(grads: Any, state: Any, group: Any) -> tuple[Any, Any]:
    """An exact reduction: ``dist.all_reduce`` of each leaf, in place."""
    for g in optree.tree_leaves(grads):
        dist.all_reduce(g, group=group)
    return grads, state


def _clone(tree: Any) -> Any:
    return optree.tree_map(lambda t: t.detach().clone(), tree)


def _same(a: Any, b: Any) -> bool:
    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    return sa == sb and all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))


def _log(log: list[Any]) -> list[tuple[str, str, int, int, str]]:
    return [
        (c.kind, str(c.dtype).removeprefix("torch."), c.numel, c.nbytes, c.purpose) for c in log
    ]


def _pack(value: Any) -> bytes:
    """Tensors go back to the parent as bytes: a tensor sent through the queue is shared by file
    descriptor, which fails once the child has exited."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _spawn(fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run ``fn`` on the 2 ranks; their unpacked results."""
    return [torch.load(io.BytesIO(v), weights_only=False) for v in values(run(fn, *args))]


def _error(fn: Callable[..., Any], *args: Any) -> str:
    try:
        fn(*args)
    except Exception as err:  # noqa: BLE001 - sent back to the test
        return f"{type(err).__name__}: {err}"
    return "no error"


def _pieces(batch: Any, k: int) -> list[Any]:
    """``batch`` (a tuple of tensors) cut into at most ``k`` non-empty micro-batches."""
    rows = len(batch[0])
    cuts = [len(c) for c in torch.arange(rows).tensor_split(k) if len(c)]
    out, start = [], 0
    for c in cuts:
        out.append(tuple(t[start : start + c] for t in batch))
        start += c
    return out


# -- 1. an exact custom reduction equals the whole batch ----------------------------------------


def _exact(rank: int, world: int) -> bytes:
    params = mlp_params(kind="dict")
    reg, tok = regression_batch(ROWS), token_batch(ROWS)
    batches = {"mean": reg, "sum": reg, "count": tok}
    ref = {
        "mean": grad(mean_loss)(params, reg),
        "sum": grad(sum_loss)(params, reg),
        "count": grad(token_mean_loss)(params, tok),
    }
    out: dict[str, Any] = {"diffs": {}, "shares": {}, "calls": {}, "seen": {}, "logs": {}}
    current: dict[str, Any] = {}

    def exact(grads: Any, state: Any, group: Any) -> tuple[Any, Any]:
        # What fn sees: its share, its state, the group, and the collectives issued so far.
        current["calls"] += 1
        current["share"] = _clone(grads)
        current["seen"] = (state, group is dist.group.WORLD, _log(current["log"]))
        return _exact_sum(grads, state, group)

    sync = gradaccum.custom_reduce(exact)
    for split, what in ((SPLIT, "7/5"), (EMPTY, "rank 1 empty")):
        for fast in (True, False):
            for n in (1, 3):
                for red, step in accumulated_steps(n, sync, fast).items():
                    key = f"{red} {what} fast={fast} n={n}"
                    current["calls"] = 0
                    with gradaccum.sync.record_collectives() as log:
                        current["log"] = log
                        g = step(params, _shard(batches[red], rank, split))
                    out["diffs"][key] = max_diff(g, ref[red])
                    out["shares"][key] = current["share"]
                    out["calls"][key] = current["calls"]
                    out["seen"][key] = current["seen"]
                    out["logs"][key] = _log(log)
    out["state"] = sync.state
    return _pack(out)


def _expected_share(red: str, rank: int, split: tuple[int, int]) -> Any:
    """Rank ``rank``'s share: its local sums divided by the global weight."""
    params = mlp_params(kind="dict")
    if split[rank] == 0:
        return {k: torch.zeros_like(v) for k, v in params.items()}
    if red == "count":
        tok = token_batch(ROWS)
        local = grad(lambda p, b: token_sum_loss(p, b)[0])(params, _shard(tok, rank, split))
        return {k: v / tok["mask"].sum() for k, v in local.items()}
    local_batch = _shard(regression_batch(ROWS), rank, split)
    if red == "sum":
        return grad(sum_loss)(params, local_batch)
    local = grad(mean_loss)(params, local_batch)
    return {k: v * split[rank] / ROWS for k, v in local.items()}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_exact_custom_reduce_equals_the_whole_batch_and_gets_the_shares() -> None:
    r0, r1 = _spawn(_exact)
    refs = {
        "mean": grad(mean_loss)(mlp_params(), regression_batch(ROWS)),
        "sum": grad(sum_loss)(mlp_params(), regression_batch(ROWS)),
        "count": grad(token_mean_loss)(mlp_params(), token_batch(ROWS)),
    }
    for rank, out in enumerate((r0, r1)):
        assert len(out["diffs"]) == 2 * 2 * 2 * 3
        bad = {k: v for k, v in out["diffs"].items() if not v < TOL}
        assert not bad, (rank, bad)
        # fn is called exactly once per window, with state None (no init), the default group,
        # after exactly one collective: the 32-byte [weight, failed, h, h**2] all-reduce.
        assert set(out["calls"].values()) == {1}, out["calls"]
        for key, seen in out["seen"].items():
            assert seen == (None, True, [WEIGHT]), (rank, key, seen)
        # fn's own collectives are not gradaccum's: nothing else is recorded.
        for key, log in out["logs"].items():
            assert log == [WEIGHT], (rank, key, log)
        assert out["state"] is None
    for key in r0["shares"]:
        red = key.split()[0]
        split = EMPTY if "empty" in key else SPLIT
        total = {k: r0["shares"][key][k] + r1["shares"][key][k] for k in refs[red]}
        assert max_diff(total, refs[red]) < TOL, key  # the shares add up to the exact gradient
        for rank, out in enumerate((r0, r1)):
            want = _expected_share(red, rank, split)
            assert max_diff(out["shares"][key], want) < TOL, (rank, key)
        if split == EMPTY:  # the empty rank still calls fn, with an exactly zero share
            assert all(float(v.abs().max()) == 0.0 for v in r1["shares"][key].values()), key
        else:
            assert all(float(v.abs().max()) > 0.0 for v in r1["shares"][key].values()), key


# -- 2 and 3. state across windows and checkpoints; failures ------------------------------------


def _window_batch(w: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _shard(regression_batch(ROWS, seed=10 + w), rank, SPLIT)


def _window_ref(w: int) -> Any:
    return grad(mean_loss)(mlp_params(), regression_batch(ROWS, seed=10 + w))


def _counting_state(rank: int, out: dict[str, Any]) -> None:
    params = mlp_params(kind="dict")
    inits: list[Any] = []

    def init(zeros: Any) -> int:
        inits.append(zeros)
        return 0

    def counting(grads: Any, state: Any, group: Any) -> tuple[Any, Any]:
        out["count states seen"].append(state)
        grads, _ = _exact_sum(grads, None, group)
        return grads, state + 1

    out["count states seen"] = []
    sync = gradaccum.custom_reduce(counting, init=init)
    step = gradaccum.accumulate(grad(mean_loss), 2, sync=sync)
    diffs = {}
    for w in range(3):
        diffs[f"accumulate w={w}"] = max_diff(step(params, _window_batch(w, rank)), _window_ref(w))
    out["accumulate state"] = sync.state
    out["accumulate inits"] = len(inits)
    out["init zeros"] = all(
        torch.equal(z, torch.zeros_like(params[k])) for k, z in inits[0].items()
    ) and list(inits[0]) == list(params)

    sync = gradaccum.custom_reduce(counting, init=init)
    acc = gradaccum.Accumulator(2, sync=sync)
    state = acc.init(params)
    states = []
    for w in range(3):
        for mb in _pieces(_window_batch(w, rank), 2):
            state = acc.add(state, grad(mean_loss)(params, mb), size=len(mb[0]))
        g, state = acc.finalize(state)
        states.append(state.reduce_state)
        diffs[f"Accumulator w={w}"] = max_diff(g, _window_ref(w))
    out["Accumulator states"] = states
    out["sync.state after Accumulator"] = sync.state  # Accumulator keeps it in AccumState
    out["Accumulator inits"] = len(inits)
    out["diffs"].update(diffs)


def _topk_accumulator_resume(rank: int, folder: str, out: dict[str, Any]) -> None:
    """Uninterrupted run vs a run resumed from a mid-window checkpoint, with top-k feedback."""
    params = mlp_params(kind="dict")
    path = os.path.join(folder, f"acc{rank}.pt")
    windows = [_pieces(_window_batch(w, rank), 3) for w in range(3)]
    stop = (1, 1)  # the checkpoint: window 1, after its first micro-batch

    def feed(acc: Any, state: Any, start: tuple[int, int], save: bool) -> tuple[list[Any], Any]:
        got = []
        for w in range(start[0], 3):
            for j, mb in enumerate(windows[w]):
                if (w, j) < start:
                    continue
                if save and (w, j) == stop:
                    torch.save(acc.state_dict(state), path)
                    out["saved reduce_state"] = _clone(state.reduce_state)
                state = acc.add(state, grad(mean_loss)(params, mb), size=len(mb[0]))
            g, state = acc.finalize(state)
            got.append(_clone(g))
        return got, state

    acc = gradaccum.Accumulator(3, sync=gradaccum.compression.topk_all_reduce(ratio=0.1))
    full, end = feed(acc, acc.init(params), (0, 0), True)
    out["topk full"] = full
    out["topk full errors"] = _clone(end.reduce_state)

    acc = gradaccum.Accumulator(3, sync=gradaccum.compression.topk_all_reduce(ratio=0.1))
    sd = torch.load(path, weights_only=True)
    state = acc.load_state_dict(acc.init(params), sd)
    out["loaded reduce_state"] = _clone(state.reduce_state)
    out["loaded micro_step"] = (state.micro_step, state.window)
    resumed, end = feed(acc, state, stop, False)
    out["topk resumed"] = resumed
    out["topk resumed errors"] = _clone(end.reduce_state)

    # The same checkpoint without the error-feedback state resumes differently: it matters.
    acc = gradaccum.Accumulator(3, sync=gradaccum.compression.topk_all_reduce(ratio=0.1))
    state = acc.load_state_dict(acc.init(params), {**sd, "reduce_state": None})
    out["topk resumed without state"], _ = feed(acc, state, stop, False)


def _topk_accumulate_resume(rank: int, folder: str, out: dict[str, Any]) -> None:
    """accumulate keeps the state in the sync; load_state restores it (via torch.save/load)."""
    params = mlp_params(kind="dict")
    path = os.path.join(folder, f"sync{rank}.pt")
    sync = gradaccum.compression.topk_all_reduce(ratio=0.1)
    step = gradaccum.accumulate(grad(mean_loss), 3, sync=sync)
    full = []
    for w in range(3):
        full.append(_clone(step(params, _window_batch(w, rank))))
        if w == 0:
            torch.save(sync.state, path)
    out["sync full"] = full
    out["sync full state"] = _clone(sync.state)
    sync = gradaccum.compression.topk_all_reduce(ratio=0.1)
    sync.load_state(torch.load(path, weights_only=True))
    step = gradaccum.accumulate(grad(mean_loss), 3, sync=sync)
    out["sync resumed"] = [_clone(step(params, _window_batch(w, rank))) for w in (1, 2)]
    out["sync resumed state"] = _clone(sync.state)


def _failures(rank: int, out: dict[str, Any]) -> None:
    params = mlp_params(kind="dict")
    calls = [0]
    fail = {"window": -1, "micro": -1}
    seen = [0]

    def counted(grads: Any, state: Any, group: Any) -> tuple[Any, Any]:
        calls[0] += 1
        return _exact_sum(grads, state, group)

    def step_fn(p: Any, b: Any) -> Any:
        seen[0] += 1
        if rank == 1 and seen[0] - 1 == fail["micro"]:
            raise ValueError("boom on rank 1")
        return grad(mean_loss)(p, b)

    def raising_loss(p: Any, b: Any) -> torch.Tensor:
        seen[0] += 1
        if rank == 1 and seen[0] - 1 == fail["micro"]:
            raise ValueError("boom on rank 1 (fast)")
        return mean_loss(p, b)

    for name, fn in (("generic", step_fn), ("fast", gradaccum.grad(raising_loss))):
        calls[0] = 0
        step = gradaccum.accumulate(fn, 3, sync=gradaccum.custom_reduce(counted))
        results = []
        for w, micro in enumerate((-1, 1, -1, 0, -1)):  # fail in windows 1 (2nd micro), 3 (1st)
            seen[0] = 0
            fail["micro"] = micro
            try:
                g = step(params, _window_batch(w, rank))
                results.append(("ok", max_diff(g, _window_ref(w)), calls[0]))
            except Exception as err:  # noqa: BLE001 - sent back to the test
                results.append((f"{type(err).__name__}: {err}", None, calls[0]))
        out[f"failures {name}"] = results

    # fn returning the wrong things: every rank raises (fn ran on every rank, then the check).
    def flat(grads: Any, state: Any, group: Any) -> tuple[Any, Any]:
        grads, state = _exact_sum(grads, state, group)
        return {k: v.reshape(-1) for k, v in grads.items()}, state

    def missing(grads: Any, state: Any, group: Any) -> tuple[Any, Any]:
        grads, state = _exact_sum(grads, state, group)
        return {k: v for k, v in grads.items() if k != "b1"}, state

    def bare(grads: Any, state: Any, group: Any) -> Any:
        return _exact_sum(grads, state, group)[0]

    def as_list(grads: Any, state: Any, group: Any) -> Any:
        return list(_exact_sum(grads, state, group))

    def triple(grads: Any, state: Any, group: Any) -> Any:
        return (*_exact_sum(grads, state, group), None)

    for name, fn in (
        ("flat", flat),
        ("missing", missing),
        ("bare", bare),
        ("list", as_list),
        ("triple", triple),
    ):
        step = gradaccum.accumulate(grad(mean_loss), 2, sync=gradaccum.custom_reduce(fn))
        out[f"bad fn {name}"] = _error(step, params, _window_batch(0, rank))
        acc = gradaccum.Accumulator(1, sync=gradaccum.custom_reduce(fn))
        state = acc.add(acc.init(params), grad(mean_loss)(params, _window_batch(0, rank)), size=3)
        out[f"bad fn {name} Accumulator"] = _error(acc.finalize, state)


def _stateful(rank: int, world: int, folder: str) -> bytes:
    out: dict[str, Any] = {"diffs": {}}
    _counting_state(rank, out)
    _topk_accumulator_resume(rank, folder, out)
    _topk_accumulate_resume(rank, folder, out)
    _failures(rank, out)
    return _pack(out)


@pytest.fixture(scope="module")
def stateful(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The 2 ranks' results of the state, checkpoint and failure checks (one spawn)."""
    return _spawn(_stateful, str(tmp_path_factory.mktemp("reductions")))


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_state_counts_windows_with_accumulate_and_accumulator(
    stateful: list[dict[str, Any]],
) -> None:
    for rank, out in enumerate(stateful):
        bad = {k: v for k, v in out["diffs"].items() if not v < TOL}
        assert not bad, (rank, bad)
        assert len(out["diffs"]) == 6
        assert out["accumulate state"] == 3
        assert out["accumulate inits"] == 1  # init runs once, before the first window
        assert out["init zeros"] is True  # with zeros shaped like the params
        assert out["Accumulator states"] == [1, 2, 3]
        assert out["Accumulator inits"] == 2  # once more for the Accumulator's sync
        assert out["sync.state after Accumulator"] is None
        assert out["count states seen"] == [0, 1, 2, 0, 1, 2]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_checkpoint_mid_window_resumes_topk_bit_identically(
    stateful: list[dict[str, Any]],
) -> None:
    for rank, out in enumerate(stateful):
        # The error-feedback state round-trips through torch.save / torch.load(weights_only).
        assert _same(out["loaded reduce_state"], out["saved reduce_state"]), rank
        assert max(float(v.abs().max()) for v in out["saved reduce_state"].values()) > 1e-6
        assert out["loaded micro_step"] == (1, 1)
        assert len(out["topk full"]) == 3
        assert len(out["topk resumed"]) == 2
        for w, (a, b) in enumerate(zip(out["topk full"][1:], out["topk resumed"], strict=True)):
            assert _same(a, b), (rank, w + 1)
        assert _same(out["topk full errors"], out["topk resumed errors"]), rank
        assert not _same(out["topk full"][1], out["topk resumed without state"][0]), rank
        # accumulate: sync.state saved after window 0, restored with load_state.
        for w, (a, b) in enumerate(zip(out["sync full"][1:], out["sync resumed"], strict=True)):
            assert _same(a, b), (rank, w + 1)
        assert _same(out["sync full state"], out["sync resumed state"]), rank
        assert max(float(v.abs().max()) for v in out["sync full state"].values()) > 1e-6
    # Every rank gets the same gradient.
    for key in ("topk full", "topk resumed", "sync full"):
        for a, b in zip(stateful[0][key], stateful[1][key], strict=True):
            assert _same(a, b), key


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_failing_rank_makes_every_rank_raise_without_calling_fn(
    stateful: list[dict[str, Any]],
) -> None:
    for name in ("generic", "fast"):
        r0, r1 = (out[f"failures {name}"] for out in stateful)
        own = "ValueError: boom on rank 1" + (" (fast)" if name == "fast" else "")
        for rank, results in enumerate((r0, r1)):
            assert len(results) == 5
            # Windows 0, 2, 4 work (also right after a failed window); fn ran once each.
            for w, calls in ((0, 1), (2, 2), (4, 3)):
                status, diff, n_calls = results[w]
                assert status == "ok", (name, rank, w, status)
                assert diff < TOL, (name, rank, w)
                assert n_calls == calls, (name, rank, w)
            for w, calls in ((1, 1), (3, 2)):  # fn not called in a failed window
                status, _, n_calls = results[w]
                assert n_calls == calls, (name, rank, w, n_calls)
                if rank == 1:
                    assert status == own, (name, w, status)
                else:
                    assert status.startswith("GradAccumError: accumulate("), (name, w, status)
                    assert "1 other rank(s) of the 2 in the group raised" in status, status


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fn_returning_the_wrong_things_raises_on_every_rank(
    stateful: list[dict[str, Any]],
) -> None:
    for out in stateful:
        for suffix in ("", " Accumulator"):
            for name in ("flat", "missing"):
                msg = out[f"bad fn {name}{suffix}"]
                assert msg.startswith("ValueError: "), (name, suffix, msg)
                assert "must return gradients shaped like the ones it was given" in msg, msg
            for name in ("bare", "list", "triple"):
                msg = out[f"bad fn {name}{suffix}"]
                assert msg.startswith("TypeError: "), (name, suffix, msg)
                assert "must return (grads, state)" in msg, msg


# -- 4 and 5. compressed and top-k all-reduce ----------------------------------------------------


def _compressed(rank: int, out: dict[str, Any]) -> None:
    params64 = mlp_params(kind="dict")
    params32 = {k: v.float() for k, v in params64.items()}
    reg = regression_batch(ROWS)
    for pname, params in (("f64", params64), ("f32", params32)):
        local = _shard(reg, rank, SPLIT)
        if pname == "f32":
            local = tuple(t.float() for t in local)
        for dtype in (torch.bfloat16, torch.float16):
            for mb in (25.0, 1e-6):
                for fast in (True, False):
                    fn = gradaccum.grad(mean_loss) if fast else grad(mean_loss)
                    sync = gradaccum.compression.compressed_all_reduce(dtype, bucket_mb=mb)
                    step = gradaccum.accumulate(fn, 3, sync=sync)
                    key = f"{pname} {str(dtype)[6:]} mb={mb} fast={fast}"
                    with gradaccum.sync.record_collectives() as log:
                        g = step(params, local)
                    out[f"compressed {key}"] = (_clone(g), _log(log), sync.state)


def _topk(rank: int, out: dict[str, Any]) -> None:
    params = mlp_params(kind="dict")
    reg = regression_batch(ROWS)
    ref = grad(mean_loss)(params, reg)
    for fast in (True, False):
        for n in (1, 3):
            fn = gradaccum.grad(mean_loss) if fast else grad(mean_loss)
            sync = gradaccum.compression.topk_all_reduce(ratio=1.0)
            step = gradaccum.accumulate(fn, n, sync=sync)
            with gradaccum.sync.record_collectives() as log:
                g = step(params, _shard(reg, rank, SPLIT))
            out[f"topk1 fast={fast} n={n}"] = (
                max_diff(g, ref),
                max(float(v.abs().max()) for v in sync.state.values()),
                _log(log),
            )
    # The law: returned + error buffers of every rank == exact sums, over windows.
    for ratio, seed, windows, n in ((0.02, 0, 4, 1), (0.1, 1, 3, 2), (0.37, 2, 5, 3)):
        sync = gradaccum.compression.topk_all_reduce(ratio=ratio)
        step = gradaccum.accumulate(grad(mean_loss), n, sync=sync)
        returned = {k: torch.zeros_like(v) for k, v in params.items()}
        exact = {k: torch.zeros_like(v) for k, v in params.items()}
        logs, nonzero = [], []
        for w in range(windows):
            batch = regression_batch(ROWS, seed=100 * seed + w)
            with gradaccum.sync.record_collectives() as log:
                g = step(params, _shard(batch, rank, SPLIT))
            logs.append(_log(log))
            nonzero.append(sum(int((v != 0).sum()) for v in g.values()))
            want = grad(mean_loss)(params, batch)
            for k in params:
                returned[k] += g[k]
                exact[k] += want[k]
        out[f"law {ratio}"] = {
            "returned": returned,
            "exact": exact,
            "errors": _clone(sync.state),
            "logs": logs,
            "nonzero": nonzero,
        }
    # Two dtypes: one top-k per dtype group, k from each group's numel.
    mixed = {"a": torch.zeros(20, dtype=F64), "b": torch.zeros(2, 5, dtype=torch.float32)}
    sync = gradaccum.compression.topk_all_reduce(ratio=0.3)
    step = gradaccum.accumulate(_given, 1, reduction="sum", sync=sync)
    returned = {k: torch.zeros_like(v) for k, v in mixed.items()}
    exact = {k: torch.zeros(v.shape, dtype=F64) for k, v in mixed.items()}
    logs = []
    for w in range(3):
        with gradaccum.sync.record_collectives() as log:
            g = step(mixed, {k: v[None] for k, v in _given_grads(mixed, rank, w).items()})
        logs.append(_log(log))
        for k in mixed:
            returned[k] += g[k]
            exact[k] += sum(_given_grads(mixed, r, w)[k].double() for r in range(2))
    out["law mixed"] = {
        "returned": returned,
        "exact": exact,
        "errors": _clone(sync.state),
        "logs": logs,
    }


def _given(params: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A step function whose gradient is given in the batch (one row)."""
    return {k: v[0] for k, v in batch.items()}


def _given_grads(params: dict[str, torch.Tensor], rank: int, w: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * w + rank)
    return {k: torch.randn(v.shape, generator=g, dtype=F64).to(v.dtype) for k, v in params.items()}


def _compress(rank: int, world: int) -> bytes:
    out: dict[str, Any] = {}
    _compressed(rank, out)
    _topk(rank, out)
    return _pack(out)


@pytest.fixture(scope="module")
def compress() -> list[dict[str, Any]]:
    """The 2 ranks' results of the compressed and top-k checks (one spawn)."""
    return _spawn(_compress)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_compressed_all_reduce_is_close_and_sends_half_the_bytes(
    compress: list[dict[str, Any]],
) -> None:
    ref = grad(mean_loss)(mlp_params(), regression_batch(ROWS))
    scale = max(float(v.abs().max()) for v in ref.values())
    tols = {"bfloat16": 1e-2, "float16": 2e-3}
    r0, r1 = compress
    keys = [k for k in r0 if k.startswith("compressed ")]
    assert len(keys) == 2 * 2 * 2 * 2
    for key in keys:
        pname, dtype, mb, _ = key.split()[1:]
        g0, log0, state0 = r0[key]
        g1, log1, _ = r1[key]
        assert _same(g0, g1), key  # every rank gets the same gradient
        assert {str(v.dtype) for v in g0.values()} == {f"torch.float{pname[1:]}"}, key
        rel = max_diff({k: v.double() for k, v in g0.items()}, ref) / scale
        assert rel < tols[dtype], (key, rel)
        if pname == "f64":
            assert rel > 1e-7, (key, rel)  # really rounded to 16 bits on the wire
        assert state0 is None, key
        wire = [c for c in log0 if c[4] == "gradients"]
        assert log0[0] == WEIGHT, (key, log0)
        assert len(wire) == len(log0) - 1, (key, log0)
        assert all(c[0] == "all_reduce" and c[1] == dtype for c in wire), (key, log0)
        assert sum(c[3] for c in log0) == NUMEL * 2 + 32, (key, log0)
        assert sum(c[2] for c in wire) == NUMEL, (key, log0)
        # A tiny bucket_mb: one all_reduce per leaf (4); the default: one for all.
        assert len(wire) == (4 if mb == "mb=1e-06" else 1), (key, log0)
        assert log0 == log1, key
    for key in keys:  # the bucketing does not change the result
        if "mb=1e-06" in key:
            twin = key.replace("mb=1e-06", "mb=25.0")
            assert _same(r0[key][0], r0[twin][0]), key


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_topk_ratio_one_is_exact(compress: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(compress):
        keys = [k for k in out if k.startswith("topk1 ")]
        assert len(keys) == 4
        for key in keys:
            diff, error, log = out[key]
            assert diff < TOL, (rank, key, diff)
            assert error == 0.0, (rank, key, error)  # nothing held back
            assert log == [
                WEIGHT,
                ("all_gather", "float64", 2 * NUMEL, 2 * NUMEL * 8, "gradients (top-k values)"),
                ("all_gather", "int64", 2 * NUMEL, 2 * NUMEL * 8, "gradients (top-k indices)"),
            ], (rank, key, log)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_topk_returned_plus_error_buffers_equal_the_exact_sums(
    compress: list[dict[str, Any]],
) -> None:
    r0, r1 = compress
    for ratio in (0.02, 0.1, 0.37):
        a, b = r0[f"law {ratio}"], r1[f"law {ratio}"]
        k = math.ceil(ratio * NUMEL)
        assert _same(a["returned"], b["returned"]), ratio  # the same on every rank
        assert _same(a["exact"], b["exact"]), ratio
        total = {
            key: a["returned"][key] + a["errors"][key] + b["errors"][key] for key in a["exact"]
        }
        assert max_diff(total, a["exact"]) < TOL, ratio
        # Not vacuous: part of the gradient is really delayed in the buffers.
        assert max(float(v.abs().max()) for v in a["errors"].values()) > 1e-6, ratio
        assert max(float(v.abs().max()) for v in b["errors"].values()) > 1e-6, ratio
        # At most world * k entries arrive per window.
        assert all(0 < nz <= 2 * k for nz in a["nonzero"]), (ratio, a["nonzero"])
        for log in a["logs"] + b["logs"]:
            assert log == [
                WEIGHT,
                ("all_gather", "float64", 2 * k, 2 * k * 8, "gradients (top-k values)"),
                ("all_gather", "int64", 2 * k, 2 * k * 8, "gradients (top-k indices)"),
            ], (ratio, log)
            assert sum(c[3] for c in log) - 32 == 2 * k * (8 + 8)
    a, b = r0["law mixed"], r1["law mixed"]
    assert _same(a["returned"], b["returned"])
    assert a["errors"]["b"].dtype == torch.float32
    for key, tol in (("a", TOL), ("b", 1e-5)):
        total = a["returned"][key].double() + a["errors"][key].double() + b["errors"][key].double()
        assert float((total - a["exact"][key]).abs().max()) < tol, key
        assert float(a["errors"][key].abs().max()) > 1e-3, key
    ka, kb = math.ceil(0.3 * 20), math.ceil(0.3 * 10)
    for log in a["logs"]:
        assert log == [
            WEIGHT,
            ("all_gather", "float64", 2 * ka, 2 * ka * 8, "gradients (top-k values)"),
            ("all_gather", "int64", 2 * ka, 2 * ka * 8, "gradients (top-k indices)"),
            ("all_gather", "float32", 2 * kb, 2 * kb * 4, "gradients (top-k values)"),
            ("all_gather", "int64", 2 * kb, 2 * kb * 8, "gradients (top-k indices)"),
        ], log


@settings(max_examples=30, deadline=None)
@given(
    ratio=st.floats(0.01, 1.0),
    windows=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=3),
)
def test_topk_conservation_in_one_process(
    ratio: float, windows: int, seed: int, sizes: list[int]
) -> None:
    """A world of one (no torch.distributed): returned + error buffer == the exact sums."""
    assert not dist.is_initialized()
    params = {f"p{i}": torch.zeros(s, dtype=F64) for i, s in enumerate(sizes)}
    k = max(1, math.ceil(ratio * sum(sizes)))
    sync = gradaccum.compression.topk_all_reduce(ratio=ratio)
    step = gradaccum.accumulate(_given, 1, reduction="sum", sync=sync)
    returned = {key: torch.zeros_like(v) for key, v in params.items()}
    exact = {key: torch.zeros_like(v) for key, v in params.items()}
    for w in range(windows):
        grads = _given_grads(params, seed, w)
        g = step(params, {key: v[None] for key, v in grads.items()})
        assert sum(int((v != 0).sum()) for v in g.values()) <= k
        for key in params:
            returned[key] += g[key]
            exact[key] += grads[key]
    total = {key: returned[key] + sync.state[key] for key in params}
    assert max_diff(total, exact) < TOL


# -- 6. micro_transform: per-sample clipping ---------------------------------------------------


MAX_NORM = 0.6


def _sample_loss(params: Any, sample: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = sample
    return (predict(params, x) - y) ** 2


def _clipper(norms: list[float]) -> Callable[[Any], Any]:
    """Clip each sample's gradient (over all leaves) to MAX_NORM, then sum the samples."""

    def clip_and_sum(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rows = next(iter(grads.values())).shape[0]
        sq = sum(g.reshape(rows, -1).pow(2).sum(1) for g in grads.values())
        factor = (MAX_NORM / sq.sqrt()).clamp(max=1.0)
        clipped = {k: g * factor.reshape(-1, *[1] * (g.dim() - 1)) for k, g in grads.items()}
        after = sum(g.reshape(rows, -1).pow(2).sum(1) for g in clipped.values()).sqrt()
        norms.extend(float(v) for v in after)
        return {k: g.sum(0) for k, g in clipped.items()}

    return clip_and_sum


def _clipped_reference(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, Any, list[float]]:
    """A Python loop over samples: clipped sum, unclipped sum, the raw per-sample norms."""
    params = mlp_params(kind="dict")
    x, y = batch
    clipped = {k: torch.zeros_like(v) for k, v in params.items()}
    plain = {k: torch.zeros_like(v) for k, v in params.items()}
    norms = []
    for i in range(len(y)):
        g = grad(_sample_loss)(params, (x[i], y[i]))
        norm = math.sqrt(sum(float(t.pow(2).sum()) for t in g.values()))
        norms.append(norm)
        for k in params:
            clipped[k] += min(1.0, MAX_NORM / norm) * g[k]
            plain[k] += g[k]
    return clipped, plain, norms


def _micro(rank: int, world: int) -> bytes:
    params = mlp_params(kind="dict")
    reg = regression_batch(ROWS)
    clipped, _, _ = _clipped_reference(reg)
    per_sample = vmap(grad(_sample_loss), in_dims=(None, 0))
    out: dict[str, Any] = {"diffs": {}, "norms": [], "counts": {}}
    for sname in ("custom", "all_reduce"):
        for split, what in ((SPLIT, "7/5"), (EMPTY, "rank 1 empty")):
            for n in (1, 3):
                sync = (
                    gradaccum.custom_reduce(_exact_sum)
                    if sname == "custom"
                    else gradaccum.all_reduce()
                )
                norms: list[float] = []
                step = gradaccum.accumulate(
                    per_sample, n, reduction="sum", sync=sync, micro_transform=_clipper(norms)
                )
                key = f"{sname} {what} n={n}"
                out["diffs"][key] = max_diff(step(params, _shard(reg, rank, split)), clipped)
                out["counts"][key] = len(norms)
                out["norms"] += norms
    # A transform with a gradaccum.grad step function: the generic path, transform applied.
    ref = grad(mean_loss)(params, reg)
    twice = {k: 2 * v for k, v in ref.items()}
    calls = [0]

    def double(grads: Any) -> Any:
        calls[0] += 1
        return {k: 2 * v for k, v in grads.items()}

    for fname, fn in (("fast", gradaccum.grad(mean_loss)), ("func", grad(mean_loss))):
        calls[0] = 0
        sync = gradaccum.custom_reduce(_exact_sum)
        step = gradaccum.accumulate(fn, 3, sync=sync, micro_transform=double)
        out["diffs"][f"doubled {fname}"] = max_diff(step(params, _shard(reg, rank, SPLIT)), twice)
        out["counts"][f"doubled {fname}"] = calls[0]
    # A transform returning the wrong shape: ValueError on every rank, then the next call works.
    step = gradaccum.accumulate(
        per_sample, 2, reduction="sum", sync=gradaccum.custom_reduce(_exact_sum)
    )
    out["unreduced"] = _error(step, params, _shard(reg, rank, SPLIT))
    step = gradaccum.accumulate(
        per_sample,
        2,
        reduction="sum",
        sync=gradaccum.custom_reduce(_exact_sum),
        micro_transform=lambda g: {
            k: v.sum(0)[:3] if k == "w1" else v.sum(0) for k, v in g.items()
        },
    )
    out["wrong shape"] = _error(step, params, _shard(reg, rank, SPLIT))
    return _pack(out)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_micro_transform_per_sample_clipping_equals_a_loop_over_samples() -> None:
    clipped, plain, raw_norms = _clipped_reference(regression_batch(ROWS))
    # Not vacuous: some samples are clipped, some not, and clipping changes the sum.
    assert min(raw_norms) < MAX_NORM < max(raw_norms), raw_norms
    assert max_diff(clipped, plain) > 1e-3
    r0, r1 = _spawn(_micro)
    for rank, out in enumerate((r0, r1)):
        assert len(out["diffs"]) == 2 * 2 * 2 + 2
        bad = {k: v for k, v in out["diffs"].items() if not v < TOL}
        assert not bad, (rank, bad)
        assert max(out["norms"]) <= MAX_NORM * (1 + 1e-12), rank
        # Every sample went through the transform once: this rank's rows per configuration.
        for key, count in out["counts"].items():
            if key.startswith("doubled"):
                assert count == 3, (rank, key)  # once per micro-batch
            else:
                split = EMPTY if "empty" in key else SPLIT
                assert count == split[rank], (rank, key, count)
        assert out["unreduced"].startswith("ValueError: "), out["unreduced"]
        rows = (SPLIT[rank] + 1) // 2  # the first micro-batch's rows
        want = f"gradient leaf ['b1'] has shape ({rows}, 7) but the params leaf has shape (7,)"
        assert want in out["unreduced"], out["unreduced"]
        assert out["wrong shape"].startswith("ValueError: "), out["wrong shape"]
        assert "gradient leaf ['w1'] has shape (3, 7)" in out["wrong shape"], out["wrong shape"]
    assert sum(r0["norms"]) > 0


def test_micro_transform_must_be_callable() -> None:
    with pytest.raises(TypeError, match=r"micro_transform must be None or a function .*int 3"):
        gradaccum.accumulate(grad(mean_loss), 2, micro_transform=3)  # type: ignore[arg-type]


def test_micro_transform_in_one_process_names_the_wrong_leaf() -> None:
    params, batch = mlp_params(kind="dict"), regression_batch(6)
    step = gradaccum.accumulate(
        grad(mean_loss), 2, micro_transform=lambda g: {**g, "b1": g["b1"][:3]}
    )
    with pytest.raises(ValueError, match=r"gradient leaf \['b1'\] has shape \(3,\) but the para"):
        step(params, batch)
    step = gradaccum.accumulate(grad(mean_loss), 2, micro_transform=lambda g: g)
    assert max_diff(step(params, batch), grad(mean_loss)(params, batch)) < TOL


# -- 7. one process ------------------------------------------------------------------------------


@pytest.mark.usefixtures("world_of_one")
def test_errors_and_exactness_in_a_world_of_one() -> None:
    where = r"custom_reduce\(fn, init=\.\.\., group=\.\.\., timeout=\.\.\.\): "
    with pytest.raises(TypeError, match=where + r"fn must be callable.*got int 3"):
        gradaccum.custom_reduce(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=where + r"init must be None or callable, got int 0"):
        gradaccum.custom_reduce(_exact_sum, init=0)  # type: ignore[arg-type]
    for bad in (0, -1.0, True, "60"):
        with pytest.raises(ValueError, match=where + r"timeout must be None or a positive"):
            gradaccum.custom_reduce(_exact_sum, timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dtype must be torch\.bfloat16 or torch\.float16"):
        gradaccum.compression.compressed_all_reduce(torch.float32)
    for bad in (0, -1.0, True):
        with pytest.raises(ValueError, match=r"bucket_mb must be a positive, finite number of MiB"):
            gradaccum.compression.compressed_all_reduce(bucket_mb=bad)
    for bad in (0, 0.0, 1.5, -0.1, True):
        with pytest.raises(ValueError, match=r"ratio must be a fraction in \(0, 1\]"):
            gradaccum.compression.topk_all_reduce(ratio=bad)
    assert gradaccum.custom_reduce(_exact_sum, timeout=5).timeout == 5.0

    params, batch = mlp_params(kind="dict"), regression_batch(10)
    ref = grad(mean_loss)(params, batch)
    groups = []

    def exact(grads: Any, state: Any, group: Any) -> tuple[Any, Any]:
        groups.append(group)
        return _exact_sum(grads, state, group)

    for fn in (gradaccum.grad(mean_loss), grad(mean_loss)):
        with gradaccum.sync.record_collectives() as log:
            g = gradaccum.accumulate(fn, 3, sync=gradaccum.custom_reduce(exact))(params, batch)
        assert max_diff(g, ref) < TOL
        assert _log(log) == [("all_reduce", "float64", 4, 32, "weight")]
    assert groups == [dist.group.WORLD] * 2
    # The built-ins are exact in a world of one (bf16 up to rounding).
    g = gradaccum.accumulate(grad(mean_loss), 3, sync=gradaccum.compression.topk_all_reduce(1.0))(
        params, batch
    )
    assert max_diff(g, ref) < TOL
    g = gradaccum.accumulate(
        grad(mean_loss), 3, sync=gradaccum.compression.compressed_all_reduce()
    )(params, batch)
    assert max_diff(g, ref) < 1e-2 * max(float(v.abs().max()) for v in ref.values())
    # A window with no rows anywhere has no mean: ValueError, not a division by zero.
    step = gradaccum.accumulate(grad(mean_loss), 2, sync=gradaccum.custom_reduce(exact))
    with pytest.raises(ValueError, match=r"rows add up to 0 over all 1 ranks"):
        step(params, tuple(t[:0] for t in batch))


def test_without_torch_distributed() -> None:
    """group=None: a world of one (fn gets group None); an explicit group needs a process group."""
    assert not dist.is_initialized()
    params, batch = mlp_params(kind="dict"), regression_batch(10)
    ref = grad(mean_loss)(params, batch)
    groups = []

    def exact(grads: Any, state: Any, group: Any) -> tuple[Any, Any]:
        groups.append(group)
        return grads, state + 1

    sync = gradaccum.custom_reduce(exact, init=lambda g: 0)
    with gradaccum.sync.record_collectives() as log:
        g = gradaccum.accumulate(grad(mean_loss), 3, sync=sync)(params, batch)
    assert max_diff(g, ref) < TOL
    assert log == []
    assert groups == [None]
    assert sync.state == 1

    # A micro-step that raises: fn is not called on the partial sums, its state stays.
    def failing(p: Any, b: Any) -> Any:
        if b[0].shape[0] < 4:  # the last micro-batch (10 rows in 3: 4, 3, 3)
            raise ValueError("boom")
        return grad(mean_loss)(p, b)

    for fn in (
        failing,
        gradaccum.grad(lambda p, b: mean_loss(p, b) if b[0].shape[0] == 4 else 1 / 0),
    ):
        with pytest.raises((ValueError, ZeroDivisionError)):
            gradaccum.accumulate(fn, 3, sync=sync)(params, batch)
        assert groups == [None], "fn ran on a failed window"
        assert sync.state == 1
    g = gradaccum.accumulate(grad(mean_loss), 3, sync=sync)(params, batch)
    assert max_diff(g, ref) < TOL
    assert sync.state == 2

    sync = gradaccum.custom_reduce(exact, init=lambda g: 0, group=object())
    step = gradaccum.accumulate(grad(mean_loss), 3, sync=sync)
    with pytest.raises(RuntimeError, match=r"needs torch\.distributed initialised"):
        step(params, batch)
    acc = gradaccum.Accumulator(1, sync=sync)
    state = acc.add(acc.init(params), ref, size=10)
    with pytest.raises(RuntimeError, match=r"needs torch\.distributed initialised"):
        acc.finalize(state)
    assert groups == [None, None]  # fn never ran again


def _disagreeing_trees(rank: int, world: int) -> str:
    """Same number of elements, different key paths: the tree hash in the weight tail differs."""
    sync = gradaccum.custom_reduce(lambda g, s, pg: (g, s))
    params = {"a": torch.zeros(4)} if rank == 0 else {"b": torch.zeros(4)}
    step = gradaccum.accumulate(lambda p, x: {k: x.mean(0) for k in p}, 1, sync=sync)
    try:
        step(params, torch.ones(2, 4))
    except gradaccum.GradAccumError as err:
        return str(err)
    return "no error"


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ranks_with_different_trees_raise_instead_of_adding_unrelated_elements() -> None:
    for message in values(run(_disagreeing_trees)):
        assert "the ranks disagree on the gradients to reduce with <lambda>" in message, message
