"""Pass 2 of the two-pass transforms replays pass 1's randomness, or says it could not.

Issue 35, section 3: randomness not drawn from torch's global generators (an explicit
``torch.Generator``, Python's ``random``, NumPy) was not replayed in pass 2: the value was right
and the gradient 0.09 to 0.95 off; ``window_stats`` routed other rows than it counted; an
explicit generator was left advanced twice. Now Python's and NumPy's global states are replayed
like torch's, explicit generators are handed in (``generators=``), and ``coupled`` compares what
pass 2 recomputed with what pass 1 cached: a difference beyond rounding raises on every rank.
Complex representations and statistics are refused in every mix.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gradaccum
from gradaccum import GradAccumError, Rows
from gradaccum.loop import Coupled, Step, WindowStats
from tests.dist import run, values

N, ROWS, D_IN, D = 4, 8, 5, 3


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(D_IN, D, generator=g, dtype=torch.float64)}


def _batch(seed: int = 1) -> torch.Tensor:
    return torch.randn(
        ROWS, D_IN, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )


def _info_nce(p: Any, z: torch.Tensor, rows: Rows) -> torch.Tensor:
    z = F.normalize(z, dim=-1)
    sim = z[rows.local] @ z.T / 0.5
    sim = sim - 1e9 * torch.eye(len(z), dtype=z.dtype)[rows.local]
    return F.cross_entropy(sim, rows.arange() ^ 1, reduction="sum") / rows.total


# Each source of randomness: (make it afresh at a seed, draw a [rows, D] keep-mask from it).
def _python(seed: int) -> Any:
    random.seed(seed)
    return None


def _numpy(seed: int) -> Any:
    np.random.seed(seed)
    return None


SOURCES: dict[str, tuple[Callable[[int], Any], Callable[[Any, int], torch.Tensor], bool]] = {
    # name: (reset(seed) -> explicit generator or None, mask(gen, rows), needs generators=)
    "python-random": (
        _python,
        lambda g, r: torch.tensor([[random.random() > 0.4 for _ in range(D)] for _ in range(r)]),
        False,
    ),
    "numpy-global": (_numpy, lambda g, r: torch.from_numpy(np.random.rand(r, D) > 0.4), False),
    "torch-generator": (
        lambda s: torch.Generator().manual_seed(s),
        lambda g, r: torch.rand(r, D, generator=g) > 0.4,
        True,
    ),
    "random.Random": (
        lambda s: random.Random(s),
        lambda g, r: torch.tensor([[g.random() > 0.4 for _ in range(D)] for _ in range(r)]),
        True,
    ),
    "numpy-Generator": (
        lambda s: np.random.default_rng(s),
        lambda g, r: torch.from_numpy(g.random((r, D)) > 0.4),
        True,
    ),
    "numpy-RandomState": (
        lambda s: np.random.RandomState(s),
        lambda g, r: torch.from_numpy(g.rand(r, D) > 0.4),
        True,
    ),
}


def _state(name: str, gen: Any) -> Any:
    """The source's state now (to check it advanced by one pass, not two)."""
    if name == "python-random":
        return random.getstate()
    if name == "numpy-global":
        return str(np.random.get_state())
    if isinstance(gen, torch.Generator):
        return gen.get_state().tolist()
    if isinstance(gen, random.Random):
        return gen.getstate()
    if hasattr(gen, "bit_generator"):
        return str(gen.bit_generator.state)
    return str(gen.get_state())


def _embed_for(name: str, box: list[Any]) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    mask = SOURCES[name][1]

    def embed(p: Any, x: torch.Tensor) -> torch.Tensor:
        return (x @ p["w"]) * mask(box[0], len(x)) / 0.6  # a dropout with the source's mask

    return embed


def _whole_batch(name: str, seed: int, p: Any, x: torch.Tensor) -> tuple[Any, Any]:
    """The reference: every micro-batch embedded once, in order, with a graph; the loss."""
    box = [SOURCES[name][0](seed)]
    embed = _embed_for(name, box)
    w = p["w"].clone().requires_grad_()
    z = torch.cat([embed({"w": w}, mb) for mb in x.chunk(N)])
    loss = _info_nce(None, z, Rows(0, ROWS, ROWS, (ROWS,)))
    (g,) = torch.autograd.grad(loss, w)
    return g, _state(name, box[0])


