"""Bad inputs: every error gradaccum raises, with its full message, and nothing mutated.

Each message starts with the call shape, says what was expected and what came, and ends with the
fix (CONTRIBUTING.md). After an error, the params, the batch, an accumulator state (running sums,
weight, micro_step) and a module's ``.grad`` and buffers are as they were.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import numpy as np
import optree
import pytest
import torch

import gradaccum

F64 = torch.float64

# Message tails shared by several tests.
N_TYPE_FIX = "; pass e.g. n=4."
N_VALUE_FIX = "; pass n >= 1 (n=1 computes the whole batch in one micro-batch)."
N_EXPECTED = "n must be a positive int (the number of micro-batches), got "
REDUCTION_TAIL = (
    "reduction must be one of 'mean', 'sum', 'count', got {got}; use 'mean' when step_fn "
    "returns the gradient of a mean loss, 'sum' to add gradients as they come, 'count' for a "
    "summed loss normalised by a count that step_fn returns in its aux."
)
NO_TENSOR_TAIL = "; pass the batch tensors (e.g. (x, y) or {'x': x, 'y': y}) as this argument."
TREE_TAIL = (
    "; step_fn must return one gradient per params leaf, in a tree of the same structure (as "
    "torch.func.grad does)."
)
SHAPE_TAIL = (
    "; step_fn must return gradients shaped like params (per-sample gradients must be reduced "
    "inside step_fn)."
)
DTYPE_TAIL = (
    "; gradients must be real floating tensors (integer and complex gradients are not "
    "supported). Check that step_fn returns gradients, not inputs or indices."
)
HAS_AUX_TAIL = "; return (grads, aux), as torch.func.grad_and_value does, or pass has_aux=False."
LOAD = "Accumulator.load_state_dict(state, state_dict): "
LOAD_FIX = "; pass the dict that state_dict() returned (torch.load(path, weights_only=True))."
SAME_PARAMS_FIX = "; load it for the same params it was saved with."
MB_TYPE_TAIL = "; wrap your micro-batches in a list: MicroBatches([mb0, mb1, ...])."
WRITE_FIX = "; compute grads with respect to gradaccum.params_of(module)."
FINALIZE_EMPTY = (
    "the window holds no micro-batch, so there is no gradient to return; call add() at least "
    "once before finalize()."
)


# -- helpers ------------------------------------------------------------------------------------


def raises(exc: type[BaseException], message: str) -> AbstractContextManager[Any]:
    """``pytest.raises`` that matches the whole message, character for character."""
    return pytest.raises(exc, match=rf"\A{re.escape(message)}\Z")


def _snapshot(tree: Any) -> tuple[Any, list[Any]]:
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
    return spec, [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves]


def _assert_same(before: tuple[Any, list[Any]], tree: Any) -> None:
    spec, old = before
    new, new_spec = optree.tree_flatten(tree, none_is_leaf=True)
    assert new_spec == spec
    for a, b in zip(old, new, strict=True):
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor)
            assert a.dtype == b.dtype
            assert torch.equal(a, b.detach())
        else:
            assert a == b


@contextmanager
def unchanged(*trees: Any) -> Iterator[None]:
    """Assert the pytrees (or what the callables among them return) are unchanged on exit."""

    def read(t: Any) -> Any:
        return t() if callable(t) else t

    before = [_snapshot(read(t)) for t in trees]
    yield
    for b, t in zip(before, trees, strict=True):
        _assert_same(b, read(t))


def params() -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([0.1, 0.2, 0.3], dtype=F64), "b": torch.tensor(0.5, dtype=F64)}


def grads() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(3, dtype=F64), "b": torch.ones((), dtype=F64)}


def x(rows: int = 8) -> torch.Tensor:
    return torch.arange(rows * 3, dtype=F64).reshape(rows, 3) / 10


def y(rows: int = 8) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, rows, dtype=F64)


def loss_grad(params: dict[str, torch.Tensor], batch: Any) -> dict[str, torch.Tensor]:
    """The gradient of the mean squared error of a linear model, in closed form.

    (Not torch.func.grad: its first call costs seconds, and the errors here do not need it.)
    """
    xs, ys = batch
    r = xs @ params["w"] + params["b"] - ys
    return {"w": 2 * xs.T @ r / len(ys), "b": 2 * r.mean()}


def step_fn(params: dict[str, torch.Tensor], batch: Any) -> dict[str, torch.Tensor]:
    return {k: torch.ones_like(v) for k, v in params.items()}


def aux_fn(params: dict[str, torch.Tensor], batch: Any) -> tuple[Any, Any]:
    return step_fn(params, batch), {
        "loss": torch.tensor(1.0, dtype=F64),
        "tokens": torch.tensor(3.0, dtype=F64),
    }


def returning(out: Any, calls: list[Any] | None = None) -> Callable[..., Any]:
    """A step function named ``step_fn`` that returns ``out`` (and records its batches)."""

    def step_fn(params: Any, batch: Any) -> Any:
        if calls is not None:
            calls.append(batch)
        return out

    return step_fn


def module_state(module: torch.nn.Module) -> dict[str, Any]:
    return {
        "params": dict(module.named_parameters()),
        "grads": {k: p.grad for k, p in module.named_parameters()},
        "buffers": dict(module.named_buffers()),
    }


@pytest.fixture
def mid_window() -> tuple[gradaccum.Accumulator, gradaccum.streaming.AccumState[Any]]:
    """A mean Accumulator and a state holding one micro-batch (running sums allocated)."""
    acc = gradaccum.Accumulator(n=4)
    state = acc.add(acc.init(params()), grads(), size=3)
    return acc, state


# -- n ------------------------------------------------------------------------------------------

BAD_N = [
    pytest.param(0, ValueError, "0" + N_VALUE_FIX, id="zero"),
    pytest.param(-1, ValueError, "-1" + N_VALUE_FIX, id="negative"),
    pytest.param(2.5, TypeError, "float 2.5" + N_TYPE_FIX, id="float"),
    pytest.param(True, TypeError, "bool True" + N_TYPE_FIX, id="bool"),
    pytest.param("4", TypeError, "str '4'" + N_TYPE_FIX, id="str"),
    pytest.param(None, TypeError, "NoneType None" + N_TYPE_FIX, id="None"),
]


@pytest.mark.parametrize(("n", "exc", "got"), BAD_N)
def test_accumulate_rejects_bad_n(n: Any, exc: type[Exception], got: str) -> None:
    with raises(exc, f"accumulate(loss_grad, n={n!r}): {N_EXPECTED}{got}"):
        gradaccum.accumulate(loss_grad, n)


@pytest.mark.parametrize(("n", "exc", "got"), BAD_N)
def test_accumulator_rejects_bad_n(n: Any, exc: type[Exception], got: str) -> None:
    with raises(exc, f"Accumulator(n={n!r}): {N_EXPECTED}{got}"):
        gradaccum.Accumulator(n=n)


@pytest.mark.parametrize(("n", "exc", "got"), BAD_N)
def test_schedule_returning_bad_n(n: Any, exc: type[Exception], got: str) -> None:
    acc = gradaccum.Accumulator(n=lambda window: [1, n][window])
    state = acc.add(acc.init(params()), grads(), size=2)
    assert acc.is_complete(state)
    _, state = acc.finalize(state)  # window 1: the schedule now returns the bad n
    message = f"Accumulator(n=<schedule>): the schedule's value for window 1: {N_EXPECTED}{got}"
    with unchanged(state), raises(exc, message):
        acc.is_complete(state)
    with unchanged(state), raises(exc, message):
        acc.window_size(state)


# -- the batch ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch", "got"),
    [
        pytest.param([1, 2, 3], "leaves int 1, int 2, int 3", id="list-of-ints"),
        pytest.param({"x": 3}, "leaves int 3", id="dict-of-int"),
        pytest.param("abc", "leaves str 'abc'", id="str"),
        pytest.param({}, "dict", id="empty-dict"),
        pytest.param((), "tuple", id="empty-tuple"),
        pytest.param(None, "NoneType None", id="None"),
        pytest.param([None, None], "list", id="list-of-None"),
    ],
)
def test_batch_without_tensor_leaf(batch: Any, got: str) -> None:
    calls: list[Any] = []
    p = params()
    message = (
        f"accumulate(step_fn, n=2)(...): expected a batch pytree with at least one tensor leaf, "
        f"got {got}{NO_TENSOR_TAIL}"
    )
    with unchanged(p, batch), raises(ValueError, message):
        gradaccum.accumulate(returning(grads(), calls), 2)(p, batch)
    assert calls == []


def test_batch_with_a_0_dim_tensor_leaf() -> None:
    calls: list[Any] = []
    p, batch = params(), {"x": x(), "scale": torch.tensor(2.0, dtype=F64)}
    message = (
        "accumulate(step_fn, n=2)(...): batch leaf ['scale'] is a 0-dim tensor, which has no dim "
        "0 to split along; give it a leading batch dimension (x.unsqueeze(0)) or pass it through "
        "another argument of step_fn."
    )
    with unchanged(p, batch), raises(ValueError, message):
        gradaccum.accumulate(returning(grads(), calls), 2)(p, batch)
    assert calls == []


DISAGREE = [
    pytest.param((x(8), y(6)), "[0] has 8 rows but [1] has 6", id="tuple"),
    pytest.param({"x": x(8), "y": y(6)}, "['x'] has 8 rows but ['y'] has 6", id="dict"),
    pytest.param(
        {"in": {"x": x(8)}, "out": [y(8), y(5)]},
        "['in']['x'] has 8 rows but ['out'][1] has 5",
        id="nested",
    ),
]


@pytest.mark.parametrize(("batch", "paths"), DISAGREE)
def test_batch_leaves_disagree_on_rows_raise_and_mutate_nothing(batch: Any, paths: str) -> None:
    calls: list[Any] = []
    p = params()
    start = (
        f"accumulate(step_fn, n=2)(...): batch leaves disagree on their size along dim 0: "
        f"{paths}; every tensor in a batch must have the same number of rows."
    )
    # The full message is tested below.
    with unchanged(p, batch), pytest.raises(ValueError, match=rf"\A{re.escape(start)}"):
        gradaccum.accumulate(returning(grads(), calls), 2)(p, batch)
    assert calls == []


@pytest.mark.parametrize(("batch", "paths"), DISAGREE)
def test_batch_leaves_disagree_on_rows_message(batch: Any, paths: str) -> None:
    message = (
        f"accumulate(step_fn, n=2)(...): batch leaves disagree on their size along dim 0: "
        f"{paths}; every tensor in a batch must have the same number of rows. Give every tensor "
        f"leaf of the batch the same number of rows, or pass tensors that are not split by row "
        f"through another argument of step_fn."
    )
    with raises(ValueError, message):
        gradaccum.accumulate(step_fn, 2)(params(), batch)


def test_n_larger_than_the_batch() -> None:
    calls: list[Any] = []
    p, batch = params(), (x(8), y(8))
    message = (
        "accumulate(step_fn, n=9)(...): n=9 micro-batches is more than the 8 rows of the batch, "
        "so some micro-batches would be empty; pass n <= 8, or a larger batch."
    )
    with unchanged(p, batch), raises(ValueError, message):
        gradaccum.accumulate(returning(grads(), calls), 9)(p, batch)
    assert calls == []


def test_empty_batch_raises_and_mutates_nothing() -> None:
    calls: list[Any] = []
    p, batch = params(), (x(0), y(0))
    start = re.escape("accumulate(step_fn, n=2)(...): ")
    with unchanged(p, batch), pytest.raises(ValueError, match=rf"\A{start}"):
        gradaccum.accumulate(returning(grads(), calls), 2)(p, batch)
    assert calls == []


def test_empty_batch_message() -> None:
    message = (
        "accumulate(step_fn, n=2)(...): the batch has 0 rows along dim 0, so there is nothing to "
        "accumulate; pass a batch with at least n=2 rows."
    )
    with raises(ValueError, message):
        gradaccum.accumulate(step_fn, 2)(params(), (x(0), y(0)))


def test_numpy_batch_leaf_is_not_silently_broadcast() -> None:
    calls: list[Any] = []
    batch = {"x": x(8), "y": np.linspace(-1.0, 1.0, 8)}
    message = (
        "accumulate(step_fn, n=2)(...): batch leaf ['y'] is ndarray, which gradaccum does not "
        "split (only torch tensors are split; other leaves go whole to every micro-batch); "
        "convert it with torch.as_tensor, or pass it through another argument of step_fn."
    )
    with raises(TypeError, message):
        gradaccum.accumulate(returning(grads(), calls), 2)(params(), batch)
    assert calls == []


# -- what step_fn returns -----------------------------------------------------------------------


def _nested_params() -> dict[str, Any]:
    return {
        "layer": {"w": torch.zeros(3, dtype=F64), "b": torch.zeros(2, dtype=F64)},
        "out": [torch.zeros(1, dtype=F64)],
    }


def _nested(layer: Any = None, out: Any = None) -> dict[str, Any]:
    if layer is None:
        layer = {"w": torch.ones(3, dtype=F64), "b": torch.ones(2, dtype=F64)}
    return {"layer": layer, "out": [torch.ones(1, dtype=F64)] if out is None else out}


ONE3, ONE = torch.ones(3, dtype=F64), torch.ones((), dtype=F64)

TREE_MISMATCH = [
    pytest.param(
        params(),
        {"w": ONE3},
        "at <root>: expected a dict with keys ['b', 'w'], got a dict with keys ['w']",
        id="missing-key",
    ),
    pytest.param(
        params(),
        {"w": ONE3, "b": ONE, "c": ONE},
        "at <root>: expected a dict with keys ['b', 'w'], got a dict with keys ['b', 'c', 'w']",
        id="extra-key",
    ),
    pytest.param(
        params(),
        {"w": ONE3, "bias": ONE},
        "at <root>: expected a dict with keys ['b', 'w'], got a dict with keys ['bias', 'w']",
        id="renamed-key",
    ),
    pytest.param(
        params(),
        [ONE3, ONE],
        "at <root>: expected a dict with keys ['b', 'w'], got a list of length 2",
        id="list-vs-dict",
    ),
    pytest.param(
        params(),
        ONE3,
        "at <root>: expected a dict with keys ['b', 'w'], got a leaf",
        id="bare-tensor",
    ),
    pytest.param(
        _nested_params(),
        _nested(layer={"w": ONE3}),
        "at ['layer']: expected a dict with keys ['b', 'w'], got a dict with keys ['w']",
        id="nested-missing-key",
    ),
    pytest.param(
        _nested_params(),
        _nested(layer=ONE3),
        "at ['layer']: expected a dict with keys ['b', 'w'], got a leaf",
        id="nested-leaf-vs-dict",
    ),
    pytest.param(
        _nested_params(),
        _nested(out=[ONE, ONE]),
        "at ['out']: expected a list of length 1, got a list of length 2",
        id="nested-list-length",
    ),
    pytest.param(
        _nested_params(),
        _nested(out=(torch.ones(1, dtype=F64),)),
        "at ['out']: expected a list of length 1, got a tuple of length 1",
        id="nested-tuple-vs-list",
    ),
]

BAD_LEAF = [
    pytest.param(
        params(),
        {"w": 1.0, "b": ONE},
        TypeError,
        "gradient leaf ['w'] is float 1.0, expected a tensor of shape (3,); step_fn must return "
        "tensors (as torch.func.grad does).",
        id="float-leaf",
    ),
    pytest.param(
        params(),
        {"w": ONE3, "b": "g"},
        TypeError,
        "gradient leaf ['b'] is str 'g', expected a tensor of shape (); step_fn must return "
        "tensors (as torch.func.grad does).",
        id="str-leaf",
    ),
    pytest.param(
        params(),
        {"w": torch.ones(2, dtype=F64), "b": ONE},
        ValueError,
        "gradient leaf ['w'] has shape (2,) but the params leaf has shape (3,)" + SHAPE_TAIL,
        id="wrong-shape",
    ),
    pytest.param(
        params(),
        {"w": torch.ones(4, 3, dtype=F64), "b": ONE},
        ValueError,
        "gradient leaf ['w'] has shape (4, 3) but the params leaf has shape (3,)" + SHAPE_TAIL,
        id="per-sample-shape",
    ),
    pytest.param(
        params(),
        {"w": torch.ones(1, 3, dtype=F64), "b": ONE},
        ValueError,
        "gradient leaf ['w'] has shape (1, 3) but the params leaf has shape (3,)" + SHAPE_TAIL,
        id="broadcastable-shape",
    ),
    pytest.param(
        _nested_params(),
        _nested(layer={"w": ONE3, "b": torch.ones(3, dtype=F64)}),
        ValueError,
        "gradient leaf ['layer']['b'] has shape (3,) but the params leaf has shape (2,)"
        + SHAPE_TAIL,
        id="nested-wrong-shape",
    ),
    pytest.param(
        params(),
        {"w": torch.ones(3, dtype=torch.int64), "b": ONE},
        TypeError,
        "gradient leaf ['w'] has dtype int64" + DTYPE_TAIL,
        id="int64",
    ),
    pytest.param(
        params(),
        {"w": ONE3, "b": torch.ones((), dtype=torch.complex128)},
        TypeError,
        "gradient leaf ['b'] has dtype complex128" + DTYPE_TAIL,
        id="complex128",
    ),
    pytest.param(
        params(),
        {"w": torch.ones(3, dtype=torch.bool), "b": ONE},
        TypeError,
        "gradient leaf ['w'] has dtype bool" + DTYPE_TAIL,
        id="bool",
    ),
    pytest.param(
        _nested_params(),
        _nested(layer={"w": ONE3, "b": torch.ones(2, dtype=torch.int32)}),
        TypeError,
        "gradient leaf ['layer']['b'] has dtype int32" + DTYPE_TAIL,
        id="nested-int32",
    ),
]


@pytest.mark.parametrize(("p", "out", "where"), TREE_MISMATCH)
def test_accumulate_grads_tree_mismatch(p: Any, out: Any, where: str) -> None:
    batch = (x(), y())
    message = (
        f"accumulate(step_fn, n=2)(...): the gradients do not match the params tree {where}"
        f"{TREE_TAIL}"
    )
    with unchanged(p, batch), raises(ValueError, message):
        gradaccum.accumulate(returning(out), 2)(p, batch)


@pytest.mark.parametrize(("p", "out", "exc", "tail"), BAD_LEAF)
def test_accumulate_bad_gradient_leaf(p: Any, out: Any, exc: type[Exception], tail: str) -> None:
    batch = (x(), y())
    with unchanged(p, batch), raises(exc, f"accumulate(step_fn, n=2)(...): {tail}"):
        gradaccum.accumulate(returning(out), 2)(p, batch)


@pytest.mark.parametrize(("p", "out", "where"), TREE_MISMATCH)
def test_accumulator_add_grads_tree_mismatch(p: Any, out: Any, where: str) -> None:
    acc = gradaccum.Accumulator(n=4)
    state = acc.add(acc.init(p), optree.tree_map(torch.ones_like, p), size=2)
    message = (
        f"Accumulator.add(state, grads): the gradients do not match the params tree {where}"
        f"{TREE_TAIL}"
    )
    with unchanged(state, p), raises(ValueError, message):
        acc.add(state, out, size=2)


@pytest.mark.parametrize(("p", "out", "exc", "tail"), BAD_LEAF)
def test_accumulator_add_bad_gradient_leaf(
    p: Any, out: Any, exc: type[Exception], tail: str
) -> None:
    acc = gradaccum.Accumulator(n=4)
    state = acc.add(acc.init(p), optree.tree_map(torch.ones_like, p), size=2)
    with unchanged(state, p), raises(exc, f"Accumulator.add(state, grads): {tail}"):
        acc.add(state, out, size=2)


def test_none_gradient_leaf() -> None:
    message = (
        "accumulate(step_fn, n=2)(...): gradient leaf ['w'] is None, expected a tensor of shape "
        "(3,); step_fn must return a tensor for every params leaf (torch.autograd.grad returns "
        "None for an unused parameter: pass materialize_grads=True, or use torch.func.grad)."
    )
    with raises(TypeError, message):
        gradaccum.accumulate(returning({"w": None, "b": ONE}), 2)(params(), (x(), y()))


def test_error_on_a_later_micro_batch_leaves_no_partial_work() -> None:
    """Micro-batch 2 returns a bad tree: nothing is mutated, and the next call starts afresh."""
    p, batch = params(), (x(8), y(8))
    good = loss_grad
    fail_at: list[int] = [2]
    seen: list[int] = []

    def bad_tree_on_micro_batch_2(params: Any, batch: Any) -> Any:
        seen.append(len(seen) + 1)
        g = good(params, batch)
        return {"w": g["w"]} if len(seen) in fail_at else g

    bad_tree_on_micro_batch_2.__name__ = "loss_grad"
    step = gradaccum.accumulate(bad_tree_on_micro_batch_2, 4)
    message = (
        "accumulate(loss_grad, n=4)(...): the gradients do not match the params tree at <root>: "
        "expected a dict with keys ['b', 'w'], got a dict with keys ['w']" + TREE_TAIL
    )
    with unchanged(p, batch), raises(ValueError, message):
        step(p, batch)
    assert seen == [1, 2]  # stopped at the bad micro-batch
    fail_at.clear()
    got, ref = step(p, batch), good(p, batch)
    for k in ref:
        assert float((got[k] - ref[k]).abs().max()) < 1e-12


@pytest.mark.parametrize(
    ("out", "got"),
    [
        pytest.param(ONE3, "Tensor(shape=(3,), dtype=float64)", id="bare-tensor"),
        pytest.param(grads(), "dict", id="grads-dict"),
        pytest.param((grads(), 1.0, 2.0), "tuple of length 3", id="3-tuple"),
        pytest.param((grads(),), "tuple of length 1", id="1-tuple"),
        pytest.param([grads(), 1.0], "list of length 2", id="list-pair"),
    ],
)
def test_has_aux_with_wrong_output_shape(out: Any, got: str) -> None:
    p, batch = params(), (x(), y())
    message = (
        f"accumulate(step_fn, n=2)(...): with has_aux=True, step_fn must return a pair (grads, "
        f"aux), got {got}{HAS_AUX_TAIL}"
    )
    with unchanged(p, batch), raises(TypeError, message):
        gradaccum.accumulate(returning(out), 2, has_aux=True)(p, batch)


def test_pair_without_has_aux_hints_at_has_aux() -> None:
    message = (
        "accumulate(step_fn, n=2)(...): the gradients do not match the params tree at <root>: "
        "expected a dict with keys ['b', 'w'], got a tuple of length 2; step_fn must return one "
        "gradient per params leaf, in a tree of the same structure (as torch.func.grad does); if "
        "step_fn returns (grads, aux), pass has_aux=True."
    )
    with raises(ValueError, message):
        gradaccum.accumulate(returning((grads(), ONE)), 2)(params(), (x(), y()))


# -- options of accumulate and Accumulator ------------------------------------------------------

BAD_REDUCTION = [
    pytest.param("avg", "str 'avg'", id="avg"),
    pytest.param("MEAN", "str 'MEAN'", id="upper-case"),
    pytest.param(None, "NoneType None", id="None"),
    pytest.param(1, "int 1", id="int"),
]


@pytest.mark.parametrize(("reduction", "got"), BAD_REDUCTION)
def test_accumulate_rejects_bad_reduction(reduction: Any, got: str) -> None:
    with raises(ValueError, "accumulate(step_fn, n=2): " + REDUCTION_TAIL.format(got=got)):
        gradaccum.accumulate(step_fn, 2, reduction=reduction)


@pytest.mark.parametrize(("reduction", "got"), BAD_REDUCTION)
def test_accumulator_rejects_bad_reduction(reduction: Any, got: str) -> None:
    with raises(ValueError, "Accumulator(n=2): " + REDUCTION_TAIL.format(got=got)):
        gradaccum.Accumulator(2, reduction)


def test_accumulator_with_schedule_names_it_schedule_in_messages() -> None:
    with raises(ValueError, "Accumulator(n=<schedule>): " + REDUCTION_TAIL.format(got="str 'x'")):
        gradaccum.Accumulator(lambda window: 2, "x")  # type: ignore[arg-type]
    acc = gradaccum.Accumulator(lambda window: 2)
    with raises(ValueError, "Accumulator(n=<schedule>).finalize(state): " + FINALIZE_EMPTY):
        acc.finalize(acc.init(params()))


def test_bad_accum_dtype_names_the_dtype() -> None:
    message = (
        "accumulate(step_fn, n=2): accum_dtype must be None or a floating torch.dtype, got "
        "torch.int32; pass e.g. accum_dtype=torch.float32."
    )
    with raises(TypeError, message):
        gradaccum.accumulate(step_fn, 2, accum_dtype=torch.int32)


COUNT_NEEDS = (
    "reduction='count' needs has_aux=True and count=, a function from a micro-batch's aux to the "
    "number of items its summed loss covers; got {got}. Pass e.g. has_aux=True, "
    "count=lambda aux: aux['tokens']."
)


@pytest.mark.parametrize(
    ("fn", "kwargs", "got"),
    [
        pytest.param(step_fn, {}, "has_aux=False, count=None", id="neither"),
        pytest.param(aux_fn, {"has_aux": True}, "has_aux=True, count=None", id="no-count"),
        pytest.param(
            step_fn, {"count": lambda aux: 1}, "has_aux=False, count=function", id="no-has-aux"
        ),
        pytest.param(
            aux_fn, {"has_aux": True, "count": 3}, "has_aux=True, count=int 3", id="count-not-fn"
        ),
    ],
)
def test_count_reduction_needs_has_aux_and_count(
    fn: Callable[..., Any], kwargs: dict[str, Any], got: str
) -> None:
    where = f"accumulate({fn.__name__}, n=2): "
    with raises(ValueError, where + COUNT_NEEDS.format(got=got)):
        gradaccum.accumulate(fn, 2, reduction="count", **kwargs)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_count_with_another_reduction(reduction: str) -> None:
    message = (
        f"accumulate(aux_fn, n=2): count= is used only with reduction='count', got "
        f"reduction={reduction!r}; pass reduction='count' or drop count=."
    )
    with raises(ValueError, message):
        gradaccum.accumulate(
            aux_fn,
            2,
            has_aux=True,
            reduction=reduction,  # type: ignore[arg-type]
            count=lambda aux: aux["tokens"],
        )


@pytest.mark.parametrize(
    ("count", "exc", "tail"),
    [
        pytest.param(
            -3,
            ValueError,
            "the count must be >= 0, got -3; return the number of items the summed loss covers.",
            id="negative",
        ),
        pytest.param(
            "3",
            TypeError,
            "the count must be a number or a one-element real tensor, got str '3'; return the "
            "number of items the summed loss covers, e.g. (labels != pad_id).sum().",
            id="str",
        ),
        pytest.param(
            torch.ones(2, dtype=F64),
            TypeError,
            "the count must be a number or a one-element real tensor, got Tensor(shape=(2,), "
            "dtype=float64); return the number of items the summed loss covers, e.g. "
            "(labels != pad_id).sum().",
            id="two-elements",
        ),
        pytest.param(
            torch.tensor(3 + 0j),
            TypeError,
            "the count must be a number or a one-element real tensor, got Tensor(shape=(), "
            "dtype=complex64); return the number of items the summed loss covers, e.g. "
            "(labels != pad_id).sum().",
            id="complex",
        ),
    ],
)
def test_accumulate_bad_count(count: Any, exc: type[Exception], tail: str) -> None:
    p, batch = params(), (x(), y())
    step = gradaccum.accumulate(aux_fn, 2, has_aux=True, reduction="count", count=lambda aux: count)
    with unchanged(p, batch), raises(exc, "accumulate(aux_fn, n=2)(...): " + tail):
        step(p, batch)


def test_aux_reduction_without_has_aux() -> None:
    message = (
        "accumulate(step_fn, n=2): aux_reduction= needs has_aux=True (step_fn returning (grads, "
        "aux)); pass has_aux=True or drop aux_reduction=."
    )
    with raises(ValueError, message):
        gradaccum.accumulate(step_fn, 2, aux_reduction="sum")


@pytest.mark.parametrize(
    ("aux_reduction", "what"),
    [
        pytest.param("avg", "aux_reduction", id="name"),
        pytest.param({"loss": "mean", "tokens": "avg"}, "aux_reduction leaf ['tokens']", id="tree"),
    ],
)
def test_unknown_aux_reduction_name_is_rejected_by_accumulate(
    aux_reduction: Any, what: str
) -> None:
    message = (
        f"accumulate(aux_fn, n=2): {what} must be one of 'mean', 'sum', 'count', 'concat', "
        f"'stack', 'last', got str 'avg'; pass one of those names, or a tree of them shaped like "
        f"the aux."
    )
    with raises(ValueError, message):
        gradaccum.accumulate(aux_fn, 2, has_aux=True, aux_reduction=aux_reduction)


@pytest.mark.parametrize(
    "aux_reduction",
    [pytest.param("count", id="name"), pytest.param({"loss": "count", "tokens": "sum"}, id="tree")],
)
def test_aux_reduction_count_needs_count_reduction(aux_reduction: Any) -> None:
    p, batch = params(), (x(), y())
    message = (
        "accumulate(aux_fn, n=2)(...): aux_reduction 'count' for aux leaf ['loss'] needs "
        "reduction='count' (there is no count to divide by); use 'mean' or 'sum'."
    )
    with unchanged(p, batch), raises(ValueError, message):
        gradaccum.accumulate(aux_fn, 2, has_aux=True, aux_reduction=aux_reduction)(p, batch)


@pytest.mark.parametrize(
    ("aux_reduction", "difference"),
    [
        pytest.param(
            {"loss": "mean"},
            "expected a dict with keys ['loss'], got a dict with keys ['loss', 'tokens']",
            id="dict",
        ),
        pytest.param(
            ["mean", "sum"],
            "expected a list of length 2, got a dict with keys ['loss', 'tokens']",
            id="list",
        ),
    ],
)
def test_aux_reduction_not_a_prefix_of_aux(aux_reduction: Any, difference: str) -> None:
    message = (
        f"accumulate(aux_fn, n=2)(...): aux_reduction {aux_reduction!r} is not a prefix of the "
        f"aux tree PyTreeSpec({{'loss': *, 'tokens': *}}): at <root>: {difference}; pass one name "
        f"for all leaves, or a tree shaped like the aux (or a prefix of it) whose leaves are names."
    )
    with raises(ValueError, message):
        gradaccum.accumulate(aux_fn, 2, has_aux=True, aux_reduction=aux_reduction)(
            params(), (x(), y())
        )


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        pytest.param({"argnums": (0, 1)}, "batch_argnum=1 is also in argnums=(0, 1)", id="tuple"),
        pytest.param({"argnums": 1}, "batch_argnum=1 is also in argnums=1", id="int"),
        pytest.param({"batch_argnum": 0}, "batch_argnum=0 is also in argnums=0", id="default"),
    ],
)
def test_batch_argnum_in_argnums(kwargs: dict[str, Any], shown: str) -> None:
    message = (
        f"accumulate(step_fn, n=2): {shown}; the batch is split, not differentiated. Pass the "
        f"position of the batch as batch_argnum."
    )
    with raises(ValueError, message):
        gradaccum.accumulate(step_fn, 2, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "args", "kw", "expected", "got"),
    [
        pytest.param({}, (), {}, "[0] and the batch at position 1", 0, id="none"),
        pytest.param({}, ("p",), {}, "[0] and the batch at position 1", 1, id="params-only"),
        pytest.param({}, ("p",), {"batch": "b"}, "[0] and the batch at position 1", 1, id="kw"),
        pytest.param(
            {"batch_argnum": 2}, ("p", "b"), {}, "[0] and the batch at position 2", 2, id="argnum2"
        ),
        pytest.param(
            {"argnums": (0, 2)},
            ("p", "b"),
            {},
            "[0, 2] and the batch at position 1",
            2,
            id="argnums",
        ),
    ],
)
def test_too_few_positional_args(
    kwargs: dict[str, Any], args: tuple[str, ...], kw: dict[str, str], expected: str, got: int
) -> None:
    values = {"p": params(), "b": (x(), y())}
    calls: list[Any] = []
    message = (
        f"accumulate(step_fn, n=2)(...): expected the params at position(s) {expected}, got {got} "
        f"positional argument(s); pass them positionally, e.g. step(params, batch)."
    )
    with raises(TypeError, message):
        gradaccum.accumulate(returning(grads(), calls), 2, **kwargs)(
            *(values[a] for a in args), **{k: values[v] for k, v in kw.items()}
        )
    assert calls == []


# -- MicroBatches -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batches", "got"),
    [
        pytest.param(
            torch.ones(3, 2, dtype=F64), "Tensor(shape=(3, 2), dtype=float64)", id="tensor"
        ),
        pytest.param({"a": torch.ones(2, dtype=F64)}, "dict", id="dict"),
        pytest.param((t for t in [torch.ones(2, dtype=F64)]), "generator", id="generator"),
        pytest.param(iter([torch.ones(2, dtype=F64)]), "list_iterator", id="iterator"),
        pytest.param(3, "int 3", id="int"),
        pytest.param(None, "NoneType None", id="None"),
    ],
)
def test_micro_batches_of_a_non_sequence(batches: Any, got: str) -> None:
    message = f"MicroBatches(batches): expected a list or tuple of micro-batch pytrees, got {got}"
    with raises(TypeError, message + MB_TYPE_TAIL):
        gradaccum.MicroBatches(batches)


def test_micro_batches_of_a_str() -> None:
    message = "MicroBatches(batches): expected a list or tuple of micro-batch pytrees, got str 'ab'"
    with raises(TypeError, message + MB_TYPE_TAIL):
        gradaccum.MicroBatches("ab")


@pytest.mark.parametrize("empty", [[], ()], ids=["list", "tuple"])
def test_empty_micro_batches(empty: Any) -> None:
    message = (
        "accumulate(f, n=2)(...): the MicroBatches is empty; without a sync there is nothing to "
        "accumulate: pass MicroBatches([mb0, ...]) with one or more micro-batches (with sync=, "
        "an empty MicroBatches joins the boundary with zero weight)."
    )

    def f(p: Any, b: Any) -> Any:
        return {"w": p["w"]}

    step = gradaccum.accumulate(f, 2)
    with raises(ValueError, message):
        step({"w": torch.zeros(2)}, gradaccum.MicroBatches(empty))


@pytest.mark.parametrize(
    "empty",
    [pytest.param(x(0), id="tensor"), pytest.param((x(0), y(0)), id="tuple")],
)
def test_micro_batch_with_0_rows(empty: Any) -> None:
    calls: list[Any] = []
    first = x(3) if isinstance(empty, torch.Tensor) else (x(3), y(3))  # the same structure
    p, mbs = params(), gradaccum.MicroBatches([first, empty])
    message = (
        "accumulate(step_fn, n=2)(...): micro-batch 1 of the MicroBatches has 0 rows; a "
        "micro-batch needs at least one row. Drop empty micro-batches before passing them."
    )
    with unchanged(p, list(mbs)), raises(ValueError, message):
        gradaccum.accumulate(returning(grads(), calls), 2)(p, mbs)
    assert calls == []


def test_micro_batch_without_tensor_leaf() -> None:
    calls: list[Any] = []
    p, mbs = params(), gradaccum.MicroBatches([(x(3), y(3)), (1, 2)])
    message = (
        "accumulate(step_fn, n=2)(...) micro-batch 1: expected a batch pytree with at least one "
        "tensor leaf, got leaves int 1, int 2" + NO_TENSOR_TAIL
    )
    with unchanged(p, list(mbs)), raises(ValueError, message):
        gradaccum.accumulate(returning(grads(), calls), 2)(p, mbs)
    assert calls == []


# -- Accumulator.add / finalize -----------------------------------------------------------------


def test_add_without_size_under_mean(mid_window: Any) -> None:
    acc, state = mid_window
    message = (
        "Accumulator.add(state, grads): reduction='mean' needs size=, the micro-batch's number of "
        "rows, to weight it exactly; pass size=len(micro_batch)."
    )
    with unchanged(state), raises(ValueError, message):
        acc.add(state, grads())


def test_add_without_count_under_count() -> None:
    acc = gradaccum.Accumulator(n=4, reduction="count")
    state = acc.add(acc.init(params()), grads(), count=5)
    message = (
        "Accumulator.add(state, grads): reduction='count' needs count=, the number of items the "
        "micro-batch's summed loss covers; pass e.g. count=(labels != pad_id).sum()."
    )
    with unchanged(state), raises(ValueError, message):
        acc.add(state, grads(), size=3)


@pytest.mark.parametrize("reduction", ["mean", "sum", "count"])
def test_add_with_size_0(reduction: str) -> None:
    acc = gradaccum.Accumulator(n=4, reduction=reduction)  # type: ignore[arg-type]
    kw: dict[str, Any] = {"count": 2} if reduction == "count" else {}
    state = acc.add(acc.init(params()), grads(), size=2, **kw)
    message = (
        "Accumulator.add(state, grads): size must be the micro-batch's number of rows, a positive "
        "int, got int 0; pass size=len(micro_batch)."
    )
    with unchanged(state), raises(ValueError, message):
        acc.add(state, grads(), size=0, **kw)


@pytest.mark.parametrize(
    ("size", "got"),
    [("3", "str '3'"), (2.5, "float 2.5"), (True, "bool True")],
    ids=["str", "float", "bool"],
)
def test_add_with_size_of_the_wrong_type(mid_window: Any, size: Any, got: str) -> None:
    acc, state = mid_window
    message = (
        f"Accumulator.add(state, grads): size must be the micro-batch's number of rows, a "
        f"positive int, got {got}; pass size=len(micro_batch)."
    )
    with raises(TypeError, message):
        acc.add(state, grads(), size=size)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_add_with_count_under_another_reduction(reduction: str) -> None:
    acc = gradaccum.Accumulator(n=4, reduction=reduction)  # type: ignore[arg-type]
    state = acc.init(params())
    message = (
        f"Accumulator.add(state, grads): count= is used only with reduction='count', got "
        f"reduction={reduction!r}; pass size= (the micro-batch's rows), or use "
        f"Accumulator(n, reduction='count')."
    )
    with raises(ValueError, message):
        acc.add(state, grads(), size=2, count=7)


def test_add_with_something_else_than_a_state() -> None:
    acc = gradaccum.Accumulator(n=4)
    message = (
        "Accumulator.add(state, grads): state must be an AccumState (from Accumulator.init, add "
        "or finalize), got dict; start with state = acc.init(params), then state = acc.add(state, "
        "grads, ...)."
    )
    with raises(TypeError, message):
        acc.add(params(), grads(), size=2)  # type: ignore[arg-type]


@pytest.mark.parametrize("reduction", ["mean", "sum", "count"])
def test_finalize_an_empty_window(reduction: str) -> None:
    acc = gradaccum.Accumulator(n=2, reduction=reduction)  # type: ignore[arg-type]
    state = acc.init(params())
    with (
        unchanged(state),
        raises(ValueError, "Accumulator(n=2).finalize(state): " + FINALIZE_EMPTY),
    ):
        acc.finalize(state)
    # Also the window after a finalized one.
    kw: dict[str, Any] = {"count": 2} if reduction == "count" else {}
    state = acc.add(state, grads(), size=2, **kw)
    _, state = acc.finalize(state)
    with (
        unchanged(state),
        raises(ValueError, "Accumulator(n=2).finalize(state): " + FINALIZE_EMPTY),
    ):
        acc.finalize(state)


def test_finalize_a_count_window_with_zero_count() -> None:
    acc = gradaccum.Accumulator(n=2, reduction="count")
    state = acc.add(acc.init(params()), grads(), count=0)
    message = (
        "Accumulator(n=2).finalize(state): the window's counts add up to 0, so there is no item "
        "mean to divide by; skip windows with no items (e.g. all padding), or use reduction='sum'."
    )
    with raises(ValueError, message):
        acc.finalize(state)


# -- Accumulator.load_state_dict ----------------------------------------------------------------


def _saved(p: Any, **kwargs: Any) -> dict[str, Any]:
    acc = gradaccum.Accumulator(n=4, **kwargs)
    weight = {"count": 2} if kwargs.get("reduction") == "count" else {"size": 2}
    state = acc.add(acc.init(p), optree.tree_map(torch.ones_like, p), **weight)
    return acc.state_dict(state)


LOAD_MISMATCH = [
    pytest.param(
        lambda: _saved({"w": torch.zeros(3, dtype=F64), "c": torch.zeros((), dtype=F64)}),
        "the saved state is for a different params tree: params leaves [\"['b']\"] are not in the "
        "saved state; saved leaves [\"['c']\"] are not in the params" + SAME_PARAMS_FIX,
        id="different-keys",
    ),
    pytest.param(
        lambda: _saved({"w": torch.zeros(3, dtype=F64)}),
        "the saved state is for a different params tree: params leaves [\"['b']\"] are not in the "
        "saved state" + SAME_PARAMS_FIX,
        id="missing-key",
    ),
    pytest.param(
        lambda: _saved({**params(), "c": torch.zeros(1, dtype=F64)}),
        "the saved state is for a different params tree: saved leaves [\"['c']\"] are not in the "
        "params" + SAME_PARAMS_FIX,
        id="extra-key",
    ),
    pytest.param(
        lambda: _saved({"w": torch.zeros(4, dtype=F64), "b": torch.zeros((), dtype=F64)}),
        "params leaf ['w'] is shape [3] float64 but the state was saved for shape [4] float64"
        + SAME_PARAMS_FIX,
        id="different-shape",
    ),
    pytest.param(
        lambda: _saved({"w": torch.zeros(3), "b": torch.zeros(())}),
        "params leaf ['b'] is shape [] float64 but the state was saved for shape [] float32"
        + SAME_PARAMS_FIX,
        id="different-dtype",
    ),
    pytest.param(
        lambda: _saved(params(), reduction="sum"),
        "the state was saved with reduction='sum' but this Accumulator has reduction='mean'; load "
        "it into an Accumulator with the same reduction.",
        id="different-reduction",
    ),
    pytest.param(
        lambda: _saved(params(), accum_dtype=torch.float32),
        "saved running sum for ['b'] is Tensor(shape=(), dtype=float32), expected shape [] float64 "
        "(the accumulation dtype); save and load with the same accum_dtype.",
        id="different-accum-dtype",
    ),
    pytest.param(
        lambda: [1, 2],
        "expected a dict saved by Accumulator.state_dict (format 'gradaccum.AccumState/1'), got "
        "list" + LOAD_FIX,
        id="list",
    ),
    pytest.param(
        lambda: None,
        "expected a dict saved by Accumulator.state_dict (format 'gradaccum.AccumState/1'), got "
        "NoneType None" + LOAD_FIX,
        id="None",
    ),
    pytest.param(
        lambda: torch.ones(2, dtype=F64),
        "expected a dict saved by Accumulator.state_dict (format 'gradaccum.AccumState/1'), got "
        "Tensor(shape=(2,), dtype=float64)" + LOAD_FIX,
        id="tensor",
    ),
    pytest.param(
        lambda: torch.nn.Linear(2, 1).state_dict(),
        "expected a dict saved by Accumulator.state_dict (format 'gradaccum.AccumState/1'), got "
        "format None" + LOAD_FIX,
        id="module-state-dict",
    ),
    pytest.param(
        lambda: {},
        "expected a dict saved by Accumulator.state_dict (format 'gradaccum.AccumState/1'), got "
        "format None" + LOAD_FIX,
        id="empty-dict",
    ),
    pytest.param(
        lambda: {**_saved(params()), "format": "gradaccum.streaming.AccumState/0"},
        "expected a dict saved by Accumulator.state_dict (format 'gradaccum.AccumState/1'), got "
        "format 'gradaccum.streaming.AccumState/0'" + LOAD_FIX,
        id="other-format",
    ),
]


@pytest.mark.parametrize(("make", "tail"), LOAD_MISMATCH)
@pytest.mark.parametrize("where", ["fresh", "mid-window"])
def test_load_state_dict_for_other_params(
    mid_window: Any, make: Callable[[], Any], tail: str, where: str
) -> None:
    acc, state = mid_window
    if where == "fresh":
        state = acc.init(params())
    sd = make()
    with unchanged(state, sd), raises(gradaccum.GradAccumError, LOAD + tail):
        acc.load_state_dict(state, sd)


def _corrupt(change: Callable[[dict[str, Any]], None]) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        sd = _saved(params())
        change(sd)
        return sd

    return make


@pytest.mark.parametrize(
    ("make", "tail"),
    [
        pytest.param(
            lambda: {"format": "gradaccum.AccumState/1"},
            "the state dict lacks the keys ['accum_dtypes', 'dtypes', 'micro_step', 'paths', "
            "'reduction', 'shapes', 'sums', 'weight', 'window']",
            id="format-only",
        ),
        pytest.param(
            _corrupt(lambda sd: sd.pop("sums")),
            "the state dict lacks the keys ['sums']",
            id="no-sums",
        ),
        pytest.param(
            _corrupt(lambda sd: sd["shapes"].pop()),
            "the state dict has 2 paths but 1 shapes",
            id="short-shapes",
        ),
        pytest.param(
            _corrupt(lambda sd: sd["sums"].pop()),
            "the state dict has 2 paths but 1 running sums",
            id="short-sums",
        ),
        pytest.param(
            _corrupt(lambda sd: sd.update(micro_step="x")),
            "micro_step must be a non-negative int, got str 'x'",
            id="micro-step-str",
        ),
        pytest.param(
            _corrupt(lambda sd: sd.update(weight="x")),
            "weight must be a number or a 0-dim tensor, got str 'x'",
            id="weight-str",
        ),
    ],
)
def test_load_corrupt_state_dict(mid_window: Any, make: Callable[[], Any], tail: str) -> None:
    acc, state = mid_window
    sd = make()
    with unchanged(state), raises(gradaccum.GradAccumError, LOAD + tail + LOAD_FIX):
        acc.load_state_dict(state, sd)


# -- nn.Module interop --------------------------------------------------------------------------


def _linear(with_grad: bool) -> torch.nn.Linear:
    torch.manual_seed(0)
    lin = torch.nn.Linear(2, 1).to(F64)
    if with_grad:
        lin.weight.grad = torch.full((1, 2), 3.0, dtype=F64)
        lin.bias.grad = torch.full((1,), 3.0, dtype=F64)
    return lin


W, B = torch.ones(1, 2, dtype=F64), torch.ones(1, dtype=F64)


@pytest.mark.parametrize("with_grad", [False, True], ids=["grad-None", "grad-set"])
@pytest.mark.parametrize(
    ("new", "exc", "tail"),
    [
        pytest.param(
            {"weight": W},
            ValueError,
            "grads and the module's trainable parameters differ: missing ['bias'], unknown []"
            + WRITE_FIX,
            id="missing",
        ),
        pytest.param(
            {"weight": W, "bias": B, "scale": B},
            ValueError,
            "grads and the module's trainable parameters differ: missing [], unknown ['scale']"
            + WRITE_FIX,
            id="extra",
        ),
        pytest.param(
            {"weight": W, "b": B},
            ValueError,
            "grads and the module's trainable parameters differ: missing ['bias'], unknown ['b']"
            + WRITE_FIX,
            id="renamed",
        ),
        pytest.param(
            {"weight": W, "bias": torch.ones(2, dtype=F64)},
            ValueError,
            "grads['bias'] is Tensor(shape=(2,), dtype=float64), expected shape (1,)" + WRITE_FIX,
            id="wrong-shape-last",
        ),
        pytest.param(
            {"weight": torch.ones(2, 1, dtype=F64), "bias": B},
            ValueError,
            "grads['weight'] is Tensor(shape=(2, 1), dtype=float64), expected shape (1, 2)"
            + WRITE_FIX,
            id="wrong-shape-first",
        ),
        pytest.param(
            [W, B],
            TypeError,
            "grads must be a dict of tensors by parameter name, got list; use the params dict "
            "from gradaccum.params_of(module).",
            id="list",
        ),
    ],
)
def test_write_grads_writes_nothing_on_error(
    new: Any, exc: type[Exception], tail: str, with_grad: bool
) -> None:
    lin = _linear(with_grad)
    with unchanged(lambda: module_state(lin)), raises(exc, "write_grads(module, grads): " + tail):
        gradaccum.write_grads(lin, new)
    if not with_grad:
        assert lin.weight.grad is None
        assert lin.bias.grad is None


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex128], ids=["int64", "complex128"])
def test_write_grads_rejects_non_floating_grads(dtype: torch.dtype) -> None:
    lin = _linear(with_grad=False)
    message = (
        f"write_grads(module, grads): grads['bias'] has dtype {str(dtype)[6:]}; gradients must be "
        f"real floating tensors. Compute grads with respect to gradaccum.params_of(module)."
    )
    with unchanged(lambda: module_state(lin)), raises(TypeError, message):
        gradaccum.write_grads(lin, {"weight": W, "bias": torch.ones(1, dtype=dtype)})


def _bn() -> torch.nn.BatchNorm1d:
    return torch.nn.BatchNorm1d(3).to(F64)


@pytest.mark.parametrize("target", ["dict", "module"])
def test_update_buffers_with_unknown_names(target: str) -> None:
    bn = _bn()
    buffers = gradaccum.buffers_of(bn) if target == "dict" else bn
    new = {"running_mean": torch.full((3,), 7.0, dtype=F64), "running_avg": torch.ones(3)}
    with unchanged(lambda: module_state(bn)), pytest.raises(KeyError) as info:
        gradaccum.update_buffers(buffers, new)
    # KeyError's str() adds quotes: compare the message itself.
    assert info.value.args == (
        "update_buffers(buffers, new_buffers): new_buffers has ['running_avg'], which buffers "
        "does not have (it has ['num_batches_tracked', 'running_mean', 'running_var']); pass the "
        "buffers of the same module.",
    )


@pytest.mark.parametrize(
    ("value", "got", "shape"),
    [
        pytest.param(torch.ones(4, dtype=F64), "Tensor(shape=(4,), dtype=float64)", "(3,)", id="4"),
        pytest.param(
            torch.tensor(5.0, dtype=F64), "Tensor(shape=(), dtype=float64)", "(3,)", id="0d"
        ),
        pytest.param(1.0, "float 1.0", "(3,)", id="float"),
    ],
)
def test_update_buffers_with_wrong_shape_updates_nothing(value: Any, got: str, shape: str) -> None:
    bn = _bn()
    new = {"running_mean": torch.full((3,), 7.0, dtype=F64), "running_var": value}
    message = (
        f"update_buffers(buffers, new_buffers): new_buffers['running_var'] is {got}, expected "
        f"shape {shape}; pass the new_buffers that call_module returned for the same module."
    )
    with unchanged(lambda: module_state(bn)), raises(ValueError, message):
        gradaccum.update_buffers(gradaccum.buffers_of(bn), new)


def test_update_buffers_with_a_non_mapping() -> None:
    bn = _bn()
    message = (
        "update_buffers(buffers, new_buffers): new_buffers must be a dict of tensors by buffer "
        "name, got list; pass the new_buffers that call_module returned."
    )
    with unchanged(lambda: module_state(bn)), raises(TypeError, message):
        gradaccum.update_buffers(bn, [torch.ones(3, dtype=F64)])  # type: ignore[arg-type]
