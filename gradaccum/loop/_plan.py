"""The plan behind ``gradaccum.loop.windows``: window sizes, the data-parallel group, agreement.

Pure functions for where each window of an epoch starts (tested with hypothesis), and the one
tiny all-reduce through [`Comm`][gradaccum.sync.Comm] by which the ranks agree on lengths.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

import torch
import torch.distributed as dist

from .._checks import check_timeout
from .._core.protocol import check_sync
from .._dist.comm import Comm
from .._dist.mesh import Axis, axes, check_group
from .._errors import GradAccumError, describe
from .._layout import check_n

__all__ = [
    "END",
    "FIX",
    "Agreement",
    "DataWindow",
    "check_args",
    "check_position",
    "generators_of",
    "set_epoch",
    "Schedule",
    "check_schedule",
    "count_windows",
    "data_axes",
    "replaying",
    "size_at",
]

Schedule = int | Callable[[int], int]
B = TypeVar("B")
END: Any = object()  # an exhausted source
FIX = "; pass what Windows.state_dict() returned, with the same data and n."


def check_schedule(where: str, n: object) -> None:
    """Validate ``n``: a positive int or a callable ``window_index -> int``."""
    if not callable(n):
        check_n(where, n)


def check_args(where: str, data: Any, n: Any, epochs: Any, prefetch: Any, timeout: Any) -> None:
    """Validate the arguments of ``windows()``."""
    if not hasattr(data, "__iter__") and not callable(data):
        raise TypeError(
            f"{where}: data must be an iterable of micro-batches (a DataLoader, a list, a "
            f"generator) or a factory epoch -> iterable, got {describe(data)}; pass e.g. a "
            f"torch.utils.data.DataLoader, or lambda epoch: DataLoader(...)."
        )
    check_schedule(where, n)
    if epochs is not None and (
        isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1
    ):
        raise ValueError(
            f"{where}: epochs must be a positive int or None (endless), got "
            f"{describe(epochs)}; pass e.g. epochs=3."
        )
    if isinstance(data, Iterator) and epochs != 1:
        raise TypeError(
            f"{where}: data is an iterator ({type(data).__name__}), which gives its "
            f"micro-batches once, but epochs={epochs}; pass an iterable that can be "
            f"iterated again (a DataLoader, a list, a class with __iter__), or epochs=1."
        )
    if not isinstance(prefetch, bool):
        raise TypeError(
            f"{where}: prefetch must be a bool, got {describe(prefetch)}; pass prefetch=True or "
            f"prefetch=False."
        )
    check_timeout(where, timeout)


def size_at(where: str, n: Schedule, index: int) -> int:
    """The schedule's number of micro-batches for window ``index`` (checked)."""
    if not callable(n):
        return n
    value = n(index)
    check_n(f"{where}: the schedule n's value for window {index}", value)
    return value


