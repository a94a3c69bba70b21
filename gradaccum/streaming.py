"""Streaming accumulation: the state that [`Accumulator`][gradaccum.Accumulator] threads."""

from ._sums import AccumState as AccumState

__all__ = ["AccumState"]
