"""Synchronisation across processes: the sync protocol, the built-in syncs, counting collectives.

Make a sync with [`gradaccum.all_reduce()`][gradaccum.all_reduce],
[`gradaccum.reduce_scatter()`][gradaccum.reduce_scatter] or
[`gradaccum.custom_reduce()`][gradaccum.custom_reduce]; the classes here are what they return.
To write a new kind of sync, subclass [`Sync`][gradaccum.sync.Sync] and
[`Window`][gradaccum.sync.Window], and talk to the process group through
[`Comm`][gradaccum.sync.Comm] (see the architecture page).
"""

from ._all_reduce import AllReduce as AllReduce
from ._buckets import Bucket as Bucket
from ._comm import Comm as Comm
from ._custom import CustomReduce as CustomReduce
from ._dcp import ShardedCheckpoint as ShardedCheckpoint
from ._dcp import dcp_checkpoint as dcp_checkpoint
from ._dcp_state import dcp_load as dcp_load
from ._dcp_state import dcp_save as dcp_save
from ._record import Collective as Collective
from ._record import record_collectives as record_collectives
from ._reduce_scatter import ReduceScatter as ReduceScatter
from ._shard import Sharded as Sharded
from ._window import Local as Local
from ._window import Sync as Sync
from ._window import Window as Window
from ._window import WindowSpec as WindowSpec

__all__ = [
    "AllReduce",
    "Bucket",
    "Collective",
    "Comm",
    "CustomReduce",
    "Local",
    "ReduceScatter",
    "Sharded",
    "ShardedCheckpoint",
    "Sync",
    "Window",
    "WindowSpec",
    "dcp_checkpoint",
    "dcp_load",
    "dcp_save",
    "record_collectives",
]
