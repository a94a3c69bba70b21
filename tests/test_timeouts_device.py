"""Timeouts on a device, proxied on the CPU: no host-blocking wait, a stuck collective still raises.

On CUDA (NCCL) ``Comm.wait`` only makes the current stream wait, and the deadline is kept where
the host reads (``Comm.fetch``/``Comm.until``): there it polls, and a collective whose inputs
have been ready for the timeout without completing raises ``GradAccumError``. These tests drive
that path on a one-rank gloo group: ``on_device`` is made true, and the collectives and events
are fakes of a device queue (``Device``), with a fake clock that only the host's pauses move.
A one-rank all-reduce is the identity, so a fake one that moves nothing is exact. The CUDA run
of the same mechanism is in tests/test_gpu.py and benchmarks/gpu_check.py ("timeout").
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

import gradaccum
from gradaccum._dist import comm as comm_mod
from gradaccum._dist import inflight
from gradaccum._dist.broken import is_broken

N = 4
T = 2.0  # the sync's timeout, in fake seconds
PAUSE = 0.1  # fake seconds each host pause takes


class Device:
    """A fake device queue: compute busy until ``busy_until``; collectives done unless stuck."""

    def __init__(self) -> None:
        self.clock = 0.0
        self.busy_until = 0.0  # the compute queued ahead ends then (fake seconds)
        self.stuck = False  # collectives started from now on never complete
        self.pauses = 0
        self.queries = 0
        self.works: list[FakeWork] = []
        self.waited: list[FakeWork] = []  # what the current stream waits for (Work.wait)

    def sleep(self, seconds: float) -> None:
        self.pauses += 1
        self.clock += PAUSE

    def event(self) -> FakeEvent:
        return FakeEvent(self, list(self.waited), self.busy_until)


class FakeEvent:
    """Done once the compute before it and the collectives the stream waited for are done."""

    def __init__(self, dev: Device, after: list[FakeWork], at: float) -> None:
        self.dev, self.after, self.at = dev, after, at

    def query(self) -> bool:
        self.dev.queries += 1
        return self.dev.clock >= self.at and all(w.is_completed() for w in self.after)

    def synchronize(self) -> None:
        if not self.query():  # a real one would block: nothing here can make it complete
            raise AssertionError("a blocking synchronize() on an event that is not done")


class FakeWork:
    """A collective queued behind the compute; ``wait`` records its ``timeout`` argument."""

    def __init__(self, dev: Device, inner: Any = None) -> None:
        self.dev, self.inner, self.stuck, self.at = dev, inner, dev.stuck, dev.busy_until
        self.timeouts: list[Any] = []

    def is_completed(self) -> bool:
        return not self.stuck and self.dev.clock >= self.at

    def wait(self, timeout: Any = None) -> bool:
        self.timeouts.append(timeout)
        self.dev.waited.append(self)
        if self.inner is not None:  # a real gloo collective (reduce-scatter, all-gather)
            self.inner.wait()
        return True


@pytest.fixture
def dev(monkeypatch: pytest.MonkeyPatch) -> Iterator[Device]:
    """A one-rank gloo group whose collectives and events are those of a fake device queue."""
    d = Device()

    def fake_all_reduce(tensor: torch.Tensor, group: Any, timeout: Any, op: Any = None) -> Any:
        work = FakeWork(d)
        d.works.append(work)
        return work

    def wrap(name: str) -> None:
        real = getattr(dist.ProcessGroup, name)

        def started(pg: Any, *args: Any) -> FakeWork:
            work = FakeWork(d, real(pg, *args))
            d.works.append(work)
            return work

        monkeypatch.setattr(dist.ProcessGroup, name, started)

    monkeypatch.setattr(inflight, "on_device", lambda tensor: True)
    monkeypatch.setattr(inflight, "new_event", d.event)
    monkeypatch.setattr(comm_mod, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(inflight, "_clock", lambda: d.clock)
    monkeypatch.setattr(inflight, "_sleep", d.sleep)
    wrap("_reduce_scatter_base")
    wrap("_allgather_base")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield d
    finally:
        inflight._QUEUED.clear()
        dist.destroy_process_group()


@pytest.fixture
def aborted(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The groups whose (fake) NCCL communicator gradaccum aborted."""
    groups: list[Any] = []

    def abort(group: Any) -> bool:
        groups.append(group)
        return True

    monkeypatch.setattr(inflight, "abort_device", abort)
    return groups