def count_windows(where: str, n: Schedule, first: int, length: int) -> int:
    """How many windows, starting at global index ``first``, cover ``length`` micro-batches."""
    if not callable(n):
        return -(-length // n)
    k = covered = 0
    while covered < length:
        covered += size_at(where, n, first + k)
        k += 1
    return k


def data_axes(where: str, sync: Any, group: Any) -> tuple[Axis, ...] | None:
    """The groups the data is split over: ``group``, else the sync's, else ``None`` (local)."""
    if group is None and sync is None:
        return None
    if sync is not None:
        check_sync(where, sync)
    if group is None:
        group = sync.data_group()  # its group (a reduce-scatter sync: the shards' mesh or group)
    check_group(where, group, "pass the process group (or mesh) the data is split over")
    shard, replicate = axes(where, group)
    return (shard,) if replicate is None else (shard, replicate)


class Agreement:
    """The data-parallel ranks' agreement on small integers: one all-reduce (MAX) per call."""

    def __init__(
        self,
        where: str,
        found: tuple[Axis, ...],
        timeout: float | None,
        what: str = "windows(data, n, sync=...)",
    ) -> None:
        self.where = where
        self.found = found
        self.timeout = timeout
        self.what = what
        self.comms: list[Comm] | None = None

    def _open(self) -> list[Comm]:
        if self.comms is None:
            what = self.what
            self.comms = [Comm(self.where, a, self.timeout, "never", what) for a in self.found]
        return self.comms

    def max(self, values: list[int], purpose: str) -> list[int]:
        """The elementwise maximum of ``values`` over the ranks (waited for, bounded)."""
        comms = self._open()
        backend = str(dist.get_backend(comms[0].group))
        device = torch.device("cpu")
        if "nccl" in backend and "gloo" not in backend:
            device = torch.device("cuda", torch.cuda.current_device())
        t = torch.tensor(values, dtype=torch.int64, device=device)
        what = f"the {purpose} all_reduce"
        for comm in comms:
            comm.wait(comm.all_reduce(t, what, purpose, op=dist.ReduceOp.MAX), what)
        return [int(v) for v in t.tolist()]

    @property
    def world(self) -> int:
        """The number of ranks that agree."""
        size = 1
        for comm in self._open():
            size *= comm.world
        return size


@contextlib.contextmanager
def replaying(rng: torch.Tensor | None) -> Iterator[None]:
    """Run the block under the global torch CPU RNG state ``rng``, then restore the current one.

    ``None``: the block runs under the current state (nothing is replayed).
    """
    if rng is None:
        yield
        return
    current = torch.get_rng_state()
    torch.set_rng_state(rng)
    try:
        yield
    finally:
        torch.set_rng_state(current)


def generators_of(data: Any) -> list[torch.Generator]:
    """The torch generators a DataLoader shuffles with (its own, its sampler's), distinct."""
    found: dict[int, torch.Generator] = {}
    batch_sampler = getattr(data, "batch_sampler", None)
    for owner in (data, getattr(data, "sampler", None), batch_sampler):
        for obj in (owner, getattr(owner, "sampler", None)):
            g = getattr(obj, "generator", None)
            if isinstance(g, torch.Generator):
                found.setdefault(id(g), g)
    return list(found.values())


def set_epoch(data: Any, epoch: int) -> None:
    """Call ``set_epoch(epoch)`` on the data, or else on its samplers and dataset that have it."""
    if callable(getattr(data, "set_epoch", None)):
        data.set_epoch(epoch)
        return
    seen: set[int] = set()
    batch_sampler = getattr(data, "batch_sampler", None)
    obj: Any
    for obj in (
        getattr(data, "sampler", None),
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
        getattr(data, "dataset", None),
    ):
        if callable(getattr(obj, "set_epoch", None)) and id(obj) not in seen:
            seen.add(id(obj))
            obj.set_epoch(epoch)


def check_position(where: str, sd: Any, fmt: str) -> dict[str, Any]:
    """Validate a saved data position (``Windows.state_dict()``); return it."""
    old = sd.get("format") if isinstance(sd, dict) else None
    if isinstance(old, str) and old.rsplit("/", 1)[0] == fmt.rsplit("/", 1)[0] and old != fmt:
        raise GradAccumError(
            f"{where}: the position has format {old!r}, written by an older gradaccum (0.1), "
            f"which this version ({fmt!r}) does not read: it lacks what resuming now checks "
            f"(the data's identity, the window sizes). Resume it with the gradaccum that "
            f"wrote it, or start the run anew."
        )
    if not isinstance(sd, dict) or sd.get("format") != fmt:
        raise GradAccumError(
            f"{where}: expected a dict with format {fmt!r}, got {describe(sd)}{FIX}"
        )
    for key in ("epoch", "micro_batch", "window", "in_window", "epoch_window", "reread", "skip"):
        value = sd.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise GradAccumError(f"{where}: {key} must be an int >= 0, got {describe(value)}{FIX}")
    rng = sd.get("rng")
    flags = (sd.get("started"), sd.get("closed"))
    if any(not isinstance(f, bool) for f in flags) or not (
        rng is None or isinstance(rng, torch.Tensor)
    ):
        raise GradAccumError(
            f"{where}: started and closed must be bools and rng a tensor or None, got "
            f"{describe(flags)} and {describe(rng)}{FIX}"
        )
    flags = (sd.get("fresh"), sd.get("exhausted"))
    if any(not isinstance(f, bool) for f in flags) or sd["skip"] > sd["reread"]:
        raise GradAccumError(
            f"{where}: fresh and exhausted must be bools and skip at most reread, got "
            f"{describe(flags)}, {describe(sd['skip'])} and {describe(sd['reread'])}{FIX}"
        )
    sizes = sd.get("sizes")
    if (
        not isinstance(sizes, list)
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in sizes)
        or not (sd.get("n") is None or (isinstance(sd["n"], int) and sd["n"] >= 1))
        or not isinstance(sd.get("identity"), dict)
    ):
        raise GradAccumError(
            f"{where}: sizes must be a list of positive ints, n a positive int or None and "
            f"identity a dict, got {describe(sizes)}, {describe(sd.get('n'))} and "
            f"{describe(sd.get('identity'))}{FIX}"
        )
    window_rng = sd.get("window_rng")
    if not (window_rng is None or (isinstance(window_rng, dict) and "torch" in window_rng)):
        raise GradAccumError(
            f"{where}: window_rng must be None or random states, got {describe(window_rng)}{FIX}"
        )
    for key in ("generators", "generators_now"):
        gens = sd.get(key)
        if not isinstance(gens, list) or any(not isinstance(g, torch.Tensor) for g in gens):
            raise GradAccumError(
                f"{where}: {key} must be a list of tensors, got {describe(gens)}{FIX}"
            )
    return sd


