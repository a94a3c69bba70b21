"""Host reads per window on the hot paths: a CPU proxy of CUDA's host syncs (issue 28, item 1).

On a CUDA device each of these Python-level reads of a device tensor stalls the host until the
launch queue has drained up to it: ``Tensor.item``, ``tolist``, ``__bool__``, ``__float__``,
``__int__``, ``torch.tensor`` / ``torch.as_tensor`` with a ``device=`` (a host-to-device
copy from pageable memory), and an index assignment of a number (``t[0] = 1.0``: the same
copy). On the CPU none of them costs anything, but the code that calls them
is the same, so counting them here (every tensor is a CPU tensor: every such call is counted)
bounds what a device run can see (the fingerprint's read counts here, though on CUDA it waits
for an event on a side stream, not for the compute stream). ``benchmarks/gpu_check.py`` and the
``gpu`` suite count the real syncs on a device with ``torch.cuda.set_sync_debug_mode``.

The bound (``docs/sync.md``, "Costs and limits"): on the all-reduce and reduce-scatter paths, at
most two reads per window, the fingerprint agreement and the boundary's tail; none inside a
backward and none between micro-batches (a read happens before the window's first forward or
after its last one; for an ``Accumulator``, in its first ``add``, where a reduce-scatter window
opens, or in ``finalize``). One process, a gloo group of world size
one on a ``HashStore``: no process is started, so these run in the fast tier.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

import gradaccum
from gradaccum.loop import Step

READS = ("item", "tolist", "__bool__", "__float__", "__int__")
N = 4
WINDOWS = 3  # the first (the all-reduce records its bucket order there), then steady ones


class Read:
    """One counted host read: what, where (the innermost gradaccum frame), and when."""

    def __init__(
        self,
        what: str,
        forwards: int,
        stepped: bool,
        stack: list[traceback.FrameSummary],
        tensor: Any = None,
    ) -> None:
        self.what, self.forwards, self.stepped = what, forwards, stepped
        self.tensor = tensor  # the tensor read (a read of a tensor's own method), or None
        self.sent = -1  # collectives the test had seen sent when it happened (HostReads.log)
        mine = [f for f in stack if "gradaccum" in f.filename and "tests" not in f.filename]
        frame = (mine or stack)[-1]
        self.where = f"{frame.filename.rsplit('gradaccum', 1)[-1]}:{frame.lineno} {frame.name}"
        # The autograd engine runs a CPU backward's hooks on the calling thread, under
        # torch.autograd's run_backward; a device backward's run on the engine's own thread.
        self.backward = threading.current_thread() is not threading.main_thread() or any(
            f.name in ("_engine_run_backward", "run_backward") and "autograd" in f.filename
            for f in stack
        )

    def __repr__(self) -> str:
        inside = ", inside a backward" if self.backward else ""
        return f"{self.what} at {self.where} after {self.forwards} forward(s){inside}"


class HostReads:
    """Counts the host reads made inside the block (``with HostReads() as reads:``).

    ``forwards`` is the number of forwards the test's loss ran so far (it increments it), so
    that each read says where in the window it happened.
    """

    def __init__(self) -> None:
        self.reads: list[Read] = []
        self.forwards = 0
        self.stepped = False  # the optimizer's step was called (test_loop_step)
        self.log: list[Any] | None = None  # a record_collectives() log: reads note its length
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> HostReads:
        for name in READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def read(t: Any, *a: Any, _name: str = name, _f: Any = original, **k: Any) -> Any:
                self._note(_name, t)
                return _f(t, *a, **k)

            setattr(torch.Tensor, name, read)
        for name in ("tensor", "as_tensor"):
            made = getattr(torch, name)
            self._saved[f"torch.{name}"] = made

            def make(*a: Any, _name: str = name, _f: Any = made, **k: Any) -> Any:
                device = k.get("device")
                if device is not None and torch.device(device).type != "cpu":  # a copy to a device
                    self._note(f"torch.{_name}(device=)")
                return _f(*a, **k)

            setattr(torch, name, make)
        setitem = torch.Tensor.__setitem__
        self._saved["__setitem__"] = setitem

        def assign(t: Any, index: Any, value: Any) -> None:
            if not isinstance(value, torch.Tensor):  # t[0] = 1.0 copies the number over
                self._note("__setitem__ of a number")
            setitem(t, index, value)

        torch.Tensor.__setitem__ = assign  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            if name.startswith("torch."):
                setattr(torch, name.removeprefix("torch."), original)
            else:
                setattr(torch.Tensor, name, original)
        self._saved.clear()

    def _note(self, what: str, tensor: Any = None) -> None:
        stack = traceback.extract_stack()[:-2]
        read = Read(what, self.forwards, self.stepped, stack, tensor)
        if self.log is not None:
            read.sent = len(self.log)
        self.reads.append(read)

    def take(self) -> list[Read]:
        """The reads so far, cleared (the forwards and the optimizer's step too)."""
        out, self.reads, self.forwards, self.stepped = self.reads, [], 0, False
        return out


@pytest.fixture
def counter() -> Iterator[HostReads]:
    with HostReads() as reads:
        yield reads


def mlp() -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    params = {
        "layers.0.weight": torch.randn(16, 8) / 8**0.5,
        "layers.0.bias": torch.zeros(16),
        "layers.1.weight": torch.randn(1, 16) / 4,
        "layers.1.bias": torch.zeros(1),
    }
    return params, (torch.randn(8 * N, 8), torch.randn(8 * N))


def mlp_loss(p: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    x, y = batch
    h = torch.tanh(F.linear(x, p["layers.0.weight"], p["layers.0.bias"]))
    return ((F.linear(h, p["layers.1.weight"], p["layers.1.bias"]).squeeze(-1) - y) ** 2).mean()


def counted(counter: HostReads) -> Callable[[dict[str, torch.Tensor], Any], torch.Tensor]:
    """``mlp_loss``, counting its forwards in ``counter``."""

    def loss(p: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
        counter.forwards += 1
        return mlp_loss(p, batch)

    return loss


def check_window(reads: list[Read], n: int, what: str) -> None:
    """At most 2 reads, none inside a backward, none between two micro-batches' forwards."""
    assert len(reads) <= 2, f"{what}: {len(reads)} host reads in a window: {reads}"
    inside = [r for r in reads if r.backward]
    assert not inside, f"{what}: host reads inside a backward: {inside}"
    between = [r for r in reads if 0 < r.forwards < n]
    assert not between, f"{what}: host reads between micro-batches: {between}"


@pytest.mark.parametrize("n", [1, N])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("timeout", [None, 30.0], ids=["no-timeout", "timeout"])
def test_accumulate_all_reduce(
    world: None, counter: HostReads, n: int, overlap: bool, timeout: float | None
) -> None:
    params, batch = mlp()
    sync = gradaccum.all_reduce(bucket_mb=0.0001, overlap=overlap, timeout=timeout)  # 3 buckets
    step = gradaccum.accumulate(gradaccum.grad_and_value(counted(counter)), n, sync=sync)
    assert len(sync.plan(params)) > 1
    for window in range(WINDOWS):
        step(params, batch)
        check_window(counter.take(), n, f"window {window}")


@pytest.mark.parametrize("n", [1, N])
@pytest.mark.parametrize("policy", ["boundary", "every"])
@pytest.mark.parametrize("timeout", [None, 30.0], ids=["no-timeout", "timeout"])
def test_accumulate_reduce_scatter(
    world: None, counter: HostReads, n: int, policy: str, timeout: float | None
) -> None:
    params, batch = mlp()
    sharded = gradaccum.shard(params, bucket_mb=0.0001)
    sync = gradaccum.reduce_scatter(sharded, policy=policy, timeout=timeout)
    step = gradaccum.accumulate(gradaccum.grad(counted(counter)), n, sync=sync)
    counter.take()  # shard() agreed on the params once
    for window in range(WINDOWS):
        step(sharded, batch)
        check_window(counter.take(), n, f"window {window}")


@pytest.mark.parametrize("n", [1, N])
def test_accumulate_custom_reduce(world: None, counter: HostReads, n: int) -> None:
    """A simple-tier sync: one read, the tail that carries the fingerprint (its own none)."""

    def summed(grads: Any, state: Any, group: Any) -> tuple[Any, Any]:
        for g in grads.values():
            dist.all_reduce(g, group=group)
        return grads, state

    sync = gradaccum.custom_reduce(summed)
    params, batch = mlp()
    step = gradaccum.accumulate(gradaccum.grad(counted(counter)), n, sync=sync)
    for window in range(WINDOWS):
        step(params, batch)
        reads = counter.take()
        check_window(reads, n, f"window {window}")
        assert len(reads) == 1, f"window {window}: {reads}"


@pytest.mark.parametrize("sync", ["all_reduce", "reduce_scatter/boundary", "reduce_scatter/every"])
@pytest.mark.parametrize("metrics", ["none", "tensors", "numbers"])
def test_accumulator(world: None, counter: HostReads, sync: str, metrics: str) -> None:
    params, (x, y) = mlp()
    target: Any = params
    if sync == "all_reduce":
        made: Any = gradaccum.all_reduce(bucket_mb=0.0001)
    else:
        target = gradaccum.shard(params, bucket_mb=0.0001)
        made = gradaccum.reduce_scatter(target, policy=sync.split("/")[1])
    acc = gradaccum.Accumulator(n=N, sync=made)
    micro = list(zip(x.chunk(N), y.chunk(N)))
    values = [torch.func.grad_and_value(mlp_loss)(params, mb) for mb in micro]
    state = acc.init(target)
    counter.take()
    for window in range(WINDOWS):
        opened: list[Read] = []
        for j, ((g, loss), mb) in enumerate(zip(values, micro)):
            extra: dict[str, Any] = {}
            if metrics == "tensors":
                extra = {"metrics": {"loss": loss.detach(), "hits": torch.ones(3)}}
            elif metrics == "numbers":
                extra = {"metrics": {"loss": 0.5, "rows": len(mb[0])}}
            state = acc.add(state, g, size=len(mb[0]), **extra)
            reads = counter.take()
            if j == 0 and sync != "all_reduce":  # a reduce-scatter window agrees as it opens
                opened = reads
            else:
                assert not reads, f"window {window}: add {j}: host reads {reads}"
        if metrics == "none":
            _, state = acc.finalize(state)
        else:
            _, state, stats = acc.boundary(state)
            assert stats.metrics["loss" if metrics == "tensors" else "rows"] > 0
        check_window(opened + counter.take(), 0, f"window {window}: add x {N} + finalize")


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clip", "clip"])
def test_loop_step(world: None, counter: HostReads, clip: float | None) -> None:
    """``Step``: the boundary's two reads, and ``grad_norm``'s once the optimizer step is queued.

    On a device that third read waits for the norm alone, with the optimizer's kernels still
    queued behind it: it drains nothing.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    opt_step = opt.step

    def stepping(*args: Any, **kwargs: Any) -> Any:
        counter.stepped = True
        return opt_step(*args, **kwargs)

    opt.step = stepping  # type: ignore[method-assign]

    def loss(m: torch.nn.Module, b: Any) -> torch.Tensor:
        counter.forwards += 1
        return F.mse_loss(m(b[0]).squeeze(-1), b[1])

    step = Step(model, loss, opt, clip=clip, sync=gradaccum.all_reduce(bucket_mb=0.0001))
    _, (x, y) = mlp()
    micro = list(zip(x.chunk(N), y.chunk(N)))
    for window in range(WINDOWS):
        for j, mb in enumerate(micro):
            step.add(mb)
            reads = counter.take()
            assert not reads, f"window {window}: Step.add {j}: host reads {reads}"
        stats = step.apply()
        reads = counter.take()
        norm = [r for r in reads if r.stepped]
        assert [r.what for r in norm] == ["__float__"], f"window {window}: {reads}"
        check_window([r for r in reads if not r.stepped], 0, f"window {window}: Step.apply()")
        assert isinstance(stats.grad_norm, float)
        assert stats.grad_norm > 0


def earlier(reads: list[Read], before: Any) -> tuple[list[Read], list[Read]]:
    """The reads of ``before``, the status an earlier window left, and the others.

    The status lives in the same buffer in every window, so identity is not enough: a read of
    it counts as the earlier window's only when no collective of this window was sent yet
    (``Read.sent``: the window writes its own status after its last collective).
    """
    if before is None:
        return [], reads
    old = [r for r in reads if r.tensor is before.host and r.sent == 0]
    return old, [r for r in reads if r not in old]


@pytest.mark.parametrize("n", [1, N])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("timeout", [None, 30.0], ids=["no-timeout", "timeout"])
def test_deferred_all_reduce_reads_nothing_of_its_own_window(
    world: None, counter: HostReads, n: int, overlap: bool, timeout: float | None
) -> None:
    """``defer=True``: 0 reads of the window's own values once the layout is steady.

    The first window agrees on the layout (its fingerprint is read) and records the bucket
    order; the second, in the new order, agrees again; from the third on, the only read is
    the status the previous window left (told apart by identity: the test holds it from before
    the window starts), and it is read before the window's first collective.
    """
    params, batch = mlp()
    sync = gradaccum.all_reduce(bucket_mb=0.0001, overlap=overlap, timeout=timeout, defer=True)
    step = gradaccum.accumulate(gradaccum.grad_and_value(counted(counter)), n, sync=sync)
    for window in range(WINDOWS + 2):
        before = sync._deferred.pending
        with gradaccum.sync.record_collectives() as counter.log:
            step(params, batch)
        old, own = earlier(counter.take(), before)
        check_window(old + own, n, f"window {window}")
        if window >= 2:
            assert not own, f"window {window}: reads of its own values: {own}"
            assert len(old) == 1, f"window {window}: {old}"
            assert old[0].forwards == n, f"window {window}: {old}"
    sync.verify()
    assert len(counter.take()) == 1  # the last window's status, read by verify()


@pytest.mark.parametrize("metrics", ["none", "tensors"])
def test_deferred_accumulator_reads_nothing_of_its_own_window(
    world: None, counter: HostReads, metrics: str
) -> None:
    params, (x, y) = mlp()
    sync = gradaccum.all_reduce(bucket_mb=0.0001, defer=True)
    acc = gradaccum.Accumulator(n=N, sync=sync)
    micro = list(zip(x.chunk(N), y.chunk(N)))
    values = [torch.func.grad_and_value(mlp_loss)(params, mb) for mb in micro]
    state = acc.init(params)
    counter.take()
    for window in range(WINDOWS + 1):
        before = sync._deferred.pending
        with gradaccum.sync.record_collectives() as counter.log:
            for g, loss in values:
                extra = {"metrics": {"loss": loss.detach()}} if metrics == "tensors" else {}
                state = acc.add(state, g, size=len(x) // N, **extra)
            _, state = acc.finalize(state)
        old, own = earlier(counter.take(), before)
        if window >= 1:
            assert not own, f"window {window}: reads of its own values: {own}"
            assert len(old) == 1, f"window {window}: {old}"


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clip", "clip"])
def test_deferred_loop_step_reads_nothing_of_its_own_window(
    world: None, counter: HostReads, clip: float | None
) -> None:
    """``Step`` over ``all_reduce(defer=True)``, a fused optimizer: 0 reads of its own window.

    Its stats stay on the device; reading one is the user's read (here, after the window).
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=True)
    sync = gradaccum.all_reduce(bucket_mb=0.0001, defer=True)

    def loss(m: torch.nn.Module, b: Any) -> torch.Tensor:
        counter.forwards += 1
        return F.mse_loss(m(b[0]).squeeze(-1), b[1])

    step = Step(model, loss, opt, clip=clip, sync=sync)
    _, (x, y) = mlp()
    micro = list(zip(x.chunk(N), y.chunk(N)))
    for window in range(WINDOWS + 1):
        before = sync._deferred.pending
        with gradaccum.sync.record_collectives() as counter.log:
            for mb in micro:
                step.add(mb)
            stats = step.apply()
        old, own = earlier(counter.take(), before)
        if window >= 1:  # the first agrees on the layout
            assert not own, f"window {window}: reads of its own values: {own}"
            assert len(old) == 1, f"window {window}: {old}"
        assert isinstance(stats.grad_norm, torch.Tensor)
        assert float(stats.grad_norm) > 0
        counter.take()  # that read was the test's
    sync.verify()
