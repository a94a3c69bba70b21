"""PowerSGD (gradaccum.compression.powersgd) on 2 gloo processes and in one process.

The law it must keep: over any number of windows, the gradients it returned plus what every rank
holds in its error-feedback buffer add up to the exact window gradients (nothing is lost, only
delayed). A matrix of rank <= r comes back exactly; vectors are all-reduced exactly; the bytes
on the wire are r * (n + m) per compressed matrix.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist import run, values

import gradaccum

F64 = torch.float64


def _params() -> dict[str, torch.Tensor]:
    return {
        "big": torch.zeros(16, 12, dtype=F64),
        "conv": torch.zeros(8, 3, 2, 2, dtype=F64),  # a 4-d leaf: 8 x 12
        "bias": torch.zeros(12, dtype=F64),
    }


def _window_grads(rank: int, window: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * window + rank)
    return {k: torch.randn(v.shape, generator=g, dtype=F64) for k, v in _params().items()}


def _given(params: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A step function whose gradient is given in the batch (one row)."""
    return {k: v[0] for k, v in batch.items()}


def _as_batch(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v[None] for k, v in grads.items()}


def _law(rank: int, world: int) -> dict[str, Any]:
    sync = gradaccum.compression.powersgd(rank=2, seed=1)
    step = gradaccum.accumulate(_given, 1, reduction="sum", sync=sync)
    params = _params()
    returned = {k: torch.zeros_like(v) for k, v in params.items()}
    exact = {k: torch.zeros_like(v) for k, v in params.items()}
    logs = []
    for w in range(4):
        mine = _window_grads(rank, w)
        with gradaccum.sync.record_collectives() as log:
            got = step(params, _as_batch(mine))
        logs.append([(c.kind, c.purpose, c.numel) for c in log])
        for k in params:
            returned[k] += got[k]
            exact[k] += sum(_window_grads(r, w)[k] for r in range(world))
    errors = {k: v.clone() for k, v in sync.state["error"].items()}
    return {"returned": returned, "exact": exact, "errors": errors, "logs": logs}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_returned_plus_error_buffers_equal_the_exact_sums() -> None:
    r0, r1 = values(run(_law))
    for k in r0["exact"]:
        assert torch.equal(r0["returned"][k], r1["returned"][k]), k  # the same on every rank
        total = r0["returned"][k] + r0["errors"][k] + r1["errors"][k]
        assert float((total - r0["exact"][k]).abs().max()) < 1e-10, k
    assert float((r0["returned"]["bias"] - r0["exact"]["bias"]).abs().max()) < 1e-12
    assert float(r0["errors"]["bias"].abs().max()) == 0.0
    # Compressed: "big" 16 x 12 and "conv" 8 x 12, rank 2: P has 2 (16 + 8), Q 2 (12 + 12).
    assert r0["logs"][1] == [
        ("all_reduce", "weight", 4),
        ("all_reduce", "gradients", 12),
        ("all_reduce", "gradients (P)", 2 * (16 + 8)),
        ("all_reduce", "gradients (Q)", 2 * (12 + 12)),
    ]
    # Some of the gradient is really delayed (the test is not vacuous).
    assert float(r0["errors"]["big"].abs().max()) > 1e-3


def test_low_rank_matrices_come_back_exactly() -> None:
    u, v = torch.randn(16, 2, dtype=F64), torch.randn(2, 12, dtype=F64)
    sync = gradaccum.compression.powersgd(rank=2)
    step = gradaccum.accumulate(_given, 1, reduction="sum", sync=sync)
    got = step({"m": torch.zeros(16, 12, dtype=F64)}, _as_batch({"m": u @ v}))
    assert float((got["m"] - u @ v).abs().max()) < 1e-10
    assert float(sync.state["error"]["m"].abs().max()) < 1e-10


def test_rank_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"rank must be a positive int, got int 0"):
        gradaccum.compression.powersgd(rank=0)


def test_a_zero_window_keeps_the_warm_start() -> None:
    """A window whose gradient is zero must not zero Q (the next window would get P = 0)."""
    sync = gradaccum.compression.powersgd(rank=1)
    step = gradaccum.accumulate(_given, 1, reduction="sum", sync=sync)
    params = {"m": torch.zeros(4, 4, dtype=F64)}
    step(params, _as_batch({"m": torch.zeros(4, 4, dtype=F64)}))
    got = step(params, _as_batch({"m": torch.ones(4, 4, dtype=F64)}))
    assert float((got["m"] - 1).abs().max()) < 1e-12
