"""The deferred boundary (``all_reduce(defer=True)``, issue 36 goal 1) on 2 gloo processes.

A deferred window reads nothing of its own on the host: its checks become a flag on the device
that a fused optimizer skips on (``sync.guard(optimizer)``), and the ranks raise for a bad window
at the next window, before its first collective. Checked here, against plain runs:

- the gradients equal the eager boundary's and the whole batch's (float64);
- a failure on one rank in window w: that rank raises at once, every rank raises at w + 1, and
  the parameters and optimizer state are bit-identical to a run that stopped after w - 1; the
  windows after it train as a run without w;
- ranks that disagree (a changed tree on one rank, ranks at different windows), an empty
  window under ``mean``, the last window (``verify()``), the streaming ``Accumulator``;
- every rank sends the same collectives, of the same sizes, in every case (no NCCL hang).

One spawn per test; each rank reports numbers and the assertions run here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist import run, values
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call

import gradaccum
from gradaccum.sync import record_collectives

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

N = 3
ROWS = (7, 5)  # rows per rank and window: unequal


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    ).double()


def _batch(window: int, rank: int, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * window + rank)
    r = ROWS[rank] if rows is None else rows
    x = torch.randn(r, 4, generator=g, dtype=torch.float64)
    return x, torch.randn(r, 1, generator=g, dtype=torch.float64)


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.05, fused=True)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True)
    return torch.optim.Adagrad(params, lr=0.05, fused=True)


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        for v in opt.state.get(p, {}).values():
            if isinstance(v, torch.Tensor):
                out.append(v.detach().clone())
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# -- equivalence ---------------------------------------------------------------------------------


def _equivalence(rank: int, world: int) -> dict[str, float]:
    model = _model()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    def sum_loss(p: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return ((functional_call(model, p, (x,)) - y) ** 2).sum()

    out: dict[str, float] = {}
    for reduction, fn in (("mean", loss), ("sum", sum_loss)):
        for path, grad_fn in (("fast", gradaccum.grad(fn)), ("generic", torch.func.grad(fn))):
            eager = gradaccum.accumulate(
                grad_fn, N, reduction=reduction, sync=gradaccum.all_reduce(bucket_mb=0.0001)
            )
            sync = gradaccum.all_reduce(bucket_mb=0.0001, defer=True)
            deferred = gradaccum.accumulate(grad_fn, N, reduction=reduction, sync=sync)
            worst_eager = worst_whole = 0.0
            for w in range(4):  # the first windows agree on the layout, then steady ones
                batch = _batch(w, rank)
                a, b = eager(params, batch), deferred(params, batch)
                whole_x = torch.cat([_batch(w, r)[0] for r in range(world)])
                whole_y = torch.cat([_batch(w, r)[1] for r in range(world)])
                ref = torch.func.grad(fn)(params, (whole_x, whole_y))
                if reduction == "sum":
                    pass  # a sum over every rank's rows
                for k in ref:
                    worst_eager = max(worst_eager, (a[k] - b[k]).abs().max().item())
                    worst_whole = max(worst_whole, (ref[k] - b[k]).abs().max().item())
            sync.verify()
            out[f"{reduction}-{path}-eager"] = worst_eager
            out[f"{reduction}-{path}-whole"] = worst_whole
    # The streaming Accumulator, with metrics travelling in the tail.
    sync = gradaccum.all_reduce(defer=True)
    acc = gradaccum.Accumulator(n=N, sync=sync)
    worst = 0.0
    for w in range(3):
        x, y = _batch(w, rank)
        state = acc.init(params)
        for xs, ys in zip(x.chunk(N), y.chunk(N)):
            g = torch.func.grad(loss)(params, (xs, ys))
            state = acc.add(state, g, size=len(xs), metrics={"rows": float(len(xs))})
        grads, state, stats = acc.boundary(state)
        whole_x = torch.cat([_batch(w, r)[0] for r in range(world)])
        whole_y = torch.cat([_batch(w, r)[1] for r in range(world)])
        ref = torch.func.grad(loss)(params, (whole_x, whole_y))
        worst = max(worst, *((ref[k] - grads[k]).abs().max().item() for k in ref))
        out["accumulator-rows"] = stats.metrics["rows"]
        out["accumulator-weight"] = stats.weight
    sync.verify()
    out["accumulator-whole"] = worst
    return out


def test_deferred_gradients_equal_the_eager_boundary_and_the_whole_batch() -> None:
    for out in values(run(_equivalence)):
        for key, diff in out.items():
            if key.startswith("accumulator-") and not key.endswith("whole"):
                assert diff == sum(ROWS), (key, diff)
            else:
                assert diff <= 1e-12, (key, diff)


# -- a failure on one rank -----------------------------------------------------------------------


def _failure(rank: int, world: int, kind: str, windows: tuple[int, ...], fail: int | None) -> Any:
    """Train ``windows`` (data indices) deferred; rank 1 raises in window ``fail``'s 2nd forward."""
    model = _model()
    opt = _optimizer(kind, model.parameters())
    sync = gradaccum.all_reduce(bucket_mb=0.0001, defer=True)
    sync.guard(opt)
    params = dict(model.named_parameters())
    now = [-1, 0]  # window, forwards in it

    def loss(p: Any, batch: Any) -> torch.Tensor:
        now[1] += 1
        if rank == 1 and now[0] == fail and now[1] == 2:
            raise RuntimeError("injected fault")
        x, y = batch
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    step = gradaccum.accumulate(gradaccum.grad(loss), N, sync=sync)
    log, snaps = [], []
    with record_collectives() as sent:
        for w in windows:
            now[:] = [w, 0]
            try:
                grads = step(params, _batch(w, rank))
                gradaccum.write_grads(model, grads)
                opt.step()
                opt.zero_grad(set_to_none=True)
                log.append((w, "ok", sync.found_inf("cpu").item()))
            except Exception as err:  # noqa: BLE001 - reported to the parent
                log.append((w, type(err).__name__, str(err)))
            snaps.append(_snapshot(model, opt))
        try:
            sync.verify()
            log.append(("verify", "ok", None))
        except Exception as err:  # noqa: BLE001
            log.append(("verify", type(err).__name__, str(err)))
    sizes = [(c.kind, c.numel, c.purpose) for c in sent]
    return log, snaps, sizes