def mlp() -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    params = {
        "w0": torch.randn(16, 8, dtype=torch.float64) / 8**0.5,
        "b0": torch.zeros(16, dtype=torch.float64),
        "w1": torch.randn(1, 16, dtype=torch.float64) / 4,
        "b1": torch.zeros(1, dtype=torch.float64),
    }
    return params, (
        torch.randn(8 * N, 8, dtype=torch.float64),
        torch.randn(8 * N, dtype=torch.float64),
    )


def loss_fn(p: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    x, y = batch
    h = torch.tanh(F.linear(x, p["w0"], p["b0"]))
    return ((F.linear(h, p["w1"], p["b1"]).squeeze(-1) - y) ** 2).mean()


def whole_batch(params: dict[str, torch.Tensor], batch: Any) -> dict[str, torch.Tensor]:
    return torch.func.grad(loss_fn)(params, batch)


def make_step(kind: str, check: str = "fingerprint") -> tuple[Any, Any]:
    """``accumulate`` over ``kind`` with timeout ``T``; the params to call it with."""
    params, _ = mlp()
    if kind == "all_reduce":
        sync: Any = gradaccum.all_reduce(bucket_mb=0.0001, timeout=T, check=check)  # 3 buckets
        return gradaccum.accumulate(gradaccum.grad(loss_fn), N, sync=sync), params
    sharded = gradaccum.shard(params, bucket_mb=0.0001)
    policy = kind.split()[1]
    sync = gradaccum.reduce_scatter(sharded, policy=policy, timeout=T, check=check)
    return gradaccum.accumulate(gradaccum.grad(loss_fn), N, sync=sync), sharded


def close(got: Any, want: dict[str, torch.Tensor], kind: str) -> None:
    if kind == "all_reduce":
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-12, atol=1e-12)
    else:  # one rank: each shard is the whole flat gradient of its bucket's leaves
        flat = torch.cat([g.reshape(-1) for g in got])
        assert flat.numel() >= sum(v.numel() for v in want.values())
        torch.testing.assert_close(
            flat.sum(), sum(v.sum() for v in want.values()), rtol=1e-12, atol=1e-12
        )


KINDS = ["all_reduce", "reduce_scatter every", "reduce_scatter boundary"]


@pytest.mark.parametrize("kind", KINDS)
def test_no_host_blocking_wait_and_no_pause_in_a_healthy_run(dev: Device, kind: str) -> None:
    """(a) every collective is waited for without a timeout (the stream waits, not the host);
    (c) a healthy run never pauses, and reads each host value with one query of its event."""
    step, params = make_step(kind)
    _, batch = mlp()
    for _ in range(3):
        got = step(params, batch)
        close(got, whole_batch(mlp()[0], batch), kind)
    assert dev.works, "the fake device saw no collective"
    timeouts = [t for w in dev.works for t in w.timeouts]
    assert timeouts
    assert all(t is None for t in timeouts), timeouts
    assert dev.pauses == 0
    reads = 3 * 2 + 1  # per window the fingerprint and the tail; shard()'s own fingerprint
    assert dev.queries <= reads, f"{dev.queries} event queries for {reads} host reads"
    assert inflight.queued(dist.group.WORLD) == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_busy_device_is_not_a_stuck_collective(dev: Device, kind: str) -> None:
    """Compute queued for 5 timeouts ahead of the collectives: the host waits, nothing raises."""
    step, params = make_step(kind)
    _, batch = mlp()
    step(params, batch)
    dev.busy_until = dev.clock + 5 * T
    got = step(params, batch)
    close(got, whole_batch(mlp()[0], batch), kind)
    assert dev.clock >= 5 * T, "the host did not wait for the device"
    assert not is_broken(None)


