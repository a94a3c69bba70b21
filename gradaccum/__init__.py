"""gradaccum: gradient accumulation as composable, functional transforms over PyTorch.

The accumulated gradient equals the whole-batch gradient; communication (when there is any)
happens once, at the accumulation boundary.
"""

from . import boundary as boundary
from . import checkpoint as checkpoint
from . import compression as compression
from . import loop as loop
from . import privacy as privacy
from . import sharding as sharding
from . import streaming as streaming
from . import sync as sync
from . import testing as testing
from ._autograd import grad as grad
from ._autograd import grad_and_value as grad_and_value
from ._core.accumulate import accumulate as accumulate
from ._core.accumulator import Accumulator as Accumulator
from ._coupled._cache import coupled as coupled
from ._coupled._exchange import Rows as Rows
from ._coupled._stats import window_stats as window_stats
from ._errors import GradAccumError as GradAccumError
from ._kinds import Mean as Mean
from ._kinds import Sum as Sum
from ._module import buffers_of as buffers_of
from ._module import call_module as call_module
from ._module import params_of as params_of
from ._module import update_buffers as update_buffers
from ._module import write_grads as write_grads
from ._split import MicroBatches as MicroBatches
from .sharding._reduce_scatter import reduce_scatter as reduce_scatter
from .sharding._sharded import shard as shard
from .sync._all_reduce import all_reduce as all_reduce
from .sync._custom import custom_reduce as custom_reduce

__version__ = "0.1.0"

__all__ = [
    "Accumulator",
    "GradAccumError",
    "Mean",
    "MicroBatches",
    "Rows",
    "Sum",
    "accumulate",
    "all_reduce",
    "buffers_of",
    "call_module",
    "coupled",
    "custom_reduce",
    "grad",
    "grad_and_value",
    "params_of",
    "reduce_scatter",
    "shard",
    "testing",
    "update_buffers",
    "window_stats",
    "write_grads",
]
