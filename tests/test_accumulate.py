"""Equivalence of ``accumulate`` with the whole-batch gradient, in float64."""

from __future__ import annotations

import weakref

import pytest
import torch
from models import (
    F64,
    max_diff,
    mean_loss,
    mlp_params,
    predict,
    regression_batch,
    sum_loss,
    token_batch,
    token_count_step,
    token_mean_loss,
)
from torch.func import functional_call, grad, grad_and_value, vmap

import gradaccum

TIGHT = 1e-12


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("kind", ["dict", "nested", "namedtuple"])
@pytest.mark.parametrize("rows", [24, 26])  # 26: n does not divide it (uneven split) except 1, 2
def test_mean_equals_whole_batch(n: int, kind: str, rows: int) -> None:
    params, batch = mlp_params(kind=kind), regression_batch(rows)
    ref = grad(mean_loss)(params, batch)
    got = gradaccum.accumulate(grad(mean_loss), n)(params, batch)
    assert type(got) is type(ref)
    assert max_diff(got, ref) < TIGHT


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_sum_equals_whole_batch(n: int) -> None:
    params, batch = mlp_params(), regression_batch(26)
    ref = grad(sum_loss)(params, batch)
    got = gradaccum.accumulate(grad(sum_loss), n, reduction="sum")(params, batch)
    assert max_diff(got, ref) < TIGHT


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_count_equals_whole_batch_token_mean(n: int) -> None:
    params, batch = mlp_params(), token_batch(16)
    ref_grads, ref_loss = grad_and_value(token_mean_loss)(params, batch)
    step = token_count_step(n, aux_reduction=("count", "sum"))
    grads, (loss, tokens) = step(params, batch)
    assert max_diff(grads, ref_grads) < TIGHT
    assert abs(float(loss - ref_loss)) < TIGHT
    assert float(tokens) == float(batch["mask"].sum())


def test_mean_of_micro_batch_token_means_is_not_the_token_mean() -> None:
    # The field's classic bug, which reduction="count" avoids: the check above is not vacuous.
    params, batch = mlp_params(), token_batch(16)
    ref = grad(token_mean_loss)(params, batch)
    naive = gradaccum.accumulate(grad(token_mean_loss), 4)(params, batch)
    assert max_diff(naive, ref) > 1e-4


@pytest.mark.parametrize("n", [1, 3, 8])
def test_aux_reductions(n: int) -> None:
    params, batch = mlp_params(), regression_batch(24)

    def step(params, batch):
        g, loss = grad_and_value(mean_loss)(params, batch)
        pred = predict(params, batch[0])
        aux = {
            "loss": loss,
            "pred": pred,
            "rows": batch[0].shape[0],
            "per_mb": loss,
            "last_x": batch[0][-1],
            "sum_sq": (pred**2).sum(),
        }
        return g, aux

    spec = {
        "loss": "mean",
        "pred": "concat",
        "rows": "sum",
        "per_mb": "stack",
        "last_x": "last",
        "sum_sq": "sum",
    }
    grads, aux = gradaccum.accumulate(step, n, has_aux=True, aux_reduction=spec)(params, batch)
    ref_grads, ref_loss = grad_and_value(mean_loss)(params, batch)
    pred = predict(params, batch[0])
    assert max_diff(grads, ref_grads) < TIGHT
    assert abs(float(aux["loss"] - ref_loss)) < TIGHT
    assert torch.allclose(aux["pred"], pred, rtol=0, atol=TIGHT)
    assert aux["rows"] == 24
    assert aux["per_mb"].shape == (n,)
    assert torch.equal(aux["last_x"], batch[0][-1])
    assert abs(float(aux["sum_sq"] - (pred**2).sum())) < TIGHT


def test_default_aux_reduction_follows_reduction() -> None:
    params, batch = mlp_params(), regression_batch(26)
    _, loss = gradaccum.accumulate(grad_and_value(mean_loss), 4, has_aux=True)(params, batch)
    assert abs(float(loss - mean_loss(params, batch))) < TIGHT
    _, loss = gradaccum.accumulate(grad_and_value(sum_loss), 4, has_aux=True, reduction="sum")(
        params, batch
    )
    assert abs(float(loss - sum_loss(params, batch))) < TIGHT


