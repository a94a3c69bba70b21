"""The ``gpu`` suite: gradaccum on one CUDA device with a NCCL process group of world size 1.

Every test is compared with a float64 reference (or the plain PyTorch loop). The suite is
skipped without CUDA, and never runs in CI. ``GRADACCUM_GPU_TEST_ON_CPU=1`` runs it on the CPU
with gloo instead, to check the tests' own logic on a machine without a GPU; the CUDA-only checks
(``torch.cuda.set_sync_debug_mode``) skip there.

One GPU cannot host two NCCL ranks: what a second rank would do (mismatched trees, a dead peer)
is covered by the gloo tests. A stuck peer is simulated here, in a process of its own, by
keeping NCCL's stream busy (``test_a_stuck_collective_raises_before_the_device_frees_it``).
``benchmarks/gpu_check.py`` runs this suite, then the measurements (host syncs per window, step
time, memory).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import gradaccum
from gradaccum.loop import Step, load, save, windows

ON_CPU = os.environ.get("GRADACCUM_GPU_TEST_ON_CPU") == "1"
CUDA = not ON_CPU and torch.cuda.is_available()
DEVICE = torch.device("cuda", 0) if CUDA else torch.device("cpu")
BACKEND = "nccl" if CUDA else "gloo"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not ON_CPU and not torch.cuda.is_available(),
        reason="needs a CUDA device (GRADACCUM_GPU_TEST_ON_CPU=1 runs it on CPU + gloo)",
    ),
    pytest.mark.timeout(120),
    # torch warns once, on the first set_sync_debug_mode, that the mode is a prototype: under
    # warnings-as-errors that raised inside it with the mode already on (device run 1).
    pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning"),
]
cuda_only = pytest.mark.skipif(not CUDA, reason="a CUDA-only check (sync debug mode)")

ROWS = 48
WIDTH = 64
TOL32 = 1e-5  # float32 against the float64 reference, relative to the largest entry


@pytest.fixture(scope="module", autouse=True)
def world() -> Iterator[None]:
    """A process group of one rank on ``DEVICE`` (NCCL on CUDA), destroyed at the end."""
    if CUDA:
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(
        BACKEND,
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
        **({"device_id": DEVICE} if CUDA else {}),
    )
    try:
        yield
    finally:
        if CUDA:
            torch.cuda.synchronize()
        dist.destroy_process_group()


# -- models and references --------------------------------------------------------------------


@pytest.fixture(autouse=True)
def sync_debug_mode_off_after() -> Iterator[None]:
    """No test leaves ``set_sync_debug_mode`` on for the next, whatever happened in it."""
    yield
    if CUDA:
        torch.cuda.set_sync_debug_mode(0)


def mlp_params(dtype: torch.dtype = torch.float32, depth: int = 3) -> dict[str, torch.Tensor]:
    """An MLP's params as a dict (several leaves, so several buckets with a small bucket_mb)."""
    gen = torch.Generator().manual_seed(0)
    params: dict[str, torch.Tensor] = {}
    for i in range(depth):
        params[f"layers.{i}.weight"] = torch.randn(WIDTH, WIDTH, generator=gen) / WIDTH**0.5
        params[f"layers.{i}.bias"] = torch.randn(WIDTH, generator=gen) * 0.1
    params["head.weight"] = torch.randn(1, WIDTH, generator=gen) / WIDTH**0.5
    params["head.bias"] = torch.zeros(1)
    return {k: v.to(DEVICE, dtype) for k, v in params.items()}


