"""What a ``loop.Step`` loss returns, read into the window's weight, loss sum and backward seed.

A bare 0-dim tensor is a mean over the micro-batch's rows (the size of dim 0 shared by its
tensors); [`gradaccum.Mean(loss, n)`][gradaccum.Mean] a mean over ``n`` items,
[`gradaccum.Sum(loss, n)`][gradaccum.Sum] a sum over ``n`` items. The step's accumulator is
``"count"`` under both ``"mean"`` and ``"count"``: the window's weight is its items, and each
micro-batch's backward is seeded with its scale (its items, for a mean; 1 for a sum).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _tree
from .._errors import describe
from .._kinds import Mean, Sum

__all__ = ["one", "scaled", "split"]


def _rows(where: str, batch: Any, reduction: str) -> int:
    """A micro-batch's rows: the size of dim 0 shared by every tensor leaf with a dim."""
    leaves = [x for x in _tree.flatten(batch)[0] if isinstance(x, torch.Tensor) and x.dim() > 0]
    rule = f"under reduction={reduction!r} a micro-batch " + (
        "weighs its rows" if reduction == "mean" else "counts its rows (StepStats.items)"
    )
    kind = "Mean" if reduction == "mean" else "Sum"
    fix = (
        f"return gradaccum.{kind}(loss, rows) from the loss function, rows the number of "
        f"examples it covers (e.g. gradaccum.{kind}(loss, len(batch['input_ids'])))"
    )
    if not leaves:
        raise ValueError(
            f"{where}: {rule}, the size of dim 0 of its tensors, but this one has no tensor "
            f"with a dim; {fix}."
        )
    rows = leaves[0].shape[0]
    if all(x.shape[0] == rows for x in leaves):
        return int(rows)
    paths, values, _ = _tree.flatten_with_paths(batch)
    sized = [
        (k, x.shape[0])
        for k, x in zip(paths, values)
        if isinstance(x, torch.Tensor) and x.dim() > 0
    ]
    (pa, ra), (pb, rb) = sized[0], next(kr for kr in sized if kr[1] != rows)
    raise ValueError(
        f"{where}: {rule}, the size of dim 0 shared by its tensors, but they disagree: "
        f"batch{pa} has {ra} along dim 0 and batch{pb} has {rb}, so the rows are not known; "
        f"{fix}."
    )


def one(x: Any) -> bool:
    """Whether ``x`` is the number 1 (a scale that changes nothing)."""
    return isinstance(x, (int, float)) and x == 1


def scaled(loss: torch.Tensor, n: Any) -> torch.Tensor:
    """``loss * n`` for the window's loss sum: 0 where ``n`` is 0 (a mean over no items is NaN).

    A micro-batch with no items (all padding) contributes nothing to the objective; its mean,
    ``F.cross_entropy`` over no tokens, is NaN, and NaN * 0 would make the window's loss NaN.
    A tensor ``n`` is not read on the host: ``torch.where`` picks on the device.
    """
    if isinstance(n, torch.Tensor):
        return torch.where(n == 0, torch.zeros((), dtype=loss.dtype, device=loss.device), loss * n)
    return loss * n if n != 0 else torch.zeros_like(loss)


def split(where: str, out: Any, batch: Any, reduction: str) -> tuple[torch.Tensor, Any, Any]:
    """What the loss returned: ``(loss, scale, items)``, checked.

    The backward of ``loss * scale`` goes into the window's sums, ``items`` into its weight
    and ``loss * scale`` into its loss sum: a bare loss (a mean over the rows) and a ``Mean``
    are scaled by their items, a ``Sum`` is not (nor anything under ``"sum"``).
    """
    red = reduction
    if isinstance(out, (Mean, Sum)):
        if red != "mean" and isinstance(out, Mean):
            fix = (
                "return gradaccum.Sum(loss * n, n) (the sum over the n items), or drop "
                "reduction='count' (a Mean is then weighted by its n)"
                if red == "count"
                else "return the summed loss, gradaccum.Sum(loss * n, n), or drop "
                "reduction='sum' to take the mean over the window's items"
            )
            raise TypeError(
                f"{where}: the loss function returned gradaccum.Mean(loss, n), but under "
                f"reduction={red!r} every micro-batch returns a sum over its items; {fix}."
            )
        value, scale, items = out.loss, (out.n if isinstance(out, Mean) else 1), out.n
    elif isinstance(out, (tuple, list)):
        got = ", ".join("tensor" if isinstance(x, torch.Tensor) else type(x).__name__ for x in out)
        raise TypeError(
            f"{where}: the loss function returned a {len(out)}-{type(out).__name__} "
            f"({got}), which does not say what the loss is: (loss, rows) and (summed_loss, "
            f"count) look the same; return gradaccum.Mean(loss, n) for a mean over n items "
            f"(rows or tokens), or gradaccum.Sum(loss_sum, n) for a sum over n items."
        )
    elif red == "count":
        raise TypeError(
            f"{where}: under reduction='count' the loss function returns "
            f"gradaccum.Sum(summed_loss, count), got {describe(out)}; return e.g. "
            f"gradaccum.Sum(loss_sum, (labels != -100).sum()), or drop reduction='count' "
            f"for a mean over the micro-batch's rows."
        )
    else:
        value = out
        items = _rows(where, batch, red)
        scale = items if red == "mean" else 1
    if red == "sum":
        scale = 1
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        raise TypeError(
            f"{where}: the loss must be a 0-dim tensor, got {describe(value)}; reduce it "
            f"(loss.mean() or .sum())."
        )
    if not value.requires_grad:
        raise ValueError(
            f"{where}: the loss does not depend on the model's trainable parameters (it "
            f"does not require grad); compute it from model(...), outside torch.no_grad()."
        )
    return value, scale, items
