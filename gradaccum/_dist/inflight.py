"""The collectives in flight: what a ``Comm`` keeps of each until it ends, and their deadlines.

Two kinds, kept apart because the backends differ:

- CPU collectives (gloo) run in the backend's worker threads until they complete or their own
  timeout fires; each is kept until it is waited for, so that after a failure ``Comm.drain``
  can wait out the others before the error is raised (``in_flight``, and ``_ABANDONED`` for
  those waited out).
- Device collectives (CUDA, NCCL) started by a ``Comm`` with a ``timeout`` are kept, in the
  order they were started, with an event marking their inputs ready (``Queued``), until they
  complete. The host reads poll them (``overdue``): the head of a group's queue whose inputs
  have been ready for its timeout is stuck, and ``abort_device`` then aborts the group's NCCL
  communicator so that the process can exit.

``Comm`` (``comm.py``) uses these through the module (``inflight.on_device(...)``), so that tests
can replace ``on_device``, ``new_event``, ``_clock`` and ``_sleep`` to drive the device path on
the CPU.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "Queued",
    "abandon",
    "abort_device",
    "any_queued",
    "clock",
    "drop_queue",
    "ended",
    "forget",
    "in_flight",
    "keep",
    "new_event",
    "on_device",
    "overdue",
    "pause",
    "queue",
    "queued",
    "take",
]


# The collectives on CPU tensors that a Comm started and nobody has waited for yet, per process
# group (weakly keyed: the entry goes with the group). Comm.drain() waits for them after a failure.
_IN_FLIGHT: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
# The collectives that Comm.drain() waited out, kept until their group is freed (or the interpreter
# clears this module), so that the last reference to each is dropped here, holding the GIL. Were
# it the worker thread's, it would free the collective's tensors itself, and a tensor whose Python
# object is gone takes the GIL to free it: during finalization CPython stops such a thread inside
# the C++ destructor, and the process aborts ("terminate called without an active exception").
_ABANDONED: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
# The same holds after a collective ends normally: its worker thread drops its own reference a
# moment after the waiter wakes, and were that the last one, the worker would free the tensors.
# So the collectives that ended are kept too, tagged with the number of collectives started on
# the group when they ended, and let go only once two more have started there (by then their
# worker has long dropped its reference: Python's is the last, dropped holding the GIL). Those
# of the last window stay until the group is freed, or the interpreter clears this module.
_ENDED: weakref.WeakKeyDictionary[Any, list[tuple[int, Any]]] = weakref.WeakKeyDictionary()
_STARTED: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def in_flight(group: Any) -> list[Any]:
    """The CPU collectives started on ``group`` through a ``Comm`` and not yet waited for."""
    return [w for w in _IN_FLIGHT.get(group, ()) if not w.is_completed()]


def keep(group: Any, work: Any) -> None:
    """Keep ``work``, a CPU collective just started on ``group``, until it is waited for.

    The collectives that ended are kept a while longer (see ``_ENDED``): here, those that
    ended before the last two collectives started on ``group`` are let go.
    """
    started = _STARTED[group] = _STARTED.get(group, 0) + 1
    works = _IN_FLIGHT.setdefault(group, [])
    ended = _ENDED.setdefault(group, [])
    ended[:] = [(t, w) for t, w in ended if t >= started - 2]
    for w in works:
        if w.is_completed():  # waited for elsewhere
            ended.append((started - 1, w))
    works[:] = [w for w in works if not w.is_completed()]
    works.append(work)


def forget(group: Any, work: Any) -> None:
    """``work`` was waited for: no longer in flight (it is kept as ended, see ``_ENDED``)."""
    works = _IN_FLIGHT.get(group)
    if works:
        works[:] = [w for w in works if w is not work]
    _ENDED.setdefault(group, []).append((_STARTED.get(group, 0), work))


def ended(group: Any) -> list[Any]:
    """The CPU collectives on ``group`` that ended and are still kept (see ``_ENDED``)."""
    return [w for _, w in _ENDED.get(group, ())]


def take(group: Any) -> list[Any]:
    """Every CPU collective kept for ``group`` (they are no longer kept): ``Comm.drain``'s."""
    return _IN_FLIGHT.pop(group, [])


def abandon(group: Any, works: list[Any]) -> None:
    """Keep ``works``, waited out after a failure, until ``group`` is freed (see ``_ABANDONED``)."""
    _ABANDONED.setdefault(group, []).extend(works)


