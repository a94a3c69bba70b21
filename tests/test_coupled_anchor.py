"""gradaccum.coupled against sentence-transformers' CachedMultipleNegativesRankingLoss (CMNRL).

The same tiny BERT (2 layers, hidden 32, a 100-word vocabulary, built from a config: nothing is
downloaded) and the same ragged batch of (anchor, positive) pairs, from
``benchmarks/coupled_anchors.py``, which prints the same comparison with memory and time.

In float64, ``coupled`` equals the whole-batch MultipleNegativesRankingLoss to 1e-12. Before
sentence-transformers 6.2, CMNRL does not: its backward hook forms ``dot(reps.float(),
cached_grad.float())``, which rounds the cached gradient of the embeddings to float32 whatever
the model's dtype, so its gradient is ~1e-7 away; with a loss that rounds its embeddings'
gradient to float32 the same way, ``coupled`` equals it to 1e-12: that rounding is the whole
difference. From 6.2 on (the surrogate keeps the wider dtype), CMNRL equals ``coupled`` and MNRL
to 1e-12. The tests check whichever the installed version should give
(``anchors.CMNRL_CASTS``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
    MultipleNegativesRankingLoss,
)

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "coupled_anchors.py"
_SPEC = importlib.util.spec_from_file_location("coupled_anchors", _PATH)
assert _SPEC is not None
assert _SPEC.loader is not None
anchors: Any = importlib.util.module_from_spec(_SPEC)
sys.modules["coupled_anchors"] = anchors
_SPEC.loader.exec_module(anchors)

ROWS, SEQ = 10, 8  # CMNRL's mini-batches of 4: 4, 4, 2 rows; coupled's n=3: 4, 3, 3


def _tol(grads: dict[str, torch.Tensor], rel: float) -> float:
    return rel * max(g.abs().max().item() for g in grads.values())


@pytest.fixture(scope="module")
def model() -> Any:
    return anchors.tiny_bert(torch.float64)


@pytest.fixture(scope="module")
def batch() -> Any:
    return anchors.pairs(ROWS, SEQ)  # lengths 3 to 8: CMNRL trims each mini-batch's padding


@pytest.fixture(scope="module")
def reference(model: Any, batch: Any) -> Any:
    return anchors.st_grads(model, MultipleNegativesRankingLoss(model), batch)


@pytest.mark.parametrize("layout", ["pairs", "stacked"])
def test_coupled_is_the_whole_batch_mnrl(
    model: Any, batch: Any, reference: Any, layout: str
) -> None:
    ref_value, ref = reference
    n = 3 if layout == "pairs" else 5  # ragged micro-batches either way
    value, grads = anchors.coupled_grads(model, n, batch, layout=layout)
    assert abs(value - ref_value).item() <= 1e-12 * abs(ref_value).item()
    assert anchors.max_diff(grads, ref) <= _tol(ref, 1e-12)


def test_cmnrl_is_coupled(model: Any, batch: Any) -> None:
    # Before 6.2 with the float32 rounding of CMNRL's cache reproduced; from 6.2, as it is.
    cmnrl = CachedMultipleNegativesRankingLoss(model, mini_batch_size=4)
    value, grads = anchors.st_grads(model, cmnrl, batch)
    mine_value, mine = anchors.coupled_grads(model, 3, batch, float32_cache=anchors.CMNRL_CASTS)
    assert abs(value - mine_value).item() <= 1e-12 * abs(value).item()
    assert anchors.max_diff(grads, mine) <= _tol(mine, 1e-12)


def test_cmnrl_against_the_whole_batch(model: Any, batch: Any, reference: Any) -> None:
    cmnrl = CachedMultipleNegativesRankingLoss(model, mini_batch_size=4)
    _, grads = anchors.st_grads(model, cmnrl, batch)
    diff = anchors.max_diff(grads, reference[1])
    if anchors.CMNRL_CASTS:
        # The cached gradient rounded to float32 (a relative error of at most 2**-24 per entry)
        # and carried back through the model: 1e-6 of the largest gradient is ample here, and
        # the rounding is really there (more than float64's).
        assert _tol(reference[1], 1e-10) < diff <= _tol(reference[1], 1e-6)
    else:
        assert diff <= _tol(reference[1], 1e-12)


def test_dropout_masks_are_replayed_as_cmnrl_does() -> None:
    # Dropout on, sequences of full length (CMNRL trims no padding, so its mini-batches draw
    # masks of the shapes coupled's do). Over CMNRL's mini-batches in its order (every anchor,
    # then every positive: the stacked layout), coupled draws and replays the same masks.
    model = anchors.tiny_bert(torch.float64, dropout=0.1).train()
    full = anchors.pairs(8, SEQ, ragged=False)
    torch.manual_seed(7)
    _, grads = anchors.st_grads(
        model, CachedMultipleNegativesRankingLoss(model, mini_batch_size=4), full
    )
    torch.manual_seed(7)
    _, mine = anchors.coupled_grads(
        model, 4, full, layout="stacked", float32_cache=anchors.CMNRL_CASTS
    )
    assert anchors.max_diff(grads, mine) <= _tol(mine, 1e-12)
    torch.manual_seed(7)
    _, whole = anchors.st_grads(model, MultipleNegativesRankingLoss(model), full)
    assert anchors.max_diff(grads, whole) > _tol(whole, 1e-3)  # the masks do matter here
