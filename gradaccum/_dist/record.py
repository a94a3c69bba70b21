"""Visibility: every collective gradaccum issues is recorded here first."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["Collective", "record", "record_collectives"]

_LOGS: list[list[Collective]] = []


class Collective:
    """One collective issued by gradaccum, as logged by a recorder.

    [`record_collectives()`][gradaccum.sync.record_collectives] yields a list of them.

    A record does not keep its process group alive: it holds it weakly, so that a log kept after
    ``torch.distributed.destroy_process_group()`` does not keep the group (and its backend's
    threads) until the interpreter's finalization, where freeing them can abort the process.
    ``group`` is then ``None``.

    Attributes:
        kind: The torch.distributed function: ``"all_reduce"``, ``"reduce_scatter"``,
            ``"all_gather"``, ``"broadcast"``, ``"all_gather_object"``.
        group: The process group it ran on (``torch.distributed.group.WORLD`` for the default),
            or ``None`` once that group has been freed.
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

    __slots__ = ("_group", "dim", "dtype", "kind", "nbytes", "numel", "purpose")

    _group: Callable[[], Any]
    kind: str
    dtype: torch.dtype
    numel: int
    nbytes: int
    purpose: str
    dim: str | None

    def __init__(
        self,
        kind: str,
        group: Any,
        dtype: torch.dtype,
        numel: int,
        nbytes: int,
        purpose: str,
        dim: str | None = None,
    ) -> None:
        try:
            ref: Callable[[], Any] = weakref.ref(group) if group is not None else _none
        except TypeError:  # an object without weak references: kept as it is
            ref = functools.partial(_same, group)
        for name, value in (
            ("kind", kind),
            ("_group", ref),
            ("dtype", dtype),
            ("numel", numel),
            ("nbytes", nbytes),
            ("purpose", purpose),
            ("dim", dim),
        ):
            object.__setattr__(self, name, value)

    @property
    def group(self) -> Any:
        """The process group, or ``None`` (none given, or freed since)."""
        return self._group()

    def _fields(self) -> tuple[Any, ...]:
        return (self.kind, self.group, self.dtype, self.numel, self.nbytes, self.purpose, self.dim)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Collective is immutable: cannot set {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Collective):
            return NotImplemented
        mine, theirs = self._fields(), other._fields()
        return mine[1] is theirs[1] and mine[:1] + mine[2:] == theirs[:1] + theirs[2:]

    def __hash__(self) -> int:
        return hash((self.kind, id(self.group), self.dtype, self.numel, self.purpose, self.dim))

    def __repr__(self) -> str:
        names = ("kind", "group", "dtype", "numel", "nbytes", "purpose", "dim")
        body = ", ".join(f"{n}={v!r}" for n, v in zip(names, self._fields()))
        return f"Collective({body})"


def _none() -> None:
    return None


def _same(value: Any) -> Any:
    return value


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