def message(what: str, fn: str = "loss_fn") -> str:
    return (
        f"accumulate({fn}, n=4)(...): {what} failed on rank 0: it had not completed 2 s "
        f"after its inputs were ready on this rank. A peer process died, failed before the "
        f"boundary, or did not reach it in time (timeout: 2 s); every rank must call the "
        f"accumulated function the same number of times. Its NCCL communicator was aborted, so "
        f"this process can exit: do not use the group again, exit every rank and restart from "
        f"a checkpoint."
    )


FIRST_STUCK = {
    ("all_reduce", "fingerprint"): "the fingerprint exchange with the other ranks",
    ("all_reduce", "never"): "the boundary all_reduce of bucket 1/3 (136 bytes of float64)",
    # given the Sharded, a window first gathers the params
    ("reduce_scatter every", "never"): "the all_gather of params bucket 1/3 (128 bytes of float64)",
    ("reduce_scatter boundary", "never"): "the all_gather of params bucket 1/3 "
    "(128 bytes of float64)",
}


@pytest.mark.parametrize(("kind", "check"), list(FIRST_STUCK))
def test_a_stuck_collective_raises_at_the_host_read(
    dev: Device, aborted: list[Any], kind: str, check: str
) -> None:
    """(b) a collective that never completes raises ``GradAccumError`` at the window's host
    read, ``T`` after its inputs were ready (here at once), naming it; the group is broken and
    its communicator aborted."""
    step, params = make_step(kind, check)
    _, batch = mlp()
    step(params, batch)
    dev.stuck = True
    start = dev.clock
    with pytest.raises(
        gradaccum.GradAccumError, match=re.escape(message(FIRST_STUCK[kind, check]))
    ):
        step(params, batch)
    waited = dev.clock - start
    assert T < waited <= T + 2 * PAUSE, f"raised after {waited:g} fake s, timeout {T:g} s"
    assert aborted == [dist.group.WORLD]
    assert is_broken(None)
    assert inflight.queued(dist.group.WORLD) == []


def test_the_clock_starts_when_the_inputs_are_ready(dev: Device, aborted: list[Any]) -> None:
    """A stuck collective behind 3 timeouts of compute raises ``T`` after it, not before."""
    step, params = make_step("all_reduce", "never")
    _, batch = mlp()
    step(params, batch)
    dev.stuck, dev.busy_until = True, dev.clock + 3 * T
    start = dev.clock
    with pytest.raises(gradaccum.GradAccumError, match="it had not completed 2 s after its"):
        step(params, batch)
    waited = dev.clock - start
    assert 4 * T < waited <= 4 * T + 2 * PAUSE, f"raised after {waited:g} fake s"


