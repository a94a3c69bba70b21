"""Boundary metrics: numbers summed over a window's micro-batches, then over the ranks.

``Accumulator.add(..., metrics={...})`` adds each value into a running sum (float64, on the
gradients' device: no host sync): a scalar (0-dim), or a 1-D tensor of a fixed length (e.g. one
count per parameter or per expert), summed element by element. The boundary sends the sums,
flat, in the tail of the collective that already carries the window's weight, and
``Accumulator.boundary`` reports the totals as a [`WindowStats`][gradaccum.streaming.WindowStats]
(a float per scalar metric, a list of floats per 1-D one).

A window's metrics are described by its signature: ``(name, shape)`` pairs sorted by name, the
shape ``()`` or ``(k,)``. A sync reads it from ``WindowSpec.metrics`` and
``WindowSpec.metric_shapes``: ``width(spec)`` is the number of floats the tail carries for them,
``line(spec)`` the fingerprint's line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ._errors import GradAccumError, describe

__all__ = [
    "Metrics",
    "Signature",
    "WindowStats",
    "add",
    "check",
    "check_names",
    "check_saved",
    "device_of",
    "line",
    "saved_signature",
    "signature",
    "unpack",
    "width",
    "zeros",
]

Metrics = dict[str, torch.Tensor]
Shape = tuple[int, ...]
Signature = tuple[tuple[str, Shape], ...]  # (name, shape) of each metric, sorted by name


class WindowStats(NamedTuple):
    """What a window's boundary reports besides its gradient: see ``Accumulator.boundary``.

    Attributes:
        window: The index of the window just closed (``AccumState.window`` before the boundary).
        weight: The window's global weight: its rows (``reduction="mean"`` or ``"sum"``) or
            counts (``"count"``), summed over the micro-batches of every rank.
        metrics: Each metric given to ``Accumulator.add(..., metrics=...)``, summed over the
            window's micro-batches and over the ranks: a float for a scalar metric, a list of
            floats (element by element) for a 1-D one.

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
    metrics: dict[str, float | list[float]]


def _dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def zeros(sig: Signature, device: torch.device) -> Metrics | None:
    """Zero sums for the signature ``sig`` (an empty window's), or None without metrics."""
    if not sig:
        return None
    return {k: torch.zeros(shape, dtype=_dtype(device), device=device) for k, shape in sig}


def signature(metrics: Metrics | None) -> Signature:
    """The ``(name, shape)`` pairs of a state's sums (sorted by name), ``()`` without metrics."""
    return tuple((k, tuple(v.shape)) for k, v in metrics.items()) if metrics else ()


def saved_signature(saved: Any) -> Signature:
    """The signature of a checkpoint's metric sums, read leniently (``check_saved`` checks)."""
    if not isinstance(saved, dict):
        return ()
    return tuple(
        sorted(
            (str(k), tuple(v.shape) if isinstance(v, torch.Tensor) and v.dim() == 1 else ())
            for k, v in saved.items()
        )
    )


def width(spec: Any) -> int:
    """The floats a window's metrics take in the boundary's tail (``spec``: a ``WindowSpec``)."""
    shapes = getattr(spec, "metric_shapes", ())
    if not shapes:  # a spec made without shapes: scalars
        return len(spec.metrics)
    return sum(math.prod(shape) for shape in shapes)


def line(spec: Any) -> str:
    """The fingerprint's line for a window's metrics: names, and the length of 1-D ones."""
    shapes = getattr(spec, "metric_shapes", ()) or ((),) * len(spec.metrics)
    labels = [k if not shape else f"{k}{list(shape)}" for k, shape in zip(spec.metrics, shapes)]
    return f"metrics {labels}"


def unpack(sig: Signature, totals: Any) -> dict[str, float | list[float]]:
    """The metrics' totals by name, from a window's ``totals[1]``.

    ``totals``: the sums in signature order, flat (numbers, as the boundary's tail holds them),
    or one number or tensor per metric (a window of one process), or a 1-D tensor.
    """
    if isinstance(totals, torch.Tensor):
        flat = totals.reshape(-1).tolist()
    else:
        flat = []
        for v in totals:
            if isinstance(v, torch.Tensor):
                flat.extend(v.reshape(-1).tolist())
            else:
                flat.append(float(v))
    out: dict[str, float | list[float]] = {}
    at = 0
    for k, shape in sig:
        if shape:
            out[k] = [float(x) for x in flat[at : at + shape[0]]]
            at += shape[0]
        else:
            out[k] = float(flat[at])
            at += 1
    return out


