"""gradaccum.loop.Step and progress: equivalence, one scheduler step a window (checkpoints:
test_loop_save.py)."""

from __future__ import annotations

import io
import math
import re

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
    return gradaccum.Sum((per_token * mask).sum(), mask.sum())


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
    out = token_loss(ref, (x, y, mask))
    summed, count = out.loss, out.n
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
    opt = torch.optim.SGD(model.parameters())
    step = Step(model, lambda m, b: gradaccum.Mean(mse(m, b), 10), optimizer=opt)
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
        (mse, "count", TypeError, r"returns gradaccum.Sum\(summed_loss, count\)"),
        (lambda m, b: m(b[0]), "mean", TypeError, r"the loss must be a 0-dim tensor"),
        (lambda m, b: mse(m, b).detach(), "mean", ValueError, r"does not require grad"),
        (lambda m, b: (mse(m, b), 3), "mean", TypeError, r"returned a 2-tuple \(tensor, int\)"),
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
        "Step.add(batch): under reduction='count' the loss function returns "
        "gradaccum.Sum(summed_loss, count), got Tensor(shape=(), dtype=float64); return e.g. "
        "gradaccum.Sum(loss_sum, (labels != -100).sum()), or drop reduction='count' for a mean "
        "over the micro-batch's rows."
    )


# -- Step equals the plain loop (issue 26, section 1) ------------------------------------------

F64 = torch.float64


def raises(exc: type[BaseException], message: str):
    return pytest.raises(exc, match=rf"\A{re.escape(message)}\Z")


class Net(nn.Module):
    """BatchNorm, dropout, a head only some micro-batches use, and a layer no loss uses."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(5, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(8, 1)
        self.extra = nn.Linear(5, 1)  # reached only by the micro-batches flagged "extra"
        self.unused = nn.Linear(4, 4)  # reached by no loss
        self.double()

    def forward(self, x: torch.Tensor, extra: bool = False) -> torch.Tensor:
        h = self.out(self.drop(self.bn(torch.tanh(self.inp(x)))))
        return h + self.extra(x) if extra else h


def micro_batch(seed: int, rows: int, extra: bool = False) -> tuple:
    """``(x, y, mask, extra)``: three tensors of ``rows`` rows and a flag (not a tensor)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 5, generator=g, dtype=F64)
    y = torch.randn(rows, 1, generator=g, dtype=F64)
    mask = (torch.rand(rows, 1, generator=g) < 0.7).to(F64)
    mask[0] = 1.0  # every micro-batch counts something
    return x, y, mask, extra


def net_loss(reduction: str):
    def mean(model, batch):
        x, y, _, extra = batch
        return F.mse_loss(model(x, extra), y)

    def summed(model, batch):
        x, y, _, extra = batch
        return F.mse_loss(model(x, extra), y, reduction="sum")

    def count(model, batch):
        x, y, mask, extra = batch
        return gradaccum.Sum(((model(x, extra) - y).pow(2) * mask).sum(), mask.sum())

    return {"mean": mean, "sum": summed, "count": count}[reduction]


def make_opt(kind: str, model: nn.Module):
    if kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))


def plain_window(model, loss_fn, opt, sched, window, seeds, reduction, clip) -> float:
    """The plain PyTorch loop over one (global) window; returns the window's loss."""
    rows = sum(len(b[0]) for b in window)
    counted = sum(float(b[2].sum()) for b in window)
    total = 0.0
    for batch, seed in zip(window, seeds, strict=True):
        torch.manual_seed(seed)
        out = loss_fn(model, batch)
        if reduction == "mean":
            scaled, part = out * len(batch[0]) / rows, out.item() * len(batch[0]) / rows
        elif reduction == "sum":
            scaled, part = out, out.item()
        else:
            scaled, part = out.loss / counted, out.loss.item() / counted
        scaled.backward()
        total += part
    if clip is not None:
        nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
        sched.step(total)
    elif sched is not None:
        sched.step()
    opt.zero_grad(set_to_none=True)
    return total


