"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), resharded on load.

[`dcp_checkpoint()`][gradaccum.checkpoint.dcp_checkpoint] presents a
[`Sharded`][gradaccum.sharding.Sharded] and its optimizer's state as DTensors;
[`dcp_save()`][gradaccum.checkpoint.dcp_save] and [`dcp_load()`][gradaccum.checkpoint.dcp_load]
add an [`Accumulator`][gradaccum.Accumulator]'s window in progress. A one-process
``Accumulator`` state goes through its own ``state_dict()``; a training loop's whole state
through [`gradaccum.loop.save()`][gradaccum.loop.save].
"""

from ._dcp import ShardedCheckpoint as ShardedCheckpoint
from ._dcp import dcp_checkpoint as dcp_checkpoint
from ._dcp import dcp_load as dcp_load
from ._dcp import dcp_save as dcp_save

__all__ = ["ShardedCheckpoint", "dcp_checkpoint", "dcp_load", "dcp_save"]
