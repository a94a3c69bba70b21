"""Streaming accumulation: the state that [`Accumulator`][gradaccum.Accumulator] threads."""

from ._accum_state import AccumState as AccumState

__all__ = ["AccumState"]
