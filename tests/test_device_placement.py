"""Every collective's tensor lives where the gradients live (issue 28, item 5: devices).

A CPU tensor handed to NCCL fails (or worse), so every tensor gradaccum communicates must be on
the gradients' device, or, where there is no gradient (an empty tree, an empty layout), on the
group's device. These tests watch every collective: the module function
``gradaccum._dist.comm.all_reduce`` (every ``Comm`` all-reduce goes through it: the gradient
buckets, the tail, the fingerprint, the bucket order, the norm and found-inf flags),
``Comm.reduce_scatter`` / ``all_gather`` / ``broadcast``, and ``torch.distributed.all_reduce``
(which the built-in custom syncs call). Each records its tensors' devices; the tests run every
sync and boundary function and check that each device is the params' device.

On this machine every tensor is a CPU tensor, so that check alone cannot tell a tensor that
follows the gradients from one made on the CPU by default. Two proxies close the gap:

- the group's device is faked (a monkeypatched backend, NCCL, or a ``meta`` device returned by
  ``group_device``) where no gradient gives the device: the empty tree and the empty layout;
- the process's default device is set to ``meta`` while params stay on the CPU: a tensor made
  without a ``device=`` then lands on ``meta`` and is caught (``torch.set_default_device``).

One process, a gloo group of one rank on a ``HashStore``: the fast tier.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

import gradaccum
from gradaccum import boundary
from gradaccum._dist import comm
from gradaccum._dist.comm import Comm

N = 2
CPU = torch.device("cpu")


class WrongDevice(Exception):  # noqa: N818 (what the watch raises instead of the collective)
    """A collective was given a tensor that is not on the CPU, where every param of these tests is.

    Raised instead of running it (gloo cannot take a ``meta`` tensor).
    """


class Seen:
    """The collectives started in a block: ``(kind, purpose or "", devices)``, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, tuple[torch.device, ...]]] = []

    def note(self, kind: str, purpose: str, *tensors: torch.Tensor) -> None:
        devices = tuple(t.device for t in tensors)
        self.calls.append((kind, purpose, devices))
        if any(d != CPU for d in devices):
            raise WrongDevice(f"{kind} ({purpose or 'purpose not given'}) on {devices}")

    def devices(self) -> set[torch.device]:
        return {d for _, _, devices in self.calls for d in devices}

    def purposes(self) -> set[str]:
        return {p for _, p, _ in self.calls}


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch, world: None) -> Seen:
    """Watch every collective gradaccum can start (then run it as before)."""
    log = Seen()
    real_all_reduce = comm.all_reduce

    def all_reduce(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
        log.note("all_reduce", "", tensor)
        return real_all_reduce(tensor, *a, **k)

    monkeypatch.setattr(comm, "all_reduce", all_reduce)
    real_comm_all_reduce = Comm.all_reduce

    def comm_all_reduce(self: Comm, tensor: torch.Tensor, what: str, purpose: str, *a: Any,
                        **k: Any) -> Any:  # fmt: skip
        log.note("all_reduce", purpose, tensor)  # the module function's entry is the same call
        out = real_comm_all_reduce(self, tensor, what, purpose, *a, **k)
        log.calls.pop()
        return out

    monkeypatch.setattr(Comm, "all_reduce", comm_all_reduce)
    for kind in ("reduce_scatter", "all_gather"):
        real = getattr(Comm, kind)

        def two(self: Comm, out: torch.Tensor, inp: torch.Tensor, what: str, purpose: str,
                _kind: str = kind, _real: Any = real) -> Any:  # fmt: skip
            log.note(_kind, purpose, out, inp)
            return _real(self, out, inp, what, purpose)

        monkeypatch.setattr(Comm, kind, two)
    real_broadcast = Comm.broadcast

    def broadcast(self: Comm, tensor: torch.Tensor, src: int, what: str, purpose: str) -> Any:
        log.note("broadcast", purpose, tensor)
        return real_broadcast(self, tensor, src, what, purpose)

    monkeypatch.setattr(Comm, "broadcast", broadcast)
    real_dist_all_reduce = dist.all_reduce

    def dist_all_reduce(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
        log.note("dist.all_reduce", "", tensor)
        return real_dist_all_reduce(tensor, *a, **k)

    monkeypatch.setattr(dist, "all_reduce", dist_all_reduce)
    return log


def mlp(dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], Any]:
    torch.manual_seed(0)
    params = {
        "layers.0.weight": torch.randn(16, 8, device=CPU) / 8**0.5,
        "layers.0.bias": torch.zeros(16, device=CPU),
        "layers.1.weight": torch.randn(1, 16, device=CPU) / 4,
        "layers.1.bias": torch.zeros(1, device=CPU),
    }
    params = {k: v.to(dtype) for k, v in params.items()}
    batch = (torch.randn(8 * N, 8, device=CPU, dtype=dtype), torch.randn(8 * N, device=CPU))
    return params, batch


def mlp_loss(p: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    x, y = batch
    h = torch.tanh(F.linear(x, p["layers.0.weight"], p["layers.0.bias"]))
    out = F.linear(h, p["layers.1.weight"], p["layers.1.bias"]).squeeze(-1)
    return ((out.float() - y) ** 2).mean()


def per_sample_loss(p: dict[str, torch.Tensor], sample: Any) -> torch.Tensor:
    x, y = sample
    return mlp_loss(p, (x[None], y[None]))


def _all_reduce(**options: Any) -> Callable[[], Any]:
    params, batch = mlp()
    step = gradaccum.accumulate(
        gradaccum.grad(mlp_loss), N, sync=gradaccum.all_reduce(bucket_mb=0.0001, **options)
    )
    return lambda: step(params, batch)


def _accumulator(make_sync: Callable[[Any], Any], sharded: bool = False) -> Callable[[], Any]:
    params, (x, y) = mlp()
    target = gradaccum.shard(params, bucket_mb=0.0001) if sharded else params
    acc = gradaccum.Accumulator(N, sync=make_sync(target))
    micro = list(zip(x.chunk(N), y.chunk(N)))

    def window() -> Any:
        state = acc.init(target)
        for mb in micro:
            state = acc.add(state, torch.func.grad(mlp_loss)(params, mb), size=len(mb[1]))
        return acc.boundary(state)

    return window


def _reduce_scatter(policy: str) -> Callable[[], Any]:
    params, batch = mlp()
    sharded = gradaccum.shard(params, bucket_mb=0.0001)
    step = gradaccum.accumulate(
        gradaccum.grad(mlp_loss), N, sync=gradaccum.reduce_scatter(sharded, policy=policy)
    )
    return lambda: step(sharded, batch)


def _custom(sync: Any, reduction: str = "mean", per_sample: bool = False) -> Callable[[], Any]:
    params, batch = mlp()
    fn = gradaccum.grad(mlp_loss)
    extra: dict[str, Any] = {}
    if per_sample:
        fn = torch.func.vmap(torch.func.grad(per_sample_loss), in_dims=(None, 0))
        extra["micro_transform"] = gradaccum.privacy.clip_per_sample(1.0)
    step = gradaccum.accumulate(fn, N, reduction=reduction, sync=sync, **extra)
    return lambda: step(params, batch)


def _sum_each(grads: Any, state: Any, group: Any) -> tuple[Any, Any]:
    for g in grads.values():
        dist.all_reduce(g, group=group)
    return grads, state


def _boundary_functions() -> Callable[[], Any]:
    params, _ = mlp()
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    scaler = boundary.LossScale()

    def run() -> Any:
        boundary.clip_by_global_norm(grads, 1.0, group=dist.group.WORLD)
        return scaler.unscale(grads, scaler.init(), group=dist.group.WORLD)

    return run


# name: (a window of the sync, the purposes its collectives must include)
CASES: dict[str, tuple[Callable[[], Callable[[], Any]], set[str]]] = {
    "all_reduce fast path": (_all_reduce, {"fingerprint", "gradients"}),
    "all_reduce no overlap": (lambda: _all_reduce(overlap=False), {"fingerprint", "gradients"}),
    "all_reduce bf16 wire": (
        lambda: _all_reduce(reduce_dtype=torch.bfloat16),
        {"fingerprint", "gradients"},
    ),
    "all_reduce Accumulator": (
        lambda: _accumulator(lambda _: gradaccum.all_reduce(bucket_mb=0.0001)),
        {"fingerprint", "gradients"},
    ),
    "reduce_scatter boundary": (lambda: _reduce_scatter("boundary"), {"gradients", "weight"}),
    "reduce_scatter every": (lambda: _reduce_scatter("every"), {"gradients (every)", "weight"}),
    "reduce_scatter Accumulator": (
        lambda: _accumulator(lambda s: gradaccum.reduce_scatter(s), sharded=True),
        {"gradients", "weight"},
    ),
    "custom_reduce": (lambda: _custom(gradaccum.custom_reduce(_sum_each)), {"weight"}),
    "compressed_all_reduce": (
        lambda: _custom(gradaccum.compression.compressed_all_reduce()),
        {"weight"},
    ),
    "dp_noise": (
        lambda: _custom(gradaccum.privacy.dp_noise(1.0, 1.0, 16.0), "sum", per_sample=True),
        {"weight"},
    ),
    "boundary functions with group=": (_boundary_functions, {"norm", "found_inf"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_collective_tensor_is_on_the_params_device(seen: Seen, case: str) -> None:
    make, purposes = CASES[case]
    window = make()
    seen.calls.clear()
    for _ in range(2):  # the first window, then a steady one (reordered buckets, reused ones)
        window()
    assert seen.calls, f"{case}: no collective was seen"
    assert seen.devices() == {CPU}, f"{case}: {seen.calls}"
    assert purposes <= seen.purposes(), f"{case}: {sorted(seen.purposes())}"


# -- where no gradient says: the group's device -------------------------------------------------


class Stop(Exception):  # noqa: N818 (a signal from the fake collective, not an error)
    """The fake collective's way out, with the devices it was given."""


@pytest.fixture
def nccl(monkeypatch: pytest.MonkeyPatch, world: None) -> list[torch.device]:
    """A default group that says it is NCCL on ``cuda:0``; its collectives stop the test.

    ``group_device`` resolves it to ``cuda:0``, which this machine cannot allocate on, so the
    sync is given ``meta`` instead (what matters is that it asks the group, not the CPU).
    """
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert gradaccum._dist.buckets.group_device(None) == torch.device("cuda", 0)
    meta = torch.device("meta")
    monkeypatch.setattr(boundary, "group_device", lambda group: meta)
    monkeypatch.setattr(gradaccum.sync._all_reduce, "group_device", lambda group: meta)
    devices: list[torch.device] = []

    def stop(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
        devices.append(tensor.device)
        raise Stop

    monkeypatch.setattr(comm, "all_reduce", stop)
    return devices


def test_an_empty_tree_unscaled_over_an_nccl_group_sends_its_flag_there(
    nccl: list[torch.device],
) -> None:
    scaler = boundary.LossScale()
    with pytest.raises(Stop):
        scaler.unscale({}, scaler.init(), group=dist.group.WORLD)
    assert nccl == [torch.device("meta")]


def test_an_empty_layouts_bucket_over_an_nccl_group_is_on_its_device(
    nccl: list[torch.device],
) -> None:
    sync = gradaccum.all_reduce()
    (bucket,) = sync.plan({})
    assert (bucket.device, bucket.tail, bucket.paths) == (torch.device("meta"), True, ())


# -- the default device: a tensor made without device= is caught --------------------------------

# The fingerprint and the tail go through gradaccum._dist.comm.to_device, which makes its CPU
# tensors with device= (before issue 28 it did not: under torch.set_default_device(...) they
# landed on the default device, not the gradients').


def _default_device_window(case: str) -> None:
    make, _ = CASES[case]
    window = make()
    torch.set_default_device("meta")
    try:
        window()
        window()
    finally:
        torch.set_default_device(None)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.usefixtures("seen")
def test_collectives_follow_the_params_not_the_default_device(case: str) -> None:
    _default_device_window(case)


def test_a_kept_log_does_not_keep_the_process_group_alive() -> None:
    """A log of ``record_collectives`` kept after ``destroy_process_group`` lets the group go.

    A record that held its group strongly kept it, and its backend's threads, until the
    interpreter's finalization, where freeing them aborted the process now and then
    ("terminate called without an active exception", examples/lightning_recipe.py under load).
    """
    import gc
    import weakref

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with gradaccum.sync.record_collectives() as log:
            gradaccum.accumulate(
                lambda p, b: {"w": b.sum() * p["w"]}, 2, sync=gradaccum.all_reduce()
            )({"w": torch.ones(3)}, torch.ones(4))
        group = weakref.ref(dist.group.WORLD)
        assert log
        assert all(c.group is group() for c in log)
    finally:
        dist.destroy_process_group()
    gc.collect()
    assert group() is None
    assert all(c.group is None for c in log)
    assert {c.purpose for c in log} >= {"gradients"}
