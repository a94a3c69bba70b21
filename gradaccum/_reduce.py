"""Reductions: how micro-batch gradients and aux outputs combine into the window's result.

A micro-batch ``i`` contributes ``alpha_i * g_i`` to the running sum and ``w_i`` to the running
weight; at the boundary the sum is divided by the total weight (or not, for ``sum``):

============  =======================  ==========  =============================
reduction     step_fn returns          alpha_i     result
============  =======================  ==========  =============================
``mean``      grad of the mean loss    rows_i      sum(rows_i g_i) / sum(rows_i)
``sum``       grad of any loss         1           sum(g_i)
``count``     grad of a summed loss    1           sum(g_i) / sum(count_i)
============  =======================  ==========  =============================

Each row is the gradient over the whole batch, however it is split (docs/concepts.md, "Why the
result equals the whole batch"). ``AuxAccumulator`` combines the aux outputs leaf by leaf.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Number, Real
from typing import Any, Literal, cast

import torch

from . import _tree
from ._errors import describe

__all__ = ["AUX_REDUCTIONS", "REDUCTIONS", "AuxAccumulator", "Reduction", "check_reduction"]

Reduction = Literal["mean", "sum", "count"]
"""How gradients of the micro-batches combine: ``"mean"``, ``"sum"`` or ``"count"``."""

REDUCTIONS: tuple[str, ...] = ("mean", "sum", "count")
AUX_REDUCTIONS: tuple[str, ...] = ("mean", "sum", "count", "concat", "stack", "last")

Weight = int | float | torch.Tensor


def check_reduction(where: str, reduction: object) -> Reduction:
    """Validate the ``reduction`` keyword."""
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(
            f"{where}: reduction must be one of {', '.join(map(repr, REDUCTIONS))}, got "
            f"{describe(reduction)}; use 'mean' when step_fn returns the gradient of a mean loss, "
            f"'sum' to add gradients as they come, 'count' for a summed loss normalised by a "
            f"count that step_fn returns in its aux."
        )
    return cast(Reduction, reduction)


def check_count(
    where: str,
    count: object,
    *,
    name: str = "the count",
    covers: str = "the summed loss",
    verb: str = "return",
) -> Weight:
    """Validate one micro-batch's count (a number or a one-element real tensor), detached.

    A number must be finite and ``>= 0``; a tensor's value is not read (that would synchronise
    with the device once per micro-batch), so a negative or NaN tensor count passes. ``name``,
    ``covers`` and ``verb`` word the messages (``gradaccum.Mean`` checks its ``n`` here).

    Examples:
        >>> check_count("f(count)", 3)
        3
        >>> check_count("f(count)", float("nan"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: f(count): the count must be a finite number >= 0, got nan; return the ...
    """
    if isinstance(count, torch.Tensor):
        if count.numel() == 1 and not count.is_complex() and count.dtype != torch.bool:
            # Summed over a window in its own dtype, a narrow count would round (float16: 3 x
            # 1001 is 3004), saturate (45 x 1500 is inf) or wrap (uint8: 3 x 200 is 88): widen
            # it, on its device, to float64 or int64 (exact up to 2**53 and 2**63).
            wide = torch.float64 if count.dtype.is_floating_point else torch.int64
            return count.detach().reshape(()).to(wide)
    elif not isinstance(count, bool) and isinstance(count, Real):  # numpy scalars too
        count = int(count) if isinstance(count, Integral) else float(count)
        if isinstance(count, float) and not math.isfinite(count):
            raise ValueError(
                f"{where}: {name} must be a finite number >= 0, got {count!r}; {verb} the "
                f"number of items {covers} covers, e.g. (labels != pad_id).sum(), as a "
                f"finite number (a NaN count often comes from a mean or a division by 0 upstream)."
            )
        if count < 0:
            raise ValueError(
                f"{where}: {name} must be >= 0, got {count!r}; {verb} the number of items "
                f"{covers} covers."
            )
        return count
    raise TypeError(
        f"{where}: {name} must be a number or a one-element real tensor, got "
        f"{describe(count)}; {verb} the number of items {covers} covers, e.g. "
        f"(labels != pad_id).sum()."
    )


def check_aux_reduction(where: str, spec: Any) -> None:
    """Validate the names in ``aux_reduction`` (a name, or a tree of names) before any call."""
    if spec is None:
        return
    paths, names, _ = _tree.flatten_with_paths(spec)
    for path, name in zip(paths, names):
        if not isinstance(name, str) or name not in AUX_REDUCTIONS:
            what = "aux_reduction" if path == "<root>" else f"aux_reduction leaf {path}"
            raise ValueError(
                f"{where}: {what} must be one of {', '.join(map(repr, AUX_REDUCTIONS))}, got "
                f"{describe(name)}; pass one of those names, or a tree of them shaped like the aux."
            )


class AuxAccumulator:
    """Combine aux pytrees over micro-batches, leaf by leaf.

    ``spec``: one of ``AUX_REDUCTIONS``, a tree prefix of the aux of those names, or ``None``: the
    gradient ``reduction`` (under ``count``, the leaf ``count(aux)`` returns gets ``sum``).
    """

    __slots__ = (
        "_acc",
        "_count_total",
        "_default",
        "_kinds",
        "_paths",
        "_reduction",
        "_size_total",
        "_spec",
        "_treespec",
        "_where",
    )

    def __init__(self, where: str, spec: Any, reduction: Reduction) -> None:
        self._where = where
        self._default = spec is None
        self._spec = reduction if spec is None else spec
        self._reduction = reduction
        self._kinds: list[str] | None = None
        self._acc: list[Any] = []
        self._treespec: _tree.PyTreeSpec | None = None
        self._paths: list[str] = []
        self._size_total: Weight = 0
        self._count_total: Weight = 0

    def _start(self, aux: Any, raw_count: object) -> None:
        self._paths, leaves, self._treespec = _tree.flatten_with_paths(aux)
        try:
            kinds = _tree.broadcast_prefix(self._spec, aux)
        except ValueError:
            where = _tree.first_difference(self._spec, aux, prefix=True)
            raise ValueError(
                f"{self._where}: aux_reduction {self._spec!r} is not a prefix of the aux tree "
                f"{self._treespec}: {where}; pass one name for all leaves, or a tree shaped like "
                f"the aux (or a prefix of it) whose leaves are names."
            ) from None
        for path, kind in zip(self._paths, kinds):
            if not isinstance(kind, str) or kind not in AUX_REDUCTIONS:
                raise ValueError(
                    f"{self._where}: aux_reduction for aux leaf {path} must be one of "
                    f"{', '.join(map(repr, AUX_REDUCTIONS))}, got {describe(kind)}."
                )
            if kind == "count" and self._reduction != "count":
                raise ValueError(
                    f"{self._where}: aux_reduction 'count' for aux leaf {path} needs "
                    f"reduction='count' (there is no count to divide by); use 'mean' or 'sum'."
                )
        if self._default and self._reduction == "count":
            # The count itself would be divided by itself (1.0): report the total instead.
            kinds = ["sum" if leaf is raw_count else k for k, leaf in zip(kinds, leaves)]
        self._kinds = kinds

    def add(self, aux: Any, size: int, count: Weight | None, raw_count: object = None) -> None:
        """Fold one micro-batch's aux in; ``raw_count`` is ``count(aux)`` before validation."""
        if self._kinds is None:
            self._start(aux, raw_count)
        leaves, treespec = _tree.flatten(aux)
        if treespec != self._treespec:
            raise ValueError(
                f"{self._where}: step_fn returned an aux tree {treespec} on this micro-batch "
                f"but {self._treespec} on the first one; return the same aux structure for "
                f"every micro-batch."
            )
        kinds = self._kinds
        assert kinds is not None
        first = not self._acc
        for i, (kind, leaf) in enumerate(zip(kinds, leaves)):
            if isinstance(leaf, torch.Tensor):
                if leaf.requires_grad:  # (grad()'s aux comes detached: no call then)
                    leaf = leaf.detach()
            elif kind in ("mean", "sum", "count") and not isinstance(leaf, Number):
                raise TypeError(
                    f"{self._where}: aux leaf {self._paths[i]} is {describe(leaf)}, which "
                    f"aux_reduction {kind!r} cannot add; return a tensor or a number there, or "
                    f"use aux_reduction 'last' for that leaf."
                )
            value: Any = leaf * size if kind == "mean" else leaf
            if kind in ("concat", "stack"):
                value = self._joinable(i, kind, leaf, None if first else self._acc[i])
            if first:
                self._acc.append([value] if kind in ("concat", "stack") else value)
            elif kind in ("mean", "sum", "count"):
                self._acc[i] = self._acc[i] + value
            elif kind in ("concat", "stack"):
                self._acc[i].append(value)
            else:
                self._acc[i] = value
        self._size_total = self._size_total + size
        if count is not None:
            self._count_total = self._count_total + count

    def _joinable(
        self, i: int, kind: str, leaf: Any, earlier: list[torch.Tensor] | None
    ) -> torch.Tensor:
        """Aux leaf ``i`` as a tensor that ``kind`` can join to the ``earlier`` micro-batches'."""
        path = self._paths[i]
        try:
            value = leaf if isinstance(leaf, torch.Tensor) else torch.as_tensor(leaf)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"{self._where}: aux leaf {path} is {describe(leaf)}, which aux_reduction "
                f"{kind!r} cannot {kind} into a tensor; return a tensor or a number there, or "
                f"use aux_reduction 'last' for that leaf."
            ) from None
        if not earlier:
            return value
        ref, mb = earlier[0], len(earlier)
        rows_only = value.dim() == ref.dim() > 0 and value.shape[1:] == ref.shape[1:]
        if kind == "stack" or ref.dim() == 0:
            ok, need = value.shape == ref.shape, "the same shape on every micro-batch"
        else:
            ok, need = rows_only, "the same shape after dim 0 on every micro-batch"
        if not ok:
            other = "'concat' (they differ along dim 0 only) or 'last'" if rows_only else "'last'"
            raise ValueError(
                f"{self._where}: aux leaf {path} has shape {tuple(value.shape)} on micro-batch "
                f"{mb} but {tuple(ref.shape)} on micro-batch 0, and aux_reduction {kind!r} needs "
                f"{need}; return that leaf with one shape (e.g. pad it), or use aux_reduction "
                f"{other} for that leaf."
            )
        return value

    def result(self) -> Any:
        """The combined aux pytree."""
        assert self._treespec is not None
        assert self._kinds is not None
        out = []
        for kind, value in zip(self._kinds, self._acc):
            if kind == "mean":
                value = value / self._size_total
            elif kind == "count":
                value = value / self._count_total
            elif kind in ("concat", "stack"):
                join = torch.stack if kind == "stack" or value[0].dim() == 0 else torch.cat
                value = join(value)
            out.append(value)
        return _tree.unflatten(self._treespec, out)


def first_add(
    grads: list[torch.Tensor],
    dtypes: Sequence[torch.dtype],
    alpha: float,
    out: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """``alpha * grads`` in ``dtypes``, into ``out`` (uninitialised) or new tensors; no_grad."""
    if out is None:
        sums = [g.to(d, copy=True) for g, d in zip(grads, dtypes)]
    else:
        sums = out
        torch._foreach_copy_(sums, grads)
    if alpha != 1:
        torch._foreach_mul_(sums, alpha)
    return sums


def add_into(sums: list[torch.Tensor], grads: list[torch.Tensor], alpha: float) -> None:
    """``sums += alpha * grads`` in place, one fused call; call under no_grad."""
    torch._foreach_add_(sums, grads, alpha=alpha)


def normalise(reduction: Reduction, sums: list[torch.Tensor], weight: Weight) -> None:
    """Divide by the total weight in place (``mean``, ``count``); ``sum`` is left as it is."""
    if reduction != "sum" and not (isinstance(weight, (int, float)) and weight == 1):
        torch._foreach_div_(sums, weight)