@pytest.mark.parametrize("name", list(SOURCES))
def test_coupled_replays_every_source_and_advances_it_once(name: str) -> None:
    p, x = _params(), _batch()
    want, state_after_one_pass = _whole_batch(name, 7, p, x)
    box = [SOURCES[name][0](7)]
    gens = [box[0]] if SOURCES[name][2] else []
    grads, _ = gradaccum.coupled(_embed_for(name, box), _info_nce, N, generators=gens)(p, x)
    torch.testing.assert_close(grads["w"], want, rtol=1e-12, atol=1e-14)
    assert _state(name, box[0]) == state_after_one_pass


@pytest.mark.parametrize("name", [k for k, v in SOURCES.items() if v[2]])
def test_coupled_refuses_an_undeclared_generator_instead_of_another_gradient(name: str) -> None:
    p, x = _params(), _batch()
    box = [SOURCES[name][0](7)]
    step = gradaccum.coupled(_embed_for(name, box), _info_nce, N)
    with pytest.raises(GradAccumError, match=r"did not reproduce pass 1's representations"):
        step(p, x)
    # The check can be turned off: then the gradient is that of other representations.
    box[0] = SOURCES[name][0](7)
    loose = gradaccum.coupled(_embed_for(name, box), _info_nce, N, check_replay=False)
    grads, _ = loose(p, x)
    want, _ = _whole_batch(name, 7, p, x)
    assert not torch.allclose(grads["w"], want, rtol=1e-6)


