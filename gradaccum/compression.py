"""Compressed boundary reductions, built on [`custom_reduce()`][gradaccum.custom_reduce]."""

from ._compress import compressed_all_reduce as compressed_all_reduce
from ._compress import powersgd as powersgd
from ._compress import topk_all_reduce as topk_all_reduce

__all__ = ["compressed_all_reduce", "powersgd", "topk_all_reduce"]
