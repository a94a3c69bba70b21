"""gradaccum.loop.Step and progress: equivalence, one scheduler step a window (checkpoints:
test_loop_save.py)."""

from __future__ import annotations

import io
import math

import dist
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import gradaccum
from gradaccum.loop import Step, load, progress, save, windows

TIGHT = 1e-12


def make_model(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(5, 8), nn.Tanh(), nn.Dropout(dropout), nn.Linear(8, 1)]
    return nn.Sequential(*layers).double()


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def make_optim(model: nn.Module):
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))


def data(rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 5, generator=g, dtype=torch.float64), torch.randn(
        rows, 1, generator=g, dtype=torch.float64
    )


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clip"])
def test_windows_of_uneven_micro_batches_equal_whole_batches(clip) -> None:
    model, ref = make_model(), make_model()
    opt, sched = make_optim(model)
    ref_opt, ref_sched = make_optim(ref)
    step = Step(model, mse, optimizer=opt, scheduler=sched, clip=clip)
    for w, sizes in enumerate([[3, 5, 1, 4], [2, 2], [7]]):
        x, y = data(sum(sizes), seed=w)
        before = mse(ref, (x, y)).item()
        for mb in zip(x.split(sizes), y.split(sizes)):
            step.add(mb)
        stats = step.apply()
        ref_opt.zero_grad()
        mse(ref, (x, y)).backward()
        norm = math.sqrt(sum(p.grad.pow(2).sum().item() for p in ref.parameters()))
        if clip is not None:
            nn.utils.clip_grad_norm_(ref.parameters(), clip)
        lr = ref_opt.param_groups[0]["lr"]
        ref_opt.step()
        ref_sched.step()
        assert max_param_diff(model, ref) < TIGHT
        assert stats.window == w
        assert stats.items == sum(sizes)
        assert stats.micro_batches == len(sizes)
        assert abs(stats.loss - before) < TIGHT
        assert abs(stats.grad_norm - norm) < TIGHT
        assert stats.lr == lr
        assert stats.seconds > 0
        assert all(p.grad is None for p in model.parameters())
    assert sched.last_epoch == 3  # one scheduler step per window
    assert opt.state[next(iter(model.parameters()))]["step"].item() == 3


def token_loss(model: nn.Module, batch):
    x, y, mask = batch
    per_token = (model(x).squeeze(-1) - y).pow(2)
    return (per_token * mask).sum(), mask.sum()


def test_count_reduction_is_the_mean_over_all_counted_items() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 6, 5, generator=g, dtype=torch.float64)
    y = torch.randn(9, 6, generator=g, dtype=torch.float64)
    mask = (torch.rand(9, 6, generator=g) < 0.6).double()
    model, ref = make_model(), make_model()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    step = Step(model, token_loss, optimizer=opt, reduction="count")
    sizes = [4, 1, 4]
    for mb in zip(x.split(sizes), y.split(sizes), mask.split(sizes)):
        step.add(mb)
    stats = step.apply()
    summed, count = token_loss(ref, (x, y, mask))
    (summed / count).backward()
    ref_opt.step()
    assert max_param_diff(model, ref) < TIGHT
    assert stats.items == mask.sum().item()
    assert abs(stats.loss - (summed / count).item()) < TIGHT


def test_sum_reduction_reports_the_summed_loss() -> None:
    model, ref = make_model(), make_model()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, ref))

    def summed(model, batch):
        x, y = batch
        return F.mse_loss(model(x), y, reduction="sum")

    step = Step(model, summed, optimizer=opt, reduction="sum")
    x, y = data(7)
    for mb in zip(x.split(3), y.split(3)):
        step.add(mb)
    stats = step.apply()
    total = summed(ref, (x, y))
    total.backward()
    ref_opt.step()
    assert max_param_diff(model, ref) < TIGHT
    assert (stats.items, stats.micro_batches) == (7.0, 3)
    assert abs(stats.loss - total.item()) < 1e-10


def test_rows_can_be_given_with_the_loss() -> None:
    model = make_model()
    step = Step(model, lambda m, b: (mse(m, b), 10), optimizer=torch.optim.SGD(model.parameters()))
    step.add(data(3))
    assert step.apply().items == 10.0


def test_an_error_in_a_micro_batch_without_sync_leaves_the_window_going() -> None:
    model = make_model()
    step = Step(model, mse, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step.add(data(3))
    with pytest.raises(RuntimeError, match=r"shapes cannot be multiplied"):
        step.add((torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 1)))
    assert (step.window, step.micro_step) == (0, 1)
    assert step.apply().micro_batches == 1