def test_rounding_differences_between_the_passes_pass_the_check() -> None:
    """Another summation order in pass 2 (a nondeterministic kernel's) is not an error."""
    calls = [0]

    def embed(p: Any, x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        prods = x.unsqueeze(-1) * p["w"]  # [rows, D_IN, D]
        if calls[0] > N:  # pass 2: the same sum, in reverse order
            return prods.flip(1).cumsum(1)[:, -1]
        return prods.cumsum(1)[:, -1]

    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        calls[0] = 0
        p = {"w": _params()["w"].to(dtype) * 10}
        x = _batch().to(dtype) * 10
        grads, _ = gradaccum.coupled(embed, _info_nce, N)(p, x)
        assert torch.isfinite(grads["w"]).all()


def test_a_changed_mask_fails_the_check_in_every_dtype() -> None:
    """One row of one micro-batch masked differently in pass 2: caught, even in bfloat16."""
    calls = [0]

    def embed(p: Any, x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        z = x @ p["w"]
        if calls[0] == 2 * N:  # pass 2, the last micro-batch: one element of one row dropped
            z = z.clone()
            z[0, 0] = 0
        return z

    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        calls[0] = 0
        p = {"w": _params()["w"].to(dtype)}
        with pytest.raises(GradAccumError, match=r"micro-batch 3 differs by"):
            gradaccum.coupled(embed, _info_nce, N)(p, _batch().to(dtype))


def test_state_that_changes_between_the_passes_is_caught() -> None:
    """A forward that depends on how often it ran (a call counter) is not a replay."""
    seen = [0]

    def embed(p: Any, x: torch.Tensor) -> torch.Tensor:
        seen[0] += 1
        return x @ p["w"] * (1.0 + 0.1 * seen[0])

    with pytest.raises(GradAccumError, match="depends on state that changed"):
        gradaccum.coupled(embed, _info_nce, N)(_params(), _batch())


def test_window_stats_routes_as_it_counted_with_python_random() -> None:
    """The rows a stats call counts are the rows the loss uses, drawn by Python's random."""

    def pick(r: int) -> torch.Tensor:
        return torch.tensor([random.random() > 0.5 for _ in range(r)])

    def stats(p: Any, x: torch.Tensor) -> torch.Tensor:
        return pick(len(x)).sum()

    def loss(p: Any, x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        keep = pick(len(x))
        return ((x @ p["w"]).pow(2).sum(-1) * keep).sum() / count

    p, x = _params(), _batch()
    random.seed(3)
    keeps = [pick(len(mb)) for mb in x.chunk(N)]
    after = random.getstate()
    count = sum(k.sum() for k in keeps)
    w = p["w"].clone().requires_grad_()
    whole = sum(((mb @ w).pow(2).sum(-1) * k).sum() for mb, k in zip(x.chunk(N), keeps)) / count
    (want,) = torch.autograd.grad(whole, w)
    random.seed(3)
    grads, _ = gradaccum.window_stats(stats, loss, N, reduction="sum")(p, x)
    torch.testing.assert_close(grads["w"], want, rtol=1e-12, atol=1e-14)
    assert random.getstate() == after


def _kept_rows_reference(x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Generator]:
    """Plain PyTorch: one row mask per micro-batch from a generator at ``seed``, drawn once;
    the gradient of the kept rows' squared outputs over the window's kept count; the generator
    as one pass leaves it."""
    ref = torch.Generator().manual_seed(seed)
    keeps = [torch.rand(len(mb), generator=ref) > 0.5 for mb in x.chunk(N)]
    count = sum(k.sum() for k in keeps)
    w = _params()["w"].clone().requires_grad_()
    whole = sum(((mb @ w).pow(2).sum(-1) * k).sum() for mb, k in zip(x.chunk(N), keeps)) / count
    (want,) = torch.autograd.grad(whole, w)
    return want, ref


def test_window_stats_replays_a_declared_generator() -> None:
    g = torch.Generator().manual_seed(5)

    def stats(p: Any, x: torch.Tensor) -> torch.Tensor:
        return (torch.rand(len(x), generator=g) > 0.5).sum()

    def loss(p: Any, x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(len(x), generator=g) > 0.5
        return ((x @ p["w"]).pow(2).sum(-1) * keep).sum() / count

    p, x = _params(), _batch()
    want, ref = _kept_rows_reference(x, seed=5)
    step = gradaccum.window_stats(stats, loss, N, reduction="sum", generators=[g])
    grads, _ = step(p, x)
    torch.testing.assert_close(grads["w"], want, rtol=1e-12, atol=1e-14)
    assert torch.equal(g.get_state(), ref.get_state())  # advanced by one pass


def _dropout_loss_reference(x: torch.Tensor, windows: int) -> tuple[torch.Tensor, list[Any]]:
    """Plain PyTorch: a count with no randomness, then one dropout per micro-batch, in order."""
    w = _params()["w"].clone()
    masks = []
    torch.manual_seed(4)
    for _ in range(windows):
        wl = w.clone().requires_grad_()
        count = (x[:, 0] > 0).sum()
        total = 0
        for mb in x.chunk(N):
            h = F.dropout(mb @ wl, 0.5, training=True)
            masks.append((h != 0).tolist())
            total = total + h.pow(2).sum() / count
        (g,) = torch.autograd.grad(total, wl)
        w = w - 0.1 * g
    return w, masks


def test_window_stats_a_dropout_only_in_the_loss_draws_fresh_masks() -> None:
    """stats counts (no randomness), loss has dropout: each micro-batch gets its own mask, and
    the generator runs on from window to window, as in a plain loop (before: one mask for every
    micro-batch of every window)."""
    x = _batch() + 0.5
    masks: list[Any] = []

    def stats(p: Any, mb: torch.Tensor) -> torch.Tensor:
        return (mb[:, 0] > 0).sum()

    def loss(p: Any, mb: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        h = F.dropout(mb @ p["w"], 0.5, training=True)
        masks.append((h.detach() != 0).tolist())
        return h.pow(2).sum() / count

    want, want_masks = _dropout_loss_reference(x, 2)
    torch.manual_seed(4)
    step = gradaccum.window_stats(stats, loss, N, reduction="sum")
    w = _params()["w"]
    for _ in range(2):
        grads, _ = step({"w": w}, x)
        w = w - 0.1 * grads["w"]
    torch.testing.assert_close(w, want, rtol=1e-12, atol=1e-14)
    assert masks == want_masks
    assert len({str(m) for m in masks}) == len(masks)  # no two micro-batches alike


def test_window_stats_a_loss_that_draws_more_than_its_stats_is_refused() -> None:
    """stats drew some numbers, the loss more: its extra ones would repeat another's."""

    def stats(p: Any, mb: torch.Tensor) -> torch.Tensor:
        return (F.dropout(mb, 0.5, training=True)[:, 0] > 0).sum()  # a router behind dropout

    def loss(p: Any, mb: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        h = F.dropout(mb, 0.5, training=True)  # the router's mask, replayed
        return F.dropout(h @ p["w"], 0.5, training=True).pow(2).sum() / count  # and one more

    with pytest.raises(
        GradAccumError,
        match=r"drew other random numbers than stats did from "
        r"torch's CPU generator",
    ):
        gradaccum.window_stats(stats, loss, N, reduction="sum")(_params(), _batch())


def _mismatch_in_row(dtype: torch.dtype, scale: float, nan_row: bool) -> None:
    """Pass 2 changes row 3 of the last micro-batch; row 0 of that micro-batch may be NaN."""
    calls = [0]

    def embed(p: Any, x: torch.Tensor) -> Any:
        calls[0] += 1
        z = (x @ p["w"]).to(dtype) * scale
        if nan_row and calls[0] in (N, 2 * N):
            z = z.clone()
            z[0] = float("nan")
        if calls[0] == 2 * N:
            z = z.clone()
            z[1] = z[1] * 2
        return {"z": z, "zero": torch.zeros_like(z)}

    def loss(p: Any, reps: Any, rows: Rows) -> torch.Tensor:
        z = torch.nan_to_num(reps["z"].double())
        return z.pow(2).sum() / scale**2 + reps["zero"].sum()

    with pytest.raises(GradAccumError, match=r"\['z'\] of micro-batch 3 differs by"):
        gradaccum.coupled(embed, loss, N)(_params(), _batch())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_check_sees_past_a_nan_row_and_at_any_magnitude(dtype: torch.dtype) -> None:
    _mismatch_in_row(dtype, 1.0, nan_row=True)
    big = 1e30 if dtype != torch.float64 else 1e150
    _mismatch_in_row(dtype, big if dtype != torch.bfloat16 else 1e30, nan_row=False)
    _mismatch_in_row(dtype, 1e-30, nan_row=False)


def test_rounding_in_a_leaf_that_is_zero_is_not_an_error() -> None:
    """A leaf exactly 0 in pass 1, rounding noise in pass 2 (a - a in another order)."""
    calls = [0]

    def embed(p: Any, x: torch.Tensor) -> Any:
        calls[0] += 1
        z = (x @ p["w"]).float()
        noise = torch.zeros_like(z) if calls[0] <= N else (z * 3 - z * 2 - z) * 1e-3
        return {"z": z, "zero": noise}

    def loss(p: Any, reps: Any, rows: Rows) -> torch.Tensor:
        return reps["z"].pow(2).sum() + reps["zero"].sum()

    grads, _ = gradaccum.coupled(embed, loss, N)(_params(), _batch())
    assert torch.isfinite(grads["w"]).all()


# -- loop.Coupled and loop.WindowStats ------------------------------------------------------------


class _Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(_params()["w"].clone())


def _loop_embed(gen: torch.Generator | None) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    def embed(model: Any, x: torch.Tensor) -> torch.Tensor:
        mask = torch.rand(len(x), D, generator=gen) > 0.4
        return (x @ model.w) * mask / 0.6

    return embed


def _loop_loss(model: Any, z: torch.Tensor, rows: Rows) -> torch.Tensor:
    return _info_nce(None, z, rows)


def test_loop_coupled_replays_a_declared_generator_and_refuses_an_undeclared_one() -> None:
    x = _batch()
    gen = torch.Generator().manual_seed(9)
    model = _Encoder()
    step = Step(
        model,
        Coupled(_loop_embed(gen), _loop_loss, generators=[gen]),
        torch.optim.SGD(model.parameters(), lr=0.1),
    )
    step.add_window(list(x.chunk(N)))
    step.apply()
    ref = torch.Generator().manual_seed(9)
    want, _ = _whole_batch("torch-generator", 9, _params(), x)
    torch.testing.assert_close(model.w.detach(), _params()["w"] - 0.1 * want, rtol=1e-12, atol=0)
    for mb in x.chunk(N):  # one pass's draws
        torch.rand(len(mb), D, generator=ref)
    assert torch.equal(gen.get_state(), ref.get_state())

    gen2 = torch.Generator().manual_seed(9)
    model2 = _Encoder()
    step2 = Step(
        model2, Coupled(_loop_embed(gen2), _loop_loss), torch.optim.SGD(model2.parameters(), 0.1)
    )
    with pytest.raises(GradAccumError, match="did not reproduce"):
        step2.add_window(list(x.chunk(N)))
    assert model2.w.grad is None  # the window was dropped whole
    torch.testing.assert_close(model2.w.detach(), _params()["w"], rtol=0, atol=0)


def test_loop_window_stats_replays_a_declared_generator() -> None:
    g = torch.Generator().manual_seed(5)

    def stats(model: Any, x: torch.Tensor) -> torch.Tensor:
        return (torch.rand(len(x), generator=g) > 0.5).sum()

    def loss(model: Any, x: torch.Tensor, count: torch.Tensor) -> gradaccum.Sum:
        keep = torch.rand(len(x), generator=g) > 0.5
        return gradaccum.Sum(((x @ model.w).pow(2).sum(-1) * keep).sum() / count, len(x))

    x = _batch()
    want, _ = _kept_rows_reference(x, seed=5)
    model = _Encoder()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    step = Step(model, WindowStats(stats, loss, generators=[g]), opt)
    step.add_window(list(x.chunk(N)))
    step.apply()
    # Sum(value, rows): the step's objective is the window's sums over its items (ROWS).
    torch.testing.assert_close(
        model.w.detach(), _params()["w"] - want / ROWS, rtol=1e-12, atol=1e-14
    )


# -- bad arguments --------------------------------------------------------------------------------


def _embed(p: Any, x: torch.Tensor) -> torch.Tensor:
    return x @ p["w"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"generators": torch.Generator()}, "generators must be a list of torch.Generator"),
        ({"generators": [1]}, r"generators\[0\] must be one of torch.Generator"),
        ({"generators": [random]}, "replayed already; pass only explicit generator objects"),
        ({"generators": [np.random]}, "the module numpy.random"),
        ({"generators": [random.SystemRandom()]}, "has no state to replay"),
        ({"generators": "gen"}, "pass a list or tuple of them"),
        ({"generators": (g for g in [torch.Generator()])}, "pass a list or tuple of them"),
        ({"check_replay": 1}, "check_replay must be a bool, got int"),
        ({"check_replay": np.bool_(True)}, r"numpy\.bool"),
    ],
)
def test_bad_replay_arguments_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        gradaccum.coupled(_embed, _info_nce, N, **kwargs)
    if "check_replay" not in kwargs:
        with pytest.raises(TypeError, match=message):
            gradaccum.window_stats(lambda p, x: x.sum(), lambda p, x, s: x.sum(), N, **kwargs)
        with pytest.raises(TypeError, match=message):
            WindowStats(lambda m, x: x.sum(), lambda m, x, s: x.sum(), **kwargs)
    with pytest.raises(TypeError, match=message):
        Coupled(_embed, _info_nce, **kwargs)


# -- complex leaves -------------------------------------------------------------------------------


@pytest.mark.parametrize("mix", ["complex-only", "complex-beside-float"])
def test_complex_representations_are_refused_in_every_mix(mix: str) -> None:
    def embed(p: Any, x: torch.Tensor) -> Any:
        z = torch.complex(x @ p["w"], x @ p["w"])
        return {"c": z} if mix == "complex-only" else {"f": x @ p["w"], "c": z}

    def loss(p: Any, reps: Any, rows: Rows) -> torch.Tensor:
        return reps["c"].abs().sum() + (reps["f"].sum() if "f" in reps else 0)

    with pytest.raises(TypeError, match=r"complex leaf .*view_as_real"):
        gradaccum.coupled(embed, loss, N)(_params(), _batch())


def test_complex_statistics_are_refused() -> None:
    def stats(p: Any, x: torch.Tensor) -> Any:
        return {"n": torch.tensor(len(x)), "c": torch.complex(x.sum(), x.sum())}

    with pytest.raises(TypeError, match=r"stats returned a complex leaf .*view_as_real"):
        gradaccum.window_stats(stats, lambda p, x, s: (x @ p["w"]).sum(), N)(_params(), _batch())


# -- two ranks ------------------------------------------------------------------------------------


def _two_ranks(rank: int, world: int) -> dict[str, Any]:
    """Each rank's mask from its own generator: declared, exact; undeclared on rank 1, an error."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    x = torch.randn(
        world * ROWS, D_IN, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    mine = x[rank * ROWS : (rank + 1) * ROWS]
    p = _params()
    sync = gradaccum.all_reduce()
    gen = torch.Generator().manual_seed(100 + rank)
    embed = _loop_embed(gen)
    step = gradaccum.coupled(
        lambda p, b: embed(_Box(p), b), _info_nce, N, sync=sync, generators=[gen]
    )
    grads, _ = step(p, mine)
    # The reference: every rank's masks, redrawn here from its seed, in rank order.
    w = p["w"].clone().requires_grad_()
    zs = []
    for r in range(world):
        g = torch.Generator().manual_seed(100 + r)
        for mb in x[r * ROWS : (r + 1) * ROWS].chunk(N):
            zs.append((mb @ w) * (torch.rand(len(mb), D, generator=g) > 0.4) / 0.6)
    total = world * ROWS
    whole = sum(
        _info_nce(None, torch.cat(zs), Rows(r * ROWS, (r + 1) * ROWS, total, (ROWS,) * world, r))
        for r in range(world)
    )
    (want,) = torch.autograd.grad(whole, w)
    out["exact"] = float((grads["w"] - want).abs().max())
    # Rank 1 forgets to declare its generator: every rank raises, nothing is returned.
    gen2 = torch.Generator().manual_seed(200 + rank)
    embed2 = _loop_embed(gen2)
    gens = [gen2] if rank == 0 else []
    step2 = gradaccum.coupled(
        lambda p, b: embed2(_Box(p), b), _info_nce, N, sync=sync, generators=gens
    )
    try:
        step2(p, mine)
        out["undeclared"] = "returned"
    except GradAccumError as err:
        out["undeclared"] = str(err)
    # The group still works: the next window is exact again on both ranks.
    gen3 = torch.Generator().manual_seed(100 + rank)
    embed3 = _loop_embed(gen3)
    step3 = gradaccum.coupled(
        lambda p, b: embed3(_Box(p), b), _info_nce, N, sync=sync, generators=[gen3]
    )
    again, _ = step3(p, mine)
    out["again"] = float((again["w"] - want).abs().max())
    dist.barrier()
    return out


class _Box:
    def __init__(self, p: Any) -> None:
        self.w = p["w"]


@pytest.mark.distributed
def test_two_ranks_replay_declared_generators_and_fail_together_on_an_undeclared_one() -> None:
    got = values(run(_two_ranks, timeout=120))
    for out in got:
        assert out["exact"] < 1e-12, got
        assert out["again"] < 1e-12, got
    assert "did not reproduce pass 1's representations" in got[1]["undeclared"], got
    assert "1 other rank(s) of the 2 in the group raised" in got[0]["undeclared"], got


# -- checkpoints -----------------------------------------------------------------------------------


def _train_coupled(
    gen: Any, kind: str, stop: int | None = None, resume: str | None = None, path: str = ""
) -> torch.Tensor:
    """3 windows of loop.Step with a loss drawing from ``gen``; save after ``stop`` windows, or
    resume from ``resume`` (a fresh process would: the model and generator as at the start)."""
    model = _Encoder()
    mask = SOURCES[kind][1]

    def embed(m: Any, x: torch.Tensor) -> torch.Tensor:
        return (x @ m.w) * mask(gen, len(x)) / 0.6

    step = Step(
        model,
        Coupled(embed, _loop_loss, generators=[gen]),
        torch.optim.SGD(model.parameters(), lr=0.1),
    )
    start = 0
    if resume is not None:
        gradaccum.loop.load(resume, step)
        start = step.window
    for w in range(start, 3):
        step.add_window(list(_batch(seed=w).chunk(N)))
        step.apply()
        if stop is not None and w + 1 == stop:
            gradaccum.loop.save(path, step)
            return model.w.detach().clone()
    return model.w.detach().clone()


@pytest.mark.parametrize("kind", [k for k, v in SOURCES.items() if v[2]])
@pytest.mark.parametrize("cut", [1, 2])
def test_a_checkpoint_keeps_the_explicit_generators(tmp_path: Any, kind: str, cut: int) -> None:
    """Saved after ``cut`` windows and resumed with a freshly seeded generator: the run is the
    uninterrupted one (before: 0.01-0.03 off, the generator started over)."""
    whole = _train_coupled(SOURCES[kind][0](7), kind)
    _train_coupled(SOURCES[kind][0](7), kind, stop=cut, path=str(tmp_path))
    resumed = _train_coupled(SOURCES[kind][0](7), kind, resume=str(tmp_path))
    torch.testing.assert_close(resumed, whole, rtol=0, atol=0)


def test_a_checkpoint_of_other_generators_is_refused(tmp_path: Any) -> None:
    _train_coupled(torch.Generator().manual_seed(7), "torch-generator", stop=1, path=str(tmp_path))
    model = _Encoder()
    step = Step(
        model, Coupled(_embed_model, _loop_loss), torch.optim.SGD(model.parameters(), lr=0.1)
    )
    with pytest.raises(ValueError, match=r"torch.Generator\(device='cpu'\).*has \[\]"):
        gradaccum.loop.load(str(tmp_path), step)
    assert step.window == 0


def _embed_model(m: Any, x: torch.Tensor) -> torch.Tensor:
    return x @ m.w


def test_a_checkpoint_of_another_bit_generator_is_refused(tmp_path: Any) -> None:
    """numpy Generators of other bit generators (PCG64, MT19937) are other kinds."""
    _train_coupled(np.random.default_rng(7), "numpy-Generator", stop=1, path=str(tmp_path))
    other = np.random.Generator(np.random.MT19937(7))
    model = _Encoder()
    step = Step(
        model,
        Coupled(_embed_model, _loop_loss, generators=[other]),
        torch.optim.SGD(model.parameters(), lr=0.1),
    )
    before = model.w.detach().clone()
    with pytest.raises(ValueError, match=r"Generator\(PCG64\).*Generator\(MT19937\)"):
        gradaccum.loop.load(str(tmp_path), step)
    assert step.window == 0
    assert torch.equal(model.w.detach(), before)


def test_window_stats_drawing_on_some_micro_batches_only_keeps_the_others_fresh() -> None:
    """stats draws only for micro-batch 1 (its data says so); each loss draws a mask. The loss
    of micro-batch 1 replays stats' numbers; the others draw afresh, one after the other, after
    stats' numbers (before: micro-batches 0 and 2 got one mask, and windows repeated masks)."""
    x = _batch()
    x[2:4, 0] = 1000.0  # micro-batch 1
    masks: list[Any] = []

    def special(mb: torch.Tensor) -> bool:
        return bool(mb[0, 0] > 100)

    def stats(p: Any, mb: torch.Tensor) -> torch.Tensor:
        if special(mb):
            return (torch.rand(len(mb)) > 0.5).sum()
        return torch.tensor(len(mb))

    def loss(p: Any, mb: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(len(mb)) > 0.5
        masks.append(keep.tolist())
        return ((mb @ p["w"]).pow(2).sum(-1) * keep).sum() / count

    torch.manual_seed(6)
    step = gradaccum.window_stats(stats, loss, N, reduction="sum")
    for _ in range(2):
        step(_params(), x)
    after = torch.get_rng_state()
    # Plain PyTorch: per window, stats' numbers first, then the other losses' fresh ones.
    torch.manual_seed(6)
    want = []
    for _ in range(2):
        drawn = (torch.rand(2) > 0.5).tolist()
        fresh = [(torch.rand(2) > 0.5).tolist() for _ in range(3)]
        want += [fresh[0], drawn, fresh[1], fresh[2]]
    assert masks == want
    assert torch.equal(after, torch.get_rng_state())


def test_a_small_leaf_redrawn_beside_a_large_one_is_caught_in_bfloat16() -> None:
    calls = [0]

    def embed(p: Any, x: torch.Tensor) -> Any:
        calls[0] += 1
        g = torch.Generator().manual_seed(calls[0])  # another draw in every call
        emb = (x @ p["w"]).repeat(1, 300).to(torch.bfloat16) * 10
        gate = (torch.rand(len(x), 1, generator=g) * 0.1).to(torch.bfloat16)
        return {"emb": emb, "gate": gate}

    def loss(p: Any, reps: Any, rows: Rows) -> torch.Tensor:
        return (reps["emb"].double().sum(-1) * reps["gate"].double()[:, 0]).sum()

    with pytest.raises(GradAccumError, match=r"\['gate'\] of micro-batch"):
        gradaccum.coupled(embed, loss, N)(_params(), _batch())


def test_loop_coupled_takes_a_micro_batch_of_no_rows() -> None:
    """A 0-row micro-batch in loop.Coupled (which takes it): exact, the replay check too."""
    x = _batch()
    model, ref = _Encoder(), _Encoder()
    step = Step(model, Coupled(_embed_model, _loop_loss), torch.optim.SGD(model.parameters(), 1.0))
    step.add_window([x[:3], x[3:3], x[3:]])
    step.apply()
    w = ref.w.detach().clone().requires_grad_()
    (g,) = torch.autograd.grad(_info_nce(None, x @ w, Rows(0, ROWS, ROWS, (ROWS,))), w)
    torch.testing.assert_close(model.w.detach(), ref.w.detach() - g, rtol=1e-12, atol=1e-14)
