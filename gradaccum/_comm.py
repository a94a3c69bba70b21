"""The transport: every collective gradaccum issues, with its timeout enforced by the backend.

``Work.wait(timeout)`` is not enough: gloo ignores it for reduce-scatter (the wait falls back to
the process group's own timeout), and where it is honoured the collective stays pending after the
wait gives up, so a late peer later blocks in it. Here the timeout goes into the collective's own
options (``AllreduceOptions.timeout`` and the like), so the backend itself fails the collective
once it is exceeded, on every kind: the waiting rank raises after ``timeout`` seconds, the pairs
are closed, and a late peer's collective fails at once instead of hanging.

On CPU tensors (gloo) the timeout goes into the options. On accelerators (NCCL) a collective
that exceeds its own timeout makes the backend's watchdog end the process, so there the timeout
stays on ``Work.wait`` (NCCL honours it), as before.

Each function returns the ``Work`` of an asynchronous collective; ``wait()`` waits for it.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

__all__ = ["all_gather", "all_reduce", "broadcast", "reduce_scatter", "resolve", "wait"]


def resolve(group: Any) -> Any:
    """The process group object: ``None`` is the default (world) group."""
    return dist.group.WORLD if group is None else group


def _options(opts: Any, timeout: float | None, tensor: torch.Tensor) -> Any:
    if timeout is not None and tensor.device.type == "cpu":
        opts.timeout = datetime.timedelta(seconds=timeout)
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = True
    return opts


def all_reduce(
    tensor: torch.Tensor,
    group: Any,
    timeout: float | None,
    op: Any = dist.ReduceOp.SUM,
) -> Any:
    """Start an in-place all-reduce of ``tensor`` over ``group``."""
    opts = _options(c10d.AllreduceOptions(), timeout, tensor)
    opts.reduceOp = op
    return resolve(group).allreduce([tensor], opts)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Any, timeout: float | None) -> Any:
    """Start a sum of ``inp`` over ``group``, of which this rank keeps its chunk in ``out``."""
    opts = _options(c10d.ReduceScatterOptions(), timeout, inp)
    opts.reduceOp = dist.ReduceOp.SUM
    return resolve(group)._reduce_scatter_base(out, inp, opts)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any, timeout: float | None) -> Any:
    """Start gathering every rank's ``inp`` into ``out`` (concatenated in rank order)."""
    opts = _options(c10d.AllgatherOptions(), timeout, inp)
    return resolve(group)._allgather_base(out, inp, opts)


def broadcast(tensor: torch.Tensor, src: int, group: Any, timeout: float | None) -> Any:
    """Start a broadcast of ``tensor`` from ``src`` (a rank of ``group``) to the group."""
    opts = _options(c10d.BroadcastOptions(), timeout, tensor)
    opts.rootRank = src
    opts.rootTensor = 0
    return resolve(group).broadcast([tensor], opts)


def wait(work: Any, timeout: float | None) -> None:
    """Wait for ``work``; raises ``RuntimeError`` when it failed or timed out."""
    if timeout is None:
        work.wait()
    else:
        # The collective fails by itself after its timeout; the wait's own bound is a second
        # line for backends that do not apply the option.
        work.wait(timeout=datetime.timedelta(seconds=timeout))