def same_training_state(model, ref, opt, ref_opt, tol: float) -> None:
    """Params, buffers, .grad and the optimizer's state all as the plain loop left them."""
    for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert (p - q).abs().max().item() < tol, k
        assert p.grad is None, k
        assert (p in opt.state) == (q in ref_opt.state), k
        for key, value in ref_opt.state.get(q, {}).items():
            got = opt.state[p][key]
            assert (got - value).abs().max().item() < tol if key != "step" else got == value, k


WINDOWS = [  # (rows, extra) of each micro-batch: the "extra" head is unused in the last window
    [(3, False), (5, True), (2, False), (4, False)],
    [(2, True), (2, False)],
    [(6, False), (2, False)],
]


@pytest.mark.parametrize("clip", [None, 0.5], ids=["no-clip", "clip"])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "count"])
def test_step_leaves_model_and_optimizer_as_the_plain_loop(reduction, kind, clip) -> None:
    model, ref = Net(), Net()
    (opt, sched), (ref_opt, ref_sched) = make_opt(kind, model), make_opt(kind, ref)
    loss_fn = net_loss(reduction)
    step = Step(model, loss_fn, opt, scheduler=sched, clip=clip, reduction=reduction)
    for w, sizes in enumerate(WINDOWS):
        window = [micro_batch(100 * w + j, r, e) for j, (r, e) in enumerate(sizes)]
        seeds = [1000 * w + j for j in range(len(window))]
        for batch, seed in zip(window, seeds):
            torch.manual_seed(seed)  # the dropout masks: the same as the plain loop's
            step.add(batch)
        stats = step.apply()
        loss = plain_window(ref, loss_fn, ref_opt, ref_sched, window, seeds, reduction, clip)
        same_training_state(model, ref, opt, ref_opt, TIGHT)
        for b, c in zip(model.buffers(), ref.buffers(), strict=True):  # BatchNorm's statistics
            assert (b.double() - c.double()).abs().max().item() < TIGHT
        assert abs(stats.loss - loss) < TIGHT
    # The head no loss reaches: untouched by weight decay and momentum, no optimizer state.
    assert torch.equal(model.unused.weight, Net().unused.weight)
    assert model.unused.weight not in opt.state
    # The extra head, unused in the last window: stepped in windows 0 and 1 only.
    if kind == "adamw":
        assert opt.state[model.extra.weight]["step"].item() == 2


def _plain_loop_on_two_ranks(rank: int, world: int) -> dict:
    """Every reduction, optimizer and clip on 2 ranks against one process over the global
    window: the extra head used on rank 1 only (window 0), an empty rank (window 1), the head
    unused on every rank (window 2), the layer "unused" never used.
    """
    plan = {  # window -> rank -> [(rows, extra)]
        0: {0: [(3, False), (2, False)], 1: [(4, True)]},
        1: {0: [(2, False), (2, True), (3, False)], 1: []},
        2: {0: [(2, False)], 1: [(3, False), (2, False)]},
    }
    out = {}
    configs = [
        (r, k, c) for r in ("mean", "sum", "count") for k in ("sgd", "adamw") for c in (None, 0.5)
    ]
    configs.append(("mean", "adamw-custom", 0.5))
    for reduction, kind, clip in configs:
        custom = kind.endswith("-custom")
        if custom:

            def summed(grads, state, group):
                for g in grads.values():
                    torch.distributed.all_reduce(g, group=group)
                return grads, state

            sync = gradaccum.custom_reduce(summed)
        else:
            sync = gradaccum.all_reduce(bucket_mb=1e-5)  # several buckets
        kind = kind.removesuffix("-custom")
        model, ref = Net(), Net()
        (opt, sched), (ref_opt, ref_sched) = make_opt(kind, model), make_opt(kind, ref)
        loss_fn = net_loss(reduction)
        step = Step(model, loss_fn, opt, scheduler=sched, clip=clip, reduction=reduction, sync=sync)
        diffs, grads_seen = [], []
        for w, ranks in plan.items():
            batches = {
                r: [micro_batch(100 * w + 10 * r + j, n, e) for j, (n, e) in enumerate(ranks[r])]
                for r in ranks
            }
            seeds = {r: [1000 * w + 10 * r + j for j in range(len(ranks[r]))] for r in ranks}
            for batch, seed in zip(batches[rank], seeds[rank]):
                torch.manual_seed(seed)
                step.add(batch)
            before = {k: p.detach().clone() for k, p in model.named_parameters()}
            stats = step.apply()
            window = batches[0] + batches[1]
            loss = plain_window(
                ref, loss_fn, ref_opt, ref_sched, window, seeds[0] + seeds[1], reduction, clip
            )
            diffs.append(max_param_diff(model, ref))
            diffs.append(abs(stats.loss - loss))
            grads_seen.append(
                sorted(k for k, p in model.named_parameters() if not torch.equal(p, before[k]))
            )
            same_training_state(model, ref, opt, ref_opt, 1e-10)
        out[(reduction, kind, clip, custom)] = {
            "diff": max(diffs),
            "moved": grads_seen,
            "extra state": model.extra.weight in opt.state,
            "unused state": model.unused.weight in opt.state,
        }
    return out


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_ranks_leave_model_and_optimizer_as_one_plain_loop_over_the_global_window() -> None:
    r0, r1 = dist.values(dist.run(_plain_loop_on_two_ranks, timeout=280))
    assert r0.keys() == r1.keys()
    assert len(r0) == 13
    body = ["bn.bias", "bn.weight", "inp.bias", "inp.weight", "out.bias", "out.weight"]
    extra = ["extra.bias", "extra.weight"]
    for key in r0:
        for r in (r0, r1):
            assert r[key]["diff"] < 1e-10, key
            assert r[key]["extra state"] is True, key  # used on rank 1 only: stepped on both
            assert r[key]["unused state"] is False, key
        assert r0[key]["moved"] == r1[key]["moved"], key
        # The extra head moves in windows 0 (rank 1 used it) and 1 (rank 0 did), and not in
        # window 2, where no rank used it: no weight decay, no momentum, as in the plain loop.
        moved = r0[key]["moved"]
        assert moved[0] == sorted(body + extra), key
        assert moved[1] == sorted(body + extra), key
        assert moved[2] == body, key