def mlp_loss(params: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    x, y = batch
    h = x
    depth = sum(1 for k in params if k.endswith(".weight")) - 1
    for i in range(depth):
        h = torch.tanh(F.linear(h, params[f"layers.{i}.weight"], params[f"layers.{i}.bias"]))
    out = F.linear(h, params["head.weight"], params["head.bias"]).squeeze(-1)
    return ((out.float() - y.float()) ** 2).mean()


def regression(rows: int = ROWS, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, WIDTH, generator=gen)
    y = torch.randn(rows, generator=gen)
    return x.to(DEVICE, dtype), y.to(DEVICE)


def reference(params: dict[str, torch.Tensor], batch: Any) -> dict[str, torch.Tensor]:
    """The whole batch's gradient in float64, from the same (possibly rounded) params."""
    wide = {k: v.detach().double() for k, v in params.items()}
    x, y = batch
    return torch.func.grad(mlp_loss)(wide, (x.double(), y.double()))


def rel_err(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per leaf: the largest difference relative to the reference's largest entry."""
    assert sorted(got) == sorted(ref)
    return {
        k: float((got[k].double() - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-30))
        for k in ref
    }


def bad(errors: dict[str, float], tol: float) -> dict[str, float]:
    return {k: v for k, v in errors.items() if not v < tol}


def assemble(params: dict[str, torch.Tensor], shards: Any) -> dict[str, torch.Tensor]:
    """The full gradient tree from reduce-scattered shards (world size 1: the whole gradient).

    The shards are copied into a fresh ``Sharded`` of the same params (the same layout), which is
    gathered.
    """
    out = gradaccum.shard({k: v.detach().clone() for k, v in params.items()}, bucket_mb=0.01)
    assert isinstance(shards, tuple)
    assert len(shards) == len(out.shards)
    with torch.no_grad():
        for s, g in zip(out.shards, shards):
            assert (g.shape, g.dtype, g.device) == (s.shape, s.dtype, s.device)
            s.copy_(g)
    gathered = out.gather()
    return dict(gathered)


# -- 1. the fast path, both syncs, both policies ------------------------------------------------


@pytest.mark.parametrize("n", [1, 4])
def test_all_reduce_fast_path_equals_the_whole_batch_gradient(n: int) -> None:
    params = mlp_params()
    batch = regression()
    ref = reference(params, batch)
    # Small buckets: several all-reduces, the first ones launched during the last backward.
    step = gradaccum.accumulate(
        gradaccum.grad(mlp_loss), n, sync=gradaccum.all_reduce(bucket_mb=0.01)
    )
    for window in range(3):  # the first window records the order; the later ones use it
        grads = step(params, batch)
        assert {g.device for g in grads.values()} == {DEVICE}
        assert not bad(rel_err(grads, ref), TOL32), window


@pytest.mark.parametrize("n", [1, 4])
def test_all_reduce_with_a_timeout_equals_the_whole_batch_gradient(n: int) -> None:
    params = mlp_params()
    batch = regression()
    ref = reference(params, batch)
    sync = gradaccum.all_reduce(bucket_mb=0.01, timeout=30.0)
    step = gradaccum.accumulate(gradaccum.grad_and_value(mlp_loss), n, sync=sync)
    for _ in range(2):
        grads, loss = step(params, batch)
        assert not bad(rel_err(grads, ref), TOL32)
    whole = mlp_loss({k: v.double() for k, v in params.items()}, (batch[0].double(), batch[1]))
    assert abs(float(loss) - float(whole)) < 1e-5 * abs(float(whole))


@pytest.mark.parametrize("policy", ["boundary", "every"])
@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("timeout", [None, 30.0], ids=["no-timeout", "timeout"])
def test_reduce_scatter_equals_the_whole_batch_gradient(
    policy: str, n: int, timeout: float | None
) -> None:
    params = mlp_params()
    batch = regression()
    ref = reference(params, batch)
    sharded = gradaccum.shard(params, bucket_mb=0.01)
    assert {s.device for s in sharded.shards} == {DEVICE}
    sync = gradaccum.reduce_scatter(sharded, policy=policy, timeout=timeout)
    step = gradaccum.accumulate(gradaccum.grad(mlp_loss), n, sync=sync)
    for window in range(2):
        shards = step(sharded, batch)  # gathers the params, then n micro-batches
        assert {s.device for s in shards} == {DEVICE}
        assert not bad(rel_err(assemble(params, shards), ref), TOL32), window
    # Gathered params passed in are used as they are.
    shards = step(sharded.gather(), batch)
    assert not bad(rel_err(assemble(params, shards), ref), TOL32)


@pytest.mark.parametrize("policy", ["boundary", "every"])
def test_reduce_scatter_in_bf16_on_the_wire(policy: str) -> None:
    """``reduce_dtype=torch.bfloat16``: bf16 on the wire, float32 sums and shards."""
    params = mlp_params()
    batch = regression()
    sharded = gradaccum.shard(params, bucket_mb=0.01)
    sync = gradaccum.reduce_scatter(sharded, policy=policy, reduce_dtype=torch.bfloat16)
    step = gradaccum.accumulate(gradaccum.grad(mlp_loss), 4, sync=sync)
    with gradaccum.sync.record_collectives() as log:
        shards = step(sharded, batch)
    assert {c.dtype for c in log if c.kind == "reduce_scatter"} == {torch.bfloat16}
    assert {(s.dtype, s.device) for s in shards} == {(torch.float32, DEVICE)}
    assert not bad(rel_err(assemble(params, shards), reference(params, batch)), 2e-2)


# -- 2. bf16 params --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("accum_dtype", "tol"),
    [(None, 3e-2), (torch.bfloat16, 6e-2)],
    ids=["fp32-accumulation", "bf16-accumulation"],
)
def test_bf16_params_accumulate_in_the_requested_dtype(
    accum_dtype: torch.dtype | None, tol: float
) -> None:
    params = mlp_params(torch.bfloat16)
    batch = regression(dtype=torch.bfloat16)
    ref = reference(params, batch)  # the gradient at the bf16 params, in float64
    n = 8
    sync = gradaccum.all_reduce(bucket_mb=0.01)
    step = gradaccum.accumulate(gradaccum.grad(mlp_loss), n, accum_dtype=accum_dtype, sync=sync)
    for _ in range(2):
        grads = step(params, batch)
        assert {g.dtype for g in grads.values()} == {torch.bfloat16}
        assert not bad(rel_err(grads, ref), tol)
    # The plain loop of bf16 micro-batch gradients, summed in float32 (the default) or bf16.
    wide = accum_dtype or torch.float32
    sums = {k: torch.zeros_like(v, dtype=wide) for k, v in params.items()}
    for x, y in zip(batch[0].chunk(n), batch[1].chunk(n)):
        g = torch.func.grad(mlp_loss)(params, (x, y))
        for k in sums:
            sums[k] += g[k].to(wide) * (len(x) / ROWS)
    hand = {k: v.to(torch.bfloat16) for k, v in sums.items()}
    # Same rounding order up to the kernels: as close to the hand loop as to the reference.
    assert not bad(rel_err(grads, {k: v.double() for k, v in hand.items()}), tol)


# -- 3. FSDP2 ------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))).squeeze(-1)


def fsdp2_model(mp_policy: Any = None, **options: Any) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(DEVICE.type, (1,))
    model = Net().to(DEVICE)
    extra = options if mp_policy is None else {"mp_policy": mp_policy, **options}
    for layer in (model.fc1, model.fc2, model.head):
        fully_shard(layer, mesh=mesh, **extra)
    fully_shard(model, mesh=mesh, **extra)
    return model


def net_reference(batch: Any, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """The whole batch's gradient of ``Net`` (its parameters rounded to ``dtype``), in float64."""
    ref = Net().to(DEVICE).to(dtype)
    x, y = batch
    ((ref(x.to(dtype)).double() - y.double()) ** 2).mean().backward()
    return {k: p.grad.double() for k, p in ref.named_parameters()}  # type: ignore[union-attr]


def fsdp2_grads(model: nn.Module, policy: str, batch: Any) -> tuple[dict[str, Any], list[Any]]:
    """One window through gradaccum; the model's ``.grad`` (full tensors) and the params seen."""
    seen: list[torch.dtype] = []

    def loss(p: Any, b: Any) -> torch.Tensor:
        seen.extend({v.dtype for v in p.values()})
        x, y = b
        out, _ = gradaccum.call_module(model, p, {}, x)
        return ((out.float() - y) ** 2).mean()

    sharded = gradaccum.shard(model)
    sync = gradaccum.reduce_scatter(sharded, policy=policy)
    step = gradaccum.accumulate(gradaccum.grad(loss), 4, sync=sync)
    sharded.write_grads(step(sharded, batch))
    grads = {
        k.replace("_fsdp_wrapped_module.", ""): p.grad.full_tensor()  # type: ignore[union-attr]
        for k, p in model.named_parameters()
    }
    return grads, seen


@pytest.mark.parametrize("policy", ["boundary", "every"])
def test_fsdp2_model_trains_through_reduce_scatter(policy: str) -> None:
    batch = regression()
    grads, seen = fsdp2_grads(fsdp2_model(), policy, batch)
    assert set(seen) == {torch.float32}
    assert not bad(rel_err(grads, net_reference(batch)), TOL32)


@pytest.mark.parametrize("policy", ["boundary", "every"])
@pytest.mark.parametrize(
    ("reduce_dtype", "wire"), [(None, torch.bfloat16), (torch.float32, torch.float32)]
)
def test_fsdp2_mixed_precision_policy_is_honoured(
    policy: str, reduce_dtype: torch.dtype | None, wire: torch.dtype
) -> None:
    """FSDP2's ``MixedPrecisionPolicy``: bf16 params for the forward, the policy's wire dtype.

    As FSDP2: the rows are cast to ``param_dtype`` for the all-gather, the gradients travel in
    ``reduce_dtype`` (``param_dtype`` when None), the sums and the gradients stay float32.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    batch = regression()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    model = fsdp2_model(mp)
    with gradaccum.sync.record_collectives() as log:
        grads, seen = fsdp2_grads(model, policy, batch)
    assert set(seen) == {torch.bfloat16}, f"the loss saw params of {sorted(map(str, set(seen)))}"
    assert {g.dtype for g in grads.values()} == {torch.float32}
    assert {c.dtype for c in log if c.kind == "all_gather"} == {torch.bfloat16}
    assert {c.dtype for c in log if c.kind == "reduce_scatter"} == {wire}
    assert not bad(rel_err(grads, net_reference(batch, torch.bfloat16)), 5e-2)


@cuda_only
def test_fsdp2_cpu_offload_is_refused_under_nccl() -> None:
    """``CPUOffloadPolicy`` keeps the rows on the CPU: NCCL would get CPU buckets."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    model = fsdp2_model(offload_policy=CPUOffloadPolicy())
    with pytest.raises(
        ValueError, match=r"CPUOffloadPolicy keeps it there\), but the group's backend is 'nccl'"
    ):
        gradaccum.shard(model)


# -- 4. loop.Step ------------------------------------------------------------------------------


def step_model(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32),
        nn.Tanh(),
        nn.Dropout(dropout),
        nn.Linear(32, 32),
        nn.Tanh(),
        nn.Linear(32, 1),
    ).to(DEVICE, torch.float64)


def mse(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).squeeze(-1), y)


