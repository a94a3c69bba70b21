"""The streaming form: Accumulator init / add / is_complete / finalize / state_dict."""

from __future__ import annotations

import io

import pytest
import torch
from models import F64, max_diff, mean_loss, mlp_params, regression_batch, token_batch
from models import token_sum_loss as token_loss
from torch.func import grad, grad_and_value

import gradaccum

TIGHT = 1e-12


def _micro_batches(batch, sizes):
    x, y = batch
    return list(zip(x.split(sizes), y.split(sizes), strict=True))


def test_streaming_equals_whole_batch_and_accumulate() -> None:
    params, batch = mlp_params(), regression_batch(22)
    acc = gradaccum.Accumulator(n=4)
    state = acc.init(params)
    for mb in _micro_batches(batch, [6, 6, 6, 4]):
        assert not acc.is_complete(state)
        state = acc.add(state, grad(mean_loss)(params, mb), size=len(mb[0]))
    assert acc.is_complete(state)
    grads, state = acc.finalize(state)
    assert max_diff(grads, grad(mean_loss)(params, batch)) < TIGHT
    assert max_diff(grads, gradaccum.accumulate(grad(mean_loss), 4)(params, batch)) < TIGHT
    assert (state.sums, state.weight, state.micro_step, state.window) == (None, 0, 0, 1)


def test_short_last_window_is_weighted_exactly() -> None:
    # An epoch of 11 rows in micro-batches of 3 with n=3: windows [3, 3, 3] and [2].
    params, batch = mlp_params(), regression_batch(11)
    mbs = _micro_batches(batch, [3, 3, 3, 2])
    acc = gradaccum.Accumulator(n=3)
    state, results = acc.init(params), []
    for i, mb in enumerate(mbs):
        state = acc.add(state, grad(mean_loss)(params, mb), size=len(mb[0]))
        if acc.is_complete(state) or i == len(mbs) - 1:
            g, state = acc.finalize(state)
            results.append(g)
    assert len(results) == 2
    first = (torch.cat([m[0] for m in mbs[:3]]), torch.cat([m[1] for m in mbs[:3]]))
    assert max_diff(results[0], grad(mean_loss)(params, first)) < TIGHT
    assert max_diff(results[1], grad(mean_loss)(params, mbs[3])) < TIGHT


def test_schedule_changes_n_between_windows() -> None:
    acc = gradaccum.Accumulator(n=lambda window: 2 ** min(window, 2))  # 1, 2, 4, 4, ...
    params = {"w": torch.zeros(2, dtype=F64)}
    state, window_sizes, count = acc.init(params), [], 0
    for _ in range(11):
        state = acc.add(state, {"w": torch.ones(2, dtype=F64)}, size=1)
        count += 1
        if acc.is_complete(state):
            assert acc.window_size(state) == count
            _, state = acc.finalize(state)
            window_sizes.append(count)
            count = 0
    assert window_sizes == [1, 2, 4, 4]


def test_count_reduction_with_tensor_counts() -> None:
    params, batch = mlp_params(), token_batch(12)
    acc = gradaccum.Accumulator(n=3, reduction="count")
    state = acc.init(params)
    for i in range(3):
        mb = {k: v[4 * i : 4 * i + 4] for k, v in batch.items()}
        g, (_, tokens) = grad_and_value(token_loss, has_aux=True)(params, mb)
        state = acc.add(state, g, count=tokens)
    grads, _ = acc.finalize(state)
    whole, (_, tokens) = grad_and_value(token_loss, has_aux=True)(params, batch)
    assert max_diff(grads, {k: v / tokens for k, v in whole.items()}) < TIGHT


def test_sum_reduction_needs_no_size() -> None:
    acc = gradaccum.Accumulator(n=2, reduction="sum")
    state = acc.init({"w": torch.zeros(2)})
    state = acc.add(state, {"w": torch.ones(2)})
    state = acc.add(state, {"w": torch.ones(2)}, size=5)
    grads, _ = acc.finalize(state)
    assert torch.equal(grads["w"], torch.full((2,), 2.0))


def test_finalize_returns_params_dtype_and_accumulates_in_float32() -> None:
    acc = gradaccum.Accumulator(n=2, reduction="sum")
    state = acc.init({"w": torch.zeros(2, dtype=torch.bfloat16)})
    state = acc.add(state, {"w": torch.ones(2, dtype=torch.bfloat16)})
    assert state.sums is not None
    assert state.sums["w"].dtype == torch.float32
    grads, _ = acc.finalize(state)
    assert grads["w"].dtype == torch.bfloat16


def test_add_leaves_caller_gradients_untouched() -> None:
    acc = gradaccum.Accumulator(n=2)
    state = acc.init({"w": torch.zeros(2)})
    g = {"w": torch.ones(2)}
    state = acc.add(state, g, size=3)
    state = acc.add(state, g, size=3)
    acc.finalize(state)
    assert torch.equal(g["w"], torch.ones(2))


def _run(acc, params, mbs, state, upto=None):
    for mb in mbs[:upto]:
        state = acc.add(state, grad(mean_loss)(params, mb), size=len(mb[0]))
    return state


@pytest.mark.parametrize("reduction", ["mean", "count"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_mid_window_is_bit_identical(reduction, dtype) -> None:
    params = {k: v.to(dtype) for k, v in mlp_params().items()}
    x, y = regression_batch(20)
    mbs = _micro_batches((x.to(dtype), y.to(dtype)), [5, 5, 5, 5])
    acc = gradaccum.Accumulator(n=4, reduction=reduction)

    def add(state, mb):
        g = grad(mean_loss)(params, mb)
        if reduction == "count":
            return acc.add(state, g, count=torch.tensor(len(mb[0]) * 1.5))
        return acc.add(state, g, size=len(mb[0]))

    state = acc.init(params)
    for mb in mbs[:2]:
        state = add(state, mb)
    buf = io.BytesIO()
    torch.save(acc.state_dict(state), buf)
    # Uninterrupted run.
    for mb in mbs[2:]:
        state = add(state, mb)
    expected, _ = acc.finalize(state)
    # Resumed run, from a fresh process's point of view.
    buf.seek(0)
    restored = acc.load_state_dict(acc.init(params), torch.load(buf, weights_only=True))
    assert restored.micro_step == 2
    for mb in mbs[2:]:
        restored = add(restored, mb)
    got, _ = acc.finalize(restored)
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def test_state_dict_of_an_empty_window_round_trips() -> None:
    acc = gradaccum.Accumulator(n=2)
    state = acc.init({"w": torch.zeros(2)})
    sd = acc.state_dict(state)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    restored = acc.load_state_dict(state, torch.load(buf, weights_only=True))
    assert restored.sums is None
    assert restored.micro_step == 0


def test_state_is_a_pytree() -> None:
    import optree

    acc = gradaccum.Accumulator(n=2)
    state = acc.add(acc.init({"w": torch.zeros(2)}), {"w": torch.ones(2)}, size=1)
    leaves = optree.tree_leaves(state)
    assert any(isinstance(x, torch.Tensor) and x.shape == (2,) for x in leaves)


def test_state_dict_is_a_snapshot_not_a_view() -> None:
    acc = gradaccum.Accumulator(n=4)
    state = acc.add(acc.init({"w": torch.zeros(2)}), {"w": torch.ones(2)}, size=1)
    sd = acc.state_dict(state)
    acc.add(state, {"w": torch.ones(2)}, size=1)
    assert torch.equal(sd["sums"][0], torch.ones(2))