@pytest.mark.parametrize("kind", ["adamw", "sgd", "adagrad"])
def test_a_failure_on_one_rank_skips_the_window_everywhere_and_raises_on_every_rank(
    kind: str,
) -> None:
    failing = values(run(_failure, kind, (0, 1, 2, 3, 4), 2))
    # The reference: the same run with windows 2 and 3 left out (2 failed, 3 raised).
    clean = values(run(_failure, kind, (0, 1, 4), None))
    for rank, (log, snaps, _) in enumerate(failing):
        status = [entry[1] for entry in log]
        if rank == 1:
            assert status == ["ok", "ok", "RuntimeError", "GradAccumError", "ok", "ok"], log
            assert "window 2 failed on this rank" in log[3][2], log[3]
        else:
            assert status == ["ok", "ok", "ok", "GradAccumError", "ok", "ok"], log
            assert log[2][2] == 1.0, "the bad window's flag, on the rank that did not fail"
            msg = log[3][2]
            assert "1 other rank(s) of the 2 raised an error in window 2" in msg, msg
            assert "skipped on the device" in msg, msg
        assert [entry[2] for entry in log if entry[1] == "ok" and entry[0] != "verify"][-1] == 0.0
        ref_snaps = clean[rank][1]
        # After windows 2 and 3: bit-identical to the run that stopped after window 1.
        assert _same(snaps[2], ref_snaps[1]), f"rank {rank}: window 2 changed the state"
        assert _same(snaps[3], ref_snaps[1]), f"rank {rank}: window 3 changed the state"
        # Window 4 trains as in a run without windows 2 and 3.
        assert _same(snaps[4], ref_snaps[2]), f"rank {rank}: window 4 differs from the reference"
    # Every rank sent the same collectives, of the same sizes.
    assert failing[0][2] == failing[1][2]


def test_a_failure_in_the_last_window_is_raised_by_verify_on_every_rank() -> None:
    out = values(run(_failure, "adamw", (0, 1, 2), 2))
    for rank, (log, snaps, _) in enumerate(out):
        assert log[-1][1] == "GradAccumError", log
        assert "window 2" in log[-1][2], log[-1]
        assert _same(snaps[2], snaps[1]), f"rank {rank}: the last, failed window was applied"
    ok = values(run(_failure, "adamw", (0, 1), None))
    assert all(log[-1][:2] == ("verify", "ok") for log, _, _ in ok)


# -- ranks that disagree -------------------------------------------------------------------------


