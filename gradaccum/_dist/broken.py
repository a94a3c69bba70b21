"""Broken process groups: those on which a gradaccum collective failed or timed out.

They are unusable (the messages say so), so the error path does not join a boundary there (it
would only wait for more timeouts): [`Comm`][gradaccum.sync.Comm] marks a group when one of its
collectives fails, and ``Window.abort`` asks before it joins.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch.distributed as dist

from .._errors import is_mesh

__all__ = ["is_broken", "mark_broken"]

# Weak references: a strong one would keep the backend (and its gloo threads, maybe inside an
# abandoned collective) alive after destroy_process_group(), until exit, where such a thread
# aborts.
_BROKEN_GROUPS: list[weakref.ref[Any]] = []


def mark_broken(group: Any) -> None:
    """Record that a collective on ``group`` (None: the default group) failed."""
    group = _resolve(group)
    if group is not None and not is_broken(group):
        _BROKEN_GROUPS[:] = [r for r in _BROKEN_GROUPS if r() is not None]
        _BROKEN_GROUPS.append(weakref.ref(group))


def is_broken(group: Any) -> bool:
    """Whether a collective on ``group`` (None: the default group) has failed."""
    group = _resolve(group)
    return group is not None and any(r() is group for r in _BROKEN_GROUPS)


def _resolve(group: Any) -> Any:
    if is_mesh(group):  # a 1-D mesh stands for its group
        return group.get_group(0) if group.ndim == 1 else None
    if group is not None:
        return group
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.group.WORLD
