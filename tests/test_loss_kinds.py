"""What a loop.Step loss returns says what it is (issue 35, section 2): gradaccum.Mean and Sum.

The objective is the same for both kinds: the per-item losses summed over the whole window (every
micro-batch of every rank) divided by the window's items. Each case is checked against the plain
PyTorch loop in float64 on that objective (1e-12): a token loss over padded sequences
(``ignore_index=-100``) in windows of uneven token counts, ``Mean(token_mean, tokens)``,
``Sum(token_sum, tokens)`` and the two mixed, with int and tensor counts, under the default and
``reduction="count"``; on 2 gloo ranks against one process over both ranks' data. The refusals
(a plain tuple, ``Mean`` under ``"count"`` or ``"sum"``, a bad ``n``) are pinned in
tests/test_misuse.py, the one-rank refusal in tests/test_faults.py.
"""

from __future__ import annotations

import math

import dist
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

import gradaccum
from gradaccum.loop import Step

TIGHT = 1e-12
VOCAB = 11
LR = 0.5


def lm(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB)).double()


def padded(rows: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` sequences of 1 to 8 tokens: inputs, and labels with -100 on the padding."""
    lengths = torch.randint(1, 9, (rows,), generator=g)
    inputs = torch.randint(1, VOCAB, (rows, int(lengths.max())), generator=g)
    labels = torch.randint(0, VOCAB, inputs.shape, generator=g)
    labels[torch.arange(inputs.shape[1]) >= lengths[:, None]] = -100
    return inputs, labels


def token_windows(sizes: list[list[int]], seed: int = 0) -> list[list[tuple]]:
    g = torch.Generator().manual_seed(seed)
    return [[padded(rows, g) for rows in window] for window in sizes]


WINDOWS = [[3, 1, 2], [2, 2], [4], [1, 3, 1, 2]]


def tokens(batch) -> torch.Tensor:
    return (batch[1] != -100).sum()


def token_sum(model, batch) -> torch.Tensor:
    inputs, labels = batch
    logits = model(inputs).flatten(0, 1)
    return F.cross_entropy(logits, labels.flatten(), ignore_index=-100, reduction="sum")


def token_mean(model, batch) -> torch.Tensor:
    """The familiar token-mean loss of a micro-batch."""
    inputs, labels = batch
    return F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(), ignore_index=-100)


def mean_of_tokens(model, batch):
    return gradaccum.Mean(token_mean(model, batch), tokens(batch))


def mean_of_tokens_int(model, batch):
    return gradaccum.Mean(token_mean(model, batch), int(tokens(batch)))


def sum_of_tokens(model, batch):
    return gradaccum.Sum(token_sum(model, batch), tokens(batch))


def sum_of_tokens_float(model, batch):
    return gradaccum.Sum(token_sum(model, batch), float(tokens(batch)))


def mixed():
    """Mean and Sum in turn, over the micro-batches (and windows)."""
    calls = [0]

    def loss(model, batch):
        calls[0] += 1
        return (mean_of_tokens_int if calls[0] % 2 else sum_of_tokens)(model, batch)

    return loss


def reference(windows) -> tuple[nn.Module, list[tuple[float, float, float]]]:
    """The plain loop on the token mean over each whole window (SGD): per window its loss, its
    tokens and the gradient's norm."""
    model = lm()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for window in windows:
        total = sum(int(tokens(mb)) for mb in window)
        loss = 0.0
        for mb in window:
            summed = token_sum(model, mb)
            (summed / total).backward()
            loss += summed.item()
        norm = math.sqrt(sum(p.grad.pow(2).sum().item() for p in model.parameters()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((loss / total, float(total), norm))
    return model, out


def train(loss, windows, **kw) -> tuple[nn.Module, list]:
    model = lm()
    step = Step(model, loss, torch.optim.SGD(model.parameters(), lr=LR), **kw)
    stats = []
    for window in windows:
        for mb in window:
            step.add(mb)
        stats.append(step.apply())
    return model, stats


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def check_against_reference(model, stats, windows) -> None:
    ref, want = reference(windows)
    assert max_param_diff(model, ref) < TIGHT
    for got, (loss, items, norm) in zip(stats, want, strict=True):
        assert abs(got.loss - loss) < TIGHT  # the progress bar's loss= is the token mean
        assert got.items == items
        assert abs(got.grad_norm - norm) < TIGHT


@pytest.mark.parametrize(
    ("loss", "reduction"),
    [
        (mean_of_tokens, None),
        (mean_of_tokens_int, None),
        (sum_of_tokens, None),
        (sum_of_tokens_float, None),
        (mixed(), None),
        (sum_of_tokens, "count"),
    ],
    ids=["mean-tensor-n", "mean-int-n", "sum-tensor-n", "sum-float-n", "mixed", "count-sum"],
)
def test_typed_token_losses_are_the_token_mean_over_the_window(loss, reduction) -> None:
    windows = token_windows(WINDOWS)
    kw = {} if reduction is None else {"reduction": reduction}
    model, stats = train(loss, windows, **kw)
    check_against_reference(model, stats, windows)


def test_count_with_sum_is_the_default_with_sum() -> None:
    windows = token_windows(WINDOWS, seed=5)
    a, sa = train(sum_of_tokens, windows)
    b, sb = train(sum_of_tokens, windows, reduction="count")
    assert max_param_diff(a, b) == 0
    assert [(s.loss, s.items, s.grad_norm) for s in sa] == [
        (s.loss, s.items, s.grad_norm) for s in sb
    ]


def test_a_bare_token_mean_is_a_mean_over_rows_the_documented_trap() -> None:
    """A bare loss stays a mean over the micro-batch's rows: a token-mean loss returned bare is
    weighted by rows (exactly), which is not the token mean; Mean(loss, tokens) is."""
    windows = token_windows(WINDOWS)
    model, stats = train(token_mean, windows)
    ref = lm()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for window, got in zip(windows, stats, strict=True):
        rows = sum(len(mb[0]) for mb in window)
        loss = 0.0
        for mb in window:
            value = token_mean(ref, mb)
            (value * len(mb[0]) / rows).backward()
            loss += value.item() * len(mb[0])
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert abs(got.loss - loss / rows) < TIGHT
        assert got.items == rows
    assert max_param_diff(model, ref) < TIGHT
    token, _ = reference(windows)
    assert max_param_diff(model, token) > 1e-4  # another objective than the token mean


def test_sum_reduction_counts_a_sums_items_and_divides_nothing() -> None:
    windows = token_windows(WINDOWS[:2])
    model, stats = train(sum_of_tokens, windows, reduction="sum")
    ref = lm()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for window, got in zip(windows, stats, strict=True):
        total = sum(token_sum(ref, mb) for mb in window)
        total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert abs(got.loss - total.item()) < 1e-10
        assert got.items == sum(int(tokens(mb)) for mb in window)
    assert max_param_diff(model, ref) < TIGHT


@pytest.mark.parametrize(
    ("loss", "reduction"),
    [(mean_of_tokens, None), (sum_of_tokens, None), (sum_of_tokens, "sum")],
    ids=["mean", "sum", "sum-under-sum"],
)
def test_the_generic_path_takes_a_tensor_n(loss, reduction) -> None:
    """float32 parameters with float64 sums (no .grad can hold them): each micro-batch's
    gradient is taken and added; a tensor n scales its backward, no host sync."""
    windows = token_windows(WINDOWS[:2], seed=3)
    model = lm().float()
    kw = {} if reduction is None else {"reduction": reduction}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    step = Step(model, loss, opt, accum_dtype=torch.float64, **kw)
    for window in windows:
        for mb in window:
            step.add(mb)
            assert all(p.grad is None for p in model.parameters())
        stats = step.apply()
    assert stats.items == sum(int(tokens(mb)) for mb in windows[-1])
    if reduction is None:
        ref, _ = reference(windows)
    else:
        ref = lm()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        for window in windows:
            sum(token_sum(ref, mb) for mb in window).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
    assert max_param_diff(model.double(), ref) < 1e-5


def test_an_empty_micro_batch_of_tokens_counts_nothing() -> None:
    """A micro-batch that is all padding: Mean(nan, 0) would poison the sums; Sum(0, 0) adds
    nothing and the window is the token mean of the others."""
    windows = token_windows([[2, 3]], seed=9)
    inputs, labels = windows[0][0]
    windows[0].insert(1, (inputs, torch.full_like(labels, -100)))
    model, stats = train(sum_of_tokens, windows)
    check_against_reference(model, stats, [[mb for mb in windows[0] if int(tokens(mb))]])


@settings(max_examples=15, deadline=None)
@given(
    cuts=st.lists(st.integers(0, 1), min_size=7, max_size=7),
    kinds=st.lists(st.booleans(), min_size=8, max_size=8),
)
def test_any_split_and_any_kinds_give_the_token_mean(cuts, kinds) -> None:
    """A window of 8 sequences, split anywhere into micro-batches, each returning Mean or Sum:
    always the token mean over the 8 (the law the typed returns keep)."""
    g = torch.Generator().manual_seed(11)
    inputs, labels = padded(8, g)
    bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [8]
    window = [(inputs[a:b], labels[a:b]) for a, b in zip(bounds, bounds[1:])]
    flags = iter(kinds)

    def loss(model, batch):
        return (mean_of_tokens if next(flags) else sum_of_tokens)(model, batch)

    model, stats = train(loss, [window])
    check_against_reference(model, stats, [[(inputs, labels)]])


# -- 2 ranks: against one process over both ranks' data ----------------------------------------

PER_RANK = [
    [2, 3, 1, 2, 1],
    [1, 4, 2],
]  # sequences per micro-batch; n=2: rank 1's last window empty


def _two_ranks(rank: int, world: int, kinds: str) -> dict:
    per_rank = [token_windows([sizes], seed=20 + r)[0] for r, sizes in enumerate(PER_RANK)]
    if kinds == "mixed":  # rank 0 returns Mean, rank 1 Sum
        loss = mean_of_tokens if rank == 0 else sum_of_tokens
    else:
        loss = {"mean": mean_of_tokens, "sum": sum_of_tokens}[kinds]
    model = lm()
    sync = gradaccum.all_reduce()
    data = gradaccum.loop.windows(per_rank[rank], 2, sync=sync)
    step = Step(model, loss, torch.optim.SGD(model.parameters(), lr=LR), data=data)
    stats = []
    for window in data:
        for mb in window:
            step.add(mb)
        s = step.apply()
        stats.append((s.loss, s.items, s.grad_norm))
    global_windows = [[mb for mbs in per_rank for mb in mbs[w * 2 : (w + 1) * 2]] for w in range(3)]
    ref, want = reference(global_windows)
    return {
        "diff": max_param_diff(model, ref),
        "stats": [
            (abs(a - la), items == li, abs(n - ln))
            for (a, items, n), (la, li, ln) in zip(stats, want, strict=True)
        ],
    }


@pytest.mark.distributed
@pytest.mark.parametrize("kinds", ["mean", "sum", "mixed"])
def test_two_ranks_are_the_token_mean_over_the_global_window(kinds) -> None:
    for got in dist.values(dist.run(_two_ranks, kinds, timeout=120)):
        assert got["diff"] < TIGHT
        for loss_diff, items_equal, norm_diff in got["stats"]:
            assert loss_diff < TIGHT
            assert items_equal
            assert norm_diff < TIGHT


def _count_against_default(rank: int, world: int) -> str:
    model = lm()
    sync = gradaccum.all_reduce(timeout=30)
    kw = {"reduction": "count"} if rank == 1 else {}
    step = Step(model, sum_of_tokens, torch.optim.SGD(model.parameters(), lr=LR), sync=sync, **kw)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        step.add(token_windows([[2]], seed=rank)[0][0])
        step.apply()
        return "no error"
    except Exception as err:  # noqa: BLE001 - reported to the test
        moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        return f"{type(err).__name__}: {err} (moved: {moved})"


@pytest.mark.distributed
def test_a_rank_under_count_against_one_under_the_default_is_refused() -> None:
    """Both accumulate items ("count" inside); the Step's reduction is in the fingerprint."""
    r0, r1 = dist.values(dist.run(_count_against_default, timeout=120))
    for got, mine, theirs in ((r0, "'mean'", "'count'"), (r1, "'count'", "'mean'")):
        assert got.startswith("GradAccumError: Step.apply(): the ranks disagree"), got
        assert f"has Step(reduction={mine}) but rank" in got, got
        assert f"has Step(reduction={theirs})" in got, got
        assert got.endswith("(moved: False)"), got


def test_a_window_saved_before_the_typed_returns_still_loads() -> None:
    """A Step.state_dict() written before issue 35 holds a "mean" accumulator under the default
    reduction: its sums (gradients times rows) and weight (rows) are what "count" holds now."""
    windows = token_windows([[2, 3]], seed=4)

    def bare(model, batch):
        return token_mean(model, batch)

    model, stats = train(bare, windows)
    first = lm()
    step = Step(first, bare, torch.optim.SGD(first.parameters(), lr=LR))
    step.add(windows[0][0])
    saved = step.state_dict()
    assert saved["accumulator"]["reduction"] == "count"
    saved["accumulator"]["reduction"] = "mean"  # as the code before wrote it
    resumed = lm(seed=1)
    again = Step(resumed, bare, torch.optim.SGD(resumed.parameters(), lr=LR))
    again.load_state_dict(saved)
    again.add(windows[0][1])
    got = again.apply()
    assert max_param_diff(resumed, model) == 0
    assert (got.loss, got.items) == (stats[0].loss, stats[0].items)


# -- the hostile pass (issue 35): what it found silently wrong, now exact or refused ------------


class MyMean(gradaccum.Mean):
    """A user's subclass: still a Mean."""

    __slots__ = ()


def test_a_subclass_of_mean_is_a_mean() -> None:
    """A subclass of Mean was weighted as a Sum (the kind was read from the class's name)."""
    windows = token_windows(WINDOWS)

    def loss(model, batch):
        return MyMean(token_mean(model, batch), tokens(batch))

    model, stats = train(loss, windows)
    check_against_reference(model, stats, windows)


def all_padding(rows: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(rows, 4, dtype=torch.long), torch.full((rows, 4), -100)


def test_a_mean_over_no_tokens_counts_nothing_and_keeps_the_loss_finite() -> None:
    """The documented pattern, Mean(F.cross_entropy(..., ignore_index=-100), tokens), on an
    all-padding micro-batch: F.cross_entropy is NaN there, and NaN * 0 made StepStats.loss NaN
    (a ReduceLROnPlateau was then fed NaN). The micro-batch adds nothing, as in the plain loop."""
    windows = token_windows(WINDOWS)
    with_padding = [[*window, all_padding()] for window in windows]
    model, stats = train(mean_of_tokens, with_padding)
    assert all(math.isfinite(s.loss) for s in stats)
    check_against_reference(model, stats, windows)
    model, stats = train(mean_of_tokens_int, with_padding)  # n = 0 as a Python int
    check_against_reference(model, stats, windows)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.uint8, torch.int16])
def test_a_narrow_tensor_n_is_counted_exactly(dtype: torch.dtype) -> None:
    """The window's items were summed in n's own dtype: float16 45 x 1500 was inf (nothing
    moved), 3 x 1001 was 3004; uint8 3 x 200 was 88. Each n is exact in its dtype here; the
    window's total is not."""
    model = lm()
    step = Step(
        model,
        lambda m, b: gradaccum.Sum(token_sum(m, b[:2]), b[2]),
        torch.optim.SGD(model.parameters(), lr=LR),
    )
    g = torch.Generator().manual_seed(0)
    per = 200 if dtype == torch.uint8 else 255 if dtype == torch.bfloat16 else 1001
    for _ in range(3):
        inputs, labels = padded(2, g)
        step.add((inputs, labels, torch.tensor(per, dtype=dtype)))
    assert step.apply().items == 3 * per


def test_a_window_whose_tensor_items_add_up_to_0_is_refused_whole() -> None:
    """In one process, tensor n's that add up to 0 gave a bare ZeroDivisionError with the window
    consumed and every .grad NaN. Refused now, nothing applied, and the next window trains."""
    model = lm()
    step = Step(model, sum_of_tokens, torch.optim.SGD(model.parameters(), lr=LR))
    before = [p.detach().clone() for p in model.parameters()]
    step.add(all_padding())
    step.add(all_padding(2))
    with pytest.raises(ValueError, match=r"Step.apply\(\): the items of window 0 add up to 0"):
        step.apply()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert step.window == 1
    for mb in token_windows([[2, 1]])[0]:
        step.add(mb)
    assert math.isfinite(step.apply().loss)
