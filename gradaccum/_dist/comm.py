"""The transport: every collective gradaccum issues, with its timeout enforced without a host stall.

On CPU tensors (gloo) the timeout goes into the collective's own options
(``AllreduceOptions.timeout`` and the like), so the backend fails the collective itself, on
every kind: ``Work.wait(timeout)`` is not enough (gloo ignores it for reduce-scatter, and a
collective left pending makes a late peer block in it); docs/sync.md ("A dead or stuck peer")
has the user's side.

On CUDA (NCCL) a ``Work.wait(timeout)`` blocks the host thread until the collective ends, and a
collective past its own timeout makes NCCL's watchdog end the process. So there the timeout is
kept by the host where it already waits, and nowhere else: ``Comm.wait`` only makes the current
stream wait (``Work.wait()``, no host stall, inside a backward too), each collective is kept in
its group's queue with an event marking its inputs ready, and the window's host reads
([`Comm.fetch()`][gradaccum.sync.Comm.fetch], the fingerprint's event in ``agree``) poll instead
of blocking: a collective at the head of its group's queue whose inputs have been ready for
``timeout`` seconds is stuck (a peer is dead or late), and becomes a ``GradAccumError`` on every
rank that waits for it. The group's NCCL communicator is then aborted, so that the stuck kernel
ends and the process can exit. A busy device is not a stuck collective: the clock starts when
the inputs are ready, not when the host queued the collective.

No collective outlives its failure. A gloo collective runs in one of the backend's worker threads
until it completes or its own timeout fires, whether or not anyone still waits for it, and torch
cannot stop it (the gloo backend's ``abort()`` and ``shutdown()`` do nothing, up to torch 2.13 at
least). So the CPU collectives a ``Comm`` starts are kept until they are waited for, and when one
fails every other one of the group is waited for to its end before the error is raised (see
[`drain()`][gradaccum.sync.Comm.drain]): a worker thread that finishes one while the interpreter
finalizes aborts the process ("terminate called without an active exception").

[`Comm`][gradaccum.sync.Comm] writes each mechanism once for every sync. (All all-reduces go
through the module function ``all_reduce``, which tests replace to watch them.)
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import re
import weakref
from collections.abc import Iterator
from itertools import zip_longest
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from .. import _metrics
from .._errors import GradAccumError, misaligned
from . import inflight
from .broken import mark_broken
from .buckets import TAIL
from .mesh import Axis, axis, hold
from .record import record

__all__ = [
    "Comm",
    "Probe",
    "bucket_what",
    "settle",
    "to_device",
]


def _options(opts: Any, timeout: float | None, tensor: torch.Tensor) -> Any:
    if timeout is not None and tensor.device.type == "cpu":
        opts.timeout = datetime.timedelta(seconds=timeout)
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = True
    return opts


def all_reduce(
    tensor: torch.Tensor, group: Any, timeout: float | None, op: Any = dist.ReduceOp.SUM
) -> Any:
    """Start an in-place all-reduce of ``tensor`` over ``group``."""
    opts = _options(c10d.AllreduceOptions(), timeout, tensor)
    opts.reduceOp = op
    pg: Any = dist.group.WORLD if group is None else group
    return pg.allreduce([tensor], opts)


FINGERPRINT = "the fingerprint exchange with the other ranks"
WINDOW = "window index "  # the first line of a window's description: the window's index


class Probe(NamedTuple):
    """A fingerprint exchange in flight.

    On CUDA, ``host`` (pinned) receives the result on a side stream that waits for the
    collective only, and ``event`` marks the copy done: reading it waits for the exchange, not
    for the compute queued since. Elsewhere both are ``None`` and ``tensor`` is read directly.
    """

    work: Any
    tensor: torch.Tensor
    desc: tuple[str, ...]
    host: torch.Tensor | None = None
    event: Any = None


# One side stream per CUDA device, on which fingerprints are copied back to the host.
_SIDE: dict[int, Any] = {}


def _side_stream(device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE.get(index)
    if stream is None:
        stream = _SIDE[index] = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
    return stream


def to_device(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1-D tensor on ``device``, without a host sync.

    On CUDA the numbers go through pinned memory with a non-blocking copy, ordered on the
    current stream (``torch.tensor(..., device=)`` would copy from pageable memory and wait for
    the device); on the CPU it is a plain tensor.
    """
    if device.type != "cuda":  # device= even on the CPU: not the default device's
        return torch.tensor(values, dtype=dtype, device=device)
    host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)


