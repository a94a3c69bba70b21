"""Streaming accumulation: the state that [`Accumulator`][gradaccum.Accumulator] threads."""

from ._core.state import AccumState as AccumState
from ._metrics import WindowStats as WindowStats

__all__ = ["AccumState", "WindowStats"]