def micro_batches(count: int, seed: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    rows = [3, 5, 4, 6, 2, 4, 5, 3, 4, 4, 6, 2][:count]  # uneven: weighted by rows
    return [
        (
            torch.randn(r, 8, generator=gen, dtype=torch.float64).to(DEVICE),
            torch.randn(r, generator=gen, dtype=torch.float64).to(DEVICE),
        )
        for r in rows
    ]


def test_loop_step_equals_the_plain_loop() -> None:
    n, windows_ = 4, 3
    data = micro_batches(n * windows_)
    model, plain = step_model(), step_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01, weight_decay=0.1)
    step = Step(model, mse, opt, clip=0.5, sync=gradaccum.all_reduce(bucket_mb=0.001))
    norms = []
    for w in range(windows_):
        window = data[w * n : (w + 1) * n]
        for batch in window:
            step.add(batch)
        stats = step.apply()
        total = sum(len(b[0]) for b in window)
        for batch in window:
            (mse(plain, batch) * (len(batch[0]) / total)).backward()
        norms.append(float(nn.utils.clip_grad_norm_(plain.parameters(), 0.5)))
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
        assert (stats.window, stats.micro_batches, stats.items) == (w, n, float(total))
        assert abs(stats.grad_norm - norms[-1]) < 1e-10 * norms[-1]
    for (k, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.device == DEVICE
        assert p.grad is None, k
        assert float((p - q).detach().abs().max()) < 1e-12, k


# -- 5. checkpoints restore the device's random state --------------------------------------------


def test_a_mid_window_save_and_load_restores_the_random_state(tmp_path: Path) -> None:
    data = micro_batches(8, seed=3)

    def run(stop: tuple[int, int] | None = None, resume: Path | None = None) -> Any:
        model = step_model(dropout=0.5)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = Step(model, mse, opt)
        source = windows(data, 4)
        if resume is not None:
            torch.rand(1000, device=DEVICE)  # move the random state away from the save's
            load(resume, step, data=source)
        for window in source:
            for batch in window:
                step.add(batch)
                if (window.index, step.micro_step) == stop:
                    save(tmp_path / "ckpt", step, data=source)
                    return torch.rand(16, device=DEVICE)  # the next draws after the save
            step.apply()
        return [p.detach().clone() for p in model.parameters()]

    whole = run()
    after_save = run(stop=(1, 2))
    resumed = run(resume=tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed))
    # The device's generator itself is restored: the draws after a load are those after the save.
    model = step_model(dropout=0.5)
    step = Step(model, mse, torch.optim.SGD(model.parameters(), lr=0.1))
    source = windows(data, 4)
    torch.rand(1000, device=DEVICE)
    load(tmp_path / "ckpt", step, data=source)
    assert torch.equal(torch.rand(16, device=DEVICE), after_save)