class WrappedLikeDDP(nn.Module):
    def no_sync(self):  # what DistributedDataParallel has
        raise NotImplementedError


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda m, o: Step(WrappedLikeDDP(), mse, optimizer=o), TypeError, r"not wrapped in"),
        (lambda m, o: Step(m, 3, optimizer=o), TypeError, r"loss must be a function"),
        (lambda m, o: Step(m, mse, optimizer="adam"), TypeError, r"must be a torch.optim"),
        (
            lambda m, o: Step(m, mse, optimizer=o, scheduler=make_optim(m)[1]),
            ValueError,
            r"the scheduler is not the optimizer's",
        ),
        (lambda m, o: Step(m, mse, optimizer=o, clip=0), ValueError, r"clip must be None or a"),
        (lambda m, o: Step(m, mse, optimizer=o, sync=3), TypeError, r"sync must be None"),
        (
            lambda m, o: Step(m.requires_grad_(False), mse, optimizer=o),
            ValueError,
            r"no trainable parameters",
        ),
    ],
)
def test_arguments_are_checked(build, error, message) -> None:
    model = make_model()
    with pytest.raises(error, match=message):
        build(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize(
    ("loss", "reduction", "error", "message"),
    [
        (mse, "count", TypeError, r"must return \(summed_loss, count\)"),
        (lambda m, b: m(b[0]), "mean", TypeError, r"the loss must be a 0-dim tensor"),
        (lambda m, b: mse(m, b).detach(), "mean", ValueError, r"does not require grad"),
        (lambda m, b: (mse(m, b), 0), "mean", ValueError, r"size must be the micro-batch's"),
    ],
)
def test_what_the_loss_returns_is_checked(loss, reduction, error, message) -> None:
    model = make_model()
    step = Step(model, loss, optimizer=torch.optim.SGD(model.parameters()), reduction=reduction)
    with pytest.raises(error, match=message):
        step.add(data(3))


def test_reduce_scatter_is_refused(world_of_one) -> None:
    model = make_model()
    sync = gradaccum.reduce_scatter(gradaccum.shard(gradaccum.params_of(model)))
    with pytest.raises(ValueError, match=r"sync is a reduce_scatter"):
        Step(model, mse, optimizer=torch.optim.SGD(model.parameters()), sync=sync)


def test_a_custom_reduction_works(world_of_one) -> None:
    model, ref = make_model(), make_model()

    def summed(grads, windows, group):
        for g in grads.values():
            torch.distributed.all_reduce(g, group=group)
        return grads, windows + 1

    sync = gradaccum.custom_reduce(summed, init=lambda grads: 0)
    step = Step(model, mse, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), sync=sync)
    x, y = data(6)
    step.add((x[:2], y[:2]))
    step.add((x[2:], y[2:]))
    step.apply()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    mse(ref, (x, y)).backward()
    ref_opt.step()
    assert max_param_diff(model, ref) < TIGHT
    assert step.state.reduce_state == 1  # the reduction's state, carried by the window


class PerLeafWindow(gradaccum.sync.Window):
    """A sync of one's own that exchanges the weight through a bare Comm (not connect())."""

    def finish(self, weight, failed=False):
        comm = gradaccum.sync.Comm(self.spec.where, None)
        total = comm.settle(comm.exchange(torch.device("cpu"), weight, failed), "mean", failed)
        return self.normalised(total)


class PerLeaf(gradaccum.sync.Sync):
    def open(self, spec):
        return PerLeafWindow(spec)


def test_a_sync_without_totals_is_refused_clearly(world_of_one) -> None:
    model = make_model()
    step = Step(model, mse, optimizer=torch.optim.SGD(model.parameters()), sync=PerLeaf())
    step.add(data(3))
    with pytest.raises(TypeError, match=r"Step.apply\(\): the sync's window reports no totals"):
        step.apply()


def loader() -> DataLoader:
    x, y = data(37, seed=5)
    return DataLoader(TensorDataset(x, y), batch_size=3, shuffle=True)  # 13 micro-batches


