"""Check your own step function: accumulated gradient against the whole-batch gradient.

``compare`` runs ``accumulate(step_fn, n)`` and ``step_fn`` on the whole batch and reports the
worst leaf by key path, at tolerances chosen from the dtype. ``assert_equivalent`` raises when
they differ. ``nonfinite`` and ``assert_finite`` find NaN/inf gradient leaves.

Things that make the two differ, on purpose: BatchNorm (statistics per micro-batch), dropout
(different random draws), losses normalised per micro-batch (use ``reduction="count"``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import _tree
from ._core.accumulate import accumulate
from ._errors import dtype_name

__all__ = ["Comparison", "LeafDiff", "assert_equivalent", "assert_finite", "compare", "nonfinite"]

# (rtol, atol) of a leaf: |acc - ref| <= atol + rtol * max|ref|. The 16-bit rows are looser than
# torch.testing.assert_close's: where a gradient entry's terms cancel, the rounding error follows
# the terms, not the small sum; with assert_close's values 1-2% of the leaves of correct
# float16/bfloat16 MLP steps failed, with these none did (the worst at 0.84 of the tolerance).
_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.bfloat16: (2e-2, 1e-3),
    torch.float16: (5e-3, 1e-4),
}


def _coarsest(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The less precise of two dtypes (larger machine epsilon); a floating one over another."""
    floats = [d for d in (a, b) if d.is_floating_point]
    return max(floats, key=lambda d: torch.finfo(d).eps, default=b)


