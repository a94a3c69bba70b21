"""gradaccum.grad / grad_and_value: torch.func's results on torch.autograd, and accumulate's fast
path (backward straight into the accumulator), against the whole-batch reference in float64."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import (
    F64,
    max_diff,
    mean_loss,
    mlp_params,
    regression_batch,
    sum_loss,
    token_batch,
    token_mean_loss,
    token_sum_loss,
)
from test_misuse import raises
from torch.func import functional_call

import gradaccum

KINDS = ["dict", "nested", "namedtuple"]


# -- called on their own: what torch.func returns -------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_grad_and_value_equal_torch_func(kind: str) -> None:
    params, batch = mlp_params(kind=kind), regression_batch(9)
    ours = gradaccum.grad(mean_loss)(params, batch)
    assert max_diff(ours, torch.func.grad(mean_loss)(params, batch)) == 0
    g, v = gradaccum.grad_and_value(mean_loss)(params, batch)
    rg, rv = torch.func.grad_and_value(mean_loss)(params, batch)
    assert max_diff(g, rg) == 0
    assert torch.equal(v, rv)
    assert not v.requires_grad
    assert all(not t.requires_grad for t in torch.utils._pytree.tree_leaves(g))


def test_has_aux_and_argnums_tuple() -> None:
    params, tok = mlp_params(), token_batch(8)
    g, (loss, count) = gradaccum.grad_and_value(token_sum_loss, has_aux=True)(params, tok)
    rg, (rloss, rcount) = torch.func.grad_and_value(token_sum_loss, has_aux=True)(params, tok)
    assert max_diff(g, rg) == 0
    assert torch.equal(loss, rloss)
    assert torch.equal(count, rcount)
    g, aux = gradaccum.grad(token_sum_loss, has_aux=True)(params, tok)
    assert max_diff(g, rg) == 0
    assert torch.equal(aux, rcount)

    def two(a: Any, b: Any, x: torch.Tensor) -> torch.Tensor:
        return (x @ a["w"] * b).sum()

    a, b, x = {"w": torch.randn(3, dtype=F64)}, torch.tensor(2.0, dtype=F64), torch.randn(4, 3)
    ours = gradaccum.grad(two, argnums=(0, 1))(a, b, x.to(F64))
    ref = torch.func.grad(two, argnums=(0, 1))(a, b, x.to(F64))
    assert isinstance(ours, tuple)
    assert max_diff(ours, ref) == 0


def test_unused_params_get_zero_gradients_like_torch_func() -> None:
    params = {**mlp_params(), "unused": torch.ones(3, dtype=F64)}
    batch = regression_batch(6)
    g = gradaccum.grad(mean_loss)(params, batch)
    assert max_diff(g, torch.func.grad(mean_loss)(params, batch)) == 0
    assert torch.equal(g["unused"], torch.zeros(3, dtype=F64))
    g = gradaccum.grad(lambda p, b: torch.tensor(1.0))(params, batch)  # no dependence at all
    assert all(torch.equal(t, torch.zeros_like(t)) for t in g.values())
    for n in (1, 3):  # and inside accumulate's fast path
        g = gradaccum.accumulate(gradaccum.grad(mean_loss), n)(params, batch)
        assert max_diff(g, torch.func.grad(mean_loss)(params, batch)) < 1e-15
        g = gradaccum.accumulate(gradaccum.grad(lambda p, b: torch.tensor(1.0)), n)(params, batch)
        assert all(torch.equal(t, torch.zeros_like(t)) for t in g.values())


def test_returned_gradients_stay_valid_after_the_next_window() -> None:
    params = mlp_params()
    step = gradaccum.accumulate(gradaccum.grad(mean_loss), 2)
    first = step(params, regression_batch(6, seed=1))
    kept = {k: v.clone() for k, v in first.items()}
    step(params, regression_batch(6, seed=2))
    assert max_diff(first, kept) == 0


def test_module_parameters_and_their_grad_are_left_alone() -> None:
    model = torch.nn.Linear(3, 2).double()

    def loss_fn(p: Any, x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x,)).pow(2).sum()

    params = dict(model.named_parameters())  # nn.Parameters, requires_grad=True
    x = torch.randn(8, 3, dtype=F64)
    g = gradaccum.grad(loss_fn)(params, x)
    assert all(not t.requires_grad for t in g.values())
    assert max_diff(g, torch.func.grad(loss_fn)(gradaccum.params_of(model), x)) < 1e-15
    step = gradaccum.accumulate(gradaccum.grad(loss_fn), 4, reduction="sum")
    assert max_diff(step(params, x), g) < 1e-14
    assert all(p.grad is None for p in model.parameters())


# -- inside accumulate: the fast path -------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3, 4, 13])
@pytest.mark.parametrize("kind", KINDS)
def test_accumulate_fast_path_equals_the_whole_batch(n: int, kind: str) -> None:
    params, reg, tok = mlp_params(kind=kind), regression_batch(13), token_batch(13)
    step = gradaccum.accumulate(gradaccum.grad_and_value(mean_loss), n, has_aux=True)
    g, loss = step(params, reg)
    rg, rloss = torch.func.grad_and_value(mean_loss)(params, reg)
    assert max_diff(g, rg) < 1e-14
    assert abs(float(loss - rloss)) < 1e-14
    step = gradaccum.accumulate(gradaccum.grad(sum_loss), n, reduction="sum")
    assert max_diff(step(params, reg), torch.func.grad(sum_loss)(params, reg)) < 1e-12
    step = gradaccum.accumulate(
        gradaccum.grad_and_value(token_sum_loss, has_aux=True),
        n,
        has_aux=True,
        reduction="count",
        count=lambda aux: aux[1],
    )
    g, (loss, count) = step(params, tok)
    assert max_diff(g, torch.func.grad(token_mean_loss)(params, tok)) < 1e-14
    assert float(count) == float(tok["mask"].sum())


def test_fast_path_micro_batches_and_argnums_tuple() -> None:
    params, reg = mlp_params(), regression_batch(10)
    micro = gradaccum.MicroBatches([tuple(t[:3] for t in reg), tuple(t[3:] for t in reg)])
    step = gradaccum.accumulate(gradaccum.grad(mean_loss), 5)
    assert max_diff(step(params, micro), torch.func.grad(mean_loss)(params, reg)) < 1e-14

    def loss2(a: Any, batch: Any, b: Any) -> torch.Tensor:
        return mean_loss({**a, **b}, batch)

    a = {k: params[k] for k in ("w1", "b1")}
    b = {k: params[k] for k in ("w2", "b2")}
    step = gradaccum.accumulate(
        gradaccum.grad(loss2, argnums=(0, 2)), 3, argnums=(0, 2), batch_argnum=1
    )
    ref = torch.func.grad(loss2, argnums=(0, 2))(a, reg, b)
    assert max_diff(step(a, reg, b), ref) < 1e-14
    # accumulate takes argnums from the gradient function when not given.
    step = gradaccum.accumulate(gradaccum.grad(loss2, argnums=(0, 2)), 3, batch_argnum=1)
    assert max_diff(step(a, reg, b), ref) < 1e-14


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), n=st.integers(1, 12), reduction=st.sampled_from(["mean", "sum"]))
def test_fast_path_equals_the_generic_path_for_any_split(rows: int, n: int, reduction: str) -> None:
    n = min(n, rows)
    params, reg = mlp_params(), regression_batch(rows, seed=rows)
    loss = mean_loss if reduction == "mean" else sum_loss
    fast = gradaccum.accumulate(gradaccum.grad(loss), n, reduction=reduction)
    generic = gradaccum.accumulate(torch.func.grad(loss), n, reduction=reduction)
    assert max_diff(fast(params, reg), generic(params, reg)) < 1e-12
    assert max_diff(fast(params, reg), torch.func.grad(loss)(params, reg)) < 1e-12


def test_low_precision_params_accumulate_in_float32() -> None:
    # bfloat16 params, float32 sums: the hook path (not .grad in place). It must match the
    # generic path, which adds each micro-batch's bfloat16 gradient into a float32 sum.
    params = {k: v.to(torch.bfloat16) for k, v in mlp_params().items()}
    x, y = regression_batch(16)
    batch = (x.to(torch.bfloat16), y.to(torch.bfloat16))
    fast = gradaccum.accumulate(gradaccum.grad(mean_loss), 4)(params, batch)
    generic = gradaccum.accumulate(torch.func.grad(mean_loss), 4)(params, batch)
    assert all(v.dtype == torch.bfloat16 for v in fast.values())
    assert (
        max_diff(
            {k: v.float() for k, v in fast.items()}, {k: v.float() for k, v in generic.items()}
        )
        < 1e-2
    )


def test_compiled_loss_inside_the_fast_path() -> None:
    params, reg = mlp_params(), regression_batch(12)
    torch._dynamo.reset()
    compiled = torch.compile(mean_loss, backend="aot_eager")
    step = gradaccum.accumulate(gradaccum.grad_and_value(compiled), 4, has_aux=True)
    g, loss = step(params, reg)
    rg, rloss = torch.func.grad_and_value(mean_loss)(params, reg)
    assert max_diff(g, rg) < 1e-14
    assert abs(float(loss - rloss)) < 1e-14


def test_compiling_the_accumulated_function_runs_the_window_eagerly() -> None:
    # torch.compile cannot trace autograd hooks and .grad writes: the window falls back to eager
    # (compile the loss function instead, as above), and the result is still right.
    params, reg = mlp_params(), regression_batch(12)
    torch._dynamo.reset()
    step = torch.compile(gradaccum.accumulate(gradaccum.grad(mean_loss), 4), backend="aot_eager")
    assert max_diff(step(params, reg), torch.func.grad(mean_loss)(params, reg)) < 1e-14


def test_compiling_a_fast_path_step_does_not_spoil_later_compiles() -> None:
    # The eager window of a gradaccum.grad step is a clean graph break: Dynamo must not skip the
    # accumulated function's code for good, or a later fullgraph compile of a torch.func step
    # (traceable) would run the window eagerly and fail on the fast path.
    params, reg = mlp_params(), regression_batch(12)
    torch._dynamo.reset()
    first = torch.compile(gradaccum.accumulate(gradaccum.grad(mean_loss), 4), backend="aot_eager")
    want = torch.func.grad(mean_loss)(params, reg)
    assert max_diff(first(params, reg), want) < 1e-14

    def tensor_loss(w: torch.Tensor, batch: Any) -> torch.Tensor:
        x, y = batch
        return ((x @ w - y) ** 2).mean()

    w, x = torch.ones(5, dtype=torch.float64), reg[0]
    second = torch.compile(
        gradaccum.accumulate(torch.func.grad(tensor_loss), 4), backend="aot_eager", fullgraph=True
    )
    want = torch.func.grad(tensor_loss)(w, (x, reg[1]))
    assert float((second(w, (x, reg[1])) - want).abs().max()) < 1e-14


def test_an_error_mid_window_leaves_nothing_behind() -> None:
    params, reg = mlp_params(), regression_batch(8)
    calls = [0]

    def fails_on_micro_batch_3(p: Any, b: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("boom in micro-batch 3")
        return mean_loss(p, b)

    step = gradaccum.accumulate(gradaccum.grad(fails_on_micro_batch_3), 4)
    with pytest.raises(RuntimeError, match="boom"):
        step(params, reg)
    assert max_diff(step(params, reg), torch.func.grad(mean_loss)(params, reg)) < 1e-14
    assert all(not v.requires_grad and v.grad is None for v in params.values())


def test_no_collective_in_one_process() -> None:
    params, reg = mlp_params(), regression_batch(8)
    with gradaccum.sync.record_collectives() as log:
        gradaccum.accumulate(gradaccum.grad(mean_loss), 4)(params, reg)
    assert log == []


# -- errors ---------------------------------------------------------------------------------------


def _vector_loss(p: Any, b: Any) -> torch.Tensor:
    return predict_all(p, b)


def predict_all(p: Any, b: Any) -> torch.Tensor:
    x, y = b
    return (torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2


@pytest.mark.parametrize(
    ("call", "exc", "message"),
    [
        (
            lambda: gradaccum.grad(_vector_loss)(mlp_params(), regression_batch(4)),
            TypeError,
            "gradaccum.grad(_vector_loss, argnums=0, has_aux=False)(...): the function must "
            "return a scalar (0-dim) loss tensor, got a tensor of shape (4,); reduce it with "
            ".mean() or .sum().",
        ),
        (
            lambda: gradaccum.grad(token_sum_loss)(mlp_params(), token_batch(4)),
            TypeError,
            "gradaccum.grad(token_sum_loss, argnums=0, has_aux=False)(...): the function must "
            "return a scalar (0-dim) loss tensor, got tuple of length 2; reduce it with .mean() "
            "or .sum(); if it returns (loss, aux), pass has_aux=True.",
        ),
        (
            lambda: gradaccum.grad_and_value(mean_loss, has_aux=True)(
                mlp_params(), regression_batch(4)
            ),
            TypeError,
            "gradaccum.grad_and_value(mean_loss, argnums=0, has_aux=True)(...): with "
            "has_aux=True the function must return a pair (loss, aux), got Tensor(shape=(), "
            "dtype=float64); return (loss, aux) or pass has_aux=False.",
        ),
        (
            lambda: gradaccum.grad(mean_loss)(
                {**mlp_params(), "step": torch.tensor(3)}, regression_batch(4)
            ),
            TypeError,
            "gradaccum.grad(mean_loss, argnums=0, has_aux=False)(...): params leaf ['step'] has "
            "dtype int64; gradients exist only for floating tensors. Move it out of the params "
            "pytree (into buffers, or another argument of step_fn).",
        ),
        (
            lambda: gradaccum.grad(mean_loss, argnums=1)(mlp_params()),
            TypeError,
            "gradaccum.grad(mean_loss, argnums=1, has_aux=False)(...): expected the params at "
            "position(s) [1], got 1 positional argument(s); pass them positionally, e.g. "
            "step(params, batch).",
        ),
        (
            lambda: gradaccum.grad(mean_loss, argnums=-1),
            ValueError,
            "gradaccum.grad(fn, argnums=...): argnums must be a non-negative int or a non-empty "
            "tuple of distinct non-negative ints, as in torch.func.grad, got int -1; pass e.g. "
            "argnums=0, or argnums=(0, 2) for several arguments.",
        ),
        (
            lambda: gradaccum.grad_and_value(mean_loss, has_aux=1),
            TypeError,
            "gradaccum.grad_and_value(fn, has_aux=...): has_aux must be a bool, got int 1; pass "
            "has_aux=True if fn returns (loss, aux), else has_aux=False.",
        ),
        (
            lambda: gradaccum.grad("loss"),
            TypeError,
            "gradaccum.grad(fn): fn must be callable (a function returning a scalar loss), got "
            "str 'loss'; pass the loss function itself, e.g. gradaccum.grad(loss_fn) with "
            "loss_fn(params, batch) -> loss.",
        ),
        (
            lambda: gradaccum.accumulate(gradaccum.grad_and_value(mean_loss), 2, has_aux=False),
            ValueError,
            "accumulate(mean_loss, n=2): step_fn (gradaccum.grad_and_value(mean_loss, argnums=0, "
            "has_aux=False)) returns (grads, value), so accumulate needs has_aux=True, got "
            "has_aux=False; pass has_aux=True (or leave it out: it is inferred from the step "
            "function).",
        ),
        (
            lambda: gradaccum.accumulate(
                gradaccum.grad(mean_loss, argnums=1), 2, argnums=0, batch_argnum=2
            ),
            ValueError,
            "accumulate(mean_loss, n=2): step_fn differentiates argnums=1 but accumulate was "
            "given argnums=0; pass the same argnums to both.",
        ),
    ],
)
def test_errors(call: Any, exc: type[BaseException], message: str) -> None:
    with raises(exc, message):
        call()


@pytest.mark.parametrize(
    ("argnums", "exc", "got"),
    [
        pytest.param(-1, ValueError, "int -1", id="negative"),
        pytest.param((0, 0), ValueError, "tuple (0, 0)", id="repeated"),
        pytest.param((), TypeError, "tuple ()", id="empty"),
        pytest.param("0", TypeError, "str '0'", id="str"),
    ],
)
def test_argnums_one_rule(argnums: Any, exc: type[BaseException], got: str) -> None:
    # grad, grad_and_value and accumulate validate argnums with one rule and one message.
    rule = (
        f"argnums must be a non-negative int or a non-empty tuple of distinct non-negative ints, "
        f"as in torch.func.grad, got {got}; pass e.g. argnums=0, or argnums=(0, 2) for several "
        f"arguments."
    )
    for name in ("grad", "grad_and_value"):
        with raises(exc, f"gradaccum.{name}(fn, argnums=...): {rule}"):
            getattr(gradaccum, name)(mean_loss, argnums=argnums)
    with raises(exc, f"accumulate(mean_loss, n=2): {rule}"):
        gradaccum.accumulate(mean_loss, 2, argnums=argnums, batch_argnum=5)


def test_repr_and_wraps() -> None:
    fn = gradaccum.grad_and_value(mean_loss, has_aux=False)
    assert repr(fn) == "gradaccum.grad_and_value(mean_loss, argnums=0, has_aux=False)"
    assert fn.__name__ == "mean_loss"
    assert fn.__wrapped__ is mean_loss


def test_has_aux_is_inferred_from_a_gradaccum_step_function() -> None:
    params = {"w": torch.randn(3, dtype=torch.float64)}
    x = torch.randn(8, 3, dtype=torch.float64)

    def loss_fn(p: Any, b: Any) -> torch.Tensor:
        return (b @ p["w"]).pow(2).mean()

    grads, loss = gradaccum.accumulate(gradaccum.grad_and_value(loss_fn), 4)(params, x)
    assert torch.allclose(loss, loss_fn(params, x))
    assert torch.allclose(grads["w"], torch.func.grad(loss_fn)(params, x)["w"])
    only = gradaccum.accumulate(gradaccum.grad(loss_fn), 4)(params, x)
    assert torch.allclose(only["w"], grads["w"])


def test_a_torch_func_step_function_takes_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """accumulate reads torch.func.grad's function, argnums and has_aux, and runs autograd."""
    import torch._functorch.eager_transforms as eager

    params = {"w": torch.randn(3, dtype=torch.float64), "b": torch.randn((), dtype=torch.float64)}
    x = torch.randn(10, 3, dtype=torch.float64)

    def loss_fn(p: Any, b: Any) -> torch.Tensor:
        return (b @ p["w"] + p["b"]).pow(2).mean()

    def loss_aux(p: Any, b: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return loss_fn(p, b), b.sum()

    ref = torch.func.grad(loss_fn)(params, x)
    ref_loss = loss_fn(params, x)
    step = gradaccum.accumulate(torch.func.grad(loss_fn), 4)
    value_step = gradaccum.accumulate(torch.func.grad_and_value(loss_fn), 4)  # has_aux inferred
    aux_step = gradaccum.accumulate(
        torch.func.grad_and_value(loss_aux, has_aux=True), 4, aux_reduction="sum"
    )
    wrapped = gradaccum.accumulate(lambda p, b: torch.func.grad(loss_fn)(p, b), 4)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch.func's grad transform ran")

    monkeypatch.setattr(eager, "grad_impl", refuse)
    monkeypatch.setattr(eager, "grad_and_value_impl", refuse)
    for k in ref:
        torch.testing.assert_close(step(params, x)[k], ref[k], rtol=1e-12, atol=1e-12)
    grads, loss = value_step(params, x)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    grads, (loss, total) = aux_step(params, x)
    torch.testing.assert_close(total, x.sum(), rtol=1e-12, atol=1e-12)
    for k in ref:
        torch.testing.assert_close(grads[k], ref[k], rtol=1e-12, atol=1e-12)
    with pytest.raises(AssertionError, match="torch.func's grad transform ran"):
        wrapped(params, x)  # a wrapped torch.func function is called as it is