def test_progress_counts_windows_and_shows_the_loss() -> None:
    out = io.StringIO()
    model = make_model()
    step = Step(model, mse, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    windowed = windows(loader(), 4)
    with progress(windowed, file=out, mininterval=0) as bar:
        for window in windowed:
            for batch in window:
                step.add(batch)
            bar.update(step.apply())
    assert bar.bar.total == 4
    assert bar.bar.n == 4
    assert [stats.window for stats in bar.history] == [0, 1, 2, 3]  # every window's stats
    assert bar.history[-1] is bar.last
    assert f"loss={bar.last.loss:.4f}" in out.getvalue()
    assert "4/4" in out.getvalue()
    with pytest.raises(TypeError, match=r"stats must be what Step.apply\(\) returned"):
        bar.update(3)


def test_progress_of_a_resumed_run_starts_at_the_windows_done(tmp_path) -> None:
    windowed = windows(range(10), 2)
    loop = iter(windowed)
    for _ in range(3):
        list(next(loop))
    del loop
    again = windows(range(10), 2)
    save(tmp_path, data=windowed)
    load(tmp_path, data=again)
    bar = progress(again, disable=True)
    assert (bar.bar.n, bar.bar.total) == (3, 5)
    assert progress(hidden(), disable=True).bar.total is None


def hidden():
    yield from range(3)


# -- over ranks ---------------------------------------------------------------------------------


def _uneven_run(rank: int, world: int) -> dict:
    """Ranks of 21 and 20 micro-batches of 2 rows, n=4, two epochs: rank 1's last window of
    each epoch is empty. Every rank returns its params, its stats and the reference's params.
    """
    x, y = data(2 * 41, seed=11)
    shards = [range(0, 42), range(42, 82)]  # 21 and 20 micro-batches
    mine = shards[rank]
    micro = [(x[i : i + 2], y[i : i + 2]) for i in range(mine.start, mine.stop, 2)]
    sync = gradaccum.all_reduce()
    model = make_model()
    opt, sched = make_optim(model)
    step = Step(model, mse, optimizer=opt, scheduler=sched, clip=0.5, sync=sync)
    windowed = windows(micro, 4, sync=sync, epochs=2)
    bar = progress(windowed, file=io.StringIO())
    stats, logs = [], []
    for window in windowed:
        with gradaccum.sync.record_collectives() as log:
            for batch in window:
                step.add(batch)
            stats.append(step.apply())
        logs.append(sorted({(c.kind, c.purpose) for c in log}))
        bar.update(stats[-1])
    # The reference: one process, each window's rows of both ranks in one batch.
    ref = make_model()
    ref_opt, ref_sched = make_optim(ref)
    for _ in range(2):
        for w in range(6):
            rows = [i for s in shards for i in s if s.start + 8 * w <= i < s.start + 8 * w + 8]
            ref_opt.zero_grad()
            mse(ref, (x[rows], y[rows])).backward()
            nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            ref_opt.step()
            ref_sched.step()
    return {
        "diff": max_param_diff(model, ref),
        "stats": [(s.window, s.loss, s.items, s.micro_batches, s.grad_norm) for s in stats],
        "bar": bar.bar.disable,
        "history": bar.history == stats,
        "steps": sched.last_epoch,
        "logs": logs,
    }


@pytest.mark.distributed
def test_uneven_ranks_match_one_process() -> None:
    r0, r1 = dist.values(dist.run(_uneven_run, timeout=180))
    assert r0["diff"] < 1e-10
    assert r1["diff"] < 1e-10
    assert r0["stats"] == r1["stats"]  # global statistics, the same on every rank
    assert [s[3] for s in r0["stats"]] == [8, 8, 8, 8, 8, 1] * 2
    assert r0["steps"] == r1["steps"] == 12
    assert (r0["bar"], r1["bar"]) == (False, True)  # the bar is rank 0's
    assert (r0["history"], r1["history"]) == (True, True)  # kept on every rank
    # The statistics ride the gradients' boundary collective: no collective of their own.
    # (The windows' agreement on lengths, at each epoch's start, runs when the loop asks for
    # the epoch's first window: outside these logs; test_loop_windows.py counts it.)
    window = [("all_reduce", "fingerprint"), ("all_reduce", "gradients")]
    assert r0["logs"] == r1["logs"] == [window] * 12


def _failing_rank(rank: int, world: int) -> str:
    model = make_model()
    sync = gradaccum.all_reduce(timeout=30)
    step = Step(model, mse, optimizer=torch.optim.SGD(model.parameters()), sync=sync)
    try:
        step.add(data(2))
        if rank == 1:
            step.add((torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 1)))
        step.apply()
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.distributed
def test_an_error_on_one_rank_reaches_every_rank() -> None:
    r0, r1 = dist.values(dist.run(_failing_rank, timeout=120))
    assert r1.startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    assert r0.startswith("GradAccumError: ")
    assert "1 other rank(s) of the 2 in the group raised an error during this window" in r0


def test_messages_in_full() -> None:
    model = make_model()
    with pytest.raises(TypeError) as err:
        Step(model, mse, optimizer=torch.optim.SGD(model.parameters()), reduction="count").add(
            data(2)
        )
    assert str(err.value) == (
        "Step.add(batch): with reduction='count' the loss function must return (summed_loss, "
        "count), got Tensor(shape=(), dtype=float64); return e.g. (loss_sum, (labels != "
        "-100).sum())."
    )