def test_without_an_abort_the_message_says_to_exit(
    dev: Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the communicator cannot be aborted (a torch without it), the fix is ``os._exit``."""
    monkeypatch.setattr(inflight, "abort_device", lambda group: False)
    step, params = make_step("all_reduce", "never")
    _, batch = mlp()
    step(params, batch)
    dev.stuck = True
    want = message(FIRST_STUCK["all_reduce", "never"]).replace(
        "Its NCCL communicator was aborted, so this process can exit: do not use the group "
        "again, exit every rank and restart from a checkpoint.",
        "Its communicator could not be aborted (no ProcessGroupNCCL.abort, or it failed or hung): "
        "exit the process with os._exit(1) and restart every rank from a checkpoint.",
    )
    with pytest.raises(gradaccum.GradAccumError, match=re.escape(want)):
        step(params, batch)


def test_the_queue_keeps_only_what_is_not_done(dev: Device) -> None:
    """Collectives leave their group's queue as they complete (no growth over windows)."""
    step, params = make_step("reduce_scatter every")
    _, batch = mlp()
    for _ in range(5):
        step(params, batch)
        assert len(inflight._QUEUED.get(dist.group.WORLD, [])) <= 3 * N + 4


def test_abort_device_without_a_cuda_backend_is_false(dev: Device) -> None:
    """On a gloo-only group there is nothing to abort."""
    assert inflight.abort_device(dist.group.WORLD) is False


def test_the_cpu_path_keeps_the_timeout_on_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off a device nothing is queued: ``Comm.wait`` passes the timeout, ``fetch`` is ``tolist``."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        c = gradaccum.sync.Comm("test", None, timeout=5.0)
        t = torch.ones(3)
        work = c.all_reduce(t, "a bucket", "gradients")
        assert type(work) is not inflight.Queued
        seen: list[Any] = []

        class Spy:
            def wait(self, timeout: Any = None) -> bool:
                seen.append(timeout)
                return bool(work.wait())

        c.wait(Spy(), "a bucket")
        assert [s.total_seconds() for s in seen] == [5.0]
        assert c.fetch(t) == [1.0, 1.0, 1.0]
        assert not inflight._QUEUED
    finally:
        dist.destroy_process_group()


def test_a_stuck_every_fold_raises_at_the_boundary_not_in_the_backward(
    dev: Device, aborted: list[Any]
) -> None:
    """``policy="every"``: a reduce-scatter stuck from micro-batch 2 on; the host never pauses
    inside the window (its folds make the stream wait), and the boundary's read raises."""
    params, batch = mlp()
    sharded = gradaccum.shard(params, bucket_mb=0.0001)
    pauses: list[int] = []

    def loss(p: dict[str, torch.Tensor], b: Any) -> torch.Tensor:
        pauses.append(dev.pauses)
        if len(pauses) == N + 2:  # the second window's second micro-batch
            dev.stuck = True
        return loss_fn(p, b)

    sync = gradaccum.reduce_scatter(sharded, policy="every", timeout=T)
    step = gradaccum.accumulate(gradaccum.grad(loss), N, sync=sync)
    step(sharded, batch)
    what = "the reduce_scatter of bucket 1/3 (128 bytes of float64)"
    with pytest.raises(gradaccum.GradAccumError, match=re.escape(message(what, "loss"))):
        step(sharded, batch)
    assert pauses == [0] * 2 * N, f"the host paused inside a window: {pauses}"
    assert dev.pauses > 0
    assert aborted == [dist.group.WORLD]


class FakeNCCLGroup:
    """A group whose CUDA backend's ``abort`` returns, raises or hangs."""

    def __init__(self, abort: Any) -> None:
        self.backend = type("Backend", (), {"abort": staticmethod(abort)})() if abort else object()

    def _get_backend(self, device: torch.device) -> Any:
        return self.backend


def _hang() -> None:
    import threading

    threading.Event().wait(5)


def _fail() -> None:
    raise RuntimeError("NCCL error: the abort failed")


@pytest.mark.parametrize(
    ("abort", "aborted"),
    [(lambda: None, True), (_fail, False), (_hang, False), (None, False)],
    ids=["returns", "raises", "hangs", "missing"],
)
def test_abort_device_is_bounded(
    monkeypatch: pytest.MonkeyPatch, abort: Any, aborted: bool
) -> None:
    """The communicator's abort: ``True`` only when it returned; a hung one is left after
    ``ABORT_S`` (the error is raised all the same, and says to ``os._exit``)."""
    import time

    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    monkeypatch.setattr(inflight, "ABORT_S", 0.2)
    t = time.monotonic()
    assert inflight.abort_device(FakeNCCLGroup(abort)) is aborted
    assert time.monotonic() - t < 1.0


def test_a_collective_the_backend_failed_raises_once(dev: Device, aborted: list[Any]) -> None:
    """``Work.wait()`` raising (NCCL found the collective failed): one ``GradAccumError`` with
    the backend's message, the communicator aborted as for a timeout."""
    c = gradaccum.sync.Comm("test", None, timeout=T)
    work = c.all_reduce(torch.ones(2), "a bucket", "gradients")

    def fail(timeout: Any = None) -> bool:
        raise RuntimeError("NCCL error: remote process exited")

    work.work.wait = fail
    want = (
        "test: a bucket failed on rank 0: NCCL error: remote process exited. A peer process "
        "died, failed before the boundary, or did not reach it in time (timeout: 2 s); every "
        "rank must call the accumulated function the same number of times. Its NCCL "
        "communicator was aborted, so this process can exit: do not use the group again, exit "
        "every rank and restart from a checkpoint."
    )
    with pytest.raises(gradaccum.GradAccumError, match=f"^{re.escape(want)}$"):
        c.wait(work, "a bucket")
    assert aborted == [dist.group.WORLD]
