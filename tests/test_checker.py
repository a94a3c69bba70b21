"""gradaccum.testing: the equivalence checker users run on their own step functions."""

from __future__ import annotations

import re

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