@pytest.mark.parametrize("sizes", [[1, 5, 2], [7], [3, 3, 3, 1], [10, 1]])
def test_ragged_micro_batches(sizes: list[int]) -> None:
    params, (x, y) = mlp_params(), regression_batch(sum(sizes))
    mbs = gradaccum.MicroBatches(list(zip(x.split(sizes), y.split(sizes))))
    ref = grad(mean_loss)(params, (x, y))
    # n is the split count for plain batches; a MicroBatches is used as given.
    got = gradaccum.accumulate(grad(mean_loss), 2)(params, mbs)
    assert max_diff(got, ref) < TIGHT


def test_uneven_split_sizes() -> None:
    seen = []

    def step(params, batch):
        seen.append(batch[0].shape[0])
        return grad(mean_loss)(params, batch)

    gradaccum.accumulate(step, 4)(mlp_params(), regression_batch(10))
    assert seen == [3, 3, 2, 2]


def test_even_split_yields_views_and_passes_non_tensor_leaves() -> None:
    x = torch.arange(12.0, dtype=F64).reshape(6, 2)
    got = []

    def step(params, batch):
        got.append(batch)
        return {"w": torch.zeros(2, dtype=F64)}

    gradaccum.accumulate(step, 3)({"w": torch.zeros(2, dtype=F64)}, {"x": x, "tag": "train"})
    assert [b["tag"] for b in got] == ["train"] * 3
    assert all(b["x"].untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for b in got)
    assert torch.equal(torch.cat([b["x"] for b in got]), x)


def test_extra_args_kwargs_argnums_and_batch_argnum() -> None:
    params, batch = mlp_params(), regression_batch(12)

    def loss(scale, params, batch, offset, *, power):
        x, y = batch
        return scale * ((predict(params, x) + offset - y).abs() ** power).mean()

    scale = torch.tensor(1.5, dtype=F64)
    ref = grad(loss, argnums=(0, 1))(scale, params, batch, 0.25, power=2)
    step = gradaccum.accumulate(grad(loss, argnums=(0, 1)), 3, argnums=(0, 1), batch_argnum=2)
    got = step(scale, params, batch, 0.25, power=2)
    assert max_diff(got, ref) < TIGHT


def test_composes_with_functional_call_on_a_module() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    model = model.to(F64)
    params = gradaccum.params_of(model)
    x, y = regression_batch(20)

    def loss(params, batch):
        x, y = batch
        return ((functional_call(model, params, (x,)).squeeze(-1) - y) ** 2).mean()

    ref = grad(loss)(params, (x, y))
    got = gradaccum.accumulate(grad(loss), 5)(params, (x, y))
    assert max_diff(got, ref) < TIGHT


