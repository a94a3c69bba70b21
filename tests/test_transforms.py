"""torch.func transforms around gradaccum: refused over the accumulation, composed over ``grad``.

``accumulate`` and ``Accumulator.add/finalize`` add each micro-batch's gradient into running sums
in place, outside autograd: ``torch.func.jacrev`` through them returned an all-zero Hessian and
``vmap`` failed inside torch. Every transform over them is now refused, naming it, before
anything runs (a refused call changes nothing), whatever the step function; none returns zeros.
The normal uses keep working and are compared with torch.func in float64: torch.func.grad/vmap
inside the step function, and ``gradaccum.grad``/``grad_and_value`` under any transform (they
run torch.func's there), against ``torch.func.hessian`` and a loop over samples.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.func import functionalize, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import gradaccum

# torch 2.13's first forward-mode transform imports torch._decomp.decompositions_for_jvp, which
# runs the deprecated torch.jit.script: torch's own warning, not this library's.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning:torch.jit._script"
)

F64 = torch.float64
TIGHT = 1e-12

WHY_GRAD = (
    "accumulation is not differentiable: gradients are accumulated, never differentiated "
    "through, and each micro-batch's gradient is added into running sums in place, outside "
    "autograd, so a derivative taken through them would be zeros (torch.func.jacrev's Hessian) "
    "or fail. Instead, differentiate the whole-batch gradient, outside gradaccum: "
    "torch.func.hessian(loss_fn)(params, batch), or torch.func.jacrev / jacfwd / jvp over "
    "torch.func.grad(loss_fn) (a Hessian-vector product); over the same batch it is the "
    "derivative of the accumulated gradient."
)
MESSAGES = {
    "grad": "called under torch.func.grad, grad_and_value, vjp, jacrev or hessian; " + WHY_GRAD,
    "jvp": "called under torch.func.jvp or jacfwd; " + WHY_GRAD,
    "vmap": (
        "called under torch.func.vmap; accumulation cannot be batched: it adds each "
        "micro-batch's gradient into running sums in place, one window at a time. Instead, for "
        "per-sample gradients, vmap the gradient function, inside the accumulation: e.g. "
        "accumulate(torch.func.vmap(torch.func.grad(loss_of_one), in_dims=(None, 0)), n, "
        "micro_transform=gradaccum.privacy.clip_per_sample(1.0)); for several batches, "
        "accumulate each in a Python loop, outside vmap."
    ),
    "functionalize": (
        "called under torch.func.functionalize; accumulation is not a pure function: it adds "
        "each micro-batch's gradient into running sums in place, kept between calls. Instead, "
        "call it outside torch.func.functionalize; to compile it, pass the accumulated function "
        "to torch.compile, which functionalizes what it traces itself."
    ),
}


def loss(params: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    x, y = batch
    return (torch.tanh(x @ params["w"] + params["b"]) - y).pow(2).mean()


def loss_of_one(params: dict[str, torch.Tensor], sample: Any) -> torch.Tensor:
    x, y = sample
    return (torch.tanh(x @ params["w"] + params["b"]) - y).pow(2)


def make(rows: int = 8) -> tuple[dict[str, torch.Tensor], Any]:
    g = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(3, generator=g, dtype=F64),
        "b": torch.randn((), generator=g, dtype=F64),
    }
    x = torch.randn(rows, 3, generator=g, dtype=F64)
    return params, (x, torch.randn(rows, generator=g, dtype=F64))


def own_step(params: dict[str, torch.Tensor], batch: Any) -> dict[str, torch.Tensor]:
    """A hand-written step function: torch.autograd on fresh leaves."""
    with torch.enable_grad():
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        grads = torch.autograd.grad(loss(leaves, batch), list(leaves.values()))
    return dict(zip(leaves, grads, strict=True))


def func_step(params: dict[str, torch.Tensor], batch: Any) -> dict[str, torch.Tensor]:
    """torch.func.grad inside a step function of the user's: the generic path."""
    return grad(loss)(params, batch)


# (name in the message, accumulate's arguments): every path through accumulate.
STEPS: dict[str, tuple[str, Callable[..., Any], dict[str, Any]]] = {
    "torch.func.grad": ("loss", grad(loss), {}),
    "torch.func.grad_and_value": ("loss", torch.func.grad_and_value(loss), {}),
    "gradaccum.grad": ("loss", gradaccum.grad(loss), {}),
    "gradaccum.grad_and_value": ("loss", gradaccum.grad_and_value(loss), {}),
    "own step": ("own_step", own_step, {}),
    "torch.func.grad inside": ("func_step", func_step, {}),
    "micro_transform": ("loss", grad(loss), {"micro_transform": lambda g: g}),
    "count": (
        "<lambda>",
        gradaccum.grad(lambda p, b: (loss(p, b) * len(b[1]), len(b[1])), has_aux=True),
        {"reduction": "count", "count": lambda rows: rows},
    ),
}


