"""Post-accumulate-grad hooks on many tensors at once, added and removed without Python calls.

``Tensor.register_post_accumulate_grad_hook`` is a Python function that builds a
``RemovableHandle`` (two more) per tensor, and each ``handle.remove()`` is one more: four Python
calls per parameter per window, where ``accumulate`` and ``loop.Step`` hook every parameter once
a window. ``register`` writes into the same per-tensor dict that it fills (autograd calls what
the dict holds, in order, after each accumulation into ``.grad``) in one C-level loop, and
returns one remover per tensor: a ``dict.pop`` bound to the dict and the key, called in C too.

A hook that is itself a C callable (``functools.partial(operator.setitem, marks, i)``: "a
backward reached tensor i") then costs no Python call at all when autograd runs it.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

__all__ = ["register", "remove"]

# The tensor types whose hook dict ``register_post_accumulate_grad_hook`` fills as written here;
# any other (a subclass with __torch_function__) goes through that function.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def register(
    tensors: Sequence[torch.Tensor], hooks: Iterable[Callable[[torch.Tensor], None]]
) -> list[Callable[[], object]]:
    """Register ``hooks[i]`` as a post-accumulate-grad hook of ``tensors[i]``; the removers.

    As ``register_post_accumulate_grad_hook`` does, hook by hook (the same dict, the same order,
    the same errors for a tensor that does not require grad or is not a leaf), with one fresh
    key for the whole call.

    Returns:
        Per tensor, a callable that removes its hook (again: nothing).
    """
    key = object()
    removers: list[Callable[[], object]] = []
    for t, hook in zip(tensors, hooks):
        if type(t) not in _PLAIN or not t.requires_grad or t.grad_fn is not None:
            removers.append(t.register_post_accumulate_grad_hook(hook).remove)  # type: ignore[no-untyped-call]
            continue
        hooks_of: dict[object, Any] | None = t._post_accumulate_grad_hooks  # None: no hook yet
        if hooks_of is None:
            hooks_of = t._post_accumulate_grad_hooks = OrderedDict()
        hooks_of[key] = hook
        removers.append(functools.partial(hooks_of.pop, key, None))
    return removers


def remove(removers: Iterable[Callable[[], object] | None]) -> None:
    """Remove the hooks of ``removers`` (``None``: one already removed)."""
    for r in removers:
        if r is not None:
            r()
