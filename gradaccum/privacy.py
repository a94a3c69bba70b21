"""Differentially private training (DP-SGD): per-sample clipping and calibrated noise."""

from ._dp import clip_per_sample as clip_per_sample
from ._dp import dp_noise as dp_noise

__all__ = ["clip_per_sample", "dp_noise"]
