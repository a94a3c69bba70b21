"""`Windows`: the accumulation windows of an iterable of micro-batches, agreed over ranks.

The position (epoch, micro-batches taken, the window in progress) moves with each micro-batch a
window gives. A checkpoint (``state_dict``) holds it with what resuming needs:

- data that keeps its own position (``state_dict``/``load_state_dict``, torchdata's
  ``StatefulDataLoader``): its state, taken now, or at the start of the window in progress
  with the random states of that moment when the window's micro-batches were read ahead (a
  peeked first micro-batch, ``prefetch=True``), which are then read again under them;
- any other data is replayed: the epoch's iterator is recreated under the random states it was
  created with (a shuffling ``DataLoader`` gives the same order) and the micro-batches already
  taken are read again and dropped. A replay is exact when reading the data depends on nothing
  but those states: ``state_dict`` refuses, at save time, data whose dataset draws random
  numbers in this process (``_loop_source.draws_randomness``) when there is something to replay.

Ranks agree at the start of each epoch (one all-reduce of a few integers: a failure flag,
whether the data has a length, the window sizes, the epochs and the lengths), and before each
window of data without a length (a failure flag and whether micro-batches are left), so that
ranks built differently, or a rank whose data raised, make every rank raise.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import torch

from .._errors import GradAccumError
from ._plan import (
    END,
    FIX,
    Agreement,
    DataWindow,
    Schedule,
    check_args,
    check_position,
    count_windows,
    data_axes,
    generators_of,
    replaying,
    set_epoch,
    size_at,
)
from ._source import (
    Source,
    draws_randomness,
    identity,
    length_of,
    rng_states,
    run_token,
    stateful,
    under_rng,
    workers_of,
)

__all__ = ["FORMAT", "Windows"]

B = TypeVar("B")
FORMAT = "gradaccum.loop.Windows/2"
SIZES = 8  # windows whose sizes the ranks compare at each epoch, and a checkpoint records


def _signature(sizes: list[int]) -> int:
    """A 62-bit number for a list of window sizes, the same in every process."""
    h = 0
    for s in sizes:
        h = (h * 1_000_003 + s) % (1 << 62)
    return h


class Windows(Generic[B]):
    """Accumulation windows over an iterable of micro-batches, agreed over the ranks of a sync.

    Made by [`windows()`][gradaccum.loop.windows], which documents the arguments and the
    contract. Iterating yields [`DataWindow`][gradaccum.loop.DataWindow] objects; a new
    ``for`` loop over it continues where the last one stopped (after ``break``, or after
    [`load_state_dict()`][gradaccum.loop.Windows.load_state_dict]).

    Attributes:
        data: The data given to ``windows()`` (an iterable, or a factory ``epoch -> iterable``).
        sync: The sync given to ``windows()`` (``None``: one process).

    Examples:
        >>> import gradaccum
        >>> data = gradaccum.loop.windows(range(7), 3, epochs=2)
        >>> len(data), [len(w) for w in data]
        (6, [3, 3, 1, 3, 3, 1])
    """

    def __init__(
        self,
        data: Iterable[B] | Callable[[int], Iterable[B]],
        n: Schedule,
        *,
        sync: Any = None,
        group: Any = None,
        epochs: int | None = 1,
        prefetch: bool = False,
        timeout: float | None = None,
    ) -> None:
        where = f"windows(data, n={'<schedule>' if callable(n) else repr(n)})"
        self._where = where
        check_args(where, data, n, epochs, prefetch, timeout)
        found = data_axes(where, sync, group)
        if timeout is None:
            timeout = sync.timeout if sync is not None else None
        self.data = data
        self.sync = sync
        self.n = n
        self.epochs = epochs
        self.prefetch = prefetch
        self._source = Source(where, data)
        self._agreement = None if found is None else Agreement(where, found, timeout)
        if found is not None:
            run_token()  # the checkpoints' run token, read while every rank is surely there
        # Called with the error when reading a micro-batch raises where the other ranks' next
        # collective is the boundary of the step fed by these windows (loop.Step(data=...)).
        self._on_error: list[Callable[[BaseException], None]] = []
        # The position.
        self._epoch = 0  # the epoch
        self._pos = 0  # micro-batches taken in the epoch
        self._window = 0  # the global index of the window in progress
        self._in_window = 0  # micro-batches taken in the window in progress
        self._epoch_window = 0  # the global index of the epoch's first window
        self._started = False  # the window in progress was yielded
        self._closed = False  # the window in progress's iteration ended
        self._rng: torch.Tensor | None = None  # the RNG the epoch's iterator was created with
        self._gens: list[torch.Tensor] = []
        self._gens_now: list[torch.Tensor] = []  # the data's generators when the state was saved
        self._fresh = True  # the epoch's iterator started worker processes of its own
        self._it: Iterator[B] | None = None
        self._buffer: deque[B] = deque()  # read from the iterator, not yet taken
        self._read = 0  # micro-batches read from the epoch's iterator (taken + buffered)
        self._exhausted = False
        self._current: DataWindow[B] | None = None
        self._agreed: tuple[int, tuple[int, int] | None] | None = None  # (epoch, lengths)
        self._planned: int | None = None  # the longest rank's length that len() assumes
        self._iterating = False
        self._broken: str | None = None  # why the windows cannot go on (the data raised)
        # Stateful data: its state and the random states before the window's first read.
        self._win_start = 0
        self._snapshot: tuple[Any, dict[str, Any]] | None = None
        self._before_end: Any = None  # (without len()) its state before the latest read
        self._keeps = False  # the epoch's data keeps its own state
        self._unsized = False  # the epoch's data has no len()
        self._resume: dict[str, Any] | None = None  # a loaded position, until the next loop
        self._head: list[B] = []  # the window's micro-batches taken before the resume, read again
        self._taken = 0  # how many micro-batches of the window were taken before the resume

    # -- the public position ---------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch in progress (from 0)."""
        return self._epoch

    @property
    def window(self) -> int:
        """The index of the window in progress, or of the next one: the windows completed."""
        return self._window + 1 if self._closed else self._window

    @property
    def micro_batch(self) -> int:
        """The micro-batches of the epoch taken so far on this rank."""
        return self._pos

    def __len__(self) -> int:
        """The number of windows of all epochs, the same on every rank (the progress total).

        Under a sync, the first call (or the first iteration) agrees with the other ranks:
        every rank must make it, data without ``len()`` included (it then raises on every rank).

        Raises:
            TypeError: The data has no ``len()``, or ``epochs=None`` (endless).
            GradAccumError: The ranks' windows were built differently (see ``windows()``).
        """
        lengths = self._agree()
        if lengths is None or self.epochs is None:
            why = "has no len()" if lengths is None else "is endless (epochs=None)"
            raise TypeError(
                f"len({self._where}): the number of windows is not known up front: the data "
                f"{why}. Windows are still agreed over the ranks, one tiny all_reduce per "
                f"window; a progress bar then has no total."
            )
        longest = self._planned if self._planned is not None else lengths[0]
        total = first = 0
        for _ in range(self.epochs):
            k = count_windows(self._where, self.n, first, longest)
            total += k
            first += k
        return total

    # -- agreement -------------------------------------------------------------------------------

    def _sizes(self, first: int) -> list[int]:
        """The sizes of the windows from global index ``first`` on (``SIZES`` of them)."""
        return [size_at(self._where, self.n, first + k) for k in range(SIZES)]

    def _agree(self) -> tuple[int, int] | None:
        """The epoch's agreement: ``(longest, shortest)`` over the ranks, ``None`` without len().

        One all-reduce (MAX) of ``[failed, epoch, -epoch, window, -window, sized, -sized, sizes,
        -sizes, epochs, -epochs, length, -length]`` (``window``: the one the loop is at): a
        rank whose data raised while it was made or measured, ranks at another place in the
        data (resumed from different checkpoints), or that disagree on the window sizes, the
        epochs or whether the data has a length, make every rank raise (the failing rank its
        own error) before any window is yielded.
        """
        if self._agreed is not None and self._agreed[0] == self._epoch:
            return self._agreed[1]
        where = self._where
        failed: BaseException | None = None
        mine: int | None = None
        signature = 0
        try:
            mine = length_of(self._source.of(self._epoch))
            signature = _signature(self._sizes(self._epoch_window))
        except Exception as err:  # noqa: BLE001 - reported to every rank, then raised here
            failed = err
        sized = int(mine is not None)
        length = mine or 0
        epochs = -1 if self.epochs is None else self.epochs
        at = [self._epoch, -self._epoch, self._window, -self._window]
        values = [int(failed is not None), *at, sized, -sized, signature, -signature]
        values += [epochs, -epochs, length, -length]
        if self._agreement is not None:
            values = self._agreement.max(values, "data lengths")
        if failed is not None:
            self._broken = f"the data raised {type(failed).__name__} in epoch {self._epoch}"
            raise failed
        if values[0]:
            self._broken = f"another rank's data raised in epoch {self._epoch}"
            raise GradAccumError(
                f"{where}: another rank raised an error while making or measuring its data for "
                f"epoch {self._epoch} (this rank did not); no window is yielded on any rank. "
                f"The cause is in the failing rank's traceback."
            )
        if values[1] != -values[2] or values[3] != -values[4]:
            raise GradAccumError(
                f"{where}: the ranks are at different places in the data: this rank is at "
                f"window {self._window} of epoch {self._epoch}, the ranks' epochs range from "
                f"{-values[2]} to {values[1]} and their windows from {-values[4]} to "
                f"{values[3]}; resume every rank from the same checkpoint (gradaccum.loop.load "
                f"on every rank), and take the windows the same way on every rank. Nothing "
                f"was yielded."
            )
        for k, what, fix in (
            (5, "whether the data has a len()", "give every rank data of the same kind"),
            (7, "the windows' sizes (n)", "pass the same n (or schedule) on every rank"),
            (9, "epochs", "pass the same epochs= on every rank"),
        ):
            if values[k] != -values[k + 1]:
                raise GradAccumError(
                    f"{where}: the ranks disagree on {what} (epoch {self._epoch}): "
                    f"{self._disagreement(k, values)}; {fix}. Nothing was yielded."
                )
        lengths = None if mine is None else (values[11], -values[12])
        if lengths is not None:
            if self._planned is None:
                self._planned = lengths[0]
            elif lengths[0] != self._planned and self.epochs is not None:
                raise GradAccumError(
                    f"{where}: in epoch {self._epoch} the longest rank's data has {lengths[0]} "
                    f"micro-batches, but {self._planned} when the windows were counted (len(), "
                    f"the progress total); give every epoch the same length (a DataLoader over "
                    f"a fixed dataset), or pass epochs=None."
                )
        self._agreed = (self._epoch, lengths)
        return lengths

    def _disagreement(self, k: int, values: list[int]) -> str:
        """How the ``k``-th agreed value differs over the ranks, in the user's terms."""
        if k == 5:
            return "some ranks' data has a len(), others' has none"
        if k == 7:
            mine = self._sizes(self._epoch_window)
            return f"this rank's windows hold {mine} micro-batches, another rank's differ"
        least = -values[k + 1]  # agreed as the MAX of -v over the ranks
        most = values[k]  # agreed as the MAX of v
        low = "None" if least < 0 else str(least)  # a value of -1 stands for None
        high = "None" if most < 0 else str(most)
        return f"between {low} and {high} over the ranks"

    def _any(self, has: bool, failed: bool) -> bool:
        """Whether any rank has micro-batches left (data without len(): once per window).

        One all-reduce (MAX) of ``[failed, window, -window, has]``; raises on every rank if a
        rank's data raised, or the ranks are at different windows.
        """
        if self._agreement is None:
            return has
        at = [self._window, -self._window]
        values = self._agreement.max([int(failed), *at, int(has)], "data left")
        if values[0] and not failed:
            self._broken = f"another rank's data raised before window {self._window}"
            raise GradAccumError(
                f"{self._where}: another rank raised an error while reading its data before "
                f"window {self._window} (this rank did not); no window is yielded on any rank. "
                f"The cause is in the failing rank's traceback."
            )
        if values[1] != -values[2]:
            raise GradAccumError(
                f"{self._where}: the ranks are at different windows: this rank is before "
                f"window {self._window}, the ranks' range from {-values[2]} to {values[1]}; "
                f"resume every rank from the same checkpoint (gradaccum.loop.load on every "
                f"rank), and take the windows the same way on every rank. Nothing was yielded."
            )
        return bool(values[3])

    # -- iterating -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[DataWindow[B]]:
        if self._iterating:
            raise RuntimeError(
                f"{self._where}: the windows are already being iterated; use one loop over "
                f"them at a time (a new loop continues where the last one stopped)."
            )
        if self._broken is not None:
            raise RuntimeError(
                f"{self._where}: the windows cannot go on: {self._broken}, and the position of "
                f"its iterator is lost; resume from a checkpoint (gradaccum.loop.load) in a new "
                f"run."
            )
        if self.epochs is not None and self._epoch >= self.epochs:
            raise ValueError(
                f"{self._where}: all {self.epochs} epoch(s) are done, so a new loop would "
                f"yield nothing; pass epochs= to windows() for more epochs (one loop goes "
                f"over all of them), or make new windows."
            )
        return self._run()

    def _run(self) -> Iterator[DataWindow[B]]:
        self._iterating = True
        try:
            while self.epochs is None or self._epoch < self.epochs:
                yield from self._run_epoch()
                self._next_epoch()
            if self.sync is not None and self.sync.defer:  # the last window's deferred checks
                self.sync.verify()
        finally:  # a window yielded stays current (iterable) until a new loop yields one
            self._iterating = False

    def _run_epoch(self) -> Iterator[DataWindow[B]]:
        where, n = self._where, self.n
        lengths = self._agree()
        longest = None if lengths is None else lengths[0]
        k = self._window - self._epoch_window
        start = 0
        for j in range(self._epoch_window, self._window):
            start += size_at(where, n, j)
        # Where window k starts in this rank's data: a rank whose data ran out in an earlier
        # (short) window is at its end.
        mine = None if longest is None else length_of(self._source.of(self._epoch))
        at = start if mine is None else min(start, mine)
        ran_out = mine is None and self._in_window == 0 and self._pos < start
        if (
            k < 0
            or (at + self._in_window != self._pos and not ran_out)
            or (
                longest is not None
                and k >= max(1, count_windows(where, n, self._epoch_window, longest))
            )
        ):
            err = GradAccumError(
                f"{where}: the data position (epoch {self._epoch}, window {self._window}, its "
                f"micro-batch {self._in_window}, micro-batch {self._pos} of the epoch) does not "
                f"fit these windows: the epoch's windows start at window {self._epoch_window}, "
                f"and window {self._window} at micro-batch {at}{FIX}"
            )
            self._failed(err, notify=True)  # the step's boundary tells the other ranks
            raise err
        if self._closed:
            start += size_at(where, n, self._window)
            self._advance()
        count = None if longest is None else count_windows(where, n, self._epoch_window, longest)
        if count is not None and self._window - self._epoch_window >= count:
            self._epoch_done()
            return
        if self._it is None:
            self._open(start)
        data = self._source.of(self._epoch)
        mine = length_of(data) or 0
        while True:
            size = size_at(where, n, self._window)
            self._win_start = start
            if count is not None:
                if self._window - self._epoch_window >= count:
                    break
                left = max(0, min(start + size, mine) - self._pos)
            else:  # agreed once per window, before it is yielded (not again on resume)
                if not self._started:
                    failed: BaseException | None = None
                    try:
                        has = self._peek(notify=False)
                    except Exception as err:  # noqa: BLE001 - told to every rank, then raised
                        failed = err
                        has = False
                    agreed = self._any(has, failed is not None)
                    if failed is not None:
                        raise failed
                    if not agreed:
                        break
                left = size - self._in_window
            self._started = True
            head = self._head
            self._head = []
            window = DataWindow(self, self._epoch, self._window, start, left, count is not None)
            window.taken = self._taken
            self._taken = 0
            window._at = self._pos
            if count is not None:
                window._len = window.taken + left
            if self.prefetch:
                rest = [b for b in (self._pull() for _ in range(left)) if b is not END]
                window.batches = head + rest
                window._left = len(rest)
                window._len = len(head) + len(rest)
            self._current = window
            yield window
            self._finish(window)
            start += size
            self._advance()
        if count is not None and self._pull() is not END:
            raise ValueError(
                f"{where}: the data gave more micro-batches than len(data) = {mine} in epoch "
                f"{self._epoch}; the windows were planned from len(): make len() match what "
                f"iterating gives (or pass data without len(), agreed per window)."
            )

    def _epoch_done(self) -> None:
        """The epoch's last window was closed before a resume: go on without reading it again.

        The data's generators go on from the states they had when the position was saved, and
        data that keeps its own position is given the state it had then.
        """
        resume, self._resume = self._resume, None
        data = self._source.of(self._epoch)
        if resume is not None and resume.get("loader") is not None:
            data.load_state_dict(resume["loader"])
            if not resume["exhausted"]:  # the saved run's iterator saw its end: this one too
                with under_rng(rng_states()):  # iter() draws a seed the saved run drew earlier
                    for _ in iter(data):
                        pass
        gens = generators_of(data)
        if self._it is None and len(self._gens_now) == len(gens):
            for g, state in zip(gens, self._gens_now):
                g.set_state(state)
        persistent = workers_of(data) and getattr(data, "persistent_workers", False)
        if (
            persistent
            and self._rng is not None  # the saved run had made the epoch's iterator
            and not self._source.factory
            and getattr(data, "_iterator", None) is None
        ):
            # Its next epoch reused those workers (drawing only the sampler's seed); start them
            # here without moving the process's random states, so that this run does the same.
            with under_rng(rng_states()):
                iter(data)

    def _advance(self) -> None:
        self._window += 1
        self._in_window = 0
        self._taken = 0
        self._started = False
        self._closed = False

    def _next_epoch(self) -> None:
        self._epoch += 1
        self._epoch_window = self._window
        self._pos = 0
        self._in_window = 0
        self._rng = None
        self._gens = []
        self._it = None
        self._exhausted = False
        self._buffer.clear()
        self._read = 0
        self._win_start = 0
        self._snapshot = None
        self._before_end = None

    def _finish(self, window: DataWindow[B]) -> None:
        """Skip a window left untouched; refuse one left part-way (its rest would be lost)."""
        self._current = None
        if self._closed or window._left <= 0:
            return
        if self._pos == window._at:  # nothing taken: skipped whole (e.g. [len(w) for w in ...])
            if window.batches is not None:
                self._pos += window._left
                self._in_window += window._left
            for _ in range(window._left if window.batches is None else 0):
                if self._pull() is END:
                    break
                self._pos += 1
                self._in_window += 1
            return
        if window.batches is None:  # read one more: the data may have run out
            item = self._pull()
            if item is END:
                return
            self._buffer.appendleft(item)
        raise ValueError(
            f"{self._where}: window {window.index} was left part-way, with micro-batches not "
            f"taken; iterate every window you start to its end (for batch in window: ...) "
            f"before asking for the next, so that no micro-batch is silently skipped."
        )

    def _take(self, window: DataWindow[B]) -> Iterator[B]:
        """Give the window's micro-batches, moving the data position with each."""
        given = window.batches
        queue = None if given is None else deque(given[len(given) - window._left :])
        while window._left > 0:
            if self._current is not window:
                raise ValueError(
                    f"{self._where}: window {window.index} is over (the loop has moved on); "
                    f"iterate a window while it is the current one."
                )
            if queue is None:
                item = self._pull()
            elif queue:
                item = queue.popleft()
            else:
                item = END
            if item is END:
                break
            window._left -= 1
            self._pos += 1
            self._in_window += 1
            yield item
        if self._current is window:
            self._closed = True

    # -- the epoch's iterator --------------------------------------------------------------------

    def _pull(self, notify: bool = True) -> Any:
        """The next micro-batch of the epoch (buffered first), or ``END``.

        An error from the data marks the windows broken and, with ``notify``, is first passed to
        the ``_on_error`` callbacks (the step joins its boundary flagged as failed).
        """
        if self._buffer:
            return self._buffer.popleft()
        if self._it is None or self._exhausted:
            return END
        if self._keeps:
            data = self._source.of(self._epoch)
            if self._read == self._win_start or self._unsized:
                state = data.state_dict()
                if self._read == self._win_start:  # before the window's first read
                    self._snapshot = (state, rng_states())
                # Data without len() ends where a read finds nothing: a checkpoint taken after
                # that holds the state from before it, whose resume sees the end again.
                self._before_end = state
        try:
            item = next(self._it)
        except StopIteration:
            self._exhausted = True
            return END
        except Exception as err:
            self._failed(err, notify)
            raise
        self._read += 1
        return item

    def _peek(self, notify: bool = True) -> bool:
        item = self._pull(notify)
        if item is END:
            return False
        self._buffer.appendleft(item)
        return True

    def _failed(self, err: BaseException, notify: bool) -> None:
        self._broken = f"the data raised {type(err).__name__} in window {self._window}"
        self._it = None
        if notify:
            for callback in list(self._on_error):
                callback(err)

    def _open(self, start: int) -> None:
        """Create the epoch's iterator (at the saved position on resume).

        ``start``: where the window in progress starts in the epoch. On resume, the window's
        micro-batches taken before the checkpoint are kept (``_head``: a prefetched window's
        ``batches`` hold them too).
        """
        try:
            self._open_iterator(start)
        except Exception as err:
            self._failed(err, notify=True)
            raise

    def _open_iterator(self, start: int) -> None:
        data = self._source.of(self._epoch)
        self._keeps = stateful(data)
        self._unsized = length_of(data) is None
        gens = generators_of(data)
        set_epoch(data, self._epoch)
        resume, self._resume = self._resume, None
        self._buffer.clear()
        self._exhausted = False
        if resume is not None and resume.get("loader") is not None:  # its own position
            data.load_state_dict(resume["loader"])
            if resume["exhausted"]:  # the epoch's iterator had ended: a new one is the next's
                self._it = iter(())
                self._exhausted = True
                return
            reread, skip = resume["reread"], resume["skip"]
            self._read = self._pos - skip
            self._win_start = start
            with under_rng(rng_states()):  # iter() draws a seed the saved run drew earlier
                self._it = iter(data)
            with under_rng(resume["window_rng"]):  # the window's start, if read again
                items = [self._pull(notify=False) for _ in range(reread)]
            if any(item is END for item in items):
                raise GradAccumError(
                    f"{self._where}: the data's restored state gives fewer micro-batches than "
                    f"were read from it when the checkpoint was saved ({reread}); resume with "
                    f"the same data{FIX}"
                )
            self._head = items[:skip]
            self._buffer.extend(items[skip:])
            return
        replay = self._rng
        if replay is None:  # a fresh epoch: remember what its iterator is created under
            self._rng = torch.get_rng_state()
            self._gens = [g.get_state() for g in gens]
            self._fresh = getattr(data, "_iterator", None) is None
        elif len(self._gens) != len(gens):
            raise GradAccumError(
                f"{self._where}: the saved position holds the states of {len(self._gens)} "
                f"random generator(s) of the data (its generator= and its sampler's), but the "
                f"data has {len(gens)}; resume with data built the same way{FIX}"
            )
        else:
            for g, state in zip(gens, self._gens):
                g.set_state(state)
            if not self._fresh and getattr(data, "_iterator", None) is None:
                # The saved run reused the workers of a persistent DataLoader, whose iterator
                # then draws only the sampler's seed; a first iterator here would draw the
                # workers' seed first. Start the workers outside the replay, and leave the
                # process's random states as they were.
                with under_rng(rng_states()):
                    iter(data)
        self._read = 0
        with replaying(replay):
            self._it = iter(data)
            for taken in range(self._pos):
                item = self._pull(notify=False)
                if item is END:
                    raise GradAccumError(
                        f"{self._where}: the data position is micro-batch {self._pos} of "
                        f"epoch {self._epoch}, but the data gives only {taken} in that epoch; "
                        f"resume with the same data (and the same ranks){FIX}"
                    )
                if taken >= start:
                    self._head.append(item)
            self._peek(notify=False)  # the first read draws a shuffling sampler's seed

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The data position, safe for ``torch.load(..., weights_only=True)``.

        It holds the epoch, the micro-batches taken in it, the window in progress, what the
        data is (its kind, length, batch size, dataset length, sampler: compared at resume)
        and the sizes of the windows, and what resuming needs: the state of data that keeps
        its own position (torchdata's ``StatefulDataLoader``, any object with ``state_dict``
        and ``load_state_dict``), else the random states the epoch's iterator was created
        with (the global torch RNG, and the data's own generators), so that a shuffling
        ``DataLoader`` gives the same order again when it is replayed.

        Raises:
            ValueError: Resuming from here could not give the same micro-batches: the data
                draws random numbers in this process while it is read (random augmentation in
                a ``Dataset``), and there are micro-batches to read again. The message says
                how to make it resumable.
        """
        if self._resume is not None:  # loaded, not iterated since: what was loaded
            return dict(self._resume)
        data = self._source.of(self._epoch)
        out: dict[str, Any] = {
            "format": FORMAT,
            "epoch": self._epoch,
            "micro_batch": self._pos,
            "window": self._window,
            "in_window": self._in_window,
            "started": self._started,
            "closed": self._closed,
            "epoch_window": self._epoch_window,
            "rng": None if self._rng is None else self._rng.clone(),
            "generators": [s.clone() for s in self._gens],
            "generators_now": [g.get_state() for g in generators_of(data)],
            "fresh": self._fresh,
            "exhausted": self._exhausted,
            "identity": identity(data),
            "n": self.n if isinstance(self.n, int) else None,
            "sizes": self._sizes(self._epoch_window),
            "loader": None,
            "reread": 0,
            "skip": 0,
            "window_rng": None,
        }
        if stateful(data):
            self._state_of(data, out)
        else:
            self._check_resumable(data, from_state=False)
        return out

    def _state_of(self, data: Any, out: dict[str, Any]) -> None:
        """Put the position of data that keeps its own into ``out``."""
        read = self._read - self._win_start  # of the window in progress, taken or not
        if self._it is not None and not self._closed and (self.prefetch or self._buffer) and read:
            if self._snapshot is None:  # pragma: no cover - taken before every window's read
                raise RuntimeError(f"{self._where}: no state of the data at the window's start")
            out["loader"], out["window_rng"] = self._snapshot
            out["reread"], out["skip"] = read, self._in_window
        elif self._exhausted and self._before_end is not None:
            out["loader"], out["exhausted"] = self._before_end, False
        else:
            out["loader"] = data.state_dict()
        self._check_resumable(data, from_state=True)

    def _check_resumable(self, data: Any, from_state: bool) -> None:
        """Refuse a position from which resuming could not give the same micro-batches.

        ``from_state``: the data's own state is restored (else the epoch is replayed). Only
        data whose dataset draws random numbers while it is read is at risk (it is probed).
        """
        workers = workers_of(data)
        persistent = workers > 0 and bool(getattr(data, "persistent_workers", False))
        if persistent and (self._epoch > 0 or (self._closed and not self._mid_epoch())):
            why = "starts new workers, while the saved run's went on from its earlier epochs"
        elif not self._mid_epoch():
            return  # at an epoch's start or end: its iterator is created as it was
        elif from_state and workers:
            why = "starts its worker processes' random states afresh"
        elif not from_state and not workers:
            why = "reads it again in this process, where the model drew in between"
        else:
            return
        self._refuse_random(data, why)

    def _mid_epoch(self) -> bool:
        """Whether resuming here goes on inside the epoch (rather than at its start or after it).

        Inside it, a resume reads micro-batches again, or goes on with an iterator made anew.
        """
        if self._pos == 0 and self._read == 0:
            return False  # nothing read in the epoch: not even a peeked or prefetched window
        lengths = self._agreed[1] if self._agreed is not None else None
        if not self._closed or lengths is None:
            return True
        count = count_windows(self._where, self.n, self._epoch_window, lengths[0])
        return self._window + 1 - self._epoch_window < count

    def _refuse_random(self, data: Any, why: str) -> None:
        what = draws_randomness(data)
        if what is None:
            return
        raise ValueError(
            f"{self._where}.state_dict(): the data draws random numbers while it is read "
            f"({what} gives another item under another seed), so resuming at micro-batch "
            f"{self._pos} of epoch {self._epoch} would give other micro-batches: resuming "
            f"{why}. Seed the randomness per sample (e.g. a torch.Generator seeded from the "
            f"epoch and the sample's index in __getitem__), or read with DataLoader("
            f"num_workers>0, persistent_workers=False); or save at an epoch's start."
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at a saved position (from [`state_dict()`][gradaccum.loop.Windows.state_dict]).

        The whole position is checked first: a refused state changes nothing. The next loop
        goes on from the saved position: data that keeps its own position is given its saved
        state; other data is replayed (its epoch's iterator recreated under the saved random
        states, the micro-batches already taken read again and dropped).

        Raises:
            RuntimeError: The windows are being iterated.
            GradAccumError: The saved state is not one of ``state_dict()``'s (the message names
                the field), comes from other data (its length, batch size, dataset length or
                sampler differ) or from windows of another ``n``; or (when the loop resumes)
                it does not fit the data.
        """
        where = f"{self._where}.load_state_dict(state_dict)"
        if self._iterating:
            raise RuntimeError(
                f"{where}: the windows are being iterated; load the position before the loop."
            )
        sd = check_position(where, state_dict, FORMAT)
        saved_n = "<schedule>" if sd["n"] is None else sd["n"]
        if sd["sizes"] != self._sizes(sd["epoch_window"]):
            raise GradAccumError(
                f"{where}: the checkpoint was saved with windows of n={saved_n} (window sizes "
                f"{sd['sizes']} from window {sd['epoch_window']} on), but these windows have "
                f"{self._sizes(sd['epoch_window'])}; resume with the n of the run that saved "
                f"(another n would move every window boundary and optimizer step)."
            )
        data = self._source.of(sd["epoch"])
        now = identity(data)
        differ = [
            _differs(key, now.get(key), saved)
            for key, saved in sd["identity"].items()
            if now.get(key) != saved
        ]
        if differ:  # every difference named: a changed batch size changes the length too
            raise GradAccumError(
                f"{where}: the data is not the checkpoint's: {', and '.join(differ)}; resume "
                f"with the data of the run that saved (a changed dataset, batch size or sampler "
                f"would give other micro-batches without any error)."
            )
        if (sd["loader"] is not None) != stateful(data):
            raise GradAccumError(
                f"{where}: the checkpoint was saved from data that "
                f"{'keeps' if sd['loader'] is not None else 'does not keep'} its own position "
                f"(state_dict/load_state_dict), but this data "
                f"{'does not' if sd['loader'] is not None else 'does'}; resume with data of "
                f"the same kind."
            )
        self._epoch = sd["epoch"]
        self._pos = sd["micro_batch"]
        self._window = sd["window"]
        self._in_window = sd["in_window"]
        self._started = sd["started"]
        self._closed = sd["closed"]
        self._epoch_window = sd["epoch_window"]
        self._rng = None if sd["rng"] is None else sd["rng"].clone()
        self._gens = [g.clone() for g in sd["generators"]]
        self._gens_now = [g.clone() for g in sd["generators_now"]]
        self._fresh = sd["fresh"]
        self._it = None
        self._exhausted = False
        self._current = None
        self._buffer.clear()
        self._head = []
        self._taken = sd["in_window"]
        self._agreed = None
        self._snapshot = None
        self._resume = dict(sd)


# How a difference in the data's identity (``_source.identity``) is said: its words, its unit.
_WORDS = {
    "length": ("length", " micro-batches"),
    "batch_size": ("batch size", " rows"),
    "dataset": ("dataset", ""),
    "dataset_length": ("dataset's length", " samples"),
    "kind": ("kind", ""),
    "sampler": ("sampler", ""),
}


def _differs(key: str, now: Any, saved: Any) -> str:
    """``its length is 19 micro-batches, the checkpoint's 13``: one difference, in plain words."""
    words, unit = _WORDS.get(key, (key.replace("sampler.", "sampler's "), ""))

    def say(v: Any) -> str:
        return "not known" if v is None else f"{v}{unit}" if isinstance(v, int) else f"{v}"

    return f"its {words} is {say(now)}, the checkpoint's {say(saved)}"
