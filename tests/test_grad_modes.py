"""Every transform under every grad mode: exact in float64, as ``torch.func.grad`` is.

``torch.func.grad`` turns autograd on inside (under ``torch.no_grad()`` and
``torch.inference_mode()`` alike), so a gradient function called there gives the same gradient.
gradaccum's transforms do the same: each call runs with grad on and inference mode off, whatever
the caller's mode, and returns plain tensors. Tensors made under ``torch.inference_mode()``
(inference tensors) as params or batch are exact too: the fast path, which cannot make autograd
leaves of them, hands such a call to ``torch.func.grad``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.func import grad

import gradaccum
from gradaccum.loop import Step

TIGHT = 1e-12
F64 = torch.float64
MODES: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "enable_grad": torch.enable_grad,
}


@pytest.fixture
def world() -> Iterator[None]:
    """A gloo process group of one rank on a ``HashStore``, destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _data() -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    p = {
        "w": torch.randn(3, 4, generator=g, dtype=F64),
        "b": torch.randn(4, generator=g, dtype=F64),
    }
    x, y = torch.randn(12, 3, generator=g, dtype=F64), torch.randn(12, 4, generator=g, dtype=F64)
    return p, (x, y)


def mse(p: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    return ((torch.tanh(x @ p["w"] + p["b"]) - y) ** 2).mean()


def generic(p: Any, batch: Any) -> Any:  # any other step function: the generic path
    return grad(mse)(p, batch)


def embed(p: Any, x: Any) -> torch.Tensor:
    return torch.tanh(x @ p["w"] + p["b"])


def info(p: Any, z: torch.Tensor, rows: gradaccum.Rows) -> torch.Tensor:
    return (z[rows.local] @ z.T).logsumexp(-1).sum() / rows.total


def positives(p: Any, batch: Any) -> torch.Tensor:
    return (batch[0] > 0).sum()


def scaled(p: Any, batch: Any, count: torch.Tensor) -> torch.Tensor:
    return mse(p, batch) / count


def _accumulate(fn: Any) -> Callable[..., Any]:
    def run(p: Any, batch: Any, sync: Any) -> Any:
        return gradaccum.accumulate(fn, 4, sync=sync)(p, batch)

    return run


def _coupled(p: Any, batch: Any, sync: Any) -> Any:
    return gradaccum.coupled(embed, info, 4, sync=sync)(p, batch[0])[0]


def _window_stats(p: Any, batch: Any, sync: Any) -> Any:
    return gradaccum.window_stats(positives, scaled, 4, sync=sync)(p, batch)[0]


def _accumulator(p: Any, batch: Any, sync: Any) -> Any:
    acc = gradaccum.Accumulator(4, sync=sync)
    state = acc.init(p)
    x, y = batch
    for rows in (slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 12)):
        state = acc.add(state, grad(mse)(p, (x[rows], y[rows])), size=3)
    return acc.finalize(state)[0]


def _whole(p: Any, batch: Any) -> dict[str, Any]:
    """The references: plain torch.func on the whole batch, in the default mode."""
    everything = gradaccum.Rows(start=0, stop=12, total=12, per_rank=(12,))
    x = batch[0]
    return {
        "mean": grad(mse)(p, batch),
        "coupled": grad(lambda q: info(q, embed(q, x), everything))(p),
        "stats": grad(lambda q: scaled(q, batch, positives(q, batch)))(p),
    }


TRANSFORMS = {
    "gradaccum.grad": (lambda p, batch, _sync: gradaccum.grad(mse)(p, batch), "mean"),
    "fast, torch.func.grad": (_accumulate(grad(mse)), "mean"),
    "fast, gradaccum.grad": (_accumulate(gradaccum.grad(mse)), "mean"),
    "generic": (_accumulate(generic), "mean"),
    "Accumulator": (_accumulator, "mean"),
    "coupled": (_coupled, "coupled"),
    "window_stats": (_window_stats, "stats"),
}


def _diff(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(float((got[k] - ref[k]).abs().max()) for k in ref)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("synced", [False, True], ids=["one process", "all_reduce"])
def test_every_transform_is_exact_under_every_grad_mode(
    transform: str, mode: str, synced: bool, request: pytest.FixtureRequest
) -> None:
    if synced:
        request.getfixturevalue("world")
    p, batch = _data()
    run, ref = TRANSFORMS[transform]
    want = _whole(p, batch)[ref]
    with MODES[mode]():
        got = run(p, batch, gradaccum.all_reduce() if synced else None)
    assert _diff(got, want) < TIGHT
    assert not any(g.is_inference() or g.requires_grad for g in got.values())
    assert torch.is_grad_enabled()  # the caller's mode is back


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_inference_tensors_as_params_and_batch_are_exact(transform: str) -> None:
    p, batch = _data()
    run, ref = TRANSFORMS[transform]
    want = _whole(p, batch)[ref]
    with torch.inference_mode():
        p_inf = {k: v.clone() for k, v in p.items()}
        batch_inf = tuple(t.clone() for t in batch)
        assert all(v.is_inference() for v in p_inf.values())
        got = run(p_inf, batch_inf, None)
    assert _diff(got, want) < TIGHT
    got = run(p_inf, batch_inf, None)  # outside inference mode, too
    assert _diff(got, want) < TIGHT


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 4).double()


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return ((torch.tanh(model(x)) - y) ** 2).mean()


@pytest.mark.parametrize("mode", list(MODES))
def test_loop_step_is_exact_under_every_grad_mode(mode: str) -> None:
    _, (x, y) = _data()
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    _loss(ref, (x, y)).backward()
    opt.step()
    model = _model()
    step = Step(model, _loss, torch.optim.SGD(model.parameters(), lr=0.5))
    with MODES[mode]():
        for rows in (slice(0, 5), slice(5, 12)):
            step.add((x[rows], y[rows]))
        stats = step.apply()
    assert stats.micro_batches == 2
    for a, b in zip(model.parameters(), ref.parameters()):
        assert float((a - b).detach().abs().max()) < TIGHT
