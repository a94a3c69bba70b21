"""Boundary metrics: scalars summed over a window's micro-batches, then over the ranks.

``Accumulator.add(..., metrics={...})`` adds each value into a 0-dim running sum (float64, on
the gradients' device: no host sync); the boundary sends the sums in the tail of the collective
that already carries the window's weight, and ``Accumulator.boundary`` reports the totals as a
[`WindowStats`][gradaccum.streaming.WindowStats].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ._errors import GradAccumError, describe

__all__ = [
    "Metrics",
    "WindowStats",
    "add",
    "check",
    "check_names",
    "check_saved",
    "device_of",
    "names_of",
    "zeros",
]

Metrics = dict[str, torch.Tensor]


class WindowStats(NamedTuple):
    """What a window's boundary reports besides its gradient: see ``Accumulator.boundary``.

    Attributes:
        window: The index of the window just closed (``AccumState.window`` before the boundary).
        weight: The window's global weight: its rows (``reduction="mean"`` or ``"sum"``) or
            counts (``"count"``), summed over the micro-batches of every rank.
        metrics: Each metric given to ``Accumulator.add(..., metrics=...)``, summed over the
            window's micro-batches and over the ranks.

    Examples:
        >>> import torch, gradaccum
        >>> acc = gradaccum.Accumulator(n=2, reduction="count")
        >>> state = acc.init({"w": torch.zeros(2)})
        >>> for loss, tokens in ((3.0, 2), (5.0, 4)):  # summed losses and their token counts
        ...     g = {"w": torch.full((2,), loss)}
        ...     state = acc.add(state, g, count=tokens, metrics={"loss": loss})
        >>> grads, state, stats = acc.boundary(state)
        >>> stats
        WindowStats(window=0, weight=6.0, metrics={'loss': 8.0})
        >>> stats.metrics["loss"] / stats.weight  # the window's mean loss per token
        1.3333333333333333
    """

    window: int
    weight: float
    metrics: dict[str, float]


def _dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def zeros(names: Any, device: torch.device) -> Metrics | None:
    """Zero sums for ``names`` (an empty window's), or None without names."""
    if not names:
        return None
    return {k: torch.zeros((), dtype=_dtype(device), device=device) for k in names}


def names_of(metrics: Metrics | None) -> tuple[str, ...]:
    """The metric names of a state's sums (sorted), ``()`` without metrics."""
    return tuple(metrics) if metrics else ()


def check(where: str, sums: Metrics | None, first: bool, given: Any) -> list[str]:
    """Validate one micro-batch's ``given`` metrics against the window's ``sums``; the names.

    ``first``: the window's first micro-batch, whose metrics start new sums (their names may
    differ from the previous window's, which an empty window would send).
    """
    if given is None:
        if first or not sums:
            return []
        _differ(where, list(sums), [])
    if not isinstance(given, Mapping):
        raise TypeError(
            f"{where}: metrics must be None or a dict from names to numbers or 0-dim tensors, "
            f"got {describe(given)}; pass e.g. metrics={{'loss': loss.detach()}}."
        )
    names = sorted(given, key=str)
    if not first and names != list(sums or ()):
        _differ(where, list(sums or ()), names)
    for k in names:
        _check(where, k, given[k])
    return names


def add(sums: Metrics | None, first: bool, given: Any, device: torch.device) -> Metrics | None:
    """Add one micro-batch's ``given`` metrics (checked) into the window's ``sums``.

    ``first``: the window's first micro-batch, whose metrics start new sums.
    """
    if given is None:
        return None
    out: Metrics = {}
    for k in sorted(given):
        v = given[k]
        if first:
            if isinstance(v, torch.Tensor):
                out[k] = v.detach().to(device=device, dtype=_dtype(device), copy=True)
            else:
                out[k] = torch.tensor(v, dtype=_dtype(device), device=device)
        else:  # a new tensor, not add_: torch.compile drops in-place adds into 0-dim inputs
            s = sums[k]  # type: ignore[index]
            out[k] = s + (v.detach().to(device) if isinstance(v, torch.Tensor) else v)
    return out


def _check(where: str, k: Any, v: Any) -> None:
    """Refuse a name that is not a str, or a value that is not a real scalar."""
    if not isinstance(k, str):
        raise TypeError(
            f"{where}: metrics must map names (str) to numbers, got the name {describe(k)}; "
            f"pass e.g. metrics={{'loss': loss.detach()}}."
        )
    if isinstance(v, torch.Tensor):
        kind_ok = not v.is_complex() and v.dtype != torch.bool
    else:
        kind_ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if not kind_ok:
        raise TypeError(
            f"{where}: metrics[{k!r}] must be a real number or a 0-dim real tensor, got "
            f"{describe(v)}; pass e.g. metrics={{{k!r}: loss.detach()}}."
        )
    if isinstance(v, torch.Tensor) and v.dim() != 0:
        raise ValueError(
            f"{where}: metrics[{k!r}] must be a scalar (a 0-dim tensor), got {describe(v)}; "
            f"sum (or average) it to one number first, e.g. metrics={{{k!r}: value.sum()}}."
        )


def _differ(where: str, have: list[str], got: list[str]) -> None:
    missing = [k for k in have if k not in got]
    extra = [k for k in got if k not in have]
    detail = "; ".join(
        [f"missing {k!r}" for k in missing[:1]] + [f"unexpected {k!r}" for k in extra[:1]]
    )
    raise ValueError(
        f"{where}: metrics has the names {got} but the window's earlier micro-batches gave "
        f"{have} ({detail}); pass the same names at every add() of a window (0 for a metric "
        f"with nothing to add in this micro-batch)."
    )


def check_saved(where: str, saved: Any, device: torch.device, fix: str) -> Metrics | None:
    """A checkpoint's metric sums, validated and copied to ``device``; None if it has none."""
    if saved is None:
        return None
    bad = not isinstance(saved, dict) or any(
        not isinstance(k, str)
        or not isinstance(v, torch.Tensor)
        or v.dim() != 0
        or not v.is_floating_point()
        for k, v in saved.items()
    )
    if bad or list(saved) != sorted(saved):
        raise GradAccumError(
            f"{where}: metrics must be None or a dict (sorted by name) from names to 0-dim "
            f"floating tensors, got {describe(saved)}{fix}"
        )
    return {k: v.to(device, copy=True) for k, v in saved.items()}


def device_of(lay: Any) -> torch.device:
    """Where a state's metric sums live: with the gradients (the boundary's tail)."""
    return lay.devices[0] if lay.devices else torch.device("cpu")


def check_names(where: str, metrics: Any) -> list[str]:
    """The metric names given to ``Accumulator.init``, sorted; a ``TypeError`` if not names."""
    metrics = () if metrics is None else metrics
    if not isinstance(metrics, (tuple, list, set, frozenset)) or any(
        not isinstance(k, str) for k in metrics
    ):
        raise TypeError(
            f"{where}: metrics must be names (a tuple of str), got {metrics!r}; pass e.g. "
            f"metrics=('loss',)."
        )
    return sorted(metrics)