def _disagree(rank: int, world: int, case: str) -> Any:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    sync = gradaccum.all_reduce(bucket_mb=0.0001, defer=True)
    sync.guard(opt)
    params = dict(model.named_parameters())

    def loss(p: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    step = gradaccum.accumulate(gradaccum.grad(loss), N, sync=sync)
    log: list[Any] = []
    snaps = []
    sizes: list[list[Any]] = []
    for w in range(5):
        given = params
        changed = {"tree": 2, "tree1": 1}.get(case)
        if rank == 1 and w == changed:  # one rank's params change shape
            given = {k: v for k, v in params.items() if k != "2.bias"}
        with record_collectives() as sent:
            try:
                grads = step(given, _batch(w, rank))
                full = {k: grads.get(k, torch.zeros_like(v)) for k, v in params.items()}
                gradaccum.write_grads(model, full)
                opt.step()
                opt.zero_grad(set_to_none=True)
                log.append((w, "ok"))
            except Exception as err:  # noqa: BLE001
                log.append((w, type(err).__name__, str(err)))
        sizes.append([(c.kind, c.numel) for c in sent])
        snaps.append(_snapshot(model, opt))
    return log, sizes, snaps


def test_a_rank_whose_tree_changed_sends_the_agreed_buckets_and_every_rank_raises() -> None:
    (log0, sizes0, snaps0), (log1, sizes1, snaps1) = values(run(_disagree, "tree"))
    assert [e[1] for e in log1] == ["ok", "ok", "GradAccumError", "GradAccumError", "ok"], log1
    assert "changed from those the ranks last agreed on" in log1[2][2], log1[2]
    assert "2.bias" in log1[2][2], log1[2]
    assert [e[1] for e in log0] == ["ok", "ok", "ok", "GradAccumError", "ok"], log0
    assert "1 other rank(s) of the 2 raised an error in window 2" in log0[3][2], log0[3]
    assert sizes0 == sizes1, "the ranks' collectives differ: NCCL would hang"
    for snaps in (snaps0, snaps1):
        assert _same(snaps[2], snaps[1])
        assert _same(snaps[3], snaps[1])
        assert not _same(snaps[4], snaps[3]), "the run goes on after the error"
    assert _same(snaps0[4], snaps1[4])


def _windows(rank: int, world: int) -> Any:
    """An Accumulator whose rank 1 jumps to window 5 at its third window (steady layouts)."""
    model = _model()
    sync = gradaccum.all_reduce(defer=True)
    params = {k: v.detach() for k, v in model.named_parameters()}
    acc = gradaccum.Accumulator(n=N, sync=sync)
    log: list[Any] = []
    sizes: list[Any] = []
    state = acc.init(params)
    for w in range(5):
        if rank == 1 and w == 2:
            state = state._replace(window=5)
        x, y = _batch(w, rank)
        with record_collectives() as sent:
            try:
                for xs in x.chunk(N):
                    grads = {k: torch.ones_like(v) * len(xs) for k, v in params.items()}
                    state = acc.add(state, grads, size=len(xs))
                _, state = acc.finalize(state)
                log.append((w, "ok"))
            except gradaccum.GradAccumError as err:
                log.append((w, "GradAccumError", str(err)))
                state = acc.init(params)._replace(window=state.window + 1)
        sizes.append([(c.kind, c.numel) for c in sent])
    return log, sizes


def test_ranks_at_different_windows_raise_on_every_rank() -> None:
    (log0, sizes0), (log1, sizes1) = values(run(_windows))
    assert [e[1] for e in log0] == ["ok", "ok", "ok", "GradAccumError", "ok"], log0
    assert [e[1] for e in log1] == ["ok", "ok", "ok", "GradAccumError", "ok"], log1
    assert "fingerprints of window 2 differ" in log0[3][2], log0[3]
    assert "fingerprints of window 5 differ" in log1[3][2], log1[3]
    assert sizes0 == sizes1, "the ranks' collectives differ"


# -- an empty window, the streaming Accumulator --------------------------------------------------


def _empty_and_accumulator(rank: int, world: int) -> Any:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, fused=True)
    sync = gradaccum.all_reduce(defer=True)
    sync.guard(opt)
    params = dict(model.named_parameters())

    def loss(p: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    step = gradaccum.accumulate(gradaccum.grad(loss), N, sync=sync)
    log: list[Any] = []
    snaps = []
    for w in range(4):
        rows = 0 if w == 1 else None  # window 1 is empty on every rank: no mean to take
        try:
            grads = step(params, _batch(w, rank, rows))
            assert all(torch.isfinite(g).all() for g in grads.values())
            gradaccum.write_grads(model, grads)
            opt.step()
            log.append((w, "ok"))
        except Exception as err:  # noqa: BLE001
            log.append((w, type(err).__name__, str(err)))
        snaps.append(_snapshot(model, opt))
    # The streaming Accumulator: rank 1 fails between two adds and aborts the window.
    acc = gradaccum.Accumulator(n=N, sync=sync)
    alog: list[Any] = []
    state = acc.init(params)
    for w in range(3):
        x, y = _batch(w, rank)
        try:
            for j, (xs, ys) in enumerate(zip(x.chunk(N), y.chunk(N))):
                if rank == 1 and w == 0 and j == 1:
                    try:
                        raise RuntimeError("injected fault")
                    except RuntimeError:
                        state = acc.abort(state)
                        raise
                g = torch.func.grad(loss)(params, (xs, ys))
                state = acc.add(state, g, size=len(xs))
            _, state = acc.finalize(state)
            alog.append((w, "ok", sync.found_inf("cpu").item()))
        except gradaccum.GradAccumError as err:
            alog.append((w, "GradAccumError", str(err)))
            state = acc.init(params)._replace(window=state.window + 1)
        except RuntimeError as err:
            alog.append((w, "RuntimeError", str(err)))
    return log, snaps, alog


def test_an_empty_window_and_the_accumulator() -> None:
    for rank, (log, snaps, alog) in enumerate(values(run(_empty_and_accumulator))):
        assert [e[1] for e in log] == ["ok", "ok", "ValueError", "ok"], log
        assert "rows of window 1 add up to 0" in log[2][2], log[2]
        assert _same(snaps[1], snaps[0])
        assert _same(snaps[2], snaps[0])
        assert not _same(snaps[3], snaps[2])
        if rank == 1:
            assert [e[1] for e in alog] == ["RuntimeError", "GradAccumError", "ok"], alog
        else:
            assert [e[1] for e in alog] == ["ok", "GradAccumError", "ok"], alog
            assert alog[0][2] == 1.0
        assert "window" in alog[1][2]


# -- misuse --------------------------------------------------------------------------------------


def test_misuse_is_refused_clearly() -> None:
    w = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="defer=True"):
        gradaccum.all_reduce().guard(torch.optim.AdamW([w], fused=True))
    with pytest.raises(ValueError, match="fused=True"):
        gradaccum.all_reduce(defer=True).guard(torch.optim.AdamW([w]))
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        gradaccum.all_reduce(defer=True).guard("adam")
    with pytest.raises(TypeError, match="defer must be a bool"):
        gradaccum.all_reduce(defer=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="check='full'"):
        gradaccum.all_reduce(defer=True, check="full")
    opt = torch.optim.AdamW([w], fused=True)
    gradaccum.all_reduce(defer=True).guard(opt)
    with pytest.raises(ValueError, match="found_inf of its own"):
        gradaccum.all_reduce(defer=True).guard(opt)
    sync = gradaccum.all_reduce(defer=True)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="defer=True"):
        gradaccum.loop.Step(model, lambda m, b: m(b).mean(), opt, sync=sync)


