"""The process group of the examples that run on one process or under torchrun, and their checks.

Shared by ``causal_lm_tokens.py``, ``hf_gpt2.py``, ``contrastive.py`` and ``clip.py``: the gloo
group (on the loopback interface when every rank is on this machine), the verdict every rank
reaches together, and the largest difference of two gradient or parameter dicts.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist


def init_distributed() -> tuple[int, int]:
    """``(rank, world)``: the default gloo process group under torchrun, ``(0, 1)`` without."""
    if "RANK" not in os.environ:
        return 0, 1
    if os.environ.get("WORLD_SIZE") == os.environ.get("LOCAL_WORLD_SIZE"):
        # Every rank is on this machine: keep gloo's traffic on the loopback interface.
        names = [name for _, name in getattr(socket, "if_nameindex", list)()]
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if "lo0" in names else "lo")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    return dist.get_rank(), dist.get_world_size()


def worst_over_ranks(*values: float) -> list[float]:
    """The largest of each value over the ranks, so every rank reaches the same verdict."""
    if not dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two dicts of tensors with the same keys."""
    return max((a[k] - b[k]).abs().max().item() for k in sorted(a))
