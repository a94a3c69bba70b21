"""Python hooks per micro-batch on the fast path: they do not depend on the dtype mix (issue 28).

On a device, a Python call per parameter per micro-batch is visible next to fast kernels. On the
fast path a leaf that accumulates in its own dtype takes each gradient in place (autograd's own
accumulation into its ``.grad``, which is its running sum): no Python runs for it during a
backward. Only a leaf whose gradient is summed in a wider dtype (a bfloat16 parameter summed in
float32) goes through a hook, once per backward. Before issue 28, a single low-precision leaf sent
every leaf through that hook. Under ``all_reduce()`` the running sums are the flat buckets,
zeroed up front, so even the first backward needs no hook to move a gradient in; only the last
backward's ready hooks (overlap) run, once per leaf per window.

These tests count the hooks of ``WindowRun`` on CPU (the count is the same on any device) and
check the result against plain PyTorch in float64.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import gradaccum
from gradaccum._core import engine

N = 4
ROWS = 3  # per micro-batch


def params_of(dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """A 2-layer MLP's params, each leaf in the given dtype."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"w0": (5, 6), "b0": (6,), "w1": (6, 1), "b1": (1,)}
    return {
        k: torch.randn(shapes[k], generator=gen, dtype=torch.float64).to(d)
        for k, d in dtypes.items()
    }


def loss(p: dict[str, torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    h = torch.tanh(x.to(p["w0"].dtype) @ p["w0"] + p["b0"])
    out = (h.to(p["w1"].dtype) @ p["w1"] + p["b1"]).squeeze(-1)
    return ((out.double() - y) ** 2).mean()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (
        torch.randn(N * ROWS, 5, generator=gen, dtype=torch.float64),
        torch.randn(N * ROWS, generator=gen, dtype=torch.float64),
    )


class Calls:
    """Counts each ``WindowRun`` hook method's calls (the methods the backward hooks call)."""

    NAMES = ("_on_grad", "_on_first", "_on_ready")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = dict.fromkeys(self.NAMES, 0)
        for name in self.NAMES:
            original = getattr(engine.WindowRun, name)

            @functools.wraps(original)
            def counted(run: Any, *args: Any, _name: str = name, _f: Any = original) -> Any:
                self.count[_name] += 1
                return _f(run, *args)

            monkeypatch.setattr(engine.WindowRun, name, counted)


def reference(params: dict[str, torch.Tensor], accum: torch.dtype) -> dict[str, torch.Tensor]:
    """Plain PyTorch: the gradients of ``loss * rows / total``, summed in ``accum``."""
    x, y = batch()
    sums = {k: torch.zeros_like(v, dtype=accum) for k, v in params.items()}
    for i in range(N):
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        rows = slice(i * ROWS, (i + 1) * ROWS)
        (loss(leaves, (x[rows], y[rows])) * (ROWS / (N * ROWS))).backward()
        for k, v in leaves.items():
            assert v.grad is not None
            sums[k] += v.grad.to(sums[k].dtype)
    return {k: s.to(params[k].dtype) for k, s in sums.items()}


F32, F64 = torch.float32, torch.float64
MIXES = {
    "all float64": dict.fromkeys(("w0", "b0", "w1", "b1"), F64),
    "one float32 leaf": {"w0": F64, "b0": F32, "w1": F64, "b1": F64},
    "half float32": {"w0": F32, "b0": F64, "w1": F32, "b1": F64},
    "all float32": dict.fromkeys(("w0", "b0", "w1", "b1"), F32),
}


@pytest.mark.parametrize("mix", MIXES)
def test_hooks_per_micro_batch_count_only_the_wider_leaves(
    mix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dtypes = MIXES[mix]
    params = params_of(dtypes)
    wider = sum(d != torch.float64 for d in dtypes.values())
    calls = Calls(monkeypatch)
    step = gradaccum.accumulate(gradaccum.grad(loss), N, accum_dtype=torch.float64)
    grads = step(params, batch())
    # One hook call per micro-batch for each leaf summed in a wider dtype; none for the others
    # (before issue 28: every leaf, as soon as one leaf was wider).
    assert calls.count["_on_grad"] == N * wider
    assert calls.count["_on_ready"] == 0  # no sync, no overlap
    want = reference(params, torch.float64)
    for k in params:
        tol = 1e-12 if dtypes[k] == torch.float64 else 1e-5
        torch.testing.assert_close(grads[k], want[k], rtol=tol, atol=tol)


@pytest.mark.parametrize("mix", ["all float64", "half float32"])
def test_all_reduce_needs_no_hook_to_move_first_gradients(
    mix: str, monkeypatch: pytest.MonkeyPatch, world: None
) -> None:
    dtypes = MIXES[mix]
    params = params_of(dtypes)
    wider = sum(d != torch.float64 for d in dtypes.values())
    calls = Calls(monkeypatch)
    sync = gradaccum.all_reduce()
    step = gradaccum.accumulate(gradaccum.grad(loss), N, accum_dtype=torch.float64, sync=sync)
    windows = 3
    for _ in range(windows):
        grads = step(params, batch())
    assert calls.count["_on_grad"] == windows * N * wider
    # The flat buckets are zeroed up front: no first gradient is moved in by a hook.
    assert calls.count["_on_first"] == 0
    # The first window's last backward reports each leaf ready once (overlap), recording the
    # order the ranks then agree on; later windows check readiness per bucket
    # (AllReduce.ready_hooks: C-level marks, one Python hook per bucket), not per leaf.
    assert calls.count["_on_ready"] == len(params)
    launched: list[int] = []
    launch = gradaccum.sync._all_reduce.BucketWindow._launch
    monkeypatch.setattr(
        gradaccum.sync._all_reduce.BucketWindow,
        "_launch",
        lambda window, k: (launched.append(k), launch(window, k))[1],
    )
    grads = step(params, batch())
    assert calls.count["_on_ready"] == len(params)  # none more
    buckets = sync.plan(params, accum_dtype=torch.float64)
    assert sorted(launched) == list(range(len(buckets)))  # every bucket, each once
    want = reference(params, torch.float64)
    for k in params:
        tol = 1e-12 if dtypes[k] == torch.float64 else 1e-5
        torch.testing.assert_close(grads[k], want[k], rtol=tol, atol=tol)


def test_bfloat16_and_float32_mix_matches_plain_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The usual mix (float32 norms, bfloat16 weights): float32 sums, hooks for bf16 only."""
    dtypes = {"w0": torch.bfloat16, "b0": torch.float32, "w1": torch.bfloat16, "b1": torch.float32}
    params = params_of(dtypes)
    calls = Calls(monkeypatch)
    grads = gradaccum.accumulate(gradaccum.grad(loss), N)(params, batch())
    assert calls.count["_on_grad"] == N * 2
    want = reference(params, torch.float32)
    for k in params:
        assert grads[k].dtype == dtypes[k]
        torch.testing.assert_close(grads[k], want[k], rtol=1e-2, atol=1e-2)