def test_unused_parameters_keep_grad_none_and_no_optimizer_state() -> None:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    seen = {}

    def hook(optimizer, args, kwargs):  # .grad as the optimizer sees it
        seen.update({k: p.grad for k, p in model.named_parameters()})

    opt.register_step_pre_hook(hook)
    step = Step(model, net_loss("mean"), opt)
    before = model.unused.weight.detach().clone()
    for w in range(3):
        step.add(micro_batch(w, 4))
        step.apply()
        assert seen["unused.weight"] is None
        assert seen["extra.bias"] is None
        assert seen["inp.weight"] is not None
    assert torch.equal(model.unused.weight, before)
    assert [p for p in (model.unused.weight, model.extra.weight) if p in opt.state] == []
    assert all(p.grad is None for p in model.parameters())


# -- the weight of a micro-batch ---------------------------------------------------------------


def test_a_batch_whose_tensors_disagree_on_dim_0_is_refused_until_rows_are_given() -> None:
    x, y = data(6)
    per_class = torch.tensor([1.0, 2.0, 0.5], dtype=F64)  # a per-class weight: 3 rows, not 6

    def weighted(model, batch):
        err = (model(batch["x"]) - batch["y"]).pow(2).squeeze(-1)
        return (err * batch["class_weight"][batch["cls"]]).mean()

    cls = torch.tensor([0, 1, 2, 0, 1, 2])
    batches = [
        {"x": x[:4], "y": y[:4], "cls": cls[:4], "class_weight": per_class},
        {"x": x[4:], "y": y[4:], "cls": cls[4:], "class_weight": per_class},
    ]
    model = make_model()
    step = Step(model, weighted, torch.optim.SGD(model.parameters(), lr=0.1))
    with raises(
        ValueError,
        "Step.add(batch): under reduction='mean' a micro-batch weighs its rows, the size of "
        "dim 0 shared by its tensors, but they disagree: batch['class_weight'] has 3 along dim "
        "0 and batch['cls'] has 4, so the rows are not known; return gradaccum.Mean(loss, rows) "
        "from the loss function, rows the number of examples it covers (e.g. "
        "gradaccum.Mean(loss, len(batch['input_ids']))).",
    ):
        step.add(batches[0])
    assert step.micro_step == 0  # nothing was added
    summed = Step(model, weighted, torch.optim.SGD(model.parameters()), reduction="sum")
    with raises(
        ValueError,
        "Step.add(batch): under reduction='sum' a micro-batch counts its rows (StepStats.items), "
        "the size of dim 0 shared by its tensors, but they disagree: batch['class_weight'] has "
        "3 along dim 0 and batch['cls'] has 4, so the rows are not known; return "
        "gradaccum.Sum(loss, rows) from the loss function, rows the number of examples it "
        "covers (e.g. gradaccum.Sum(loss, len(batch['input_ids']))).",
    ):
        summed.add(batches[0])
    # Stated: exact.
    model, ref = make_model(), make_model()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    step = Step(model, lambda m, b: gradaccum.Mean(weighted(m, b), len(b["x"])), opt)
    for batch in batches:
        step.add(batch)
    step.apply()
    weighted(ref, {"x": x, "y": y, "cls": cls, "class_weight": per_class}).backward()
    ref_opt.step()
    assert max_param_diff(model, ref) < TIGHT
    # No tensor with a dim at all.
    step = Step(model, lambda m, b: m(b["x"].expand(1, 5)).sum(), opt)
    with raises(
        ValueError,
        "Step.add(batch): under reduction='mean' a micro-batch weighs its rows, the size of "
        "dim 0 of its tensors, but this one has no tensor with a dim; return "
        "gradaccum.Mean(loss, rows) from the loss function, rows the number of examples it "
        "covers (e.g. gradaccum.Mean(loss, len(batch['input_ids']))).",
    ):
        step.add({"x": torch.zeros((), dtype=F64), "id": 3})


