"""DP-SGD: per-sample clipping as a micro-batch transform and one Gaussian noise draw per window.

Checked against a plain loop over samples (float64), in one process and on 2 gloo processes:
the clipping bound, the sum, the division by the expected batch size, the noise scale (std
sigma * C / L, drawn once per window, not once per rank), identical noise on every rank, a new
draw each window, and the same draws after resuming from a checkpoint. ``clip_per_sample`` under
each reduction, ragged micro-batches included: ``"mean"`` (the default) gives the mean over the
window's rows of the clipped per-sample gradients, ``"sum"`` their sum, ``"count"`` their sum over
the counts; ``dp_noise`` refuses any reduction but ``"sum"``.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from dist import run, values
from torch.func import grad, vmap

import gradaccum

F64 = torch.float64
C = 1.0  # clipping bound


def sample_loss(params: dict[str, torch.Tensor], sample: Any) -> torch.Tensor:
    x, y = sample
    return (torch.tanh(x @ params["w"]) @ params["v"] - y) ** 2


def make(rows: int = 12, seed: int = 0) -> tuple[dict[str, torch.Tensor], Any]:
    g = torch.Generator().manual_seed(seed)
    params = {
        "w": torch.randn(3, 4, generator=g, dtype=F64),
        "v": torch.randn(4, generator=g, dtype=F64),
    }
    x = torch.randn(rows, 3, generator=g, dtype=F64)
    y = torch.randn(rows, generator=g, dtype=F64) * torch.logspace(-2, 2, rows, dtype=F64)
    return params, (x, y)


def reference(params: dict[str, torch.Tensor], batch: Any, size: float) -> dict[str, torch.Tensor]:
    """Clip each sample's gradient in a Python loop, sum, divide by the expected batch size."""
    x, y = batch
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    for i in range(len(y)):
        g = grad(sample_loss)(params, (x[i], y[i]))
        norm = math.sqrt(sum(float(t.pow(2).sum()) for t in g.values()))
        factor = min(1.0, C / (norm + 1e-6))
        for k in total:
            total[k] += factor * g[k]
    return {k: v / size for k, v in total.items()}


def clipped(params: dict[str, torch.Tensor], batch: Any) -> dict[str, torch.Tensor]:
    """The sum of the clipped per-sample gradients, one sample at a time."""
    return reference(params, batch, 1.0)


def dp_step(n: int, sigma: float, size: float, seed: int = 0) -> Any:
    return gradaccum.accumulate(
        vmap(grad(sample_loss), in_dims=(None, 0)),
        n,
        reduction="sum",
        micro_transform=gradaccum.privacy.clip_per_sample(C),
        sync=gradaccum.privacy.dp_noise(sigma, C, size, seed=seed),
    )


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_clip_per_sample_bounds_each_sample_and_sums() -> None:
    g = torch.Generator().manual_seed(3)
    per_sample = {
        "a": torch.randn(6, 2, 3, generator=g, dtype=F64),
        "b": torch.randn(6, 5, generator=g, dtype=F64),
    }
    scale = torch.tensor([1e-3, 0.1, 0.5, 2.0, 10.0, 1e3], dtype=F64)
    per_sample = {k: v * scale.view(-1, *[1] * (v.dim() - 1)) for k, v in per_sample.items()}
    got = gradaccum.privacy.clip_per_sample(C)(per_sample)
    want = {k: torch.zeros_like(v[0]) for k, v in per_sample.items()}
    for i in range(6):
        norm = math.sqrt(sum(float(v[i].pow(2).sum()) for v in per_sample.values()))
        # Each sample's clipped contribution has norm at most C, and small ones are untouched.
        contribution = min(1.0, C / (norm + 1e-6))
        assert norm * contribution <= C
        if norm < C:
            assert contribution == 1.0
        for k in want:
            want[k] += contribution * per_sample[k][i]
    assert _diff(got, want) < 1e-12


def test_clip_per_sample_errors() -> None:
    with pytest.raises(
        ValueError, match=r"max_norm must be a positive, finite number, got int 0; pass"
    ):
        gradaccum.privacy.clip_per_sample(0)
    clip = gradaccum.privacy.clip_per_sample(1.0)
    with pytest.raises(ValueError, match=r"leaf \['b'\] is .* and the first has 3 rows"):
        clip({"a": torch.zeros(3, 2), "b": torch.zeros(4, 2)})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"noise_multiplier": -1.0}, r"noise_multiplier must be a finite number >= 0"),
        ({"max_norm": 0}, r"max_norm must be a positive, finite number"),
        ({"expected_batch_size": -4}, r"expected_batch_size must be a positive, finite number"),
        ({"seed": 1.5}, r"seed must be an int, the same on every rank"),
    ],
)
def test_dp_noise_errors(kwargs: dict[str, Any], message: str) -> None:
    args = {"noise_multiplier": 1.0, "max_norm": 1.0, "expected_batch_size": 8.0, **kwargs}
    seed = args.pop("seed", 0)
    with pytest.raises(ValueError, match=message):
        gradaccum.privacy.dp_noise(**args, seed=seed)


