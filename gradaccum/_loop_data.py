"""`Windows`: the accumulation windows of an iterable of micro-batches, agreed over ranks."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

import torch

from ._errors import GradAccumError
from ._loop_plan import (
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

__all__ = ["FORMAT", "Windows"]

B = TypeVar("B")
FORMAT = "gradaccum.loop.Windows/1"


class Windows(Generic[B]):
    """Accumulation windows over an iterable of micro-batches, agreed over the ranks of a sync.

    Made by [`windows()`][gradaccum.loop.windows], which documents the arguments and the
    contract. Iterating yields [`DataWindow`][gradaccum.loop.DataWindow] objects; a new
    ``for`` loop over it continues where the last one stopped (after ``break``, or after
    [`load_state_dict()`][gradaccum.loop.Windows.load_state_dict]).

    Examples:
        >>> import gradaccum
        >>> data = gradaccum.loop.windows(range(7), 3, epochs=2)
        >>> len(data), [len(w) for w in data]
        (6, [3, 3, 1, 3, 3, 1])
    """

    def __init__(
        self,
        data: Iterable[B],
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
            timeout = getattr(sync, "timeout", None)
        self.data, self.n, self.epochs, self.prefetch = data, n, epochs, prefetch
        self._agreement = None if found is None else Agreement(where, found, timeout)
        try:
            len(data)  # type: ignore[arg-type]
            self._sized = True
        except TypeError:
            self._sized = False
        # The position: the epoch, micro-batches taken in it, the window in progress (its global
        # index, micro-batches taken in it, whether its iteration ended), the epoch's first window.
        self._epoch = self._pos = self._window = self._in_window = self._epoch_window = 0
        self._started = self._closed = False  # the window in progress was yielded; its loop ended
        self._rng: torch.Tensor | None = None  # the RNG the epoch's iterator was created with
        self._gens: list[torch.Tensor] = []
        self._gens_now: list[torch.Tensor] = []  # the data's generators when the state was saved
        self._it: Iterator[B] | None = None
        self._buffer: deque[B] = deque()
        self._exhausted = False
        self._current: DataWindow[B] | None = None
        self._agreed: tuple[int, int, int] | None = None  # (epoch, longest, shortest)
        self._planned: int | None = None  # the longest rank's length that len() assumes
        self._iterating = False

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

        The first call (or the first iteration) agrees on the lengths with the other ranks:
        every rank must make it.

        Raises:
            TypeError: The data has no ``len()``, or ``epochs=None`` (endless).
        """
        if not self._sized or self.epochs is None:
            why = "has no len()" if not self._sized else "is endless (epochs=None)"
            raise TypeError(
                f"len({self._where}): the number of windows is not known up front: the data "
                f"{why}. Windows are still agreed over the ranks, one tiny all_reduce per "
                f"window; a progress bar then has no total."
            )
        longest = self._lengths()[0] if self._planned is None else self._planned
        total = first = 0
        for _ in range(self.epochs):
            k = count_windows(self._where, self.n, first, longest)
            total, first = total + k, first + k
        return total

    # -- agreement -------------------------------------------------------------------------------

    def _lengths(self) -> tuple[int, int]:
        """``(longest, shortest)`` micro-batches of this epoch over the ranks (one all-reduce)."""
        if self._agreed is not None and self._agreed[0] == self._epoch:
            return self._agreed[1], self._agreed[2]
        mine = len(self.data)  # type: ignore[arg-type]
        longest, shortest = mine, mine
        if self._agreement is not None:
            longest, neg = self._agreement.max([mine, -mine], "data lengths")
            shortest = -neg
        if self._planned is None:
            self._planned = longest
        elif longest != self._planned and self.epochs is not None:
            raise GradAccumError(
                f"{self._where}: in epoch {self._epoch} the longest rank's data has {longest} "
                f"micro-batches, but {self._planned} when the windows were counted (len(), the "
                f"progress total); give every epoch the same length (a DataLoader over a fixed "
                f"dataset), or pass epochs=None."
            )
        self._agreed = (self._epoch, longest, shortest)
        return longest, shortest

    def _any(self, has: bool) -> bool:
        """Whether any rank has micro-batches left (data without len(): once per window)."""
        if self._agreement is None:
            return has
        return bool(self._agreement.max([int(has)], "data left")[0])

    # -- iterating -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[DataWindow[B]]:
        if self._iterating:
            raise RuntimeError(
                f"{self._where}: the windows are already being iterated; use one loop over "
                f"them at a time (a new loop continues where the last one stopped)."
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
        finally:  # a window yielded stays current (iterable) until a new loop yields one
            self._iterating = False

    def _run_epoch(self) -> Iterator[DataWindow[B]]:
        where, n = self._where, self.n
        longest = self._lengths()[0] if self._sized else None
        k = self._window - self._epoch_window
        start = 0
        for j in range(self._epoch_window, self._window):
            start += size_at(where, n, j)
        if (
            k < 0
            or start + self._in_window != self._pos
            or (
                longest is not None
                and k >= max(1, count_windows(where, n, self._epoch_window, longest))
            )
        ):
            raise GradAccumError(
                f"{where}: the data position (epoch {self._epoch}, window {self._window}, its "
                f"micro-batch {self._in_window}, micro-batch {self._pos} of the epoch) does not "
                f"fit these windows: the epoch's windows start at window {self._epoch_window}, "
                f"and window {self._window} at micro-batch {start}{FIX}"
            )
        if self._closed:
            start += size_at(where, n, self._window)
            self._advance()
        count = None if longest is None else count_windows(where, n, self._epoch_window, longest)
        if count is not None and self._window - self._epoch_window >= count:
            # The epoch's last window was closed: no need to read the epoch again, but the
            # data's generators go on from the states they had when it was saved.
            gens = generators_of(self.data)
            if self._it is None and len(self._gens_now) == len(gens):
                for g, state in zip(gens, self._gens_now):
                    g.set_state(state)
            return
        if self._it is None:
            self._open()
        mine = len(self.data) if self._sized else 0  # type: ignore[arg-type]
        while True:
            size = size_at(where, n, self._window)
            if count is not None:
                if self._window - self._epoch_window >= count:
                    break
                left = max(0, min(start + size, mine) - self._pos)
            else:  # agreed once per window, before it is yielded (not again on resume)
                if not self._started and not self._any(self._peek()):
                    break
                left = size - self._in_window
            self._started = True
            window = DataWindow(self, self._epoch, self._window, self._pos, left, count is not None)
            if self.prefetch:
                window.batches = [b for b in (self._pull() for _ in range(left)) if b is not END]
                window._left = window._len = len(window.batches)
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

    def _advance(self) -> None:
        self._window, self._in_window = self._window + 1, 0
        self._started = self._closed = False

    def _next_epoch(self) -> None:
        self._epoch += 1
        self._epoch_window, self._pos, self._in_window = self._window, 0, 0
        self._rng, self._gens, self._it, self._exhausted = None, [], None, False
        self._buffer.clear()

    def _finish(self, window: DataWindow[B]) -> None:
        """Skip a window left untouched; refuse one left part-way (its rest would be lost)."""
        self._current = None
        if self._closed or window._left <= 0:
            return
        if self._pos == window.start:  # nothing taken: skipped whole (e.g. [len(w) for w in ...])
            if window.batches is not None:
                self._pos += window._left
            for _ in range(window._left if window.batches is None else 0):
                if self._pull() is END:
                    break
                self._pos += 1
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
            item = (queue.popleft() if queue else END) if queue is not None else self._pull()
            if item is END:
                break
            window._left -= 1
            self._pos, self._in_window = self._pos + 1, self._in_window + 1
            yield item
        if self._current is window:
            self._closed = True

    # -- the epoch's iterator --------------------------------------------------------------------

    def _pull(self) -> Any:
        if self._buffer:
            return self._buffer.popleft()
        if self._it is None or self._exhausted:
            return END
        try:
            return next(self._it)
        except StopIteration:
            self._exhausted = True
            return END

    def _peek(self) -> bool:
        item = self._pull()
        if item is END:
            return False
        self._buffer.appendleft(item)
        return True

    def _open(self) -> None:
        """Create the epoch's iterator (under the saved RNG on resume), skip what was taken."""
        gens = generators_of(self.data)
        set_epoch(self.data, self._epoch)
        replay = self._rng
        if replay is None:
            self._rng = torch.get_rng_state()
            self._gens = [g.get_state() for g in gens]
        elif len(self._gens) != len(gens):
            raise GradAccumError(
                f"{self._where}: the saved position holds the states of {len(self._gens)} "
                f"random generator(s) of the data (its generator= and its sampler's), but the "
                f"data has {len(gens)}; resume with data built the same way{FIX}"
            )
        else:
            for g, state in zip(gens, self._gens):
                g.set_state(state)
        with replaying(replay):
            self._it = iter(self.data)
            self._exhausted = False
            for taken in range(self._pos):
                if self._pull() is END:
                    raise GradAccumError(
                        f"{self._where}: the data position is micro-batch {self._pos} of "
                        f"epoch {self._epoch}, but the data gives only {taken} in that epoch; "
                        f"resume with the same data (and the same ranks){FIX}"
                    )
            self._peek()  # the first read draws a shuffling sampler's seed: inside the replay

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The data position, safe for ``torch.load(..., weights_only=True)``.

        It holds the epoch, the micro-batches taken in it, the window in progress and the
        random states the epoch's iterator was created with (the global torch RNG, and the
        data's own generators), so that a shuffling ``DataLoader`` gives the same order again.
        """
        return {
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
            "generators_now": [g.get_state() for g in generators_of(self.data)],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at a saved position (from [`state_dict()`][gradaccum.loop.Windows.state_dict]).

        The next loop recreates the epoch's iterator under the saved random states, skips the
        micro-batches already taken, and goes on from there.

        Raises:
            RuntimeError: The windows are being iterated.
            GradAccumError: The saved state is not one of ``state_dict()``'s (the message names
                the field), or (when the loop resumes) it does not fit the data and ``n``.
        """
        where = f"{self._where}.load_state_dict(state_dict)"
        if self._iterating:
            raise RuntimeError(
                f"{where}: the windows are being iterated; load the position before the loop."
            )
        sd = check_position(where, state_dict, FORMAT)
        self._epoch, self._pos = sd["epoch"], sd["micro_batch"]
        self._window, self._in_window = sd["window"], sd["in_window"]
        self._started, self._closed = sd["started"], sd["closed"]
        self._epoch_window = sd["epoch_window"]
        self._rng = None if sd["rng"] is None else sd["rng"].clone()
        self._gens = [g.clone() for g in sd["generators"]]
        self._gens_now = [g.clone() for g in sd.get("generators_now", [])]
        self._it, self._exhausted, self._current = None, False, None
        self._buffer.clear()