def test_the_rows_are_dim_0_of_every_tensor_leaf_whatever_the_keys() -> None:
    # A dict batch whose first key (sorted) is not the inputs: the same rows from every leaf.
    model, ref = make_model(), make_model()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    step = Step(model, lambda m, b: F.mse_loss(m(b["x"]), b["y"]), opt)
    x, y = data(7)
    for rows in (slice(0, 2), slice(2, 7)):
        step.add({"a_ids": torch.arange(7)[rows], "x": x[rows], "y": y[rows], "note": "text"})
    assert step.apply().items == 7.0
    F.mse_loss(ref(x), y).backward()
    ref_opt.step()
    assert max_param_diff(model, ref) < TIGHT


# -- schedulers that take a metric -------------------------------------------------------------


class NeedsAValue:
    """A scheduler of one's own whose step() requires the value to follow."""

    def __init__(self, opt) -> None:
        self.optimizer, self.values = opt, []

    def step(self, value) -> None:
        self.values.append(value)
        for group in self.optimizer.param_groups:
            group["lr"] *= 0.5 if value > 1.0 else 1.0


def test_a_plateau_scheduler_is_stepped_with_the_window_loss_as_in_the_plain_loop() -> None:
    model, ref = Net(), Net()
    (opt, _), (ref_opt, _) = make_opt("sgd", model), make_opt("sgd", ref)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    ref_plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(ref_opt, factor=0.5, patience=0)
    step = Step(model, net_loss("mean"), opt, scheduler=plateau)
    lrs = []
    for w in range(6):
        window = [micro_batch(7 * w + j, 3 + j) for j in range(3)]
        for j, batch in enumerate(window):
            torch.manual_seed(j)
            step.add(batch)
        stats = step.apply()
        plain_window(ref, net_loss("mean"), ref_opt, ref_plateau, window, range(3), "mean", None)
        same_training_state(model, ref, opt, ref_opt, TIGHT)
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        assert stats.lr == lrs[-1] if lrs else stats.lr == 0.05
        lrs.append(opt.param_groups[0]["lr"])
    assert len(set(lrs)) > 1  # the plateau did lower the rate
    # Any scheduler whose step() needs a value gets the window's loss.
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    own = NeedsAValue(opt)
    step = Step(model, mse, opt, scheduler=own)
    step.add(data(4))
    assert own.values == [step.apply().loss]


# -- parameters frozen or unfrozen -------------------------------------------------------------