# -- found by the hostile pass ---------------------------------------------------------------


def _one_process_run(kind: str, empty_first: bool, guard_under_inference: bool = False) -> Any:
    model = _model()
    if kind == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(
            model.parameters(), lr=0.05, momentum=0.9, nesterov=True, fused=True
        )
    else:
        opt = _optimizer(kind, model.parameters())
    sync = gradaccum.all_reduce(defer=True)
    if guard_under_inference:
        with torch.inference_mode():
            sync.found_inf("cpu")
            sync.guard(opt)
    else:
        sync.guard(opt)
    params = dict(model.named_parameters())

    def loss(p: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    step = gradaccum.accumulate(gradaccum.grad(loss), N, sync=sync)
    raised = []
    batches = [_batch(0, 0, 0)] * empty_first + [_batch(w, 0) for w in range(3)]
    i = 0
    while i < len(batches):
        try:
            grads = step(params, batches[i])
            gradaccum.write_grads(model, grads)
            if i == 0:  # freed blocks of the parameters' sizes, full of NaN, for empty_like
                junk = [torch.full_like(p, float("nan")) for p in model.parameters() for _ in "ab"]
                del junk
            opt.step()
            opt.zero_grad(set_to_none=True)
            i += 1
        except ValueError as err:  # the empty window, read by the next: that one again
            raised.append(str(err))
    sync.verify()
    return [p.detach().clone() for p in model.parameters()], raised


@pytest.mark.parametrize("kind", ["sgd", "adamw", "adagrad"])
def test_a_skipped_first_window_leaves_no_trace(world: None, kind: str) -> None:
    """Fused SGD with momentum keeps uninitialised buffers after a skipped first step (torch):
    ``guard`` gives it zeros, with which the next first step is the same."""
    skipped, raised = _one_process_run(kind, empty_first=True)
    assert len(raised) == 1, raised  # the empty window, read by the next one
    assert "rows of window 0 add up to 0" in raised[0]
    clean, _ = _one_process_run(kind, empty_first=False)
    assert all(torch.equal(a, b) for a, b in zip(skipped, clean))


def test_a_flag_first_asked_for_under_inference_mode_works(world: None) -> None:
    got, raised = _one_process_run("adamw", empty_first=False, guard_under_inference=True)
    clean, _ = _one_process_run("adamw", empty_first=False)
    assert not raised
    assert all(torch.equal(a, b) for a, b in zip(got, clean))


def test_an_optimizer_that_lost_its_flag_is_named(world: None) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    sync = gradaccum.all_reduce(defer=True)
    sync.guard(opt)
    del opt.found_inf  # as torch.amp.GradScaler does after each of its steps
    params = dict(model.named_parameters())
    step = gradaccum.accumulate(
        gradaccum.grad(lambda p, b: functional_call(model, p, (b[0],)).pow(2).mean()), N, sync=sync
    )
    step(params, _batch(0, 0, 0))  # no rows: a bad window
    with pytest.raises(ValueError, match="has lost it"):
        step(params, _batch(1, 0))


def test_fused_sgd_with_dampening_is_refused() -> None:
    w = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9, dampening=0.1, fused=True)
    with pytest.raises(ValueError, match="dampening"):
        gradaccum.all_reduce(defer=True).guard(opt)


