"""Synchronisation across processes: the built-in syncs, sharded params, and counting collectives.

Make a sync with [`gradaccum.all_reduce()`][gradaccum.all_reduce],
[`gradaccum.reduce_scatter()`][gradaccum.reduce_scatter] or
[`gradaccum.custom_reduce()`][gradaccum.custom_reduce]; the classes here are what they return.
"""

from ._custom import CustomReduce as CustomReduce
from ._record import Collective as Collective
from ._record import record_collectives as record_collectives
from ._scatter import ReduceScatter as ReduceScatter
from ._shard import Sharded as Sharded
from ._sync import AllReduce as AllReduce
from ._sync import Bucket as Bucket

__all__ = [
    "AllReduce",
    "Bucket",
    "Collective",
    "CustomReduce",
    "ReduceScatter",
    "Sharded",
    "record_collectives",
]
