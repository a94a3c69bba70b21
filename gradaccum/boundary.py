"""Boundary transforms: what to do with a window's gradients before the optimizer step."""

from ._boundary import LossScale as LossScale
from ._boundary import LossScaleState as LossScaleState
from ._boundary import clip_by_global_norm as clip_by_global_norm

__all__ = ["LossScale", "LossScaleState", "clip_by_global_norm"]