def _default_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for a leaf compared in ``dtype``."""
    if dtype in _TOLERANCES:
        return _TOLERANCES[dtype]
    if dtype.is_floating_point:  # e.g. float8: two units in the last place
        return 2 * torch.finfo(dtype).eps, 1e-3
    return _TOLERANCES[torch.float32]


@dataclass(frozen=True)
class LeafDiff:
    """How one gradient leaf differs from the whole-batch reference.

    Attributes:
        path: The leaf's key path, e.g. ``['layer']['weight']``.
        dtype: The dtype that selects the default tolerances: the less precise of the
            accumulated and the reference gradient's dtypes (they differ when ``step_fn`` returns,
            say, float32 gradients for bfloat16 params: accumulated ones come in the params').
        max_abs_err: ``max |accumulated - reference|`` over the leaf.
        scale: ``max |reference|`` over the leaf.
        rtol: The relative tolerance used.
        atol: The absolute tolerance used.

    Examples:
        >>> import torch
        >>> from gradaccum.testing import LeafDiff
        >>> d = LeafDiff("['w']", torch.float64, max_abs_err=1e-12, scale=2.0, rtol=1e-10, atol=0)
        >>> d.ok, d.rel_err
        (True, 5e-13)
    """

    path: str
    dtype: torch.dtype
    max_abs_err: float
    scale: float
    rtol: float
    atol: float

    @property
    def rel_err(self) -> float:
        """``max_abs_err / max|reference|`` (0 when both are 0)."""
        if self.scale:
            return self.max_abs_err / self.scale
        return float("inf") if self.max_abs_err else 0.0

    @property
    def ok(self) -> bool:
        """Within ``atol + rtol * max|reference|``."""
        return self.max_abs_err <= self.atol + self.rtol * self.scale


@dataclass(frozen=True)
class Comparison:
    """The result of [`compare()`][gradaccum.testing.compare]: one ``LeafDiff`` per leaf.

    Attributes:
        leaves: One [`LeafDiff`][gradaccum.testing.LeafDiff] per gradient leaf, in flat order.
        n: The number of micro-batches compared.

    Examples:
        >>> import torch, gradaccum.testing
        >>> from torch.func import grad
        >>> loss = lambda p, b: (b @ p).pow(2).mean()
        >>> p, b = torch.ones(3, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
        >>> result = gradaccum.testing.compare(grad(loss), p, b, n=2)
        >>> result.ok, result.worst.path, len(result.leaves)
        (True, '<root>', 1)
    """

    leaves: tuple[LeafDiff, ...]
    n: int

    @property
    def ok(self) -> bool:
        """Every leaf is within tolerance."""
        return all(leaf.ok for leaf in self.leaves)

    @property
    def worst(self) -> LeafDiff:
        """The leaf with the largest error relative to its tolerance."""

        def badness(d: LeafDiff) -> float:
            tol = d.atol + d.rtol * d.scale
            return d.max_abs_err / tol if tol > 0 else (float("inf") if d.max_abs_err else 0.0)

        return max(self.leaves, key=badness)

    def __str__(self) -> str:
        w, verdict = self.worst, "match" if self.ok else "DIFFER"
        return (
            f"accumulated (n={self.n}) and whole-batch gradients {verdict}: worst leaf {w.path} "
            f"({dtype_name(w.dtype)}): max abs error {w.max_abs_err:.3g}, relative "
            f"{w.rel_err:.3g} (tolerance {w.atol:.1g} + {w.rtol:.1g} * {w.scale:.3g})"
        )


def compare(
    step_fn: Callable[..., Any],
    params: Any,
    batch: Any,
    n: int,
    *args: Any,
    rtol: float | None = None,
    atol: float | None = None,
    **accumulate_kwargs: Any,
) -> Comparison:
    """Compare ``accumulate(step_fn, n, ...)`` with ``step_fn`` on the whole batch.

    The reference is ``step_fn(params, batch, *args)``; with ``reduction="count"`` it is divided
    by the whole batch's count, and with ``reduction="sum"`` it is the sum, as
    [`accumulate()`][gradaccum.accumulate] defines them.

    Args:
        step_fn: The gradient function, as given to [`accumulate()`][gradaccum.accumulate].
        params: The parameters pytree (first argument of ``step_fn``).
        batch: The whole batch (second argument).
        n: Micro-batches to split it into.
        *args: Further positional arguments of ``step_fn``.
        rtol: Relative tolerance: a leaf passes when ``max|acc - ref| <= atol + rtol * max|ref|``.
            Default: per leaf, from the less precise of the two gradients' dtypes: float64 1e-10,
            float32 1e-5, float16 5e-3, bfloat16 2e-2, other floats twice their epsilon. For
            float32 gradients computed in lower precision (``torch.autocast``) pass the compute
            dtype's, e.g. ``rtol=2e-2, atol=1e-3`` for bfloat16.
        atol: Absolute tolerance, for entries that sum terms that cancel. Default: per leaf,
            float64 1e-12, float32 1e-6, float16 1e-4, bfloat16 and other floating dtypes 1e-3.
        **accumulate_kwargs: Keywords for [`accumulate()`][gradaccum.accumulate] (``has_aux``,
            ``reduction``, ``count``...).

    Returns:
        A [`Comparison`][gradaccum.testing.Comparison]; ``str()`` of it names the worst leaf.

    Examples:
        >>> import torch, gradaccum.testing
        >>> from torch.func import grad
        >>> loss = lambda p, b: (b @ p).pow(2).mean()
        >>> p, b = torch.ones(3, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
        >>> gradaccum.testing.compare(grad(loss), p, b, n=4).ok
        True

        Tolerances follow the dtype: bfloat16 gradients are held to bfloat16's.

        >>> p16 = torch.ones(3, dtype=torch.bfloat16)
        >>> b16 = torch.linspace(-1, 1, 24, dtype=torch.bfloat16).reshape(8, 3)
        >>> worst = gradaccum.testing.compare(grad(loss), p16, b16, n=4).worst
        >>> worst.ok, worst.dtype, worst.rtol, worst.atol
        (True, torch.bfloat16, 0.02, 0.001)
    """
    has_aux = accumulate_kwargs.get("has_aux", False)
    acc_out = accumulate(step_fn, n, **accumulate_kwargs)(params, batch, *args)
    ref_out = step_fn(params, batch, *args)
    acc = acc_out[0] if has_aux else acc_out
    ref = ref_out[0] if has_aux else ref_out
    if accumulate_kwargs.get("reduction") == "count":
        total = accumulate_kwargs["count"](ref_out[1])
        ref = _tree.map_(lambda g: g / total, ref)
    paths, ref_leaves, _ = _tree.flatten_with_paths(ref)
    diffs = []
    for path, r, a in zip(paths, ref_leaves, _tree.flatten(acc)[0]):
        dtype = _coarsest(r.dtype, a.dtype)
        dr, da = r.detach(), a.detach().to(r.dtype)
        d_rtol, d_atol = _default_tolerances(dtype)
        tols = (d_rtol if rtol is None else rtol, d_atol if atol is None else atol)
        wide = torch.float64 if dr.device.type != "mps" else torch.float32
        err = (da.to(wide) - dr.to(wide)).abs().max().item() if dr.numel() else 0.0
        scale = dr.to(wide).abs().max().item() if dr.numel() else 0.0
        diffs.append(LeafDiff(path, dtype, err, scale, *tols))
    return Comparison(tuple(diffs), n)


def assert_equivalent(
    step_fn: Callable[..., Any],
    params: Any,
    batch: Any,
    n: int,
    *args: Any,
    rtol: float | None = None,
    atol: float | None = None,
    **accumulate_kwargs: Any,
) -> Comparison:
    """Like ``compare``, but raise ``AssertionError`` naming the worst leaf when they differ.

    See [`compare()`][gradaccum.testing.compare] for the arguments.

    Examples:
        >>> import torch, gradaccum.testing
        >>> from torch.func import grad
        >>> loss = lambda p, b: (b @ p).pow(2).mean()
        >>> p, b = torch.ones(3, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
        >>> _ = gradaccum.testing.assert_equivalent(grad(loss), p, b, n=3)
    """
    result = compare(step_fn, params, batch, n, *args, rtol=rtol, atol=atol, **accumulate_kwargs)
    if not result.ok:
        raise AssertionError(
            f"{result}. Common causes: BatchNorm (statistics per micro-batch), dropout, or a "
            f"loss normalised per micro-batch (use reduction='count'); see the Concepts page."
        )
    return result


def nonfinite(grads: Any) -> list[str]:
    """Key paths of the gradient leaves that hold a NaN or an infinity.

    This synchronises with the device once per leaf; call it for debugging, not every step.

    Examples:
        >>> import torch, gradaccum.testing
        >>> grads = {"a": torch.ones(2), "b": torch.tensor([1.0, float("nan")])}
        >>> gradaccum.testing.nonfinite(grads)
        ["['b']"]
    """
    paths, leaves, _ = _tree.flatten_with_paths(grads)
    bad = [isinstance(g, torch.Tensor) and not bool(torch.isfinite(g).all()) for g in leaves]
    return [p for p, b in zip(paths, bad) if b]


def assert_finite(grads: Any) -> None:
    """Raise ``AssertionError`` listing the key paths of non-finite gradient leaves, if any.

    Examples:
        >>> import torch, gradaccum.testing
        >>> gradaccum.testing.assert_finite({"w": torch.ones(3)})
    """
    bad = nonfinite(grads)
    if bad:
        raise AssertionError(
            f"assert_finite(grads): gradient leaves {bad} hold NaN or inf; look for a division "
            f"by a zero count, log(0), or an overflow in float16 (use loss scaling)."
        )