def test_parameters_frozen_or_unfrozen_between_windows_train_as_in_the_plain_loop() -> None:
    model, ref = Net(), Net()
    (opt, sched), (ref_opt, ref_sched) = make_opt("adamw", model), make_opt("adamw", ref)
    step = Step(model, net_loss("mean"), opt, scheduler=sched, clip=1.0)
    changes = {  # before window w: (module name, requires_grad)
        1: [("inp", False)],
        2: [("out", False), ("unused", True)],  # unused stays unused: still no .grad
        3: [("inp", True), ("out", True)],
    }
    for w in range(5):
        for name, flag in changes.get(w, []):
            for m in (model, ref):
                getattr(m, name).requires_grad_(flag)
        window = [micro_batch(10 * w + j, 3, j == 1) for j in range(3)]
        for j, batch in enumerate(window):
            torch.manual_seed(j)
            step.add(batch)
        step.apply()
        plain_window(ref, net_loss("mean"), ref_opt, ref_sched, window, range(3), "mean", 1.0)
        same_training_state(model, ref, opt, ref_opt, TIGHT)
    # Changed in the middle of a window: refused before anything changes; the window goes on.
    step.add(micro_batch(99, 3))
    model.out.weight.requires_grad_(False)
    with raises(
        ValueError,
        "Step.add(batch): the parameter 'out.weight' was frozen (requires_grad=False) in the "
        "middle of window 5, after 1 micro-batch(es); change requires_grad between windows "
        "(after step.apply()), where the step follows it as a plain loop would. This "
        "micro-batch was not added.",
    ):
        step.add(micro_batch(98, 3))
    model.out.weight.requires_grad_(True)
    step.add(micro_batch(98, 3))
    assert step.apply().micro_batches == 2
    # Nothing left to train.
    model.requires_grad_(False)
    step.add  # noqa: B018 - the refusal comes at the next window's start
    with raises(
        ValueError,
        "Step.add(batch): the model has no trainable parameters (none with requires_grad); "
        "unfreeze what you mean to train.",
    ):
        step.add(micro_batch(97, 3))


def test_a_custom_reduction_with_state_refuses_a_change_of_trainable_parameters(
    world_of_one,
) -> None:
    model = make_model()
    sync = gradaccum.custom_reduce(lambda g, s, pg: (g, s), init=lambda grads: grads)
    step = Step(model, mse, torch.optim.SGD(model.parameters(), lr=0.1), sync=sync)
    step.add(data(3))
    step.apply()
    model[0].requires_grad_(False)
    with raises(
        ValueError,
        "Step.add(batch): the trainable parameters (requires_grad) changed since the last "
        "window, but the sync keeps a state between windows shaped like the old ones (its "
        "custom reduction's, e.g. error feedback), which would not fit; keep requires_grad "
        "fixed with this sync, or build a new sync and Step after changing it. Nothing was "
        "changed.",
    ):
        step.add(data(3))


# -- data= and the boundary's agreements -------------------------------------------------------


def with_hooks(data, sync):
    """The real windows(...), given the attributes Step reads if this Windows lacks them."""
    native = hasattr(data, "_on_error")
    if not hasattr(data, "sync"):
        data.sync = sync
    if not native:
        data._on_error = []
    return data, native


def test_data_gives_its_sync_and_a_different_sync_is_refused(world_of_one) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = gradaccum.all_reduce()
    windowed, _ = with_hooks(windows([data(2)] * 4, 2, sync=sync), sync)
    step = Step(model, mse, opt, data=windowed)
    assert step.sync is sync
    assert step.data is windowed
    assert windowed._on_error == [step._failed_data]
    again = Step(model, mse, opt, data=windowed, sync=sync)  # the same sync: fine
    assert again.sync is sync
    assert windowed._on_error == [again._failed_data]  # the data feeds the last step built
    other = gradaccum.all_reduce()
    with raises(
        ValueError,
        f"Step(model, loss, optimizer, ...): sync= and data= name different syncs: sync is "
        f"AllReduce at {id(other):#x}, data.sync (the sync given to windows(...)) is AllReduce "
        f"at {id(sync):#x}; pass the same sync object to both, or leave out sync= here (the "
        f"step then takes data's).",
    ):
        Step(model, mse, opt, data=windowed, sync=other)
    with raises(
        TypeError,
        "Step(model, loss, optimizer, ...): data must be None or what "
        "gradaccum.loop.windows(...) returned, got list; pass "
        "data=gradaccum.loop.windows(loader, n, sync=sync).",
    ):
        Step(model, mse, opt, data=[data(2)])
    assert Step(model, mse, optimizer=opt).optimizer is opt  # by keyword, as before