# -- 6. no host sync per micro-batch ----------------------------------------------------------


class SyncErrors:
    """``torch.cuda.set_sync_debug_mode("error")`` on entry, back to 0 on exit (also on errors)."""

    def __enter__(self) -> None:
        torch.cuda.synchronize()
        try:
            torch.cuda.set_sync_debug_mode("error")
        except BaseException:
            torch.cuda.set_sync_debug_mode(0)
            raise

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode(0)


def accumulator_case(n: int) -> tuple[Any, ...]:
    """An all-reduce ``Accumulator``, its params and batch, and each micro-batch's (grads, loss)."""
    params = mlp_params()
    batch = regression()
    acc = gradaccum.Accumulator(n=n, sync=gradaccum.all_reduce(bucket_mb=0.01))
    micro = list(zip(batch[0].chunk(n), batch[1].chunk(n)))
    values = [torch.func.grad_and_value(mlp_loss)(params, mb) for mb in micro]
    return params, batch, acc, acc.init(params), micro, values


@cuda_only
@pytest.mark.parametrize("metrics", [False, True], ids=["plain", "metrics"])
def test_accumulator_add_in_the_middle_of_a_window_does_not_sync(metrics: bool) -> None:
    n = 4
    params, batch, acc, state, micro, values = accumulator_case(n)
    for window in range(2):
        extra = {"metrics": {"loss": values[0][1].detach()}} if metrics else {}
        state = acc.add(state, values[0][0], size=len(micro[0][0]), **extra)  # opens the window
        with SyncErrors():
            for (g, loss), (x, _) in zip(values[1:], micro[1:]):
                extra = {"metrics": {"loss": loss.detach()}} if metrics else {}
                state = acc.add(state, g, size=len(x), **extra)
        grads, state = acc.finalize(state)
        assert not bad(rel_err(grads, reference(params, batch)), TOL32), window