def test_found_inf_refuses_what_is_not_a_device() -> None:
    sync = gradaccum.all_reduce(defer=True)
    with pytest.raises(ValueError, match=r"found_inf\(device\): device='nope' is not a device"):
        sync.found_inf("nope")
    with pytest.raises(TypeError, match="device must be None, a str"):
        sync.found_inf(torch.float32)
    with pytest.raises(ValueError, match="meta device"):
        sync.found_inf("meta")
    with pytest.raises(ValueError, match="defer=True"):
        gradaccum.all_reduce().found_inf()


def test_a_tree_changed_on_one_rank_as_the_order_is_agreed_is_named_on_every_rank() -> None:
    """Window 1 (the bucket order just agreed): every rank reads its fingerprint, so the
    difference is named on every rank there, as without ``defer``, and window 2 runs."""
    (log0, sizes0, _), (log1, sizes1, _) = values(run(_disagree, "tree1"))
    for log in (log0, log1):
        assert [e[1] for e in log] == ["ok", "GradAccumError", "ok", "ok", "ok"], log
        assert "disagree" in log[1][2], log[1]
        assert "2.bias" in log[1][2], log[1]
    assert sizes0 == sizes1


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 13),
    n=st.integers(1, 5),
    reduction=st.sampled_from(["mean", "sum", "count"]),
    fast=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_deferred_equals_the_eager_boundary_for_any_window(
    rows: int, n: int, reduction: str, fast: bool, seed: int
) -> None:
    """Any rows (0 too), n, reduction and path: the same gradient as the eager boundary, and a
    flag of 1 exactly where the eager boundary raises (a mean or count with nothing to divide)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(4, 2, generator=g, dtype=torch.float64)
        x = torch.randn(rows, 4, generator=g, dtype=torch.float64)
        counts = torch.randint(0, 3, (rows,), generator=g).to(torch.float64)

        def loss(p: Any, b: Any) -> Any:
            xs, cs = b
            per_row = (xs @ p["w"]).pow(2).sum(-1) * cs
            if reduction == "count":
                return per_row.sum(), cs.sum()
            return per_row.sum() if reduction == "sum" else per_row.mean()

        has_aux = reduction == "count"
        grad_fn = (gradaccum.grad if fast else torch.func.grad)(loss, has_aux=has_aux)
        kwargs: dict[str, Any] = {"reduction": reduction}
        if reduction == "count":
            kwargs["count"] = lambda aux: aux
        eager_sync, sync = gradaccum.all_reduce(), gradaccum.all_reduce(defer=True)
        eager = gradaccum.accumulate(grad_fn, n, sync=eager_sync, has_aux=has_aux, **kwargs)
        deferred = gradaccum.accumulate(grad_fn, n, sync=sync, has_aux=has_aux, **kwargs)
        params = {"w": w}
        try:
            want = eager(params, (x, counts))
        except ValueError:
            want = None  # nothing to divide by
        got = deferred(params, (x, counts))
        flag = sync.found_inf("cpu").item()
        if want is None:
            assert flag == 1.0
            with pytest.raises(ValueError, match="no mean to divide by"):
                sync.verify()
        else:
            assert flag == 0.0
            if has_aux:
                want, got = want[0], got[0]
            torch.testing.assert_close(got["w"], want["w"], rtol=1e-12, atol=1e-12)
            sync.verify()
    finally:
        dist.destroy_process_group()