def test_composes_with_vmap_per_sample_gradients() -> None:
    # Per-sample gradients by vmap inside the step, clipped per sample, then averaged (the
    # DP-SGD shape). Clipping is per sample, so accumulation stays exact.
    params, batch = mlp_params(), regression_batch(24)

    def per_sample_loss(params, x, y):
        return (predict(params, x[None]) - y[None]).pow(2).sum()

    def clipped_mean_grad(params, batch):
        x, y = batch
        g = vmap(grad(per_sample_loss), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.sqrt(sum(v.reshape(len(v), -1).pow(2).sum(1) for v in g.values()))
        factor = (1.0 / norms).clamp(max=1.0)
        return {k: (v * factor.view(-1, *[1] * (v.dim() - 1))).mean(0) for k, v in g.items()}

    ref = clipped_mean_grad(params, batch)
    got = gradaccum.accumulate(clipped_mean_grad, 4)(params, batch)
    assert max_diff(got, ref) < TIGHT


def test_accumulate_composes_with_itself() -> None:
    params, batch = mlp_params(), regression_batch(36)
    ref = grad(mean_loss)(params, batch)
    inner = gradaccum.accumulate(grad(mean_loss), 2)
    got = gradaccum.accumulate(inner, 3)(params, batch)
    assert max_diff(got, ref) < TIGHT
    assert gradaccum.accumulate(inner, 3).__name__ == inner.__name__  # wraps keeps metadata


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_accumulates_in_float32(dtype: torch.dtype) -> None:
    # Seven additions of a tiny value to 1.0 are each lost in 16-bit arithmetic (its step at
    # 1.0 is 2**-7 for bfloat16, 2**-10 for float16); a float32 accumulator keeps them.
    tiny = 2.0**-9 if dtype == torch.bfloat16 else 2.0**-12
    calls = iter([1.0] + [tiny] * 7)

    def step(params, batch):
        return {"w": torch.full((3,), next(calls), dtype=dtype)}

    params = {"w": torch.zeros(3, dtype=dtype)}
    got = gradaccum.accumulate(step, 8, reduction="sum")(params, torch.zeros(8, 1))
    assert got["w"].dtype == dtype
    expected = torch.tensor(1.0 + 7 * tiny, dtype=torch.float32).to(dtype)
    assert torch.equal(got["w"], torch.full((3,), float(expected), dtype=dtype))
    assert float(expected) != 1.0
    calls = iter([1.0] + [tiny] * 7)
    lossy = gradaccum.accumulate(step, 8, reduction="sum", accum_dtype=dtype)(
        params, torch.zeros(8, 1)
    )
    assert torch.equal(lossy["w"], torch.ones(3, dtype=dtype))


def test_no_autograd_graph_or_micro_batch_tensor_outlives_its_micro_batch() -> None:
    params, batch = mlp_params(), regression_batch(32)
    alive: list[weakref.ref[torch.Tensor]] = []

    def step(params, batch):
        # Nothing the previous micro-batch produced (gradients, aux, activations) is alive.
        assert all(r() is None for r in alive), "a previous micro-batch's tensor is alive"
        params = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        loss = mean_loss(params, batch)
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
        out = dict(zip(params, grads, strict=True))
        alive.extend(weakref.ref(t) for t in (*grads, loss))
        return out, loss  # grads and loss both carry an autograd graph

    grads, loss = gradaccum.accumulate(step, 8, has_aux=True)(params, batch)
    assert not loss.requires_grad
    assert all(not g.requires_grad and g.grad_fn is None for g in grads.values())
    assert max_diff(grads, grad(mean_loss)(params, batch)) < TIGHT


def test_n_equal_one_goes_through_the_accumulator() -> None:
    params, batch = mlp_params(), regression_batch(4)
    out = {}

    def step(params, batch):
        out["g"] = grad(mean_loss)(params, batch)
        return out["g"]

    got = gradaccum.accumulate(step, 1)(params, batch)
    assert max_diff(got, out["g"]) == 0.0
    assert all(got[k] is not out["g"][k] for k in got)  # a new buffer, not step_fn's tensor


def test_compiled_step_matches_eager() -> None:
    params, batch = mlp_params(), regression_batch(24)
    ref = gradaccum.accumulate(grad(mean_loss), 4)(params, batch)
    compiled = torch.compile(grad(mean_loss), backend="aot_eager")
    got = gradaccum.accumulate(compiled, 4)(params, batch)
    assert max_diff(got, ref) < TIGHT


@pytest.mark.slow  # compiles (6 s); test_compiled_step_matches_eager stays in the fast tier
def test_compiling_the_accumulated_function_matches_eager_without_graph_breaks() -> None:
    params, batch = mlp_params(), regression_batch(24)
    ref = gradaccum.accumulate(grad(mean_loss), 4)(params, batch)
    torch._dynamo.reset()
    step = gradaccum.accumulate(grad(mean_loss), 4)
    explanation = torch._dynamo.explain(step)(params, batch)
    assert explanation.graph_break_count == 0
    got = torch.compile(step, backend="aot_eager")(params, batch)
    assert max_diff(got, ref) < TIGHT


@pytest.mark.slow  # three compiles (12 s)
def test_compiled_accumulated_function_survives_dynamic_then_uneven_batches() -> None:
    params = mlp_params()
    torch._dynamo.reset()
    step = torch.compile(gradaccum.accumulate(grad(mean_loss), 4), backend="aot_eager")
    for rows in (64, 62, 61, 64):  # 62 makes Dynamo go dynamic; 61 and 62 split unevenly
        batch = regression_batch(rows)
        assert max_diff(step(params, batch), grad(mean_loss)(params, batch)) < TIGHT


def test_count_leaf_reports_the_total_by_default() -> None:
    params, batch = mlp_params(), token_batch(16)
    step = token_count_step(4)
    _, (loss, tokens) = step(params, batch)
    assert float(tokens) == float(batch["mask"].sum())
    assert abs(float(loss - token_mean_loss(params, batch))) < TIGHT


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_nested_accumulate_is_exact_under_mean_and_sum(reduction: str) -> None:
    # Under "count" nesting is refused (tests/test_misuse.py): the inner result is normalised.
    params, batch = mlp_params(), regression_batch(24)
    loss = mean_loss if reduction == "mean" else sum_loss
    inner = gradaccum.accumulate(grad(loss), 3, reduction=reduction)
    got = gradaccum.accumulate(inner, 2, reduction=reduction)(params, batch)
    assert max_diff(got, grad(loss)(params, batch)) < TIGHT