def check(where: str, sums: Metrics | None, first: bool, given: Any) -> Signature:
    """Validate one micro-batch's ``given`` metrics against the window's ``sums``; their signature.

    ``first``: the window's first micro-batch, whose metrics start new sums (their names and
    shapes may differ from the previous window's, which an empty window would send).
    """
    if given is None:
        if first or not sums:
            return ()
        _differ(where, list(sums), [])
    if not isinstance(given, Mapping):
        raise TypeError(
            f"{where}: metrics must be None or a dict from names to numbers or 0-dim tensors "
            f"(or 1-D tensors of a fixed length), got {describe(given)}; pass e.g. "
            f"metrics={{'loss': loss.detach()}}."
        )
    names = sorted(given, key=str)
    if not first and names != list(sums or ()):
        _differ(where, list(sums or ()), names)
    sig = []
    for k in names:
        v = given[k]
        _check(where, k, v)
        shape = tuple(v.shape) if isinstance(v, torch.Tensor) else ()
        if not first and sums is not None and tuple(sums[k].shape) != shape:
            have = tuple(sums[k].shape)
            raise ValueError(
                f"{where}: metrics[{k!r}] has the shape {shape} but {have} at the window's "
                f"earlier micro-batches; give a metric one shape in every add() of a window "
                f"(a scalar, or a 1-D tensor of one length)."
            )
        sig.append((k, shape))
    return tuple(sig)


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
                # A kernel argument: torch.tensor(v, device=) would copy from the host and wait.
                out[k] = torch.full((), v, dtype=_dtype(device), device=device)
        else:  # a new tensor, not add_: torch.compile drops in-place adds into 0-dim inputs
            s = sums[k]  # type: ignore[index]
            out[k] = s + (v.detach().to(device) if isinstance(v, torch.Tensor) else v)
    return out


def _check(where: str, k: Any, v: Any) -> None:
    """Refuse a name that is not a str, or a value that is not a real scalar or 1-D tensor."""
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
            f"{where}: metrics[{k!r}] must be a real number or a 0-dim real tensor (or a 1-D "
            f"one), got {describe(v)}; pass e.g. metrics={{{k!r}: loss.detach()}}."
        )
    if isinstance(v, torch.Tensor) and v.dim() > 1:
        raise ValueError(
            f"{where}: metrics[{k!r}] must be a scalar (a 0-dim tensor) or a 1-D tensor, got "
            f"{describe(v)}; sum it to one number (metrics={{{k!r}: value.sum()}}) or flatten "
            f"it (metrics={{{k!r}: value.reshape(-1)}})."
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
        or v.dim() > 1
        or not v.is_floating_point()
        for k, v in saved.items()
    )
    if bad or list(saved) != sorted(saved):
        raise GradAccumError(
            f"{where}: metrics must be None or a dict (sorted by name) from names to floating "
            f"tensors of 0 or 1 dims, got {describe(saved)}{fix}"
        )
    return {k: v.to(device, copy=True) for k, v in saved.items()}


def device_of(lay: Any) -> torch.device:
    """Where a state's metric sums live: with the gradients (the boundary's tail)."""
    return lay.devices[0] if lay.devices else torch.device("cpu")


def check_names(where: str, metrics: Any) -> Signature:
    """The metrics given to ``Accumulator.init``, as a signature; a ``TypeError`` if malformed.

    ``metrics``: names (scalar metrics), or a dict from names to shapes (``()`` for a scalar,
    ``(k,)`` for a 1-D metric of ``k`` numbers).
    """
    metrics = () if metrics is None else metrics
    if isinstance(metrics, Mapping):
        items = list(metrics.items())
    elif isinstance(metrics, (tuple, list, set, frozenset)):
        items = [(k, ()) for k in metrics]
    else:
        items = None
    ok = items is not None and all(
        isinstance(k, str)
        and isinstance(shape, (tuple, list))
        and len(shape) <= 1
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        for k, shape in items
    )
    if not ok:
        raise TypeError(
            f"{where}: metrics must be names (a tuple of str), or a dict from names to shapes "
            f"(() or (length,)), got {metrics!r}; pass e.g. metrics=('loss',) or "
            f"metrics={{'loss': (), 'per_expert': (8,)}}."
        )
    return tuple(sorted((k, tuple(shape)) for k, shape in items or ()))