class Comm:
    """A sync's process group for one window: collectives that log and name themselves.

    Every collective goes through here: it is recorded for
    [`record_collectives()`][gradaccum.sync.record_collectives], started with the sync's
    timeout set on the collective itself, and a failure (a dead or late peer, a timeout) becomes
    a [`GradAccumError`][gradaccum.GradAccumError] that names the call, the collective and the
    rank, and marks the group broken (the error path then does not wait on it again). Before
    that error is raised, every other collective started on the group has ended
    ([`drain()`][gradaccum.sync.Comm.drain]), so the caller may catch it and exit normally.

    Args:
        where: The call shape that failures are reported against (e.g.
            ``"accumulate(loss, n=4)(...)"``); may be changed later (``comm.where = ...``).
        group: A process group, ``None`` for the default group, or a 1-D ``DeviceMesh`` (its
            group; the collectives are recorded with its dim name).
        timeout: Seconds after which each collective fails; ``None``: the group's timeout. On
            the CPU the backend fails the collective; on CUDA the host does, at its next read
            ([`fetch()`][gradaccum.sync.Comm.fetch]), counting from when the collective's inputs
            were ready.
        check: ``"fingerprint"``, ``"full"`` or ``"never"``, as in
            [`all_reduce()`][gradaccum.all_reduce].
        what: How the sync calls itself when torch.distributed is missing.
        window: The [`Window`][gradaccum.sync.Window] whose boundary this is, or ``None``;
            [`Window.connect()`][gradaccum.sync.Window.connect] passes it. Its fingerprint then
            covers the window's index and metric names, and
            [`exchange()`][gradaccum.sync.Comm.exchange] carries its metric sums.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: This process is not a member of ``group``, or ``group`` is a mesh of more
            than one dim.

    Examples:
        >>> import torch, torch.distributed as dist, gradaccum
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> comm = gradaccum.sync.Comm("my_sync", None, timeout=60)
        >>> t = torch.ones(3)
        >>> comm.wait(comm.all_reduce(t, "my bucket", "gradients"), "my bucket")
        >>> comm.fetch(t)  # a host read; on CUDA it polls, bounded by the timeout
        [1.0, 1.0, 1.0]
        >>> comm.drain()  # what a failure does first: wait until nothing is in flight on the group
        >>> comm.rank, comm.world, t
        (0, 1, tensor([1., 1., 1.]))
        >>> comm.settle(comm.exchange(torch.device("cpu"), 5, False), "mean")
        5.0
        >>> comm.boundary(torch.device("cpu"), 5, False, ("my tree",), "gradients")  # + fingerprint
        5.0
        >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        where: str,
        group: Any,
        timeout: float | None = None,
        check: str = "fingerprint",
        what: str = "sync=all_reduce()",
        window: Any = None,
    ) -> None:
        self.where, self.timeout, self.check = where, timeout, check
        # Weakly: a window holds its Comm; a cycle would keep its buckets alive until a GC pass.
        self.window: Any = weakref.proxy(window) if window is not None else None
        try:
            group, self.dim = group if isinstance(group, Axis) else axis(where, group)
        except GradAccumError as err:  # a group held weakly (Axis) was freed
            raise GradAccumError(f"{where}: {err}") from None
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"{where}: {what} needs torch.distributed initialised, but no process "
                f"group exists; call torch.distributed.init_process_group(...) first (torchrun "
                f"sets the environment for it; after destroy_process_group(), again before using "
                f"it), or, in a job of one process only, drop sync=."
            )
        pg: Any = dist.group.WORLD if group is None else group
        try:
            rank = -1 if pg is dist.GroupMember.NON_GROUP_MEMBER else dist.get_rank(pg)
        except ValueError as err:  # torch: "Group ... is not registered"
            if "not registered" not in str(err):
                raise
            raise GradAccumError(
                f"{where}: its process group {group_name(pg)} is not registered any more (it "
                f"was destroyed, torch.distributed.destroy_process_group()); build the sync, "
                f"the windows and the step again with a group of the current process group."
            ) from None
        if rank < 0:
            raise ValueError(
                f"{where}: this process (global rank {dist.get_rank()}) is not a member of the "
                f"sync group {group_name(pg)}; build the sync with a group this rank belongs to "
                f"(every rank must call dist.new_group with the same ranks)."
            )
        self.rank, self.world = rank, dist.get_world_size(pg)
        # Weakly: destroy_process_group() frees the group whatever keeps this Comm (see hold).
        self._group = hold(pg)

    @property
    def group(self) -> Any:
        """The process group the collectives run on (held weakly: see ``_dist.mesh.hold``)."""
        try:
            return self._group()
        except GradAccumError as err:
            raise GradAccumError(f"{self.where}: {err}") from None

    def all_reduce(
        self, tensor: torch.Tensor, what: str, purpose: str, op: Any = dist.ReduceOp.SUM
    ) -> Any:
        """Start an in-place sum (or ``op``) of ``tensor`` over the group."""
        record("all_reduce", self.group, tensor.dtype, tensor.numel(), purpose, self.dim)
        with self.failing(what):
            return self.started(all_reduce(tensor, self.group, self.timeout, op), tensor, what)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, what: str, purpose: str) -> Any:
        """Start a sum of ``inp`` over the group, this rank's chunk of it into ``out``."""
        record("reduce_scatter", self.group, inp.dtype, inp.numel(), purpose, self.dim)
        opts = _options(c10d.ReduceScatterOptions(), self.timeout, inp)
        opts.reduceOp = dist.ReduceOp.SUM
        with self.failing(what):
            return self.started(self.group._reduce_scatter_base(out, inp, opts), inp, what)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, what: str, purpose: str) -> Any:
        """Start gathering every rank's ``inp`` into ``out``, in rank order."""
        record("all_gather", self.group, out.dtype, out.numel(), purpose, self.dim)
        opts = _options(c10d.AllgatherOptions(), self.timeout, inp)
        with self.failing(what):
            return self.started(self.group._allgather_base(out, inp, opts), inp, what)

    def broadcast(self, tensor: torch.Tensor, src: int, what: str, purpose: str) -> Any:
        """Start a broadcast of ``tensor`` from rank ``src``."""
        record("broadcast", self.group, tensor.dtype, tensor.numel(), purpose, self.dim)
        opts = _options(c10d.BroadcastOptions(), self.timeout, tensor)
        opts.rootRank, opts.rootTensor = src, 0
        with self.failing(what):
            return self.started(self.group.broadcast([tensor], opts), tensor, what)

    def started(self, work: Any, tensor: torch.Tensor, what: str = "a collective") -> Any:
        """Keep ``work``, the collective ``what`` just started on ``tensor``, until it ends.

        On a device with a ``timeout`` it comes back as a ``Queued`` (the work, with the event
        that marks its inputs ready), which ``wait`` and the bounded reads know. On the CPU it
        is kept for [`drain()`][gradaccum.sync.Comm.drain].
        """
        if self.timeout is not None and inflight.on_device(tensor):
            work = inflight.queue(self.group, work, what, self)
        elif tensor.device.type == "cpu":  # a gloo worker thread runs it
            inflight.keep(self.group, work)
        return work

    def wait(self, work: Any, what: str) -> None:
        """Wait for ``work`` (at most the timeout); a failure raises ``GradAccumError``.

        On a device (a ``Queued`` collective) only the current stream waits: the host does
        not, and the timeout is kept where the host reads ([`fetch()`][gradaccum.sync.Comm.fetch]).
        """
        if type(work) is inflight.Queued:  # the stream waits for it, the host goes on
            try:
                work.work.wait()
            except RuntimeError as err:  # NCCL found it failed: abort, as for a timeout
                raise self.broken(what, err, device=True) from err
            return
        try:  # failing(what), written out: this runs for every bucket of every window
            if self.timeout is None:
                work.wait()
            else:  # the collective fails by itself after its timeout; this bound is a second line
                work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as err:
            raise self.broken(what, err) from err
        inflight.forget(self.group, work)

    def fetch(self, tensor: torch.Tensor, done: Any = None) -> list[Any]:
        """``tensor.tolist()``: a host read, waiting for the collectives at most their timeout.

        With device collectives queued by a ``Comm`` with a ``timeout``, the host does not block
        in the read: it waits for an event recorded after ``tensor`` (or for ``done``, an event
        that marks ``tensor`` ready), polling, and raises
        [`GradAccumError`][gradaccum.GradAccumError] naming the collective when one has had
        its inputs ready for its timeout without completing
        ([`until()`][gradaccum.sync.Comm.until]). Otherwise (the CPU, no timeout) it is
        ``tensor.tolist()``, which waits as long as it takes.
        """
        if done is None and inflight.any_queued() and inflight.on_device(tensor):
            done = inflight.new_event()
        if done is not None:
            self.until(done)
        return tensor.tolist()

    def until(self, done: Any) -> None:
        """Wait for the event ``done``; raise if a queued collective is stuck past its timeout.

        The host polls (``done.query()``, pausing 50 us, growing to 0.5 ms) and, between polls,
        looks at the head of each group's queue: the collective that has had its inputs ready for
        its ``Comm``'s timeout without completing raises
        [`GradAccumError`][gradaccum.GradAccumError] here, on every rank that waits for it (each
        by its own clock), and its group's NCCL communicator is aborted. Done at once: no pause.
        """
        if done.query():
            return
        pause = inflight.POLL_FIRST
        while True:
            late = inflight.overdue(inflight.clock())
            if late is not None:
                raise late.comm.timed_out(late)
            if not inflight.any_queued():  # nothing of ours left to time: a plain wait
                done.synchronize()
                return
            inflight.pause(pause)
            if done.query():
                return
            pause = min(2 * pause, inflight.POLL_MAX)

    def timed_out(self, late: inflight.Queued) -> GradAccumError:
        """The error for ``late``, a device collective of this ``Comm`` stuck past its timeout."""
        return self.broken(
            late.what,
            TimeoutError(
                f"it had not completed {self.timeout:g} s after its inputs were ready on this rank"
            ),
            device=True,
        )

    def drain(self) -> None:
        """Wait until every CPU collective started on the group through a ``Comm`` has ended.

        Called when a collective failed, before its error is raised: the others are then
        abandoned, but each still runs in a gloo worker thread until it completes or fails (at
        most its own timeout after it starts; at once when the failure closed the peer's
        connection, as a timeout or a dead peer does). Once they have ended, nothing of
        gradaccum's runs in the backend, so the caller may catch the error, destroy the group and
        let the interpreter exit normally. They stay referenced until the group is freed, so that
        no worker thread frees them (which takes the GIL: fatal while the interpreter finalizes).

        The group's ``abort()`` and ``shutdown()`` cannot do this: the gloo backend's do nothing
        (up to torch 2.13 at least), and torch 2.4 to 2.6 do not have them. This uses neither,
        so it is the same on every supported torch. Collectives on accelerators are not kept
        (NCCL's own watchdog handles them).
        """
        works = inflight.take(self.group)
        for work in works:
            with contextlib.suppress(RuntimeError):  # its failure is this error's, or a sequel
                work.wait()  # no bound needed: the collective's own timeout ends it
        inflight.abandon(self.group, works)  # kept, not freed here: see inflight.abandon

    @contextlib.contextmanager
    def failing(self, what: str) -> Iterator[None]:
        """Turn a failed collective (``RuntimeError`` from the backend) into ``broken``'s error."""
        try:
            yield
        except RuntimeError as err:
            raise self.broken(what, err) from err

    def broken(self, what: str, err: Exception, device: bool = False) -> GradAccumError:
        """The error for a failed collective ``what``; the group is marked broken and drained.

        Every other collective started on the group has ended when this returns
        ([`drain()`][gradaccum.sync.Comm.drain]). ``device``: a device collective timed out; its
        group's NCCL communicator is aborted, so that the stuck kernel ends and the process can
        exit (the message says whether it was).
        """
        mark_broken(self.group)
        aborted = False
        if device:
            inflight.drop_queue(self.group)
            aborted = inflight.abort_device(self.group)
        self.drain()
        limit = f"{self.timeout:g} s" if self.timeout is not None else "the process group's timeout"
        cause = str(err).splitlines()[0] if str(err) else type(err).__name__
        then = "The process group cannot be reused: destroy it and restart from a checkpoint."
        if device:
            then = (
                "Its NCCL communicator was aborted, so this process can exit: do not use the "
                "group again, exit every rank and restart from a checkpoint."
                if aborted
                else "Its communicator could not be aborted (no ProcessGroupNCCL.abort, or it "
                "failed or hung): exit the process with os._exit(1) and restart every rank from "
                "a checkpoint."
            )
        return GradAccumError(
            f"{self.where}: {what} failed on rank {self.rank}: {cause}. A peer process died, "
            f"failed before the boundary, or did not reach it in time (timeout: {limit}); every "
            f"rank must call the accumulated function the same number of times. {then}"
        )

    def lines(self, desc: tuple[str, ...]) -> tuple[str, ...]:
        """``desc`` after the window's index, metric names and options (if bound to one)."""
        if self.window is None:
            return desc
        spec = self.window.spec
        names = (_metrics.line(spec),) if spec.metrics else ()
        epoch = f" of epoch {spec.epoch}" if spec.epoch else ""
        return (f"{WINDOW}{spec.index}{epoch}", *names, *spec.options, *desc)

    def probe(
        self,
        desc: tuple[str, ...],
        device: torch.device,
        read: bool = True,
        into: torch.Tensor | None = None,
        deferred: bool = False,
    ) -> Probe | None:
        """Start the exchange of a fingerprint of ``desc`` (16 bytes: max of ``h`` and ``-h``).

        ``desc`` describes what the collectives depend on, one line per item; the window's index
        and metric names come first (for a ``Comm`` made by ``Window.connect``). ``None`` with
        ``check="never"``. Wait for it with [`agree()`][gradaccum.sync.Comm.agree] before any
        collective whose size depends on what ``desc`` describes.

        Nothing here waits for the device: on CUDA the fingerprint goes up from pinned memory,
        and its result comes back to pinned memory on a side stream that waits for the
        collective alone. Start it early (a window's first micro-batch, say), and ``agree``
        later reads it at the cost of the exchange, not of the compute queued in between.
        ``read=False``: its result is never read on the host (a deferred window checks it on
        the device), so nothing comes back. ``into``: a 2-element int64 tensor on ``device`` to
        exchange in (a deferred sync's, kept between windows): the numbers are written by
        ``fill_``, kernel arguments, so a CUDA graph that captures it replays no host memory.
        ``deferred``: a deferred window's exchange, ``[h, -h, r, -r]`` with ``r`` 1 where this
        rank reads it (``read``): its readers learn whether every rank reads it
        ([`read_probe()`][gradaccum.sync.Comm.read_probe]).
        """
        if self.check == "never":
            return None
        desc = self.lines(desc)
        h = digest(desc) >> 2  # fits in int64 with its negation
        values = [h, -h, int(read), -int(read)] if deferred else [h, -h]
        if into is not None:
            for k, v in enumerate(values):
                into[k : k + 1].fill_(v)
            tensor = into
        else:
            tensor = to_device(values, torch.int64, device)
        work = self.all_reduce(tensor, FINGERPRINT, "fingerprint", op=dist.ReduceOp.MAX)
        nccl = tensor.device.type == "cuda" and "nccl" in str(dist.get_backend(self.group))
        if not read or not nccl:
            return Probe(work, tensor, desc)
        # The result comes back on a side stream that waits for this collective alone (NCCL's
        # Work.wait makes the current stream wait, not the host), into pinned memory: agree()
        # then waits for that copy, not for the compute stream.
        host = torch.empty(len(values), dtype=torch.int64, pin_memory=True)
        side, event = _side_stream(tensor.device), torch.cuda.Event()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(side), self.failing(FINGERPRINT):
            work.wait()  # the side stream waits for the collective (the host does not)
            host.copy_(tensor, non_blocking=True)
            event.record(side)
        tensor.record_stream(side)
        return Probe(work, tensor, desc, host, event)

    def agree(self, probe: Probe | None, subject: str = "gradients to synchronise") -> None:
        """Wait for a fingerprint exchange; when the ranks differ, raise naming the difference.

        With ``check="full"`` the descriptions themselves are compared (a debug mode that does
        not rely on the 62-bit hash). On a mismatch every rank raises
        [`GradAccumError`][gradaccum.GradAccumError] and no collective of the window was sent.

        The window's one host read for its fingerprint: on CUDA it waits for the probe's copy
        (an event on the side stream), not for the compute stream. With a ``timeout`` it polls
        that event, bounded by the timeout ([`until()`][gradaccum.sync.Comm.until]).
        """
        if probe is None:
            return
        if self.agrees(probe) and self.check != "full":
            return
        self.compare(probe.desc, subject)

    def agrees(self, probe: Probe) -> bool:
        """Wait for a fingerprint exchange; whether every rank sent the same fingerprint."""
        hi, neg_lo = self.read_probe(probe)[:2]
        return bool(hi == -neg_lo)

    def read_probe(self, probe: Probe) -> list[int]:
        """Wait for a fingerprint exchange and read it: ``[max h, -min h, ...]`` over the ranks."""
        if probe.event is not None:  # NCCL: the side stream waited; wait for its copy, read it
            return self.fetch(probe.host, probe.event)  # type: ignore[arg-type]
        self.wait(probe.work, FINGERPRINT)
        return self.fetch(probe.tensor)

    def compare(self, desc: tuple[str, ...], subject: str = "gradients to synchronise") -> None:
        """Gather every rank's ``desc``; if any differs, raise naming the first difference.

        A collective: every rank of the group calls it. Ranks at different windows (the first
        line of a window's ``desc``) get a message of their own, whatever else differs.
        """
        gathered: list[Any] = [None] * self.world
        record("all_gather_object", self.group, torch.uint8, 0, "fingerprint", self.dim)
        dist.all_gather_object(gathered, desc, group=self.group)
        at = [_window_of(d) for d in gathered]
        if None not in at and len(set(at)) > 1:
            mark_broken(self.group)
            raise GradAccumError(misaligned(self.where, self.rank, at))
        diffs = []
        for r, other in enumerate(gathered):
            if r == self.rank or other == desc:
                continue
            mine, theirs = first_diff(desc, other)
            diffs.append(f"rank {self.rank} has {mine} but rank {r} has {theirs}")
        if not diffs:
            return
        mark_broken(self.group)  # so the error path joins no boundary of differing buckets
        options, done = (
            ("bucket_mb and param_groups", "sharded")
            if subject == "params to shard"
            else ("reduction, sync options and (where it sets the collectives) n", "reduced")
        )
        raise GradAccumError(
            f"{self.where}: the ranks disagree on the {subject}: {'; '.join(diffs)}. Every rank "
            f"must pass params with the same key paths, shapes and dtypes, and the same "
            f"{options}; nothing was {done}."
        )

    def fill(self, tail: torch.Tensor, weight: Any, failed: bool) -> None:
        """Write the boundary's tail, ``[weight, failed, *metric sums]``, into ``tail``.

        No host sync: a tensor weight is copied on the device, a number is written by ``fill_``
        (an index assignment would copy it from the host and wait). The metric sums are those
        of the bound window (``Window.connect``; zeros for those not given: a failed rank);
        ``tail`` has room for them. Every sync's tail is written here, wherever it travels (its own
        all-reduce, or the end of the last gradient bucket);
        [`read()`][gradaccum.sync.Comm.read] reads it back.
        """
        if isinstance(weight, torch.Tensor):
            tail[:1].copy_(weight.reshape(1), non_blocking=True)
        else:  # fill_ takes the number as a kernel argument: tail[0] = weight would copy it
            tail[:1].fill_(weight)
        tail[1:2].fill_(1.0 if failed else 0.0)
        window = self.window
        if window is not None and window.spec.metrics:
            m = _metrics.width(window.spec)
            rest = tail[TAIL : TAIL + m]
            rest.zero_()
            if window.metrics:
                flat = torch.cat([x.reshape(-1) for x in window.metrics])
                rest[: len(flat)].copy_(flat)

    def read(self, summed: list[float], failed: bool, world: int | None = None) -> float:
        """Read a tail summed over the ranks: set the window's ``totals``; return the total weight.

        Raises as [`settle()`][gradaccum.sync.Comm.settle] does (another rank failed, or a mean
        with nothing to divide by). ``world``: the ranks the tail was summed over (the group's
        by default; a hybrid sync's tail is summed over two groups).
        """
        window = self.window
        reduction = "sum"  # without a window: no mean to check
        if window is not None:
            spec = window.spec
            reduction, m = spec.reduction, _metrics.width(spec) if spec.metrics else 0
            window.totals = (summed[0], summed[TAIL : TAIL + m])
        world = self.world if world is None else world
        return settle(self.where, world, self.rank, summed, reduction, failed)

    def exchange(
        self, device: torch.device, weight: Any, failed: bool, extra: tuple[float, ...] = ()
    ) -> list[float]:
        """All-reduce ``[weight, failed, *extra]`` in float64 and wait; return the sums.

        Bound to a window (``Window.connect``), the window's metric sums travel in the same
        all-reduce (between ``failed`` and ``extra``), and their totals over the ranks go to
        ``window.totals``.
        """
        window = self.window
        m = _metrics.width(window.spec) if window is not None and window.spec.metrics else 0
        tail = to_device([0.0] * (TAIL + m) + list(extra), torch.float64, device)
        self.fill(tail, weight, failed)
        self.wait(self.all_reduce(tail, "the weight all_reduce", "weight"), "the weight all_reduce")
        out = self.fetch(tail)
        if window is not None:
            window.totals = (out[0], out[TAIL : TAIL + m])
        return out[:TAIL] + out[TAIL + m :]

    def boundary(
        self, device: torch.device, weight: Any, failed: bool, desc: tuple[str, ...], subject: str
    ) -> float | None:
        """The boundary's tail with the fingerprint in it: one all-reduce; the total weight.

        All-reduces ``[weight, failed, *metric sums, h, h**2]`` (float64): every rank has the same
        20-bit hash ``h`` of the window (its index, metric names and ``desc``) exactly when
        ``world * sum(h**2) == sum(h)**2`` (exact in float64). On a mismatch the ranks compare
        their descriptions ([`compare()`][gradaccum.sync.Comm.compare]) and raise
        [`GradAccumError`][gradaccum.GradAccumError] on every rank, before any gradient is sent.
        ``check="never"`` leaves the hash out. Returns ``None`` for a failed rank (its flag told
        the others); raises where another rank failed, or a mean has nothing to divide by.
        """
        hashed = self.check != "never"
        lines = self.lines(desc)
        h = float(tail_hash(lines)) if hashed else 0.0
        tail = self.exchange(device, weight, failed, (h, h * h) if hashed else ())
        if failed:
            return None
        if tail[1]:
            self.settle(tail, "sum")  # raises: another rank failed
        if hashed and (self.check == "full" or self.world * tail[3] != tail[2] * tail[2]):
            self.compare(lines, subject)  # every rank is here: raises naming the difference
            if self.world * tail[3] != tail[2] * tail[2]:
                mark_broken(self.group)
                raise GradAccumError(
                    f"{self.where}: the ranks disagree on the {subject} (their params' key "
                    f"paths, shapes or dtypes, the reduction, n, or the reduction function "
                    f"differ); nothing was reduced. Every rank must pass params of the same tree "
                    f"and the same reduction; gradaccum.all_reduce() names the difference."
                )
        reduction = self.window.spec.reduction if self.window is not None else "sum"
        return settle(self.where, self.world, self.rank, tail[:TAIL], reduction)

    def settle(self, tail: list[float], reduction: str, failed: bool = False) -> float:
        """Read an exchanged tail ``[total weight, failed ranks, ...]``; return the total.

        Raises [`GradAccumError`][gradaccum.GradAccumError] when another rank failed in the
        window (this one did not), and ``ValueError`` when a mean has nothing to divide by.
        """
        return settle(self.where, self.world, self.rank, tail, reduction, failed)


