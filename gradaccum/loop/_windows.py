"""``gradaccum.loop.windows()``: any iterable of micro-batches, cut into accumulation windows."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from ._data import Windows
from ._plan import Schedule

__all__ = ["windows"]

B = TypeVar("B")


def windows(
    data: Iterable[B] | Callable[[int], Iterable[B]],
    n: Schedule,
    *,
    sync: Any = None,
    group: Any = None,
    epochs: int | None = 1,
    prefetch: bool = False,
    timeout: float | None = None,
) -> Windows[B]:
    """Cut an iterable of micro-batches into accumulation windows of ``n``, agreed over ranks.

    Iterating the result yields one [`DataWindow`][gradaccum.loop.DataWindow] per optimizer
    step, for ``epochs`` passes over ``data``. A window holds ``n`` micro-batches (or
    ``n(index)`` for a schedule, ``index`` counting the windows of every epoch); the last
    window of an epoch holds what is left, and is weighted exactly by it at the boundary.
    Windows never span two epochs.

    Under a sync, the ranks agree on the windows. Each epoch starts with one tiny all-reduce
    (13 integers, logged by [`record_collectives()`][gradaccum.sync.record_collectives] as
    ``"data lengths"``, bounded by ``timeout``) of a failure flag, the position (the epoch and the
    window the loop is at), whether the data has a
    ``len()``, the window sizes, ``epochs`` and the ranks' ``len(data)``: ranks built
    differently (another ``n`` or ``epochs``, data with a length against data without), or a
    rank whose data raised while it was made, make every rank raise
    [`GradAccumError`][gradaccum.GradAccumError] (the failing rank its own error) before any
    window is yielded. Every rank yields as many windows as the longest rank needs: a rank whose
    data ran out yields empty windows, so it joins every boundary with zero weight instead of
    hanging, or pairing its next epoch's micro-batches with the others' last window. ``len()``
    is the total of all epochs, the same on every rank (the progress total).

    Data without ``len()`` (a generator, an ``IterableDataset``) is also agreed per window: one
    32-byte all-reduce before each window (a failure flag, the window, and whether the rank has
    micro-batches left), and ``len()`` raises ``TypeError`` on every rank. Without a sync
    nothing is communicated. When reading a micro-batch raises on one rank inside a window, the
    [`Step`][gradaccum.loop.Step] fed by these windows (``Step(..., data=...)``) joins its
    boundary flagged as failed, so the other ranks raise instead of waiting; the windows are
    then over (resume from a checkpoint).

    Each epoch calls ``set_epoch(epoch)`` on the data (or its sampler, batch sampler or
    dataset) when it has one, as a ``DistributedSampler`` needs to reshuffle.

    Resuming ([`state_dict()`][gradaccum.loop.Windows.state_dict],
    [`load_state_dict()`][gradaccum.loop.Windows.load_state_dict], or ``loop.save`` /
    ``loop.load``) gives the same micro-batches as the uninterrupted run, bit for bit, or is
    refused when the position is saved:

    - data that keeps its own position (``state_dict`` / ``load_state_dict``, as torchdata's
      ``StatefulDataLoader``) is given its saved state;
    - any other data is replayed: the epoch's iterator is recreated under the random states it
      was created with (a shuffling ``DataLoader`` gives the same order, workers the same
      seeds) and the micro-batches already taken are read again and dropped (skipping costs
      reading them);
    - a dataset that draws random numbers while it is read (random augmentation in
      ``__getitem__``; probed by reading its first item under two seeds) cannot be replayed in
      this process, where the model drew in between, nor continued by new worker processes:
      ``state_dict()`` then raises ``ValueError`` mid-epoch, and says how to seed it per sample.

    The checkpoint records what the data is (its length, batch size, dataset length, sampler
    and seed) and the window sizes; loading it into other data or another ``n`` is refused.

    Args:
        data: An iterable of micro-batches: a ``DataLoader`` (its ``batch_size`` is the
            micro-batch size), a torchdata ``StatefulDataLoader``, a list, a generator (one
            epoch), any object with ``__iter__``; or a factory ``epoch -> iterable``, called
            once at the start of each epoch (e.g. ``lambda epoch: DataLoader(...)``, a loader
            built anew each epoch). Each rank passes its own shard (e.g. through a
            ``DistributedSampler``, or a ``Subset``); the shards may differ in length.
        n: Micro-batches per window: a positive int, or a schedule ``index -> int``, the same
            on every rank.
        sync: The sync of the accumulation (e.g. [`all_reduce()`][gradaccum.all_reduce]):
            its group (for a sharded sync, all the ranks of its mesh) is the one to agree over,
            and its ``timeout`` the default one. ``None`` (and no ``group``): one process.
        group: The process group or ``DeviceMesh`` the data is split over, if not the sync's.
        epochs: Passes over ``data``, or ``None`` to go on until the loop stops.
        prefetch: Read each window's micro-batches before it is yielded (``window.batches``),
            e.g. to count its tokens before the first backward.
        timeout: Seconds after which the agreement fails with
            [`GradAccumError`][gradaccum.GradAccumError]; default: the sync's timeout.

    Returns:
        A [`Windows`][gradaccum.loop.Windows].

    Raises:
        TypeError: ``data`` is neither iterable nor a factory, or is a one-shot iterator with
            ``epochs != 1``; ``n`` or ``group`` has the wrong type.
        ValueError: ``n`` or ``epochs`` is out of range.

    Examples:
        Ten micro-batches in windows of 4 (the last one short), twice:

        >>> import gradaccum
        >>> data = gradaccum.loop.windows(range(10), 4, epochs=2)
        >>> len(data)
        6
        >>> [(w.epoch, list(w)) for w in data][:3]
        [(0, [0, 1, 2, 3]), (0, [4, 5, 6, 7]), (0, [8, 9])]

        A schedule: windows of 1, then 2, then 4 micro-batches:

        >>> sizes = gradaccum.loop.windows(range(10), lambda i: min(4, 2**i))
        >>> [len(w) for w in sizes]
        [1, 2, 4, 3]

        A factory: the data of each epoch made anew (here, epoch 1 reversed):

        >>> def epoch_data(epoch):
        ...     return range(4) if epoch == 0 else range(3, -1, -1)
        >>> made = gradaccum.loop.windows(epoch_data, 2, epochs=2)
        >>> [list(w) for w in made]
        [[0, 1], [2, 3], [3, 2], [1, 0]]
    """
    return Windows(
        data,
        n,
        sync=sync,
        group=group,
        epochs=epochs,
        prefetch=prefetch,
        timeout=timeout,
    )
