"""Synchronisation across processes: the sync protocol, the built-in syncs, counting collectives.

Make a sync with [`gradaccum.all_reduce()`][gradaccum.all_reduce] or
[`gradaccum.custom_reduce()`][gradaccum.custom_reduce]; the classes here are what they return
(the sharded sync, [`ReduceScatter`][gradaccum.sharding.ReduceScatter], is in
[`gradaccum.sharding`](../sharded.md)).
To write a new kind of sync, subclass [`Sync`][gradaccum.sync.Sync] and implement its
[`reduce()`][gradaccum.sync.Sync.reduce], which talks to the process group through the
[`Comm`][gradaccum.sync.Comm] it is given; the base class does the rest of the boundary (see the
architecture page). A sync that overlaps its collectives with the backward also subclasses
[`Window`][gradaccum.sync.Window].
"""

from .._core.protocol import Local as Local
from .._core.protocol import Sync as Sync
from .._core.protocol import Window as Window
from .._core.protocol import WindowSpec as WindowSpec
from .._dist.buckets import Bucket as Bucket
from .._dist.comm import Comm as Comm
from .._dist.record import Collective as Collective
from .._dist.record import record_collectives as record_collectives
from ._all_reduce import AllReduce as AllReduce
from ._custom import CustomReduce as CustomReduce

__all__ = [
    "AllReduce",
    "Bucket",
    "Collective",
    "Comm",
    "CustomReduce",
    "Local",
    "Sync",
    "Window",
    "WindowSpec",
    "record_collectives",
]