def digest(lines: tuple[str, ...]) -> int:
    """The 64-bit hash of a fingerprint's description (one line per item): both carriers'."""
    h = hashlib.blake2b("\n".join(lines).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def tail_hash(lines: tuple[str, ...]) -> int:
    """The 20-bit hash a boundary tail carries: ``lines`` after the window's index, plus it.

    Consecutive windows never share one (the index is added, not hashed), and ``h**2`` summed
    over the ranks stays exact in float64.
    """
    index = _window_of(lines)
    if index is None:
        return digest(lines) % 2**20 + 1
    number = int(index.split()[0])
    rest = (index.removeprefix(str(number)), *lines[1:])  # the epoch stays hashed
    return (digest(rest) + number) % 2**20 + 1


def settle(
    where: str, world: int, rank: int, tail: list[float], reduction: str, failed: bool = False
) -> float:
    """[`Comm.settle`][gradaccum.sync.Comm.settle] for a group of ``world`` ranks."""
    total, n_failed = tail[0], tail[1]
    if n_failed and not failed:
        raise GradAccumError(
            f"{where}: {int(n_failed)} other rank(s) of the {world} in the group raised an "
            f"error during this window (rank {rank} did not); no gradient is returned on any "
            f"rank. The cause is in the failing rank's traceback."
        )
    if not failed and reduction != "sum" and total <= 0:
        raise ValueError(
            f"{where}: the window's {'counts' if reduction == 'count' else 'rows'} add up to "
            f"{total:g} over all {world} ranks, so there is no mean to divide by; skip windows "
            f"with no items on any rank (e.g. all padding), or use reduction='sum'."
        )
    return float(total)


def bucket_what(kind: str, buckets: Any, k: int, noun: str = "bucket") -> str:
    """How a failure names the ``kind`` collective of bucket ``k`` (its bytes and dtype)."""
    b = buckets[k]
    return (
        f"the {kind} of {noun} {k + 1}/{len(buckets)} ({b.nbytes} bytes of "
        f"{str(b.dtype).removeprefix('torch.')})"
    )


def _window_of(desc: Any) -> str | None:
    """The window (``"5"``, ``"5 of epoch 1"``) in a gathered description's first line, or None."""
    line = desc[0] if isinstance(desc, (tuple, list)) and desc else None
    if isinstance(line, str) and re.fullmatch(rf"{WINDOW}\d+( of epoch \d+)?", line):
        return line[len(WINDOW) :]
    return None


def group_name(group: Any) -> str:
    """How messages name a process group."""
    if group is None or group is dist.group.WORLD:
        return "the default group"
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return "(dist.new_group returned GroupMember.NON_GROUP_MEMBER here)"
    return f"{getattr(group, 'group_name', '?')!r}"


def first_diff(mine: tuple[str, ...], theirs: Any) -> tuple[str, str]:
    """The first differing line of two descriptions, phrased for an error message."""
    theirs = tuple(theirs) if isinstance(theirs, (tuple, list)) else (repr(theirs),)
    return next((a, b) for a, b in zip_longest(mine, theirs, fillvalue="nothing there") if a != b)