@cuda_only
@pytest.mark.parametrize("sync", ["all_reduce", "reduce_scatter/every"])
def test_the_fast_path_does_not_sync_before_the_last_micro_batch(sync: str) -> None:
    params = mlp_params()
    batch = regression()
    n = 4
    calls = [0]

    def loss(p: Any, b: Any) -> torch.Tensor:
        # Errors on from the first micro-batch's forward to the last one's (both backwards of
        # the non-last micro-batches, and gradaccum's work between micro-batches, inside).
        k = calls[0] % n
        calls[0] += 1
        if k == 0:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        elif k == n - 1:
            torch.cuda.set_sync_debug_mode(0)
        return mlp_loss(p, b)

    if sync == "all_reduce":
        target: Any = params
        made: Any = gradaccum.all_reduce(bucket_mb=0.01)
    else:
        target = gradaccum.shard(params, bucket_mb=0.01)
        made = gradaccum.reduce_scatter(target, policy="every")
    step = gradaccum.accumulate(gradaccum.grad(loss), n, sync=made)
    try:
        for _ in range(2):
            step(target, batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)


class UntilTheTail:
    """Sync debug mode ``"error"`` from entry to the first host read of a CUDA tensor's list.

    That read is the boundary's tail (``tolist``), the one sync a window needs besides its
    fingerprint, which is read through an event on a side stream (not a sync of the compute
    stream, so the mode does not see it). Everything before it, the window's start, each
    micro-batch, the last backward and the buckets it launches, must not sync.
    """

    def __enter__(self) -> UntilTheTail:
        self.tolist = torch.Tensor.tolist
        self.reached = False
        original = self.tolist

        def tolist(t: torch.Tensor) -> Any:
            if t.is_cuda and not self.reached:
                self.reached = True
                torch.cuda.set_sync_debug_mode(0)
            return original(t)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign,assignment]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode(0)
        torch.Tensor.tolist = self.tolist  # type: ignore[method-assign]


