"""The public surface: the top-level verbs and the public submodules, as the tests see them."""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType

import gradaccum

# The public submodules. A module object in gradaccum.__all__ (testing) is covered through its
# own __all__ here; the tests check that none is left out.
SUBMODULES = (
    "sync",
    "sharding",
    "checkpoint",
    "boundary",
    "compression",
    "privacy",
    "streaming",
    "testing",
    "loop",
)

# gradaccum.__all__, exactly.
TOP_LEVEL = (
    "accumulate",
    "Accumulator",
    "grad",
    "grad_and_value",
    "MicroBatches",
    "coupled",
    "window_stats",
    "Rows",
    "Mean",  # what a loss returns (issue 35): gradaccum.Mean(loss, n), gradaccum.Sum(loss, n)
    "Sum",
    "all_reduce",
    "reduce_scatter",
    "shard",
    "custom_reduce",
    "params_of",
    "buffers_of",
    "call_module",
    "update_buffers",
    "write_grads",
    "GradAccumError",
    "testing",
)

# The names that left the top level, and the submodule each lives in now.
MOVED = {
    "sync": (
        "AllReduce",
        "Bucket",
        "Collective",
        "CustomReduce",
        "record_collectives",
    ),
    "sharding": ("ReduceScatter", "Sharded"),
    "boundary": ("LossScale", "LossScaleState", "clip_by_global_norm"),
    "compression": ("compressed_all_reduce", "topk_all_reduce", "powersgd"),
    "privacy": ("clip_per_sample", "dp_noise"),
    "streaming": ("AccumState",),
}


def modules() -> list[ModuleType]:
    """Gradaccum and its public submodules."""
    return [gradaccum] + [importlib.import_module(f"gradaccum.{name}") for name in SUBMODULES]


def public_objects() -> dict[str, object]:
    """Every public name (``gradaccum.sync.AllReduce``) and its object, modules left out."""
    found = {}
    for module in modules():
        for name in module.__all__:
            obj = getattr(module, name)
            if not inspect.ismodule(obj):
                found[f"{module.__name__}.{name}"] = obj
    return found
