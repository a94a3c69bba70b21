"""Synchronisation across processes: the sync protocol, the built-in syncs, counting collectives.

Make a sync with [`gradaccum.all_reduce()`][gradaccum.all_reduce] or
[`gradaccum.custom_reduce()`][gradaccum.custom_reduce]; the classes here are what they return
(the sharded sync, [`ReduceScatter`][gradaccum.sharding.ReduceScatter], is in
[`gradaccum.sharding`](../sharded.md)).
To write a new kind of sync, subclass [`Sync`][gradaccum.sync.Sync] and
[`Window`][gradaccum.sync.Window], and talk to the process group through
[`Comm`][gradaccum.sync.Comm] (see the architecture page).
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
