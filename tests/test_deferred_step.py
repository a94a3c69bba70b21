"""``loop.Step`` over a deferred boundary (``all_reduce(defer=True)``) on 2 gloo processes.

Against the same ``Step`` over the default boundary (which reads the tail on the host):

- the same updates, bit for bit, with a scheduler, with clipping, and with a parameter that
  one rank's micro-batches never reach (its ``.grad``: the same decision on every rank);
- a failure on one rank in window w: the parameters and the optimizer state after w are
  bit-identical to those before it on every rank, every rank raises at the next ``apply()``,
  and every rank's learning rate is where the failing rank's is (the scheduler put back);
- the ranks saving a different number of times: the window is skipped, every rank raises;
- the last window's failure surfaces at the end of ``loop.windows``, on every rank;
- ``StepStats`` hold device values, equal to the default boundary's numbers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist import run, values

import gradaccum
from gradaccum.loop import Step

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

N = 3


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 1)
        self.side = torch.nn.Linear(4, 1)  # reached only by rank 0's micro-batches (case "used")

    def forward(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        out = self.b(torch.tanh(self.a(x)))
        return out + self.side(x) if side else out


def _batch(window: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * window + rank)
    rows = 7 if rank == 0 else 5
    x = torch.randn(rows, 4, generator=g, dtype=torch.float64)
    return x, torch.randn(rows, 1, generator=g, dtype=torch.float64)


def _train(rank: int, world: int, defer: bool, case: str, fail: int | None) -> Any:
    model = Net().double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
    now = [-1, 0]

    def loss(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        now[1] += 1
        if rank == 1 and now[0] == fail and now[1] == 2:
            raise RuntimeError("injected fault")
        x, y = batch
        side = case == "used" and rank == 0
        return ((m(x, side) - y) ** 2).mean()

    clip = 0.5 if case == "clip" else None
    sync = gradaccum.all_reduce(bucket_mb=0.0001, defer=defer)
    step = Step(model, loss, opt, scheduler=sched, clip=clip, sync=sync)
    log: list[Any] = []
    snaps = []
    for w in range(5):
        now[:] = [w, 0]
        x, y = _batch(w, rank)
        try:
            for xs, ys in zip(x.chunk(N), y.chunk(N)):
                step.add((xs, ys))
            if case == "saves" and w == 2 and rank == 0:
                step._saves += 1  # as loop.save counts a save (on this rank only)
            stats = step.apply()
            numbers = [float(v) for v in stats[1:6]]
            kinds = sorted({type(v).__name__ for v in stats[1:5]})
            log.append((w, "ok", numbers, kinds))
        except Exception as err:  # noqa: BLE001 - reported to the parent
            log.append((w, type(err).__name__, str(err)))
        snap = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():
            snap += [v.clone() for v in opt.state.get(p, {}).values() if torch.is_tensor(v)]
        snaps.append((snap, [g["lr"] for g in opt.param_groups]))
    return log, snaps


@pytest.mark.parametrize("case", ["plain", "clip", "used"])
def test_deferred_step_trains_as_the_default_boundary(case: str) -> None:
    eager = values(run(_train, False, case, None))
    deferred = values(run(_train, True, case, None))
    for rank in range(2):
        (elog, esnaps), (dlog, dsnaps) = eager[rank], deferred[rank]
        for e, d in zip(elog, dlog):
            assert e[1] == d[1] == "ok", (e, d)
            assert e[2] == d[2], f"rank {rank}: stats differ: {e} vs {d}"
            assert e[3] == ["float", "int"], e
            assert d[3] == ["Tensor"], d  # the deferred stats stay on the device
        for (es, elr), (ds, dlr) in zip(esnaps, dsnaps):
            assert elr == dlr
            assert len(es) == len(ds)
            assert all(torch.equal(a, b) for a, b in zip(es, ds)), f"rank {rank}: state differs"
    if case == "used":  # side was reached on rank 0 only: trained on both, as by the default
        assert not torch.equal(deferred[1][1][0][0][4], deferred[1][1][-1][0][4])


def test_a_failure_on_one_rank_skips_the_window_and_keeps_the_schedules_together() -> None:
    failing = values(run(_train, True, "plain", 2))
    (log0, snaps0), (log1, snaps1) = failing
    assert [e[1] for e in log1] == ["ok", "ok", "RuntimeError", "GradAccumError", "ok"], log1
    assert [e[1] for e in log0] == ["ok", "ok", "ok", "GradAccumError", "ok"], log0
    assert "1 other rank(s) of the 2 raised an error in window 2" in log0[3][2], log0[3]
    assert "window 2 failed on this rank" in log1[3][2], log1[3]
    for snaps in (snaps0, snaps1):
        before, _ = snaps[1]
        assert all(torch.equal(a, b) for a, b in zip(before, snaps[2][0]))
        assert all(torch.equal(a, b) for a, b in zip(before, snaps[3][0]))
    # Every rank's schedule is where the failing rank's is once the error is raised: the bad
    # window did not count. (Until then rank 0's scheduler had stepped for it; no optimizer
    # step reads the learning rate in between.)
    lrs0, lrs1 = [lr for _, lr in snaps0], [lr for _, lr in snaps1]
    assert lrs0[:2] + lrs0[3:] == lrs1[:2] + lrs1[3:], (lrs0, lrs1)
    assert snaps0[3][1] == snaps0[1][1]
    # The run goes on together: window 3's micro-batches stay and close with window 4's.
    assert all(torch.equal(a, b) for a, b in zip(snaps0[4][0], snaps1[4][0]))
    assert not all(torch.equal(a, b) for a, b in zip(snaps0[4][0], snaps0[3][0]))


def test_ranks_that_save_differently_fail_the_window_on_every_rank() -> None:
    for rank, (log, snaps) in enumerate(values(run(_train, True, "saves", None))):
        assert [e[1] for e in log] == ["ok", "ok", "ok", "GradAccumError", "ok"], log
        assert "loop.save a different number of times" in log[3][2], log[3]
        assert all(torch.equal(a, b) for a, b in zip(snaps[1][0], snaps[2][0])), rank


def _schedules(rank: int, world: int, kind: str, fails: dict[tuple[int, int], str]) -> Any:
    """``Step`` + defer under ``kind`` of scheduler; ``fails[(window, rank)]``: where that rank
    fails in that window (``"loss"``: its 2nd micro-batch; ``"save"``: every rank calls
    ``Step.state_dict()`` before the window, which reads the last window's checks)."""
    model = Net().double()
    if kind == "cyclic":
        opt: torch.optim.Optimizer = torch.optim.SGD(
            model.parameters(), lr=0.05, momentum=0.9, fused=True
        )
        sched: Any = torch.optim.lr_scheduler.CyclicLR(opt, 0.01, 0.1, step_size_up=2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20)
    now = [-1, 0]

    def loss(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        now[1] += 1
        if fails.get((now[0], rank)) == "loss" and now[1] == 2:
            raise RuntimeError("injected fault")
        x, y = batch
        return ((m(x, False) - y) ** 2).mean()

    step = Step(model, loss, opt, scheduler=sched, sync=gradaccum.all_reduce(defer=True))
    log, groups, params = [], [], []
    for w in range(8):
        now[:] = [w, 0]
        x, y = _batch(w, rank)
        try:
            if "save" in (fails.get((w, 0)), fails.get((w, 1))):
                step.state_dict()  # on every rank, before the window (as loop.save is called)
            for xs, ys in zip(x.chunk(N), y.chunk(N)):
                step.add((xs, ys))
            stats = step.apply()
            log.append((w, "ok", float(stats.items)))
        except Exception as err:  # noqa: BLE001
            log.append((w, type(err).__name__, str(err)[:200]))
        groups.append([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
        params.append([p.detach().clone() for p in model.parameters()])
    return log, groups, params, [s for s in log if s[1] == "ok"]


@pytest.mark.parametrize(
    ("kind", "fails"),
    [
        ("onecycle", {(2, 1): "loss"}),  # OneCycleLR sets betas too
        ("cyclic", {(2, 1): "loss"}),  # CyclicLR sets momentum too
        ("onecycle", {(2, 1): "loss", (3, 0): "loss"}),  # two in a row, on either rank
        ("onecycle", {(2, 1): "loss", (3, 0): "save"}),  # the bad window read by state_dict()
    ],
    ids=["onecycle", "cyclic", "two-in-a-row", "read-by-state_dict"],
)
def test_the_ranks_schedules_and_parameters_stay_together(kind: str, fails: Any) -> None:
    (log0, groups0, params0, ok0), (log1, groups1, params1, ok1) = values(
        run(_schedules, kind, fails)
    )
    assert groups0[-1] == groups1[-1], (groups0[-1], groups1[-1])
    assert all(torch.equal(a, b) for a, b in zip(params0[-1], params1[-1]))
    assert ok0[-1][0] == ok1[-1][0] == 7, (log0, log1)  # the run goes on, in step, to the end
    assert [e[2] for e in ok0 if e[0] >= 5] == [12.0, 12.0, 12.0], log0  # windows whole again


def _items(rank: int, world: int) -> Any:
    model = Net().double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    step = Step(
        model, lambda m, b: m(b[0], False).pow(2).mean(), opt, sync=gradaccum.all_reduce(defer=True)
    )
    kept = []
    for w in range(3):
        x, y = _batch(w, rank)
        x, y = x[: w + 2], y[: w + 2]  # items 4, 6, 8 over the ranks
        for xs, ys in zip(x.chunk(w + 1), y.chunk(w + 1)):
            step.add((xs, ys))
        kept.append(step.apply())
    return [(float(s.items), int(s.micro_batches), s.micro_batches.dtype) for s in kept]


def test_stats_keep_their_own_values() -> None:
    """Read after the run: each window's own (not a buffer the next window rewrote)."""
    for out in values(run(_items)):
        assert out == [(4.0, 2, torch.int64), (6.0, 4, torch.int64), (8.0, 4, torch.int64)]


def _last_window(rank: int, world: int) -> Any:
    model = Net().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, fused=True)
    sync = gradaccum.all_reduce(defer=True)
    micro = [torch.full((2, 4), float(i + rank), dtype=torch.float64) for i in range(6)]
    data = gradaccum.loop.windows(micro, n=2, sync=sync)  # 3 windows

    def loss(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if rank == 1 and step.window == 2:
            raise RuntimeError("injected fault in the last window")
        return m(x, False).pow(2).mean()

    step = Step(model, loss, opt, data=data)
    seen: list[Any] = []
    try:
        for window in data:
            batches = iter(window)
            try:
                for mb in batches:
                    step.add(mb)
                step.apply()
                seen.append("ok")
            except RuntimeError as err:  # the window was joined as failed: take the rest
                seen.append(str(err))
                for _ in batches:
                    pass
    except gradaccum.GradAccumError as err:
        seen.append(f"end: {err}")
    return seen


def test_the_last_window_fails_at_the_end_of_the_windows_on_every_rank() -> None:
    for rank, seen in enumerate(values(run(_last_window))):
        assert seen[-1].startswith("end: "), (rank, seen)
        assert seen[:2] == ["ok", "ok"], seen
        assert "AllReduce.verify()" in seen[-1], seen[-1]


def test_step_refuses_what_cannot_skip_on_the_device() -> None:
    model = torch.nn.Linear(2, 1)
    sync = gradaccum.all_reduce(defer=True)
    with pytest.raises(ValueError, match="fused=True"):
        Step(model, lambda m, b: m(b).mean(), torch.optim.AdamW(model.parameters()), sync=sync)
    coupled = gradaccum.loop.Coupled(lambda m, b: m(b), lambda m, b, rows: rows.all.sum())
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    with pytest.raises(ValueError, match="defer=True"):
        Step(model, coupled, opt, sync=sync)


def _zero_items(rank: int, world: int, defer: bool, skip: bool) -> Any:
    """Window 2's losses cover no items (``Sum(loss, 0)``, the loss not 0); ``skip``: no
    window 2 at all (the reference)."""
    model = Net().double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    now = [-1]

    def loss(m: torch.nn.Module, batch: Any) -> Any:
        x, y = batch
        per_row = ((m(x, False) - y) ** 2).sum()
        return gradaccum.Sum(per_row, 0 if now[0] == 2 else len(x))

    step = Step(model, loss, opt, sync=gradaccum.all_reduce(defer=defer))
    log: list[Any] = []
    for w in range(5):
        if skip and w == 2:
            continue
        now[0] = w
        x, y = _batch(w, rank)
        batches = list(zip(x.chunk(N), y.chunk(N)))
        try:
            try:
                step.add(batches[0])
            except ValueError as err:  # deferred: the last window's error, at the first add
                log.append((w, "raised at add", str(err)[:80]))
                step.add(batches[0])
            for mb in batches[1:]:
                step.add(mb)
            stats = step.apply()
            log.append((w, "ok", int(stats.micro_batches), float(stats.items)))
        except ValueError as err:
            log.append((w, "raised at apply", str(err)[:80]))
    return log, [p.detach().clone() for p in model.parameters()]


def test_a_window_without_items_is_dropped_whole() -> None:
    """Its micro-batches and sums never flow into the next window (the default boundary raised
    at apply() and kept them); every run trains as one without that window."""
    ref = values(run(_zero_items, False, True))
    for defer in (False, True):
        out = values(run(_zero_items, defer, False))
        for rank in range(2):
            log, params = out[rank]
            after = [e for e in log if e[0] == 3 and e[1] == "ok"]
            assert after == [(3, "ok", 6, 12.0)], (defer, log)
            assert all(torch.equal(a, b) for a, b in zip(params, ref[rank][1])), (defer, log)
