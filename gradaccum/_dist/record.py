"""Visibility: every collective gradaccum issues is recorded here first."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Collective", "record", "record_collectives"]

_LOGS: list[list[Collective]] = []


@dataclass(frozen=True)
class Collective:
    """One collective issued by gradaccum, as logged by a recorder.

    [`record_collectives()`][gradaccum.sync.record_collectives] yields a list of them.

    Attributes:
        kind: The torch.distributed function: ``"all_reduce"``, ``"reduce_scatter"``,
            ``"all_gather"``, ``"broadcast"``, ``"all_gather_object"``.
        group: The process group it ran on (``torch.distributed.group.WORLD`` for the default).
        dtype: The dtype of the tensor on the wire.
        numel: Elements on the wire (0 for object collectives, whose size is not known).
        nbytes: Bytes on the wire: ``numel`` times the element size.
        purpose: ``"gradients"`` (a boundary bucket), ``"gradients (every)"`` (a bucket
            reduce-scattered per micro-batch), ``"weight"`` (a sharded window's weight and
            failure flag), ``"params"`` (gathering or broadcasting sharded params),
            ``"fingerprint"`` (the tree check), ``"found_inf"`` (a loss-scaling decision),
            ``"norm"`` (a sharded gradient norm).
        dim: The ``DeviceMesh`` dim it ran over (its name, e.g. ``"replicate"``), or ``None``
            for a process group given as such.

    Examples:
        >>> import torch, gradaccum
        >>> c = gradaccum.sync.Collective("all_reduce", None, torch.float32, 10, 40, "gradients")
        >>> c.nbytes
        40
    """

    kind: str
    group: Any
    dtype: torch.dtype
    numel: int
    nbytes: int
    purpose: str
    dim: str | None = None


@contextlib.contextmanager
def record_collectives() -> Iterator[list[Collective]]:
    """Record the collectives gradaccum issues inside the ``with`` block.

    Yields a list that fills with one [`Collective`][gradaccum.sync.Collective] per collective, in
    the order they are issued (nested blocks each see all of them). Nothing is recorded for
    collectives other code issues.

    Examples:
        >>> import torch, gradaccum
        >>> with gradaccum.sync.record_collectives() as log:
        ...     grads = gradaccum.accumulate(lambda p, b: {"w": b.sum() * p["w"]}, n=2)(
        ...         {"w": torch.ones(1)}, torch.ones(4))
        >>> log  # one process, no sync: nothing on the wire
        []
    """
    log: list[Collective] = []
    _LOGS.append(log)
    try:
        yield log
    finally:
        _LOGS.remove(log)


def record(
    kind: str, group: Any, dtype: torch.dtype, numel: int, purpose: str, dim: str | None = None
) -> None:
    """Log one collective in every active ``record_collectives()`` block."""
    if not _LOGS:
        return
    item = Collective(kind, group, dtype, numel, numel * dtype.itemsize, purpose, dim)
    for log in _LOGS:
        log.append(item)
