"""Property tests: any partition of a batch gives the whole-batch gradient."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import max_diff, mean_loss, mlp_params, regression_batch, sum_loss
from torch.func import grad

import gradaccum

TIGHT = 1e-11


@st.composite
def partitions(draw: st.DrawFn) -> list[int]:
    rows = draw(st.integers(1, 40))
    cuts = (
        draw(st.lists(st.integers(1, rows - 1), max_size=rows - 1, unique=True)) if rows > 1 else []
    )
    bounds = [0, *sorted(cuts), rows]
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


@settings(max_examples=60, deadline=None)
@given(sizes=partitions(), seed=st.integers(0, 2**16))
def test_any_partition_gives_the_whole_batch_gradient(sizes: list[int], seed: int) -> None:
    params, (x, y) = mlp_params(seed), regression_batch(sum(sizes), seed=seed + 1)
    mbs = gradaccum.MicroBatches(list(zip(x.split(sizes), y.split(sizes), strict=True)))
    for loss, reduction in ((mean_loss, "mean"), (sum_loss, "sum")):
        got = gradaccum.accumulate(grad(loss), 1, reduction=reduction)(params, mbs)
        assert max_diff(got, grad(loss)(params, (x, y))) < TIGHT * max(1, sum(sizes))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), data=st.data())
def test_any_n_gives_the_whole_batch_gradient(rows: int, data: st.DataObject) -> None:
    n = data.draw(st.integers(1, rows))
    params, batch = mlp_params(rows), regression_batch(rows, seed=rows)
    got = gradaccum.accumulate(grad(mean_loss), n)(params, batch)
    assert max_diff(got, grad(mean_loss)(params, batch)) < TIGHT


@settings(max_examples=40, deadline=None)
@given(order=st.permutations(["c", "a", "b", "d"]))
def test_dict_insertion_order_does_not_matter(order: list[str]) -> None:
    base = {"a": torch.ones(2), "b": torch.zeros(3), "c": torch.ones(()), "d": torch.ones(1, 2)}
    params = {k: base[k] for k in order}
    acc = gradaccum.Accumulator(n=1)
    state = acc.add(acc.init(params), {k: v + 1 for k, v in reversed(params.items())}, size=2)
    paths = acc.state_dict(state)["paths"]  # before finalize, which consumes the state
    grads, _ = acc.finalize(state)
    assert list(paths) == ["['a']", "['b']", "['c']", "['d']"]
    assert all(torch.equal(grads[k], base[k] + 1) for k in base)
