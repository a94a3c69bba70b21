"""Misuse of the boundary helpers and of the inputs they rest on: LossScale's range and floor,
its checkpoint, non-finite counts and MicroBatches of different structures.

Each error is matched with its full message (it names the argument) and leaves the inputs and
the state as they were.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import optree
import pytest
import torch

import gradaccum

F64 = torch.float64
SCALE = "LossScale(init_scale, growth_factor, backoff_factor, growth_interval, min_scale): "
UNSCALE = "LossScale.unscale(grads, state): "
FLOOR = 2.0**-126  # LossScale's default min_scale: the smallest normal float32


def raises(exc: type[BaseException], message: str) -> AbstractContextManager[Any]:
    """``pytest.raises`` that matches the whole message, character for character."""
    return pytest.raises(exc, match=rf"\A{re.escape(message)}\Z")


@contextmanager
def unchanged(*trees: Any) -> Iterator[None]:
    """Assert the pytrees (tensors compared exactly, other leaves by ==) are unchanged on exit."""

    def snapshot(tree: Any) -> tuple[Any, list[Any]]:
        leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
        return spec, [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves]

    before = [snapshot(t) for t in trees]
    yield
    for (spec, old), tree in zip(before, trees, strict=True):
        new, new_spec = optree.tree_flatten(tree, none_is_leaf=True)
        assert new_spec == spec
        for a, b in zip(old, new, strict=True):
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype
                assert torch.equal(a, b)
            else:
                assert a == b


def params() -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([0.1, 0.2, 0.3], dtype=F64)}


def rows(n: int) -> torch.Tensor:
    return torch.arange(n * 3, dtype=F64).reshape(n, 3) / 10


def targets(n: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, n, dtype=F64)


def recording(calls: list[Any]) -> Any:
    """A closed-form mean-squared-error gradient step that records its calls."""

    def step_fn(p: dict[str, torch.Tensor], batch: Any) -> dict[str, torch.Tensor]:
        calls.append(batch)
        x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch[:2]
        return {"w": 2 * x.T @ (x @ p["w"] - y) / len(y)}

    return step_fn


# -- LossScale: arguments -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(
            {"init_scale": float("inf")},
            SCALE + "init_scale must be a finite positive number, got float inf; an infinite "
            "scale makes every scaled loss non-finite, so every window would be skipped. Pass "
            "e.g. init_scale=2.0**16 (torch.amp.GradScaler's default).",
            id="init-inf",
        ),
        pytest.param(
            {"init_scale": float("nan")},
            SCALE + "init_scale must be a positive number, got float nan; pass e.g. "
            "init_scale=2.0**16 (torch.amp.GradScaler's default).",
            id="init-nan",
        ),
        pytest.param(
            {"init_scale": float("-inf")},
            SCALE + "init_scale must be a positive number, got float -inf; pass e.g. "
            "init_scale=2.0**16 (torch.amp.GradScaler's default).",
            id="init-minus-inf",
        ),
        pytest.param(
            {"init_scale": -8.0},
            SCALE + "init_scale must be a positive number, got float -8.0; pass e.g. "
            "init_scale=2.0**16 (torch.amp.GradScaler's default).",
            id="init-negative",
        ),
        pytest.param(
            {"growth_factor": float("inf")},
            SCALE + "growth_factor must be a finite number >= 1, got float inf; pass e.g. "
            "growth_factor=2.0 (the default), or 1.0 to never grow the scale.",
            id="growth-inf",
        ),
        pytest.param(
            {"growth_factor": float("nan")},
            SCALE + "growth_factor must be a finite number >= 1, got float nan; pass e.g. "
            "growth_factor=2.0 (the default), or 1.0 to never grow the scale.",
            id="growth-nan",
        ),
        pytest.param(
            {"min_scale": 0.0},
            SCALE + "min_scale must be a finite positive number, got float 0.0; pass e.g. "
            "min_scale=1.0, or leave the default (2.0**-126).",
            id="floor-zero",
        ),
        pytest.param(
            {"min_scale": float("nan")},
            SCALE + "min_scale must be a finite positive number, got float nan; pass e.g. "
            "min_scale=1.0, or leave the default (2.0**-126).",
            id="floor-nan",
        ),
        pytest.param(
            {"min_scale": float("inf")},
            SCALE + "min_scale must be a finite positive number, got float inf; pass e.g. "
            "min_scale=1.0, or leave the default (2.0**-126).",
            id="floor-inf",
        ),
        pytest.param(
            {"min_scale": "1"},
            SCALE + "min_scale must be a finite positive number, got str '1'; pass e.g. "
            "min_scale=1.0, or leave the default (2.0**-126).",
            id="floor-str",
        ),
        pytest.param(
            {"init_scale": 0.5, "min_scale": 1.0},
            SCALE + "init_scale must be >= min_scale=1.0, got float 0.5; pass a larger "
            "init_scale or a smaller min_scale.",
            id="init-below-floor",
        ),
    ],
)
def test_loss_scale_refuses_out_of_range_arguments(kwargs: dict[str, Any], message: str) -> None:
    with raises(ValueError, message):
        gradaccum.boundary.LossScale(**kwargs)


@pytest.mark.parametrize(
    ("scale", "got"),
    [
        (0.0, "float 0.0"),
        (-1.0, "float -1.0"),
        (float("inf"), "float inf"),
        (None, "NoneType None"),
    ],
)
def test_unscale_refuses_a_state_whose_scale_is_not_finite_positive(scale: Any, got: str) -> None:
    scaler = gradaccum.boundary.LossScale()
    state = gradaccum.boundary.LossScaleState(scale, 3)
    grads = {"w": torch.tensor([1.0, 2.0])}
    message = (
        UNSCALE + f"state.scale must be a finite positive number, got {got}; start with state = "
        "scaler.init() and pass on the state unscale() returns."
    )
    with unchanged(grads), raises(ValueError, message):
        scaler.unscale(grads, state)
    assert state == gradaccum.boundary.LossScaleState(scale, 3)


# -- LossScale: the floor and the ceiling -------------------------------------------------------


def test_repeated_overflows_stop_at_the_floor_instead_of_dividing_by_zero() -> None:
    """Halving 2**16 about 1100 times used to reach 0.0 and raise ZeroDivisionError."""
    scaler = gradaccum.boundary.LossScale()
    state = scaler.init()
    overflow = {"w": torch.tensor([float("inf")])}
    for _ in range(1200):
        _, finite, state = scaler.unscale(overflow, state)
        assert not finite
    assert state == gradaccum.boundary.LossScaleState(FLOOR, 0)
    # At the floor, a finite window is still unscaled exactly, and counts towards growth.
    grads, finite, state = scaler.unscale({"w": torch.tensor([2.0**-120], dtype=F64)}, state)
    assert finite
    assert grads["w"].tolist() == [64.0]
    assert state == gradaccum.boundary.LossScaleState(FLOOR, 1)
    assert 1.0 / state.scale < torch.finfo(torch.float32).max


def test_min_scale_is_the_floor_of_the_backoff() -> None:
    scaler = gradaccum.boundary.LossScale(init_scale=8.0, min_scale=1.0)
    state = scaler.init()
    scales = []
    for _ in range(5):
        _, _, state = scaler.unscale({"w": torch.tensor([float("nan")])}, state)
        scales.append(state.scale)
    assert scales == [4.0, 2.0, 1.0, 1.0, 1.0]


def test_a_growth_that_would_overflow_the_float_keeps_the_scale() -> None:
    scaler = gradaccum.boundary.LossScale(init_scale=2.0**1023, growth_interval=1)
    _, finite, state = scaler.unscale({"w": torch.zeros(2, dtype=F64)}, scaler.init())
    assert finite
    assert state == gradaccum.boundary.LossScaleState(2.0**1023, 0)


# -- LossScaleState: checkpoints ----------------------------------------------------------------


def test_loss_scale_state_round_trips_through_a_weights_only_load(tmp_path: Path) -> None:
    scaler = gradaccum.boundary.LossScale(init_scale=1024.0)
    _, _, state = scaler.unscale({"w": torch.ones(2)}, scaler.init())
    path = tmp_path / "checkpoint.pt"
    torch.save({"loss_scale": state, "model": {"w": torch.ones(2)}}, path)
    loaded = torch.load(path, weights_only=True)["loss_scale"]
    assert type(loaded) is gradaccum.boundary.LossScaleState
    assert loaded == gradaccum.boundary.LossScaleState(1024.0, 1)
    assert type(loaded.scale) is float
    assert type(loaded.good_steps) is int
    # Training resumes from it as from the original.
    assert scaler.unscale({"w": torch.ones(2)}, loaded)[2] == gradaccum.boundary.LossScaleState(
        1024.0, 2
    )


# -- counts -------------------------------------------------------------------------------------

COUNT_TAIL = (
    "the count must be a finite number >= 0, got {got}; return the number of items the summed "
    "loss covers, e.g. (labels != pad_id).sum(), as a finite number (a NaN count often comes from "
    "a mean or a division by 0 upstream)."
)
NON_FINITE = [
    pytest.param(float("nan"), "nan", id="nan"),
    pytest.param(float("inf"), "inf", id="inf"),
    pytest.param(float("-inf"), "-inf", id="minus-inf"),
]


@pytest.mark.parametrize(("count", "got"), NON_FINITE)
def test_accumulator_add_refuses_a_non_finite_count(count: float, got: str) -> None:
    acc = gradaccum.Accumulator(n=2, reduction="count")
    grads = {"w": torch.ones(3, dtype=F64)}
    state = acc.add(acc.init(params()), grads, count=4)
    message = "Accumulator.add(state, grads): " + COUNT_TAIL.format(got=got)
    with unchanged(state, grads), raises(ValueError, message):
        acc.add(state, grads, count=count)
    # The state was not consumed: the window goes on from it.
    state = acc.add(state, grads, count=2)
    result, _ = acc.finalize(state)
    assert torch.equal(result["w"], torch.full((3,), 2 / 6, dtype=F64))


@pytest.mark.parametrize(("count", "got"), NON_FINITE)
def test_accumulate_refuses_a_non_finite_count(count: float, got: str) -> None:
    def step_fn(p: dict[str, torch.Tensor], batch: Any) -> tuple[Any, Any]:
        x, y = batch
        r = x @ p["w"] - y
        return {"w": 2 * x.T @ r}, {"loss": (r * r).sum(), "count": count}

    p, batch = params(), (rows(4), targets(4))
    step = gradaccum.accumulate(
        step_fn, 2, has_aux=True, reduction="count", count=lambda aux: aux["count"]
    )
    message = "accumulate(step_fn, n=2)(...): " + COUNT_TAIL.format(got=got)
    with unchanged(p, batch), raises(ValueError, message):
        step(p, batch)


def test_a_finite_float_count_is_still_accepted() -> None:
    acc = gradaccum.Accumulator(n=1, reduction="count")
    state = acc.add(acc.init(params()), {"w": torch.ones(3, dtype=F64)}, count=2.5)
    result, _ = acc.finalize(state)
    assert torch.equal(result["w"], torch.full((3,), 0.4, dtype=F64))


# -- MicroBatches of different structures -------------------------------------------------------

MB_FIX = (
    "; give every micro-batch the structure of micro-batch 0 (the same dict keys, tuple lengths "
    "and nesting), e.g. put an optional entry in every micro-batch or in none."
)


def _dict_mb(n: int, **extra: Any) -> dict[str, Any]:
    return {"x": rows(n), "y": targets(n), **extra}


@pytest.mark.parametrize(
    ("batches", "index", "difference"),
    [
        pytest.param(
            [_dict_mb(3), {"x": rows(2)}],
            1,
            "at <root>: expected a dict with keys ['x', 'y'], got a dict with keys ['x']",
            id="dict-missing-key",
        ),
        pytest.param(
            [_dict_mb(3), _dict_mb(2, mask=torch.ones(2))],
            1,
            "at <root>: expected a dict with keys ['x', 'y'], got a dict with keys "
            "['mask', 'x', 'y']",
            id="dict-extra-key",
        ),
        pytest.param(
            [(rows(3), targets(3)), (rows(2), targets(2), torch.ones(2))],
            1,
            "at <root>: expected a tuple of length 2, got a tuple of length 3",
            id="tuple-length",
        ),
        pytest.param(
            [(rows(3), targets(3)), [rows(2), targets(2)]],
            1,
            "at <root>: expected a tuple of length 2, got a list of length 2",
            id="tuple-vs-list",
        ),
        pytest.param(
            [
                _dict_mb(3, meta={"a": torch.ones(3)}),
                _dict_mb(2, meta={"a": torch.ones(2)}),
                _dict_mb(2, meta={"b": torch.ones(2)}),
            ],
            2,
            "at ['meta']: expected a dict with keys ['a'], got a dict with keys ['b']",
            id="nested-key-in-micro-batch-2",
        ),
        pytest.param(
            [_dict_mb(3, mask=torch.ones(3)), _dict_mb(2, mask=None)],
            1,
            "at ['mask']: expected a leaf, got a NoneType",
            id="tensor-vs-None",
        ),
    ],
)
def test_micro_batches_of_different_structures(
    batches: list[Any], index: int, difference: str
) -> None:
    message = (
        f"MicroBatches(batches): micro-batch {index} of the MicroBatches differs in "
        f"structure from micro-batch 0 {difference}" + MB_FIX
    )
    with unchanged(batches), raises(ValueError, message):
        gradaccum.MicroBatches(batches)  # refused at construction


def test_micro_batch_changed_after_construction_is_refused_at_the_call() -> None:
    calls: list[Any] = []
    p, mbs = params(), gradaccum.MicroBatches([_dict_mb(3), _dict_mb(2)])
    del mbs[1]["y"]
    message = (
        "accumulate(step_fn, n=2)(...): micro-batch 1 of the MicroBatches differs in "
        "structure from micro-batch 0 at <root>: expected a dict with keys ['x', 'y'], got a "
        "dict with keys ['x']" + MB_FIX
    )
    with unchanged(p, list(mbs)), raises(ValueError, message):
        gradaccum.accumulate(recording(calls), 2)(p, mbs)
    assert calls == []  # refused before any step_fn call


def test_micro_batches_may_differ_in_non_tensor_leaf_values() -> None:
    """Only the tree structure must agree: a flag or an int may change per micro-batch."""
    calls: list[Any] = []
    x, y = rows(8), targets(8)
    mbs = gradaccum.MicroBatches(
        [{"x": x[:3], "y": y[:3], "tag": 0}, {"x": x[3:], "y": y[3:], "tag": 1}]
    )
    whole = recording([])(params(), {"x": x, "y": y})
    got = gradaccum.accumulate(recording(calls), 2)(params(), mbs)
    assert [mb["tag"] for mb in calls] == [0, 1]
    assert torch.allclose(got["w"], whole["w"], rtol=0, atol=1e-14)