def test_a_data_error_without_a_sync_leaves_the_window_going() -> None:
    model = make_model()
    windowed, _ = with_hooks(windows([data(2)] * 4, 2), None)
    step = Step(model, mse, torch.optim.SGD(model.parameters(), lr=0.1), data=windowed)
    step.add(data(2))
    windowed._on_error[0](RuntimeError("a bad file"))
    assert (step.window, step.micro_step) == (0, 1)
    assert step.apply().micro_batches == 1


class RaisingData:
    """A rank's micro-batches: reading number ``bad`` raises (a corrupt file, say)."""

    def __init__(self, rank: int, bad: int | None) -> None:
        self.rank, self.bad = rank, bad

    def __len__(self) -> int:
        return 8

    def __iter__(self):
        for i in range(8):
            if i == self.bad:
                raise OSError(f"rank {self.rank}: cannot read micro-batch {i}")
            yield data(2, seed=10 * self.rank + i)


def _one_rank_fails(rank: int, world: int, how: str) -> dict:
    import time

    model = make_model()
    sync = gradaccum.all_reduce()  # no timeout of its own: the group's (short) one
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bad = 5 if how == "data" and rank == 1 else None
    data, native = with_hooks(windows(RaisingData(rank, bad), 4, sync=sync), sync)
    step = Step(model, mse, opt, data=data)
    t0 = time.perf_counter()
    try:
        for window in data:
            it = iter(window)
            while True:
                try:
                    batch = next(it)
                except StopIteration:
                    break
                except Exception as err:
                    if not native:  # what windows(...) does itself once it has _on_error
                        for hook in data._on_error:
                            hook(err)
                    raise
                if how == "loss" and rank == 1 and window.index == 1 and step.micro_step == 1:
                    batch = (batch[0][:, :4], batch[1])  # the wrong shape for the model
                step.add(batch)
            t0 = time.perf_counter()
            step.apply()
    except Exception as err:  # noqa: BLE001
        return {"error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - t0}
    return {"error": "none", "seconds": 0.0}


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["data", "loss"])
def test_an_error_on_one_rank_mid_window_makes_every_rank_raise_promptly(how) -> None:
    results = dist.run(_one_rank_fails, how, timeout=120, pg_timeout=30)
    r0, r1 = dist.values(results)
    if how == "data":
        assert r1["error"] == "OSError: rank 1: cannot read micro-batch 5"
    else:
        assert r1["error"].startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    assert r0["error"] == (
        "GradAccumError: Step.apply(): 1 other rank(s) of the 2 in the group raised an error "
        "during this window (rank 0 did not); no gradient is returned on any rank. The cause "
        "is in the failing rank's traceback."
    )
    assert r0["seconds"] < 10  # the group's timeout is 30 s: nobody waited for it


