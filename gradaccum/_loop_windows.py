"""``gradaccum.loop.windows()``: any iterable of micro-batches, cut into accumulation windows."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from ._loop_data import Windows
from ._loop_plan import Schedule

__all__ = ["windows"]

B = TypeVar("B")


def windows(
    data: Iterable[B],
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

    Under a sync, the ranks agree on the windows: each epoch starts with one tiny all-reduce
    (16 bytes, logged by [`record_collectives()`][gradaccum.sync.record_collectives] as
    ``"data lengths"``, bounded by ``timeout``) of the ranks' ``len(data)``, and every rank
    yields as many windows as the longest rank needs. A rank whose data ran out yields empty
    windows, so it joins every boundary with zero weight instead of hanging, or pairing its
    next epoch's micro-batches with the others' last window. ``len()`` is the total of all
    epochs, the same on every rank (the progress total).

    Data without ``len()`` (a generator, an ``IterableDataset``) is agreed per window instead:
    one 8-byte all-reduce before each window (a rank with micro-batches left, or none), and
    ``len()`` raises ``TypeError``. Without a sync nothing is communicated.

    Each epoch calls ``set_epoch(epoch)`` on the data (or its sampler, batch sampler or
    dataset) when it has one, as a ``DistributedSampler`` needs to reshuffle.
    [`state_dict()`][gradaccum.loop.Windows.state_dict] saves the position and the random
    states the epoch's iterator was created with; after
    [`load_state_dict()`][gradaccum.loop.Windows.load_state_dict] the epoch's iterator is
    recreated under them (a shuffling ``DataLoader`` gives the same order) and the micro-batches
    already taken are skipped (read and dropped: skipping costs reading them).

    Args:
        data: An iterable of micro-batches: a ``DataLoader`` (its ``batch_size`` is the
            micro-batch size), a list, a generator (one epoch), any object with ``__iter__``.
            Each rank passes its own shard (e.g. through a ``DistributedSampler``, or a
            ``Subset``); the shards may differ in length.
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
        TypeError: ``data`` is not iterable, or is a one-shot iterator with ``epochs != 1``;
            ``n`` or ``group`` has the wrong type.
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