@pytest.mark.parametrize("n", [1, 3, 4, 12])
def test_without_noise_equals_the_clipped_loop(n: int) -> None:
    params, batch = make()
    got = dp_step(n, 0.0, 16.0)(params, batch)
    assert _diff(got, reference(params, batch, 16.0)) < 1e-12


def test_noise_scale_seed_and_windows() -> None:
    """Zero gradients: the result is the noise alone, std sigma * C / L, a new draw per window."""
    params = {"w": torch.zeros(200_000, dtype=F64)}

    def flat(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return (p["w"] * 0).sum() + x.sum() * 0

    def step(seed: int) -> Any:
        return gradaccum.accumulate(
            vmap(grad(flat), in_dims=(None, 0)),
            2,
            reduction="sum",
            micro_transform=gradaccum.privacy.clip_per_sample(C),
            sync=gradaccum.privacy.dp_noise(2.0, C, 50.0, seed=seed),
        )

    x = torch.zeros(4, 1, dtype=F64)
    s1, s2, other = step(7), step(7), step(8)
    a, b = s1(params, x)["w"], s1(params, x)["w"]  # two windows of one run
    assert abs(float(a.std()) / (2.0 * C / 50.0) - 1) < 0.01
    assert abs(float(a.mean())) < 5 * 2.0 * C / 50.0 / math.sqrt(a.numel())
    assert not torch.equal(a, b)  # a new draw each window
    assert torch.equal(s2(params, x)["w"], a)  # the same seed and window: the same draw
    assert not torch.equal(other(params, x)["w"], a)


def _zero_grad_noise(params: dict[str, torch.Tensor], seed: int = 7, **kw: Any) -> Any:
    """One window of dp_noise(2.0, C, 50.0) over zero gradients: the noise alone."""

    def flat(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return sum((v * 0).sum() for v in p.values()) + x.sum() * 0

    step = gradaccum.accumulate(
        vmap(grad(flat), in_dims=(None, 0)),
        2,
        reduction="sum",
        micro_transform=gradaccum.privacy.clip_per_sample(C),
        sync=gradaccum.privacy.dp_noise(2.0, C, 50.0, seed=seed),
        **kw,
    )
    return step(params, torch.zeros(4, 1, dtype=F64))


def test_noise_is_drawn_on_the_gradients_device_in_their_dtype(monkeypatch: Any) -> None:
    """One draw per (device, dtype) with a generator of that device: no float64 CPU noise."""
    draws: list[tuple[int, torch.dtype, torch.device, torch.device]] = []
    real = torch.randn

    def spy(*shape: Any, generator: Any = None, **k: Any) -> torch.Tensor:
        out = real(*shape, generator=generator, **k)
        if generator is not None:
            draws.append((out.numel(), out.dtype, out.device, generator.device))
        return out

    params = {
        "a": torch.zeros(300, dtype=torch.float32),
        "b": torch.zeros(20, 10, dtype=torch.float32),
        "c": torch.zeros(50, dtype=F64),
        "d": torch.zeros(40, dtype=torch.bfloat16),
    }
    monkeypatch.setattr(torch, "randn", spy)
    noise = _zero_grad_noise(params)
    cpu = torch.device("cpu")
    # The bfloat16 leaf accumulates in float32: one group with a and b, one draw of 540.
    assert sorted(draws) == sorted([(540, torch.float32, cpu, cpu), (50, F64, cpu, cpu)])
    assert {k: v.dtype for k, v in noise.items()} == {k: v.dtype for k, v in params.items()}


def test_noise_of_low_precision_accumulators_is_drawn_in_float32(monkeypatch: Any) -> None:
    draws: list[torch.dtype] = []
    real = torch.randn

    def spy(*shape: Any, generator: Any = None, **k: Any) -> torch.Tensor:
        out = real(*shape, generator=generator, **k)
        if generator is not None:
            draws.append(out.dtype)
        return out

    monkeypatch.setattr(torch, "randn", spy)
    params = {"w": torch.zeros(1000, dtype=torch.bfloat16)}
    noise = _zero_grad_noise(params, accum_dtype=torch.bfloat16)["w"]
    assert draws == [torch.float32]
    assert noise.dtype == torch.bfloat16
    assert abs(float(noise.float().std()) / (2.0 * C / 50.0) - 1) < 0.1


def test_noise_of_float32_gradients_has_the_scale_and_groups_are_independent() -> None:
    params = {"a": torch.zeros(100_000), "b": torch.zeros(100_000, dtype=F64)}
    noise = _zero_grad_noise(params)
    for v in noise.values():
        assert abs(float(v.std()) / (2.0 * C / 50.0) - 1) < 0.02
    # Two groups of the same size: independent draws, not one sequence twice.
    a, b = noise["a"].double(), noise["b"]
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.02
    again = _zero_grad_noise(params)
    assert all(torch.equal(noise[k], again[k]) for k in noise)  # the same seed and window


def test_checkpointed_accumulator_resumes_the_same_noise(tmp_path: Any) -> None:
    params, batch = make(rows=8)
    x, y = batch
    per_sample = vmap(grad(sample_loss), in_dims=(None, 0))
    clip = gradaccum.privacy.clip_per_sample(C)

    def run_windows(acc: gradaccum.Accumulator, state: Any, windows: range) -> tuple[list, Any]:
        out = []
        for _ in windows:
            for i in range(2):
                mb = (x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4])
                state = acc.add(state, clip(per_sample(params, mb)), size=4)
            g, state = acc.finalize(state)
            out.append(g)
        return out, state

    make_acc = lambda: gradaccum.Accumulator(  # noqa: E731
        2, reduction="sum", sync=gradaccum.privacy.dp_noise(1.0, C, 8.0, seed=3)
    )
    acc = make_acc()
    whole, _ = run_windows(acc, acc.init(params), range(3))
    acc = make_acc()
    first, state = run_windows(acc, acc.init(params), range(1))
    assert state.reduce_state == 1
    torch.save(acc.state_dict(state), tmp_path / "acc.pt")
    acc = make_acc()
    state = acc.load_state_dict(
        acc.init(params), torch.load(tmp_path / "acc.pt", weights_only=True)
    )
    rest, _ = run_windows(acc, state, range(2))
    for g, h in zip(whole, first + rest, strict=True):
        assert all(torch.equal(g[k], h[k]) for k in g)


# -- clip_per_sample under each reduction ------------------------------------------------------

PER_SAMPLE = vmap(grad(sample_loss), in_dims=(None, 0))


def _ragged(batch: Any, sizes: list[int]) -> gradaccum.MicroBatches[Any]:
    x, y = batch
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    return gradaccum.MicroBatches([(x[e - k : e], y[e - k : e]) for e, k in zip(ends, sizes)])


@pytest.mark.parametrize("split", [1, 3, 4, 11, [1, 7, 3], [6, 5]])
@pytest.mark.parametrize("reduction", ["mean", "sum", "count"])
def test_clip_per_sample_under_each_reduction(reduction: str, split: Any) -> None:
    params, batch = make(rows=11)
    total = clipped(params, batch)
    # Not vacuous: clipping changes the sum, so a wrong weighting cannot pass.
    assert _diff(total, grad(lambda p, b: sample_loss(p, b).sum())(params, batch)) > 0.1
    want = total if reduction == "sum" else {k: v / 11 for k, v in total.items()}
    kwargs: dict[str, Any] = {}
    step_fn: Any = PER_SAMPLE
    if reduction == "count":  # the summed loss of the micro-batch covers one item per row
        kwargs = {"has_aux": True, "count": lambda rows: rows}
        step_fn = lambda p, b: (PER_SAMPLE(p, b), len(b[1]))  # noqa: E731
    step = gradaccum.accumulate(
        step_fn,
        split if isinstance(split, int) else len(split),
        reduction=reduction,  # type: ignore[arg-type]
        micro_transform=gradaccum.privacy.clip_per_sample(C),
        **kwargs,
    )
    given = batch if isinstance(split, int) else _ragged(batch, split)
    got = step(params, given)
    got = got[0] if reduction == "count" else got
    assert _diff(got, want) < 1e-12


def test_the_default_reduction_is_the_clipped_mean() -> None:
    """The issue's probe: under "mean", neither the clipped mean nor the clipped sum came out."""
    params, batch = make(rows=12)
    step = gradaccum.accumulate(PER_SAMPLE, 3, micro_transform=gradaccum.privacy.clip_per_sample(C))
    want = {k: v / 12 for k, v in clipped(params, batch).items()}
    assert _diff(step(params, batch), want) < 1e-12


def test_a_transform_of_yours_marked_sums_rows_gives_the_mean() -> None:
    params, batch = make(rows=11)
    clip = gradaccum.privacy.clip_per_sample(C)

    def clip_and_sum(per_sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return clip(per_sample)

    want = {k: v / 11 for k, v in clipped(params, batch).items()}
    # Unmarked, its output is weighted as a micro-batch's mean would be, by its rows: with one
    # row per micro-batch that is the same mean, with more it is not.
    unmarked = gradaccum.accumulate(PER_SAMPLE, 11, micro_transform=clip_and_sum)
    assert _diff(unmarked(params, batch), want) < 1e-12
    unmarked = gradaccum.accumulate(PER_SAMPLE, 3, micro_transform=clip_and_sum)
    assert _diff(unmarked(params, batch), want) > 1e-3
    clip_and_sum.sums_rows = True  # type: ignore[attr-defined]
    marked = gradaccum.accumulate(PER_SAMPLE, 3, micro_transform=clip_and_sum)
    assert _diff(marked(params, batch), want) < 1e-12


def test_clip_per_sample_under_mean_needs_one_sample_per_row() -> None:
    params, batch = make(rows=6)

    def twice_per_row(p: dict[str, torch.Tensor], b: Any) -> dict[str, torch.Tensor]:
        x, y = b
        return PER_SAMPLE(p, (torch.cat([x, x]), torch.cat([y, y])))

    clip = gradaccum.privacy.clip_per_sample(C)
    step = gradaccum.accumulate(twice_per_row, 2, micro_transform=clip)
    message = (
        "accumulate(twice_per_row, n=2)(...): with reduction='mean', "
        "micro_transform=clip_per_sample(1) sums over the micro-batch's samples, one per row, "
        "so the window's gradient is their mean over the rows; but step_fn returned gradients "
        "with 6 samples (leading dim) for a micro-batch of 3 rows. Return one gradient per row, "
        "e.g. torch.func.vmap(torch.func.grad(loss_of_one), in_dims=(None, 0)), or pass "
        "reduction='sum' (the clipped sum) and divide it yourself."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        step(params, batch)
    # Under "sum" the samples are whatever the step function returns: each row counted twice.
    step = gradaccum.accumulate(twice_per_row, 2, reduction="sum", micro_transform=clip)
    assert _diff(step(params, batch), {k: 2 * v for k, v in clipped(params, batch).items()}) < 1e-12


def _dp_refusal(where: str, reduction: str) -> str:
    return (
        f"{where}: sync=dp_noise(noise_multiplier=0, max_norm=1) needs reduction='sum', got "
        f"reduction='{reduction}': DP-SGD adds the noise to the sum of the clipped per-sample "
        f"gradients and divides by the expected batch size itself, so the window must hold that "
        f"sum (a mean or count would be divided twice, and the noise would not match the "
        f"clipping). Pass reduction='sum', and sum the clipped per-sample gradients: "
        f"micro_transform=gradaccum.privacy.clip_per_sample(max_norm)."
    )


def test_dp_noise_refuses_mean_and_count() -> None:
    params, batch = make(rows=8)
    clip = gradaccum.privacy.clip_per_sample(C)
    noise = gradaccum.privacy.dp_noise(0.0, C, 8.0)
    assert repr(noise) == "dp_noise(noise_multiplier=0, max_norm=1)"
    step = gradaccum.accumulate(PER_SAMPLE, 2, micro_transform=clip, sync=noise)
    with pytest.raises(
        ValueError, match=re.escape(_dp_refusal("accumulate(sample_loss, n=2)(...)", "mean"))
    ):
        step(params, batch)
    assert noise.state is None  # no window was reduced

    def with_rows(p: dict[str, torch.Tensor], b: Any) -> tuple[Any, int]:
        return PER_SAMPLE(p, b), len(b[1])

    step = gradaccum.accumulate(
        with_rows,
        2,
        reduction="count",
        has_aux=True,
        count=lambda r: r,
        micro_transform=clip,
        sync=noise,
    )
    with pytest.raises(
        ValueError, match=re.escape(_dp_refusal("accumulate(with_rows, n=2)(...)", "count"))
    ):
        step(params, batch)
    acc = gradaccum.Accumulator(2, sync=noise)
    state = acc.init(params)
    with pytest.raises(
        ValueError, match=re.escape(_dp_refusal("Accumulator.add(state, grads)", "mean"))
    ):
        acc.add(state, clip(PER_SAMPLE(params, batch)), size=8)
    # Under "sum" it is the clipped sum over the expected batch size.
    step = gradaccum.accumulate(PER_SAMPLE, 2, reduction="sum", micro_transform=clip, sync=noise)
    assert _diff(step(params, batch), reference(params, batch, 8.0)) < 1e-12


# -- 2 processes -----------------------------------------------------------------------------------


def _two_ranks(rank: int, world: int) -> dict[str, Any]:
    params, batch = make(rows=12)
    x, y = batch
    mine = (x[:7], y[:7]) if rank == 0 else (x[7:], y[7:])  # unequal rows
    exact = _diff(dp_step(3, 0.0, 16.0)(params, mine), reference(params, batch, 16.0))
    zero = {"w": torch.zeros(100_000, dtype=F64)}

    def flat(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return (p["w"] * 0).sum() + x.sum() * 0

    step = gradaccum.accumulate(
        vmap(grad(flat), in_dims=(None, 0)),
        2,
        reduction="sum",
        micro_transform=gradaccum.privacy.clip_per_sample(C),
        sync=gradaccum.privacy.dp_noise(1.5, C, 10.0, seed=5),
    )
    with gradaccum.sync.record_collectives() as log:
        noise = step(zero, torch.zeros(4, 1, dtype=F64))["w"]
    return {
        "exact": exact,
        "noise": noise,
        "kinds": [(c.kind, c.purpose) for c in log],
    }


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_two_ranks_sum_exactly_and_add_the_same_noise_once() -> None:
    r0, r1 = values(run(_two_ranks))
    assert r0["exact"] < 1e-12, r0["exact"]
    assert r1["exact"] < 1e-12, r1["exact"]
    assert torch.equal(r0["noise"], r1["noise"])  # identical on every rank
    # Added once after the sum, not once per rank: std sigma * C / L, not sqrt(2) times that.
    assert abs(float(r0["noise"].std()) / (1.5 * C / 10.0) - 1) < 0.015
    assert r0["kinds"] == [("all_reduce", "weight"), ("all_reduce", "gradients")]


def _two_ranks_reductions(rank: int, world: int) -> dict[str, Any]:
    params, batch = make(rows=12)
    x, y = batch
    clip = gradaccum.privacy.clip_per_sample(C)
    out: dict[str, Any] = {}
    for split in (7, 12):  # rows of rank 0: uneven, and rank 1 empty
        mine = (x[:split], y[:split]) if rank == 0 else (x[split:], y[split:])
        for n in (1, 3):
            mean = gradaccum.accumulate(
                PER_SAMPLE, n, micro_transform=clip, sync=gradaccum.all_reduce()
            )
            summed = gradaccum.accumulate(
                PER_SAMPLE, n, reduction="sum", micro_transform=clip, sync=gradaccum.all_reduce()
            )
            out[f"mean {split} n={n}"] = _diff(mean(params, mine), reference(params, batch, 12.0))
            out[f"sum {split} n={n}"] = _diff(summed(params, mine), clipped(params, batch))
    # Ragged micro-batches of each rank's own sizes, under dp_noise with sigma 0.
    mine = _ragged((x[:7], y[:7]), [1, 4, 2]) if rank == 0 else _ragged((x[7:], y[7:]), [5])
    noise = gradaccum.privacy.dp_noise(0.0, C, 16.0)
    step = gradaccum.accumulate(PER_SAMPLE, 3, reduction="sum", micro_transform=clip, sync=noise)
    out["dp_noise ragged"] = _diff(step(params, mine), reference(params, batch, 16.0))
    # dp_noise under "mean": refused on every rank before any collective; the next call works.
    step = gradaccum.accumulate(PER_SAMPLE, 2, micro_transform=clip, sync=noise)
    try:
        step(params, mine)
        out["refused"] = None
    except ValueError as err:
        out["refused"] = str(err)
    step = gradaccum.accumulate(PER_SAMPLE, 2, reduction="sum", micro_transform=clip, sync=noise)
    out["after"] = _diff(step(params, mine), reference(params, batch, 16.0))
    return out


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_two_ranks_clip_per_sample_mean_and_sum_equal_the_loop() -> None:
    for rank, out in enumerate(values(run(_two_ranks_reductions))):
        diffs = {k: v for k, v in out.items() if k not in ("refused",)}
        assert len(diffs) == 2 * 2 * 2 + 2
        bad = {k: v for k, v in diffs.items() if not v < 1e-12}
        assert not bad, (rank, bad)
        assert out["refused"] == _dp_refusal("accumulate(sample_loss, n=2)(...)", "mean"), rank