def _saves_differ(rank: int, world: int) -> dict:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = Step(model, mse, opt, sync=gradaccum.all_reduce())
    out = {}
    step.add(data(2, seed=rank))
    step._saves += 1  # both ranks saved once: fine
    step.apply()
    out["after equal"] = step._saves
    step.add(data(2, seed=rank))
    if rank == 0:
        step._saves += 1  # a loop.save reached by rank 0 only
    before = [p.detach().clone() for p in model.parameters()]
    steps = opt.state[model[0].weight]["momentum_buffer"].clone()
    try:
        step.apply()
        out["error"] = "none"
    except gradaccum.GradAccumError as err:
        out["error"] = str(err)
    out["unchanged"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    out["momentum"] = torch.equal(opt.state[model[0].weight]["momentum_buffer"], steps)
    out["saves"] = step._saves
    return out


@pytest.mark.distributed
def test_ranks_that_saved_a_different_number_of_times_all_raise_before_the_optimizer_steps() -> (
    None
):
    r0, r1 = dist.values(dist.run(_saves_differ, timeout=120))
    for rank, r in enumerate((r0, r1)):
        assert r["after equal"] == 0
        assert r["error"] == (
            f"Step.apply(): the ranks called gradaccum.loop.save a different number of times "
            f"in window 1 (this rank {1 - rank}; 1 calls over 2 ranks), so the checkpoint is "
            f"not the same point on every rank. Every rank must reach each save: decide it "
            f"from the window alone (if window.index == save_at: loop.save(path, step)). The "
            f"optimizer did not step, on any rank."
        )
        assert r["unchanged"]
        assert r["momentum"]
        assert r["saves"] == 0


def _frozen_on_one_rank(rank: int, world: int) -> dict:
    model = make_model()
    step = Step(
        model, mse, torch.optim.SGD(model.parameters(), lr=0.1), sync=gradaccum.all_reduce()
    )
    out = {}
    # Both ranks freeze the first layer; rank 1's window is empty: it follows at apply().
    model[0].requires_grad_(False)
    if rank == 0:
        step.add(data(2))
    step.apply()
    out["frozen"] = model[0].weight.grad is None
    # Only rank 1 unfreezes it: the ranks' gradient trees differ.
    if rank == 1:
        model[0].requires_grad_(True)
    step.add(data(2, seed=rank))
    try:
        step.apply()
        out["error"] = "none"
    except gradaccum.GradAccumError as err:
        out["error"] = str(err)
    return out


@pytest.mark.distributed
def test_ranks_that_freeze_different_parameters_all_raise() -> None:
    r0, r1 = dist.values(dist.run(_frozen_on_one_rank, timeout=120))
    for r in (r0, r1):
        assert r["frozen"] is True
        assert r["error"].startswith(
            "Step.apply(): the ranks disagree on the gradients to synchronise"
        )
        assert "nothing was reduced" in r["error"]


# -- the fast path: the backward goes straight into the window's sums --------------------------


def plain_grads(ref: nn.Module, sizes: list[int], x: torch.Tensor, y: torch.Tensor) -> None:
    """The plain loop's gradients of one window (each micro-batch weighted by its rows)."""
    for xb, yb in zip(x.split(sizes), y.split(sizes)):
        (mse(ref, (xb, yb)) * (len(xb) / len(x))).backward()


def test_the_backward_goes_into_the_all_reduce_buckets_without_a_copy(
    world_of_one, monkeypatch
) -> None:
    """Each ``.grad`` is a view of the sync's flat bucket from the first backward on, and the later
    backwards add into it in place: no ``torch.autograd.grad``, no gradient tree to copy."""
    model, ref = make_model(), make_model()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    step = Step(model, mse, opt, sync=gradaccum.all_reduce())

    def refused(*args, **kwargs):
        raise AssertionError("Step.add called torch.autograd.grad")

    monkeypatch.setattr(torch.autograd, "grad", refused)
    sizes = [3, 1, 2]
    x, y = data(sum(sizes))
    for w in range(2):
        where = None
        for j, mb in enumerate(zip(x.split(sizes), y.split(sizes))):
            step.add(mb)
            grads = [p.grad for p in model.parameters()]
            assert all(g is not None and g._base is not None for g in grads), (w, j)
            ptrs = [g.data_ptr() for g in grads]
            assert where is None or ptrs == where, (w, j)
            where = ptrs
        step.apply()
        ref_opt.zero_grad()
        plain_grads(ref, sizes, x, y)
        ref_opt.step()
        assert max_param_diff(model, ref) < TIGHT
        assert all(p.grad is None for p in model.parameters())


def test_each_parameter_hook_runs_once_per_window() -> None:
    """The ``used`` metric costs one Python hook call per parameter and window: on the micro-batch
    that first reaches it (the extra head: the third), none after."""
    model = Net()
    step = Step(model, net_loss("mean"), torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    on_first = step._micro._on_first

    def counted(i, p):
        calls.append(i)
        on_first(i, p)

    step._micro._on_first = counted  # the hooks are made when a window opens
    reached = [k for k, p in model.named_parameters() if not k.startswith(("unused", "extra"))]
    for w in range(2):
        per_micro = []
        for j in range(4):
            step.add(micro_batch(j, 2, extra=j == 2))
            per_micro.append(len(calls))
            calls.clear()
        step.apply()
        assert per_micro == [len(reached), 0, 2, 0], w


def test_sums_in_another_dtype_take_the_generic_path() -> None:
    """Float64 sums of float32 parameters: no ``.grad`` can hold them, so each micro-batch's
    gradient is taken and added (``.grad`` untouched in the window), with the same result."""
    model, ref = make_model().float(), make_model()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    step = Step(model, mse, opt, accum_dtype=torch.float64)
    sizes = [2, 3]
    x, y = data(sum(sizes))
    for mb in zip(x.split(sizes), y.split(sizes)):
        step.add((mb[0].float(), mb[1].float()))
        assert all(p.grad is None for p in model.parameters())
    step.apply()
    plain_grads(ref, sizes, x, y)
    ref_opt.step()
    assert max_param_diff(model.double(), ref) < 1e-6


def test_an_error_inside_the_backward_without_sync_drops_the_window() -> None:
    """The backward adds into the window's sums in place, so one that raises part-way leaves them
    partial: the window's micro-batches so far are dropped (its index stays), and it goes on."""
    model, ref = make_model(), make_model()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))

    def failing(model, batch):
        out = model(batch[0])
        out.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("in the backward")))
        return F.mse_loss(out, batch[1])

    step = Step(model, mse, opt)
    x, y = data(5)
    step.add((x[:2], y[:2]))
    step.loss = failing
    with pytest.raises(RuntimeError, match=re.escape("in the backward")):
        step.add((x[2:4], y[2:4]))
    assert (step.window, step.micro_step) == (0, 0)
    step.loss = mse
    step.add((x[4:], y[4:]))
    stats = step.apply()
    assert (stats.window, stats.micro_batches, stats.items) == (0, 1, 1.0)
    mse(ref, (x[4:], y[4:])).backward()
    ref_opt.step()
    assert max_param_diff(model, ref) < TIGHT


