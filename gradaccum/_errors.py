"""Error types and message builders (the rules of a message: CONTRIBUTING.md)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["GradAccumError", "check_not_dtensor", "describe", "is_dtensor", "is_mesh", "misaligned"]


class GradAccumError(RuntimeError):
    """Raised when gradaccum detects inconsistent state it cannot repair.

    Examples are a saved accumulator state that does not match the parameters it is loaded for,
    or (in data-parallel training) processes that disagree on the gradient tree.

    Examples:
        >>> import gradaccum
        >>> issubclass(gradaccum.GradAccumError, RuntimeError)
        True
    """

    # Tracebacks and reprs name it where users import it from (the docs' name); pickle finds it
    # there too.
    __module__ = "gradaccum"


def describe(value: Any) -> str:
    """A short description of a value for error messages: type, and shape/dtype for tensors."""
    if isinstance(value, torch.Tensor):
        return f"Tensor(shape={tuple(value.shape)}, dtype={dtype_name(value.dtype)})"
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, (bool, int, float, str)) or value is None:
        return f"{type(value).__name__} {value!r}"
    return type(value).__name__


def misaligned(where: str, rank: int, at: list[Any]) -> str:
    """The message for ranks at different windows (``at``: each rank's window index)."""
    mine, others = at[rank], sorted({w for w in at if w != at[rank]})
    ranks = [", ".join(str(r) for r, w in enumerate(at) if w == o) for o in others]
    them = "; ".join(
        f"rank{'s' if ',' in r else ''} {r} at window {o}" for r, o in zip(ranks, others)
    )
    return (
        f"{where}: the ranks are at different windows: rank {rank} is at window {mine} but "
        f"{them}. Their data or their calls got out of step (e.g. loaders of different lengths, "
        f"or an epoch that ended early on one rank), so this boundary would combine gradients of "
        f"different windows; nothing was reduced. Every rank must run the same number of "
        f"windows: call each accumulated function (or finalize) as often on every rank, let "
        f"gradaccum.loop.windows(...) pad a short loader with empty windows (with an "
        f"Accumulator, call acc.end_epoch(state) at each epoch's end so that this is caught), "
        f"and restore Accumulator states from the same checkpoint on every rank."
    )


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor`` (without importing it)."""
    cls = type(value)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def check_not_dtensor(where: str, what: str, value: Any) -> None:
    """Refuse a DTensor where a plain tensor is needed: its gradients would be all-zero."""
    if is_dtensor(value):
        raise GradAccumError(
            f"{where}: {what} is a DTensor (a parameter of a model wrapped with FSDP2's "
            f"fully_shard, or made by torch.distributed.tensor), which gradaccum would give "
            f"wrong (all-zero) gradients here. For an FSDP2 model, shard it with "
            f"sharded = gradaccum.shard(model) and sync=gradaccum.reduce_scatter(sharded); the "
            f"step function then gets the gathered, plain params (step(sharded, batch)) and "
            f"sharded.write_grads(grads) puts DTensor gradients on the model's parameters."
        )


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``'float32'``."""
    return str(dtype).removeprefix("torch.")


def is_mesh(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed`` ``DeviceMesh`` (without importing it)."""
    cls = type(value)
    return cls.__name__ == "DeviceMesh" and cls.__module__.startswith("torch.distributed")