@cuda_only
@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("sync", ["all_reduce", "reduce_scatter/boundary", "reduce_scatter/every"])
def test_a_window_syncs_only_at_its_tail(sync: str, n: int) -> None:
    """issue 28 (1): no sync inside a backward; the fingerprint is read without draining."""
    params = mlp_params()
    batch = regression()
    if sync == "all_reduce":
        target: Any = params
        made: Any = gradaccum.all_reduce(bucket_mb=0.01)
    else:
        target = gradaccum.shard(params, bucket_mb=0.01)
        made = gradaccum.reduce_scatter(target, policy=sync.split("/")[1])
    step = gradaccum.accumulate(gradaccum.grad(mlp_loss), n, sync=made)
    step(target, batch)  # the first window: the bucket order, the side stream, pinned memory
    for window in range(1, 3):
        with UntilTheTail() as tail:
            step(target, batch)
        assert tail.reached, window


@cuda_only
def test_an_accumulator_window_syncs_only_at_its_tail() -> None:
    n = 4
    params, batch, acc, state, micro, values = accumulator_case(n)
    for window in range(3):
        with UntilTheTail() as tail:
            for (g, loss), (x, _) in zip(values, micro):
                state = acc.add(state, g, size=len(x), metrics={"loss": loss.detach(), "rows": 1})
            grads, state, stats = acc.boundary(state)
        assert tail.reached, window
        assert stats.metrics["rows"] == n
        assert not bad(rel_err(grads, reference(params, batch)), TOL32), window


def _step_and_data(n: int) -> tuple[Step, list[Any]]:
    model = step_model()
    step = Step(
        model, mse, torch.optim.SGD(model.parameters(), lr=0.01), sync=gradaccum.all_reduce()
    )
    return step, micro_batches(n)


def _counted_loss(kind: str) -> Any:
    """A loss over the rows with y > 0, returned as ``gradaccum.Mean`` or ``Sum`` with the
    count as a tensor on the device (as a token count is)."""

    def loss(model: nn.Module, batch: Any) -> Any:
        x, y = batch
        kept = y > 0
        summed = ((model(x).squeeze(-1) - y).pow(2) * kept).sum()
        if kind == "Mean":
            return gradaccum.Mean(summed / kept.sum().clamp(min=1), kept.sum())
        return gradaccum.Sum(summed, kept.sum())

    return loss


@cuda_only
@pytest.mark.parametrize("kind", ["Mean", "Sum"])
def test_loop_step_add_with_a_tensor_n_does_not_sync(kind: str) -> None:
    """Issue 35: a loss's n as a tensor on the device scales the backward (a Mean's seed) and
    adds to the window's weight there: no host sync per micro-batch."""
    model = step_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = Step(model, _counted_loss(kind), opt, sync=gradaccum.all_reduce())
    data = micro_batches(4)
    for _ in range(2):
        step.add(data[0])
        with SyncErrors():
            for batch in data[1:]:
                step.add(batch)
        step.apply()


@cuda_only
def test_loop_step_add_in_the_middle_of_a_window_does_not_sync() -> None:
    n = 4
    step, data = _step_and_data(n)
    for _ in range(2):
        step.add(data[0])
        with SyncErrors():
            for batch in data[1:]:
                step.add(batch)
        step.apply()


@cuda_only
def test_loop_step_add_at_a_window_start_does_not_sync() -> None:
    n = 4
    step, data = _step_and_data(n)
    for batch in data:  # window 0: the step's device-side constants are made once
        step.add(batch)
    step.apply()
    with SyncErrors():
        step.add(data[0])


def _sleep_then(fn: Callable[[], Any]) -> float:
    """Host seconds ``fn`` takes behind a 200 ms kernel on the current stream."""
    import time

    torch.cuda.synchronize()
    torch.cuda._sleep(int(200e-3 * 2e9))  # about 200 ms at 2 GHz (more on slower clocks)
    t = time.perf_counter()
    fn()
    took = time.perf_counter() - t
    torch.cuda.synchronize()
    return took


