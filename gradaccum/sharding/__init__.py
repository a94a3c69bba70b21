"""Sharded data parallel: params cut into per-rank shards, gradients reduce-scattered.

[`shard()`][gradaccum.shard] cuts a params tree (or takes an FSDP2 model's own shards) into a
[`Sharded`][gradaccum.sharding.Sharded]; [`reduce_scatter()`][gradaccum.reduce_scatter] makes
the [`ReduceScatter`][gradaccum.sharding.ReduceScatter] sync that gathers its params for each
micro-step and leaves each rank its shard of the window's gradient. See the page "Sharded data
parallel" (docs/sharded.md).
"""

from ._reduce_scatter import ReduceScatter as ReduceScatter
from ._sharded import Sharded as Sharded

__all__ = ["ReduceScatter", "Sharded"]
