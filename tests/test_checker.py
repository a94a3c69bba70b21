"""gradaccum.testing: the equivalence checker users run on their own step functions."""

from __future__ import annotations

import re
from typing import Any

import optree
import pytest
import torch
from models import mean_loss, mlp_params, regression_batch, token_batch, token_sum_loss
from torch.func import grad, grad_and_value

import gradaccum
from gradaccum import testing


def test_compare_reports_every_leaf_and_passes_for_a_correct_step() -> None:
    params, batch = mlp_params(kind="nested"), regression_batch(20)
    result = testing.compare(grad(mean_loss), params, batch, 4)
    assert result.ok
    assert [leaf.path for leaf in result.leaves] == [
        "['hidden'][0]",
        "['hidden'][1]",
        "['out'][0]",
        "['out'][1]['bias']",
    ]
    assert all(leaf.max_abs_err < 1e-12 for leaf in result.leaves)
    assert str(result).startswith("accumulated (n=4) and whole-batch gradients match: worst leaf")


def test_compare_count_reduction_uses_the_whole_batch_count() -> None:
    params, batch = mlp_params(), token_batch(12)
    result = testing.compare(
        grad_and_value(token_sum_loss, has_aux=True),
        params,
        batch,
        3,
        has_aux=True,
        reduction="count",
        count=lambda aux: aux[1],
    )
    assert result.ok


def test_assert_equivalent_names_the_worst_leaf_of_a_broken_step() -> None:
    params, batch = mlp_params(), regression_batch(20)

    def per_micro_batch_bias(params, batch):
        # A step that is not batch-size invariant: adds a constant to one leaf.
        g = grad(mean_loss)(params, batch)
        return {**g, "b1": g["b1"] + 1.0 / len(batch[0])}

    with pytest.raises(AssertionError, match=re.escape("DIFFER: worst leaf ['b1'] (float64)")):
        testing.assert_equivalent(per_micro_batch_bias, params, batch, 4)


def test_tolerances_are_dtype_aware_and_overridable() -> None:
    params = {k: v.float() for k, v in mlp_params().items()}
    x, y = regression_batch(64)
    result = testing.compare(grad(mean_loss), params, (x.float(), y.float()), 8)
    assert result.ok
    assert result.worst.rtol == 1e-5
    strict = testing.compare(grad(mean_loss), params, (x.float(), y.float()), 8, rtol=0, atol=0)
    assert strict.worst.atol == 0


def test_nonfinite_and_assert_finite() -> None:
    grads = {"a": torch.ones(2), "b": [torch.tensor([1.0, float("inf")]), torch.zeros(1)]}
    assert testing.nonfinite(grads) == ["['b'][0]"]
    with pytest.raises(AssertionError, match=re.escape("gradient leaves [\"['b'][0]\"] hold NaN")):
        testing.assert_finite(grads)
    testing.assert_finite({"a": torch.ones(2)})


def test_testing_is_reachable_from_the_package() -> None:
    assert gradaccum.testing is testing


# -- tolerances follow the dtype ----------------------------------------------------------------


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    return optree.tree_map(lambda t: t.to(dtype), tree)


@pytest.mark.parametrize(
    ("dtype", "rtol", "atol"),
    [(torch.bfloat16, 2e-2, 1e-3), (torch.float16, 5e-3, 1e-4)],
    ids=["bfloat16", "float16"],
)
def test_low_precision_gradients_within_their_rounding_pass(
    dtype: torch.dtype, rtol: float, atol: float
) -> None:
    params, batch = _cast(mlp_params(), dtype), _cast(regression_batch(64), dtype)
    before = _cast(params, torch.float64)
    result = testing.assert_equivalent(grad(mean_loss), params, batch, 4)
    assert {(leaf.dtype, leaf.rtol, leaf.atol) for leaf in result.leaves} == {(dtype, rtol, atol)}
    assert f"match: worst leaf {result.worst.path} ({str(dtype)[6:]})" in str(result)
    assert all(torch.equal(params[k].double(), before[k]) for k in params)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_float32_gradients_of_low_precision_params_get_the_low_precision_tolerances(
    dtype: torch.dtype,
) -> None:
    """step_fn returns float32 gradients; the accumulated ones come back in the params' dtype.

    The accumulated gradient is then rounded to bfloat16/float16, and was held to float32's
    tolerances (1e-5): a correct step failed.
    """

    def upcast_step(params: Any, batch: Any) -> Any:
        return grad(mean_loss)(_cast(params, torch.float32), _cast(batch, torch.float32))

    params, batch = _cast(mlp_params(), dtype), _cast(regression_batch(64), dtype)
    result = testing.compare(upcast_step, params, batch, 4)
    assert result.ok, str(result)
    assert {leaf.dtype for leaf in result.leaves} == {dtype}
    # Held to float32's tolerances, the rounding to the params' dtype shows.
    assert not testing.compare(upcast_step, params, batch, 4, rtol=1e-5, atol=1e-6).ok


def _size_dependent(step: Any, rel: float) -> Any:
    """A broken step: its gradient is scaled by ``1 + rel * 16 / rows`` (not batch invariant)."""

    def broken(params: Any, batch: Any) -> Any:
        g = step(params, batch)
        return optree.tree_map(lambda t: t * (1 + rel * 16 / len(batch[0])), g)

    return broken


def test_a_bfloat16_gradient_far_off_fails() -> None:
    params, batch = _cast(mlp_params(), torch.bfloat16), _cast(regression_batch(64), torch.bfloat16)
    broken = _size_dependent(grad(mean_loss), 0.2)  # 20% on micro-batches of 16, 5% on 64
    result = testing.compare(broken, params, batch, 4)
    assert not result.ok
    assert result.worst.dtype == torch.bfloat16
    assert result.worst.rel_err > 0.1
    before = _cast((params, batch), torch.float64)
    with pytest.raises(AssertionError, match=re.escape("DIFFER: worst leaf")) as info:
        testing.assert_equivalent(broken, params, batch, 4)
    assert f"worst leaf {result.worst.path} (bfloat16)" in str(info.value)
    after = optree.tree_leaves((params, batch))
    assert all(a.dtype == torch.bfloat16 for a in after)
    assert all(torch.equal(a.double(), b) for a, b in zip(after, optree.tree_leaves(before)))


def test_float64_stays_tight() -> None:
    params, batch = mlp_params(), regression_batch(64)
    broken = _size_dependent(grad(mean_loss), 1e-8)  # a 1e-8 relative error
    result = testing.compare(broken, params, batch, 4)
    assert not result.ok
    assert {(leaf.dtype, leaf.rtol, leaf.atol) for leaf in result.leaves} == {
        (torch.float64, 1e-10, 1e-12)
    }
    assert 1e-9 < result.worst.rel_err < 1e-7
    assert testing.compare(grad(mean_loss), params, batch, 4).ok