@cuda_only
@pytest.mark.parametrize("timeout", [None, 30.0], ids=["no-timeout", "timeout"])
def test_accumulator_add_does_not_block_the_host(timeout: float | None) -> None:
    params = mlp_params()
    batch = regression()
    acc = gradaccum.Accumulator(n=4, sync=gradaccum.all_reduce(timeout=timeout))
    state = acc.init(params)
    g = torch.func.grad(mlp_loss)(params, batch)
    state = acc.add(state, g, size=ROWS)
    box = [state]

    def add() -> None:
        box[0] = acc.add(box[0], g, size=ROWS)

    took = _sleep_then(add)
    assert took < 0.05, f"Accumulator.add blocked the host {took * 1e3:.0f} ms behind a kernel"
    acc.finalize(box[0])


# -- timeouts: no host-blocking wait; a stuck collective still raises --------------------------


@cuda_only
@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter every", "reduce_scatter boundary"])
def test_a_timeout_never_blocks_the_host_inside_a_backward(kind: str) -> None:
    """With ``timeout=`` the micro-batches are queued without waiting for the device: a 200 ms
    kernel queued in the window's first forward does not delay the next forwards (before issue
    28 ``policy="every"`` waited for its folds on the host, behind such a kernel: 174 ms)."""
    import time

    n = 4
    params = mlp_params()
    batch = regression()
    marks: list[float] = []

    def loss(p: Any, b: Any) -> torch.Tensor:
        marks.append(time.perf_counter())
        if len(marks) == n + 1:  # the second window's first forward
            torch.cuda._sleep(int(200e-3 * 2e9))  # about 200 ms at 2 GHz
        return mlp_loss(p, b)

    target: Any = params
    if kind == "all_reduce":
        sync: Any = gradaccum.all_reduce(bucket_mb=0.01, timeout=30.0)
    else:
        target = gradaccum.shard(params, bucket_mb=0.01)
        sync = gradaccum.reduce_scatter(target, policy=kind.split()[1], timeout=30.0)
    step = gradaccum.accumulate(gradaccum.grad(loss), n, sync=sync)
    step(target, batch)  # the first window: plans, layouts, allocations
    step(target, batch)
    torch.cuda.synchronize()
    starts = [round(1e3 * (m - marks[n]), 1) for m in marks[n:]]
    assert max(starts) < 50, f"{kind}: forwards began at {starts} ms, a 200 ms kernel queued"


def _block_pool(seconds: float) -> None:
    """Keep every pooled CUDA stream busy (NCCL's is one of them): a stuck peer, simulated."""
    for priority in (0, -1):
        for _ in range(32):  # torch's streams per pool and priority
            with torch.cuda.stream(torch.cuda.Stream(priority=priority)):
                torch.cuda._sleep(int(seconds * 2e9))


@cuda_only
def test_a_late_device_is_not_a_stuck_collective() -> None:
    """2 s of compute ahead of a window with ``timeout=0.5``: the window completes, exact."""
    params = mlp_params()
    batch = regression()
    ref = reference(params, batch)
    step = gradaccum.accumulate(
        gradaccum.grad(mlp_loss), 4, sync=gradaccum.all_reduce(bucket_mb=0.01, timeout=0.5)
    )
    step(params, batch)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2.0 * 2e9))
    grads = step(params, batch)
    assert not bad(rel_err(grads, ref), TOL32)


# A stuck peer on one GPU, in a process of its own (its group is aborted, and how the process ends
# after that is what benchmarks/gpu_check.py's "timeout" section measures): every pooled CUDA
# stream, NCCL's included, is kept busy 4 s, so the window's collectives have their inputs ready
# but cannot run. It prints the outcome and leaves with os._exit.
STUCK_CHILD = """
import datetime, os, time, torch, torch.distributed as dist, gradaccum
torch.cuda.set_device(0)
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                        device_id=torch.device("cuda", 0), timeout=datetime.timedelta(seconds=60))
p = {"w": torch.randn(64, 64, device="cuda"), "b": torch.zeros(64, device="cuda")}
x = torch.randn(32, 64, device="cuda")
loss = lambda p, x: torch.tanh(x @ p["w"] + p["b"]).square().mean()
sync = gradaccum.all_reduce(bucket_mb=0.001, timeout=0.5, check="never")
step = gradaccum.accumulate(gradaccum.grad(loss), 4, sync=sync)
step(p, x)
torch.cuda.synchronize()
busy = []
for priority in (0, -1):
    for _ in range(32):
        with torch.cuda.stream(torch.cuda.Stream(priority=priority)):
            torch.cuda._sleep(int(4.0 * 2e9))
            busy.append(torch.cuda.Event())
            busy[-1].record()
t = time.perf_counter()
try:
    step(p, x)
    print("RESULT no error", flush=True)
except gradaccum.GradAccumError as e:
    freed = all(ev.query() for ev in busy)  # the sleeping kernels have ended
    print(f"RESULT {time.perf_counter() - t:.3f} {'freed' if freed else 'busy'} {e}", flush=True)
os._exit(0)
"""