def test_a_failed_window_leaves_no_sums_in_grad(world_of_one) -> None:
    """Under a sync, an error joins the boundary flagged as failed: the window's running sums,
    which ``.grad`` pointed at, are let go with it (``.grad`` is ``None``, as after a plain
    ``zero_grad``), and the next window starts from nothing."""
    model, ref = make_model(), make_model()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    step = Step(model, mse, opt, sync=gradaccum.all_reduce())
    x, y = data(4)
    step.add((x[:2], y[:2]))
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(RuntimeError, match=r"shapes cannot be multiplied"):
        step.add((torch.randn(2, 4, dtype=torch.float64), y[:2]))
    assert all(p.grad is None for p in model.parameters())
    assert (step.window, step.micro_step) == (1, 0)
    step.add((x[2:], y[2:]))
    step.apply()
    mse(ref, (x[2:], y[2:])).backward()
    ref_opt.step()
    assert max_param_diff(model, ref) < TIGHT


def _clip_disagrees(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = nn.Linear(3, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clip = 0.1 if rank == 0 else None
    step = Step(model, lambda m, b: m(b).pow(2).mean(), opt, clip=clip, sync=gradaccum.all_reduce())
    before = model.weight.detach().clone()
    try:
        step.add(torch.randn(4, 3, dtype=torch.float64))
        step.apply()
        return "no error"
    except Exception as err:  # noqa: BLE001 - reported to the test
        moved = not torch.equal(before, model.weight.detach())
        return f"{type(err).__name__}: {err} (moved: {moved})"


@pytest.mark.distributed
def test_ranks_built_with_another_clip_raise_before_stepping() -> None:
    # Clipping on one rank only would make the replicas drift apart without a word: the
    # Step's options are in the window's fingerprint.
    r0, r1 = dist.values(dist.run(_clip_disagrees, timeout=120))
    for got, mine, theirs in ((r0, "0.1", "None"), (r1, "None", "0.1")):
        assert got.startswith("GradAccumError: Step.apply(): the ranks disagree"), got
        assert f"has Step(clip={mine}) with a per-micro-batch loss but rank" in got, got
        assert f"has Step(clip={theirs}) with a per-micro-batch loss" in got, got
        assert got.endswith("(moved: False)"), got
