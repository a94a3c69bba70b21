"""The boundary transforms' kernels: foreach, in place when donated, no host read (issue 28).

``clip_by_global_norm`` and ``LossScale.unscale`` are pure by default; ``donate=True`` writes the
result into the given gradients (as ``clip_grad_norm_`` and ``GradScaler.unscale_`` do). Both
forms must equal each other exactly, and the PyTorch references in float64. The clipping factor
is a device tensor (no host read); the unscale reads its found-inf flag once. An empty tree with
``group=`` builds its flag on the group's device (a CPU tensor cannot reach NCCL).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_host_syncs import HostReads

from gradaccum import boundary
from gradaccum._dist import buckets, comm

F64 = torch.float64


def grads(dtypes: tuple[torch.dtype, ...] = (F64, F64, F64)) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (7,), (2, 2, 2)]
    return {
        f"g{i}": torch.randn(shape, generator=gen, dtype=F64).to(dt) * 3
        for i, (shape, dt) in enumerate(zip(shapes, dtypes, strict=True))
    }


def copy(tree: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tree.items()}


def reference_clip(tree: dict[str, torch.Tensor], max_norm: float) -> tuple[Any, torch.Tensor]:
    """The clipping as it was before issue 28: per leaf, a new tensor each."""
    leaves = list(tree.values())
    norms = [n.to(torch.float64) for n in torch._foreach_norm(leaves)]
    total = torch.linalg.vector_norm(torch.stack(norms))
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return {k: g * factor.to(g.dtype) for k, g in tree.items()}, total


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_donated_and_pure_equal_the_old_clip_and_torch_in_float64(max_norm: float) -> None:
    g = grads()
    pure, norm = boundary.clip_by_global_norm(g, max_norm)
    want, want_norm = reference_clip(g, max_norm)
    donated_in = copy(g)
    donated, donated_norm = boundary.clip_by_global_norm(donated_in, max_norm, donate=True)
    ref = [v.clone() for v in g.values()]
    for t in ref:
        t.grad = t.clone()
    torch_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    assert torch.equal(norm, want_norm)
    assert torch.equal(donated_norm, want_norm)
    assert float((norm - torch_norm).abs()) < 1e-15
    for k, t in zip(g, ref, strict=True):
        assert torch.equal(pure[k], want[k])
        assert torch.equal(donated[k], want[k])
        assert torch.equal(pure[k], t.grad)  # clip_grad_norm_'s own multiply, in float64


def test_clip_donated_writes_into_the_given_gradients() -> None:
    g = grads()
    storage = {k: v.data_ptr() for k, v in g.items()}
    clipped, _ = boundary.clip_by_global_norm(g, 0.5, donate=True)
    for k in g:
        assert clipped[k] is g[k]
        assert clipped[k].data_ptr() == storage[k]
    before = copy(g)
    fresh, _ = boundary.clip_by_global_norm(g, 0.1)  # pure: g is left as it was
    for k in g:
        assert torch.equal(g[k], before[k])
        assert fresh[k].data_ptr() != g[k].data_ptr()


def test_clip_of_mixed_dtypes_donated_equals_pure() -> None:
    g = grads((torch.float32, F64, torch.bfloat16))
    pure, norm = boundary.clip_by_global_norm(g, 0.5)
    donated, donated_norm = boundary.clip_by_global_norm(copy(g), 0.5, donate=True)
    want, want_norm = reference_clip(g, 0.5)
    assert norm.dtype == F64
    assert torch.equal(norm, donated_norm)
    assert float((norm - want_norm).abs()) < 1e-12  # leaves summed in (device, dtype) groups
    for k in g:
        assert pure[k].dtype == g[k].dtype
        assert torch.equal(pure[k], donated[k])
        assert torch.equal(pure[k], want[k])  # the same factor, cast to each leaf's dtype


def test_clip_reads_nothing_on_the_host() -> None:
    g = grads((torch.float32, torch.float32, torch.bfloat16))
    for donate in (False, True):
        with HostReads() as reads:
            boundary.clip_by_global_norm(g, 0.5, donate=donate)
        assert reads.take() == []


def test_clip_uses_one_foreach_multiply_per_device_and_dtype(monkeypatch: Any) -> None:
    calls: list[tuple[str, int]] = []
    for name in ("_foreach_mul", "_foreach_mul_"):
        real = getattr(torch, name)

        def spy(tensors: Any, *a: Any, _name: str = name, _f: Any = real, **k: Any) -> Any:
            calls.append((_name, len(tensors)))
            return _f(tensors, *a, **k)

        monkeypatch.setattr(torch, name, spy)
    g = grads((torch.float32, torch.float32, F64))
    boundary.clip_by_global_norm(g, 0.5)
    assert calls == [("_foreach_mul", 2), ("_foreach_mul", 1)]
    calls.clear()
    boundary.clip_by_global_norm(g, 0.5, donate=True)
    assert calls == [("_foreach_mul_", 2), ("_foreach_mul_", 1)]


@pytest.mark.parametrize("scale", [1024.0, 3.0])
def test_unscale_donated_equals_pure_and_the_old_unscale(scale: float) -> None:
    scaler = boundary.LossScale(init_scale=scale)
    g = grads((F64, torch.float32, torch.float16))
    pure, finite, state = scaler.unscale(g, scaler.init())
    donated_in = copy(g)
    donated, finite_d, state_d = scaler.unscale(donated_in, scaler.init(), donate=True)
    assert finite
    assert finite_d
    assert state == state_d == boundary.LossScaleState(scale, 1)
    for k in g:
        assert donated[k] is donated_in[k]
        assert torch.equal(pure[k], g[k] * (1.0 / scale))  # the old unscale, leaf by leaf
        assert torch.equal(donated[k], pure[k])


def test_unscale_equals_grad_scaler_unscale() -> None:
    g = grads((torch.float32, torch.float32, torch.float32))
    scaler = boundary.LossScale(init_scale=2.0**10)
    unscaled, _, _ = scaler.unscale(copy(g), scaler.init(), donate=True)
    params = [torch.nn.Parameter(torch.zeros_like(v)) for v in g.values()]
    for p, v in zip(params, g.values(), strict=True):
        p.grad = v.clone()
    opt = torch.optim.SGD(params, lr=0.1)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    torch_scaler.scale(torch.ones(()))  # makes its scale tensor
    torch_scaler.unscale_(opt)
    for p, k in zip(params, g, strict=True):
        assert p.grad is not None
        assert torch.equal(p.grad, unscaled[k])


def test_unscale_of_a_non_finite_window_donated() -> None:
    scaler = boundary.LossScale(init_scale=8.0)
    g = {"a": torch.tensor([8.0, 16.0]), "b": torch.tensor([float("nan")], dtype=F64)}
    out, finite, state = scaler.unscale(g, scaler.init(), donate=True)
    assert not finite
    assert state == boundary.LossScaleState(4.0, 0)
    assert out["a"].tolist() == [1.0, 2.0]


def test_unscale_reads_the_host_once() -> None:
    g = grads((torch.float32, torch.float32, torch.bfloat16))
    scaler = boundary.LossScale()
    for donate in (False, True):
        with HostReads() as reads:
            scaler.unscale(g, scaler.init(), donate=donate)
        assert [r.what for r in reads.take()] == ["item"]


DONATE = (
    ": donate must be a bool, got int 1; pass donate=True to overwrite the gradients you pass "
    "(no new tree), or leave the default (False)."
)


@pytest.mark.parametrize(
    ("call", "where"),
    [
        (
            lambda: boundary.clip_by_global_norm({"w": torch.ones(2)}, 1.0, donate=1),
            "clip_by_global_norm(grads, max_norm)",
        ),
        (
            lambda: boundary.LossScale().unscale(
                {"w": torch.ones(2)}, boundary.LossScale().init(), donate=1
            ),
            "LossScale.unscale(grads, state)",
        ),
    ],
    ids=["clip", "unscale"],
)
def test_donate_must_be_a_bool(call: Any, where: str) -> None:
    with pytest.raises(TypeError, match=rf"\A{re.escape(where + DONATE)}\Z"):
        call()


def _shared() -> dict[str, torch.Tensor]:
    t = torch.full((3,), 4.0)
    return {"a": t, "b": t}


def _overlapping() -> dict[str, torch.Tensor]:
    flat = torch.full((5,), 4.0)
    return {"a": flat[:3], "b": flat[2:]}


def _expanded() -> dict[str, torch.Tensor]:
    return {"a": torch.full((2,), 4.0).expand(3, 2)}


SHARED = (
    "{where}: with donate=True, gradient leaves ['a'] and ['b'] share memory (the same tensor "
    "twice, or overlapping views): scaling them in place would scale it twice. Pass distinct "
    "tensors, or donate=False."
)
EXPANDED = (
    "{where}: with donate=True, gradient leaf ['a'] has elements that share memory (an "
    "expand()-ed tensor, say): scaling it in place would scale them more than once. Pass a "
    "tensor of its own (.clone()), or donate=False."
)
CALLS = {
    "clip": (
        lambda g: boundary.clip_by_global_norm(g, 1.0, donate=True),
        "clip_by_global_norm(grads, max_norm)",
    ),
    "unscale": (
        lambda g: boundary.LossScale().unscale(g, boundary.LossScale().init(), donate=True),
        "LossScale.unscale(grads, state)",
    ),
}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize(
    ("make", "message"),
    [(_shared, SHARED), (_overlapping, SHARED), (_expanded, EXPANDED)],
    ids=["the same tensor twice", "overlapping views", "expanded"],
)
def test_donate_refuses_leaves_that_share_memory(call: str, make: Any, message: str) -> None:
    """Scaled in place, memory two leaves share would be scaled twice: refused, nothing written."""
    fn, where = CALLS[call]
    grads = make()
    before = [g.clone() for g in grads.values()]
    with pytest.raises(ValueError, match=rf"\A{re.escape(message.format(where=where))}\Z"):
        fn(grads)
    assert all(torch.equal(g, b) for g, b in zip(grads.values(), before))


def test_donate_takes_adjacent_views_of_one_buffer() -> None:
    """Views that touch but do not overlap (gradaccum's flat buckets) are clipped in place."""
    flat = torch.full((6,), 4.0)
    grads = {"a": flat[:2], "b": flat[2:].view(2, 2)}
    want, norm = boundary.clip_by_global_norm({k: v.clone() for k, v in grads.items()}, 1.0)
    out, got = boundary.clip_by_global_norm(grads, 1.0, donate=True)
    assert torch.equal(got, norm)
    assert all(torch.equal(out[k], want[k]) for k in grads)
    assert out["a"].data_ptr() == flat.data_ptr()


# -- devices: an empty tree with group= ---------------------------------------------------------


class Seen(Exception):  # noqa: N818 (a signal from the fake collective, not an error)
    """Raised by the fake collective with the device of the tensor it was given."""


@pytest.mark.usefixtures("world_of_one")
def test_an_empty_tree_with_group_builds_its_flag_on_the_groups_device(monkeypatch: Any) -> None:
    # A gloo group: the flag is a CPU tensor, and the all-reduce runs.
    scaler = boundary.LossScale()
    out, finite, _ = scaler.unscale({}, scaler.init(), group=dist.group.WORLD)
    assert out == {}
    assert finite
    # An NCCL group (faked): the flag goes where its collectives take their tensors.
    monkeypatch.setattr(boundary, "group_device", lambda group: torch.device("meta"))

    def fake_all_reduce(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
        raise Seen(tensor.device)

    monkeypatch.setattr(comm, "all_reduce", fake_all_reduce)
    with pytest.raises(Seen) as seen:
        scaler.unscale({}, scaler.init(), group=dist.group.WORLD)
    assert seen.value.args == (torch.device("meta"),)


def test_group_device_without_a_process_group_is_the_cpu() -> None:
    assert not dist.is_initialized()
    assert buckets.group_device(None) == torch.device("cpu")


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize(
    ("backend", "want"),
    [
        ("gloo", "cpu"),
        ("nccl", "cuda:2"),
        ("cpu:gloo,cuda:nccl", "cpu"),
        ("cuda:nccl", "cuda:2"),
        ("mpi", "cpu"),
    ],
)
def test_group_device_follows_the_backend(monkeypatch: Any, backend: str, want: str) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert buckets.group_device(None) == torch.device(want)
    assert buckets.group_device(dist.group.WORLD) == torch.device(want)
