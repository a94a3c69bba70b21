"""gradaccum: gradient accumulation as composable, functional transforms over PyTorch.

The accumulated gradient equals the whole-batch gradient; communication (when there is any)
happens once, at the accumulation boundary.
"""

from . import testing as testing
from ._accumulate import accumulate as accumulate
from ._autograd import grad as grad
from ._autograd import grad_and_value as grad_and_value
from ._boundary import LossScale as LossScale
from ._boundary import LossScaleState as LossScaleState
from ._boundary import clip_by_global_norm as clip_by_global_norm
from ._compress import compressed_all_reduce as compressed_all_reduce
from ._compress import powersgd as powersgd
from ._compress import topk_all_reduce as topk_all_reduce
from ._custom import CustomReduce as CustomReduce
from ._custom import custom_reduce as custom_reduce
from ._dp import clip_per_sample as clip_per_sample
from ._dp import dp_noise as dp_noise
from ._errors import GradAccumError as GradAccumError
from ._module import buffers_of as buffers_of
from ._module import call_module as call_module
from ._module import params_of as params_of
from ._module import update_buffers as update_buffers
from ._module import write_grads as write_grads
from ._record import Collective as Collective
from ._record import record_collectives as record_collectives
from ._scatter import ReduceScatter as ReduceScatter
from ._scatter import reduce_scatter as reduce_scatter
from ._shard import Sharded as Sharded
from ._shard import shard as shard
from ._split import MicroBatches as MicroBatches
from ._state import Accumulator as Accumulator
from ._sums import AccumState as AccumState
from ._sync import AllReduce as AllReduce
from ._sync import Bucket as Bucket
from ._sync import all_reduce as all_reduce

__version__ = "0.1.0"

__all__ = [
    "AccumState",
    "Accumulator",
    "AllReduce",
    "Bucket",
    "Collective",
    "CustomReduce",
    "GradAccumError",
    "LossScale",
    "LossScaleState",
    "MicroBatches",
    "ReduceScatter",
    "Sharded",
    "accumulate",
    "all_reduce",
    "buffers_of",
    "call_module",
    "clip_by_global_norm",
    "clip_per_sample",
    "compressed_all_reduce",
    "custom_reduce",
    "dp_noise",
    "grad",
    "grad_and_value",
    "params_of",
    "powersgd",
    "record_collectives",
    "reduce_scatter",
    "shard",
    "topk_all_reduce",
    "update_buffers",
    "write_grads",
]