class _Source(Protocol[B]):
    def _take(self, window: DataWindow[B]) -> Iterator[B]: ...


class DataWindow(Generic[B]):
    """One accumulation window: the micro-batches of one optimizer step on this rank.

    [`windows()`][gradaccum.loop.windows] yields them. Iterate each to its end (that is what
    advances the data position), then close the window at the boundary
    ([`Step.apply()`][gradaccum.loop.Step.apply] or ``Accumulator.finalize``). On a rank whose
    data ran out the window is empty: iterate it all the same, and join the boundary.

    Attributes:
        epoch: The epoch the window belongs to (from 0).
        index: The window's index over the whole run, counting every epoch's windows (the
            optimizer step it makes; ``AccumState.window`` of an ``Accumulator`` fed by it).
        start: The position in the epoch of the window's first micro-batch.
        taken: The micro-batches of the window taken before it was yielded: by the run that
            saved the checkpoint this one resumed from, mid-window; else 0. Iterating the window
            gives the others.
        batches: The micro-batches, as a list, when ``windows(..., prefetch=True)``; else
            ``None`` (they are read from the data while the window is iterated). After a
            mid-window resume it holds the whole window, the ``taken`` first.

    Examples:
        >>> import gradaccum
        >>> [(w.index, w.start, list(w)) for w in gradaccum.loop.windows(range(5), 2)]
        [(0, 0, [0, 1]), (1, 2, [2, 3]), (2, 4, [4])]
    """

    __slots__ = ("_at", "_left", "_len", "_owner", "batches", "epoch", "index", "start", "taken")

    def __init__(
        self, owner: _Source[B], epoch: int, index: int, start: int, left: int, known: bool
    ) -> None:
        self._owner = owner
        self.epoch = epoch
        self.index = index
        self.start = start
        self._left = left  # at most this many micro-batches still to give
        self._len = left if known else None
        self._at = start  # the epoch's position when the window was yielded
        self.taken = 0
        self.batches: list[B] | None = None

    def __len__(self) -> int:
        """The number of micro-batches of the window on this rank (``taken`` included).

        Raises:
            TypeError: The data has no ``len()`` and the window was not prefetched: its length
                is known only once it has been read (pass ``prefetch=True``).
        """
        if self._len is None:
            raise TypeError(
                f"len(window): window {self.index} comes from data without len(), so its "
                f"number of micro-batches is known only once it is read; pass "
                f"windows(..., prefetch=True) to read each window before it is yielded."
            )
        return self._len

    def __iter__(self) -> Iterator[B]:
        return self._owner._take(self)

    def __repr__(self) -> str:
        size = "?" if self._len is None else self._len
        return f"DataWindow(epoch={self.epoch}, index={self.index}, micro_batches={size})"