def on_device(tensor: torch.Tensor) -> bool:
    """Whether a collective on ``tensor`` runs in a device queue whose timeout the host keeps.

    CUDA: there ``Work.wait`` only makes the current stream wait, and the deadline is kept by
    the host reads ([`Comm.fetch()`][gradaccum.sync.Comm.fetch]). (Tests replace it, with fake
    works and events, to drive that path on the CPU.)
    """
    return tensor.device.type == "cuda"


def new_event() -> Any:
    """An event recorded now on the current CUDA stream (tests replace it with a fake)."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return event


# How the host polls for a device read with collectives queued: the first pause, the longest.
POLL_FIRST, POLL_MAX = 5e-5, 5e-4
_clock, _sleep = time.monotonic, time.sleep  # tests replace them (a fake clock, counted pauses)
ABORT_S = 10.0  # the longest wait for a NCCL communicator's abort


class Queued:
    """A collective started on a device by a ``Comm`` with a ``timeout``: kept until it completes.

    ``ready`` is an event recorded on the current stream as it started: it completes when the
    collective's inputs are ready, so the collective's own time (waiting for the peers) is
    counted from then (``since``: when the host first saw it ready at the head of its group's
    queue). The collective's methods (``wait``, ``is_completed``, ...) are its ``work``'s.
    """

    __slots__ = ("comm", "ready", "since", "what", "work")

    def __init__(self, work: Any, what: str, ready: Any, comm: Any) -> None:
        self.work, self.what, self.ready, self.comm = work, what, ready, comm
        self.since: float | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


# The device collectives a Comm with a timeout started, per process group, in the order they
# were started (which is the order a NCCL group's queue runs them), until they complete. A plain
# dict: each entry's Comm holds its group anyway, and a group leaves with its last entry (empty
# when no such collective was started: the reads' one test on the CPU path).
_QUEUED: dict[Any, list[Queued]] = {}


def queue(group: Any, work: Any, what: str, comm: Any) -> Queued:
    """Keep ``work``, the device collective ``what`` just started by ``comm`` on ``group``."""
    line = _QUEUED.setdefault(group, [])
    while line and line[0].work.is_completed():  # ended: nothing left to time
        line.pop(0)
    kept = Queued(work, what, new_event(), comm)
    line.append(kept)
    return kept


def any_queued() -> bool:
    """Whether any device collective is kept (then the host reads poll)."""
    return bool(_QUEUED)


def drop_queue(group: Any) -> None:
    """Forget ``group``'s device collectives (it timed out: they are abandoned)."""
    _QUEUED.pop(group, None)


def clock() -> float:
    """The monotonic clock the deadlines use (``_clock``: tests replace it)."""
    return _clock()


def pause(seconds: float) -> None:
    """A pause between two polls (``_sleep``: tests replace it, to count them)."""
    _sleep(seconds)


def queued(group: Any) -> list[Queued]:
    """The device collectives started on ``group`` through a ``Comm`` with a timeout, not done."""
    return [q for q in _QUEUED.get(group, ()) if not q.work.is_completed()]


def overdue(now: float) -> Queued | None:
    """A queued collective whose inputs have been ready for its ``Comm``'s timeout, or ``None``.

    Only the head of each group's queue can be stuck (a group's collectives run in order). It is
    timed from the first call that saw its inputs ready; the completed ones are dropped.
    """
    for group, queue in list(_QUEUED.items()):
        while queue and queue[0].work.is_completed():
            queue.pop(0)
        if not queue:
            del _QUEUED[group]
            continue
        head = queue[0]
        if head.since is None:
            if head.ready.query():
                head.since = now
        elif now - head.since > (head.comm.timeout or 0.0):  # queued only with a timeout
            return head
    return None


def abort_device(group: Any) -> bool:
    """Abort ``group``'s NCCL communicator, so that its stuck collectives end; whether it could.

    The backend's own ``abort()`` (torch's ``_abort_process_group`` would also remove the group
    from torch.distributed's tables, and, for the default group, every group). ``False`` where the
    group is not NCCL's, or the abort is missing (no ``ProcessGroupNCCL.abort``), failed, or
    did not return within ``ABORT_S`` seconds.
    """
    if "nccl" not in str(dist.get_backend(group)):
        return False
    try:
        backend = group._get_backend(torch.device("cuda"))
    except (RuntimeError, AttributeError):
        return False
    abort = getattr(backend, "abort", None)
    if abort is None:
        return False
    done: list[bool] = []

    def run() -> None:
        with contextlib.suppress(RuntimeError):
            abort()
            done.append(True)

    # Bounded: ncclCommAbort has been seen to hang; the error is then raised all the same.
    thread = threading.Thread(target=run, name="gradaccum-abort", daemon=True)
    thread.start()
    thread.join(ABORT_S)
    return bool(done)