def _grads(out: Any) -> dict[str, torch.Tensor]:
    """The gradients of an accumulated function's output, with aux or without."""
    return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]


def _scalar(step: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    return lambda p, b: sum(g.sum() for g in _grads(step(p, b)).values())  # type: ignore[return-value]


# (the transform's kind, how to call it over an accumulated function).
TRANSFORMS: dict[str, tuple[str, Callable[[Callable[..., Any], Any, Any], Any]]] = {
    "jacrev": ("grad", lambda f, p, b: jacrev(f)(p, b)),
    "jacfwd": ("jvp", lambda f, p, b: jacfwd(f)(p, b)),
    "hessian": ("grad", lambda f, p, b: hessian(_scalar(f))(p, b)),
    "grad": ("grad", lambda f, p, b: grad(_scalar(f))(p, b)),
    "vjp": ("grad", lambda f, p, b: vjp(lambda q: f(q, b), p)),
    "jvp": ("jvp", lambda f, p, b: jvp(lambda q: f(q, b), (p,), (p,))),
    "vmap over batches": (
        "vmap",
        lambda f, p, b: vmap(f, in_dims=(None, 0))(p, (b[0][None], b[1][None])),
    ),
    "vmap over params": (
        "vmap",
        lambda f, p, b: vmap(f, in_dims=(0, None))({k: v[None] for k, v in p.items()}, b),
    ),
    "functionalize": ("functionalize", lambda f, p, b: functionalize(f)(p, b)),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("step", list(STEPS))
def test_every_transform_over_accumulate_is_refused(step: str, transform: str) -> None:
    name, step_fn, kwargs = STEPS[step]
    acc = gradaccum.accumulate(step_fn, 2, **kwargs)
    kind, call = TRANSFORMS[transform]
    params, batch = make()
    message = f"accumulate({name}, n=2)(...): {MESSAGES[kind]}"
    with pytest.raises(ValueError, match=re.escape(message)):
        call(acc, params, batch)
    # Nothing changed: the next plain call is the whole-batch gradient.
    got = _grads(acc(params, batch))
    want = grad(loss)(params, batch)
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < TIGHT


def test_the_probe_no_longer_returns_an_all_zero_hessian() -> None:
    """The issue's probe: jacrev over accumulate of a step of the user's gave zeros."""
    params, batch = make()
    true = hessian(loss)(params, batch)
    assert max(float(v.abs().max()) for row in true.values() for v in row.values()) > 0.1
    acc = gradaccum.accumulate(func_step, 2)
    message = f"accumulate(func_step, n=2)(...): {MESSAGES['grad']}"
    with pytest.raises(ValueError, match=re.escape(message)):
        jacrev(acc)(params, batch)


def test_a_refused_call_leaves_the_sync_state_and_window_index() -> None:
    def summed(grads: Any, windows: int, group: Any) -> tuple[Any, int]:
        return grads, windows + 1

    sync = gradaccum.custom_reduce(summed, init=lambda grads: 0)
    acc = gradaccum.accumulate(grad(loss), 2, sync=sync)
    params, batch = make()
    acc(params, batch)
    assert sync.state == 1
    message = f"accumulate(loss, n=2)(...): {MESSAGES['grad']}"
    with pytest.raises(ValueError, match=re.escape(message)):
        jacrev(acc)(params, batch)
    assert sync.state == 1
    acc(params, batch)
    assert sync.state == 2


@pytest.mark.parametrize("transform", ["jacrev", "jacfwd", "vmap over params"])
def test_accumulator_add_and_finalize_are_refused(transform: str) -> None:
    kind, call = TRANSFORMS[transform]
    params, batch = make()
    acc = gradaccum.Accumulator(2)
    state = acc.init(params)

    def add(p: dict[str, torch.Tensor], b: Any) -> dict[str, torch.Tensor]:
        acc.add(state, grad(loss)(p, b), size=len(b[1]))
        return p

    message = f"Accumulator.add(state, grads): {MESSAGES[kind]}"
    with pytest.raises(ValueError, match=re.escape(message)):
        call(add, params, batch)
    assert state.micro_step == 0  # nothing added
    assert state.sums is None
    x, y = batch
    for half in (slice(0, 4), slice(4, 8)):
        state = acc.add(state, grad(loss)(params, (x[half], y[half])), size=4)

    def finalize(p: dict[str, torch.Tensor], b: Any) -> dict[str, torch.Tensor]:
        grads, _ = acc.finalize(state)
        return {k: g * p[k] for k, g in grads.items()}

    message = f"Accumulator(n=2).finalize(state): {MESSAGES[kind]}"
    with pytest.raises(ValueError, match=re.escape(message)):
        call(finalize, params, batch)
    grads, _ = acc.finalize(state)  # the window is still whole
    want = grad(loss)(params, batch)
    assert max(float((grads[k] - want[k]).abs().max()) for k in want) < TIGHT


def test_a_compiled_transform_over_accumulate_is_refused() -> None:
    params, batch = make()
    acc = gradaccum.accumulate(grad(loss), 2)
    compiled = torch.compile(jacrev(acc), backend="eager")
    message = f"accumulate(loss, n=2)(...): {MESSAGES['grad']}"
    with pytest.raises(ValueError, match=re.escape(message)):
        compiled(params, batch)


# -- what keeps working ------------------------------------------------------------------------


def _max_diff(a: Any, b: Any) -> float:
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    assert len(la) == len(lb)
    return max(float((x - y).abs().max()) for x, y in zip(la, lb, strict=True))


@pytest.mark.parametrize("make_grad", [gradaccum.grad, torch.func.grad])
def test_gradaccum_grad_under_jacrev_jacfwd_is_the_hessian(make_grad: Any) -> None:
    params, batch = make()
    true = hessian(loss)(params, batch)
    assert _max_diff(jacrev(make_grad(loss))(params, batch), true) < TIGHT
    assert _max_diff(jacfwd(make_grad(loss))(params, batch), true) < TIGHT


def test_gradaccum_grad_under_vmap_gives_per_sample_gradients() -> None:
    params, (x, y) = make()
    got = vmap(gradaccum.grad(loss_of_one), in_dims=(None, 0))(params, (x, y))
    with_value = vmap(gradaccum.grad_and_value(loss_of_one), in_dims=(None, 0))(params, (x, y))
    for i in range(len(y)):
        want = grad(loss_of_one)(params, (x[i], y[i]))
        assert _max_diff({k: v[i] for k, v in got.items()}, want) < TIGHT
        assert _max_diff({k: v[i] for k, v in with_value[0].items()}, want) < TIGHT
        assert float((with_value[1][i] - loss_of_one(params, (x[i], y[i]))).abs()) < TIGHT


def test_gradaccum_grad_under_functionalize() -> None:
    params, batch = make()
    got = functionalize(gradaccum.grad(loss))(params, batch)
    assert _max_diff(got, grad(loss)(params, batch)) < TIGHT


@pytest.mark.parametrize("inner", [gradaccum.grad, torch.func.grad])
def test_transforms_inside_the_step_function_accumulate_exactly(inner: Any) -> None:
    """vmap over grad inside the step (per-sample clipping), jacrev inside the step."""
    params, batch = make(rows=11)
    clip = gradaccum.privacy.clip_per_sample(0.05)
    step = gradaccum.accumulate(
        vmap(inner(loss_of_one), in_dims=(None, 0)), 3, reduction="sum", micro_transform=clip
    )
    want = clip(vmap(grad(loss_of_one), in_dims=(None, 0))(params, batch))
    assert _max_diff(step(params, batch), want) < TIGHT

    def gauss_newton_step(p: dict[str, torch.Tensor], b: Any) -> dict[str, torch.Tensor]:
        """The gradient through jacrev of the predictions, inside the step."""
        x, y = b

        def predict(q: dict[str, torch.Tensor]) -> torch.Tensor:
            return torch.tanh(x @ q["w"] + q["b"])

        jac = jacrev(predict)(p)
        residual = 2 * (predict(p) - y) / len(y)
        return {k: torch.einsum("r,r...->...", residual, j) for k, j in jac.items()}

    step = gradaccum.accumulate(gauss_newton_step, 4)
    assert _max_diff(step(params, batch), grad(loss)(params, batch)) < TIGHT


@pytest.mark.slow  # compiles (5 s); test_accumulate.py compiles a step in the fast tier
def test_compiled_accumulate_is_exact() -> None:
    params, batch = make()
    for step_fn in (grad(loss), func_step):
        compiled = torch.compile(gradaccum.accumulate(step_fn, 2), backend="eager")
        assert _max_diff(compiled(params, batch), grad(loss)(params, batch)) < TIGHT
