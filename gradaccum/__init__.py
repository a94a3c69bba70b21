"""gradaccum: gradient accumulation as composable, functional transforms over PyTorch.

The accumulated gradient equals the whole-batch gradient; communication (when there is any)
happens once, at the accumulation boundary.
"""

from . import testing as testing
from ._accumulate import accumulate as accumulate
from ._errors import GradAccumError as GradAccumError
from ._module import buffers_of as buffers_of
from ._module import call_module as call_module
from ._module import params_of as params_of
from ._module import update_buffers as update_buffers
from ._module import write_grads as write_grads
from ._split import MicroBatches as MicroBatches
from ._state import AccumState as AccumState
from ._state import Accumulator as Accumulator

__version__ = "0.1.0"

__all__ = [
    "AccumState",
    "Accumulator",
    "GradAccumError",
    "MicroBatches",
    "accumulate",
    "buffers_of",
    "call_module",
    "params_of",
    "update_buffers",
    "write_grads",
]