@cuda_only
@pytest.mark.distributed
def test_a_stuck_collective_raises_before_the_device_frees_it() -> None:
    """``timeout=0.5`` and a collective that cannot run for about 4 s: ``GradAccumError`` names
    it, and the process goes on (it leaves with ``os._exit``).

    On an H200 (torch 2.11) the error came 4.0 s after the host reached the boundary, with the
    sleeping kernels about 5 s long: the clock starts when the collective's inputs are ready
    (the busy streams delay those too), and the abort of the NCCL communicator, which runs before
    the error is raised, returned only once the simulated kernels had ended. This simulation
    cannot tell a stuck peer's kernel (which the abort ends) from a long kernel of one's own,
    so the bound asserted is the kernels' length plus the abort's bound, not the timeout."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", STUCK_CHILD], capture_output=True, text=True, timeout=60
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no result (rc {r.returncode}): {r.stdout[-2000:]} {r.stderr[-2000:]}"
    took, _, rest = lines[0].removeprefix("RESULT ").partition(" ")
    assert took != "no", f"no error: {r.stderr[-2000:]}"
    device, _, message = rest.partition(" ")
    assert "failed on rank 0: it had not completed 0.5 s after its inputs were ready" in message
    assert 0.5 < float(took) < 4.0 * 2e9 / 1.4e9 + 10.0, f"raised after {took} s: {message}"
    assert device in ("busy", "freed")


def test_suite_device_is_what_it_claims() -> None:
    """The constants the other tests use: CUDA + NCCL unless GRADACCUM_GPU_TEST_ON_CPU=1."""
    assert dist.get_backend() == BACKEND
    assert DEVICE.type == ("cuda" if CUDA else "cpu")


# -- coupled losses ---------------------------------------------------------------------------


def test_coupled_with_dropout_equals_the_whole_window() -> None:
    """coupled() on the device: dropout masks replayed from the device's random state."""
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 8))
    enc = enc.double().to(DEVICE)
    params = gradaccum.params_of(enc)

    def embed(p: Any, x: torch.Tensor) -> dict[str, torch.Tensor]:
        z = gradaccum.call_module(enc, p, {}, x)[0]
        return {"z": F.normalize(z, dim=-1)}

    def loss(p: Any, reps: dict[str, torch.Tensor], rows: gradaccum.Rows) -> torch.Tensor:
        z = reps["z"]
        sim = 10.0 * z[rows.local] @ z.T
        sim = sim - 1e9 * torch.eye(len(z), dtype=z.dtype, device=z.device)[rows.local]
        nll = F.cross_entropy(sim, rows.arange(z.device) ^ 1, reduction="sum")
        return nll / rows.total

    x = torch.randn(ROWS, 16, dtype=torch.float64, device=DEVICE)
    step = gradaccum.coupled(embed, loss, 4, sync=gradaccum.all_reduce())
    torch.manual_seed(1)
    grads, value = step(params, x)
    torch.manual_seed(1)
    live = {k: v.detach().requires_grad_() for k, v in params.items()}
    reps = {"z": torch.cat([embed(live, mb)["z"] for mb in x.split(ROWS // 4)])}
    total = loss(live, reps, gradaccum.Rows(0, ROWS, ROWS, (ROWS,)))
    want = torch.autograd.grad(total, list(live.values()))
    for k, w in zip(live, want):
        torch.testing.assert_close(grads[k], w, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(value, total.detach(), rtol=1e-12, atol=0)
