"""The ``gpu`` suite, part 2: the boundary transforms, ``dp_noise`` and the wire dtype on CUDA.

As ``tests/test_gpu.py`` (whose set-up it shares): one CUDA device, a NCCL group of world size
1, skipped without CUDA, ``GRADACCUM_GPU_TEST_ON_CPU=1`` runs it on the CPU with gloo. The CPU
proxies of the same logic are in the fast tier (``tests/test_boundary.py``,
``tests/test_reduce_dtype.py``, ``tests/test_device_placement.py``, ``tests/test_dp.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_gpu import DEVICE, cuda_only, mlp_loss, mlp_params, pytestmark, regression
from test_gpu import world as world  # the module's process group (NCCL on CUDA)

import gradaccum
from gradaccum import boundary

__all__ = ["pytestmark", "world"]


def gradients(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"a": (64, 64), "b": (64,), "c": (3, 5)}
    return {k: (torch.randn(s, generator=gen) * 3).to(DEVICE, dtype) for k, s in shapes.items()}


@cuda_only
@pytest.mark.parametrize("donate", [False, True])
def test_clip_by_global_norm_does_not_sync(donate: bool) -> None:
    g = gradients()
    want = [v.clone() for v in g.values()]
    for t in want:
        t.grad = t.clone()
    torch.nn.utils.clip_grad_norm_(want, 1.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        clipped, _ = boundary.clip_by_global_norm(g, 1.0, donate=donate)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for k, t in zip(g, want, strict=True):
        assert t.grad is not None
        assert torch.allclose(clipped[k], t.grad, rtol=1e-6, atol=0)


@pytest.mark.parametrize("donate", [False, True])
def test_unscale_equals_grad_scaler_unscale(donate: bool) -> None:
    g = gradients()
    scaler = boundary.LossScale(init_scale=2.0**10)
    mine = {k: v.clone() for k, v in g.items()}
    unscaled, finite, _ = scaler.unscale(mine, scaler.init(), donate=donate)
    assert (unscaled["a"] is mine["a"]) == donate
    params = [torch.nn.Parameter(torch.zeros_like(v)) for v in g.values()]
    for p, v in zip(params, g.values(), strict=True):
        p.grad = v.clone()
    torch_scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0**10)
    torch_scaler.scale(torch.ones((), device=DEVICE))
    torch_scaler.unscale_(torch.optim.SGD(params, lr=0.1))
    assert finite
    for p, k in zip(params, g, strict=True):
        assert p.grad is not None
        assert torch.equal(p.grad, unscaled[k])


def test_an_empty_tree_unscaled_over_the_group_agrees_on_its_device() -> None:
    """Before issue 28 the flag was a CPU tensor, which NCCL cannot take."""
    scaler = boundary.LossScale()
    with gradaccum.sync.record_collectives() as log:
        out, finite, _ = scaler.unscale({}, scaler.init(), group=dist.group.WORLD)
    assert (out, finite) == ({}, True)
    assert [c.purpose for c in log] == ["found_inf"]
    assert gradaccum.all_reduce().plan({})[0].device == DEVICE


def test_dp_noise_draws_on_the_device_the_same_noise_for_the_same_seed() -> None:
    params = {"w": torch.zeros(100_000, device=DEVICE)}

    def flat(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return (p["w"] * 0).sum() + x.sum() * 0

    def step() -> Any:
        return gradaccum.accumulate(
            torch.func.vmap(torch.func.grad(flat), in_dims=(None, 0)),
            2,
            reduction="sum",
            micro_transform=gradaccum.privacy.clip_per_sample(1.0),
            sync=gradaccum.privacy.dp_noise(2.0, 1.0, 50.0, seed=5),
        )

    x = torch.zeros(4, 1, device=DEVICE)
    first, again = step()(params, x)["w"], step()(params, x)["w"]
    assert (first.device, first.dtype) == (DEVICE, torch.float32)
    assert torch.equal(first, again)
    assert abs(float(first.std()) / (2.0 / 50.0) - 1) < 0.02


@pytest.mark.parametrize("overlap", [True, False])
def test_all_reduce_bf16_wire_is_the_rounded_sum(overlap: bool) -> None:
    params, batch = mlp_params(), regression()
    local = gradaccum.accumulate(gradaccum.grad(mlp_loss), 4, reduction="sum")(params, batch)
    sync = gradaccum.all_reduce(bucket_mb=0.01, reduce_dtype=torch.bfloat16, overlap=overlap)
    step = gradaccum.accumulate(gradaccum.grad(mlp_loss), 4, reduction="sum", sync=sync)
    for _ in range(2):
        with gradaccum.sync.record_collectives() as log:
            got = step(params, batch)
        for k in params:
            assert torch.equal(got[k], local[k].bfloat16().float()), k
        wire = {c.dtype for c in log if c.purpose == "gradients"}
        assert wire == {torch.bfloat16, torch.float32}  # the gradients, then the tail
