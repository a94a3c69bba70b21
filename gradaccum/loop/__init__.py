"""The training loop around accumulation: data windows, the boundary step, checkpoints, progress.

[`windows()`][gradaccum.loop.windows] cuts any iterable of micro-batches into accumulation
windows that every rank agrees on; [`Step`][gradaccum.loop.Step] runs a module's micro-steps
and its boundary (clipping, ``write_grads``, one optimizer and scheduler step per window);
[`save()`][gradaccum.loop.save] and [`load()`][gradaccum.loop.load] checkpoint the whole state,
mid-window included; [`progress()`][gradaccum.loop.progress] is a tqdm bar of the windows.
See the page "A whole training loop" (docs/loop.md).
"""

from ._boundary import StepStats as StepStats
from ._coupled import Coupled as Coupled
from ._coupled import WindowStats as WindowStats
from ._data import Windows as Windows
from ._plan import DataWindow as DataWindow
from ._progress import Progress as Progress
from ._progress import progress as progress
from ._save import load as load
from ._save import save as save
from ._step import Step as Step
from ._windows import windows as windows

__all__ = [
    "Coupled",
    "DataWindow",
    "Progress",
    "Step",
    "StepStats",
    "WindowStats",
    "Windows",
    "load",
    "progress",
    "save",
    "windows",
]
