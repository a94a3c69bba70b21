"""What a loss returns says what it is: ``Mean(loss, n)`` or ``Sum(loss, n)`` over ``n`` items.

A ``loop.Step`` loss that covers items other than its micro-batch's rows (tokens, say) returns
one of these instead of a bare tensor. The objective is the same for both kinds: the sum over
the items of the per-item loss divided by the number of items, over the whole window and all
ranks. ``Mean(loss, n)`` adds ``n * loss`` to the window's loss sum and ``n`` to its items;
``Sum(loss, n)`` adds ``loss`` and ``n``. So the two may be mixed across micro-batches (and
ranks). A plain tuple ``(loss, k)`` says neither (is ``loss`` a mean over the ``k`` items, or
their sum?), and ``Step`` refuses it.

``n`` is checked as ``reduction="count"`` checks a count (``_reduce.check_count``): a finite
number ``>= 0``, or a one-element real tensor whose value is not read (no device sync).

They are frozen dataclasses, not tuples: a user's ``(loss, k)`` cannot pass for one, optree
treats them as leaves (nothing flattens them into their parts by accident), and ``torch.compile``
traces their construction inside a compiled loss.
"""

from __future__ import annotations

import dataclasses

import torch

from . import _reduce
from ._errors import describe

__all__ = ["Mean", "Sum"]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Items:
    """A 0-dim loss over ``n`` items (the base of ``Mean`` and ``Sum``)."""

    loss: torch.Tensor
    n: int | float | torch.Tensor

    def __post_init__(self) -> None:
        kind = "Mean" if isinstance(self, Mean) else "Sum"  # a subclass is still its kind
        where = f"gradaccum.{kind}(loss, n)"
        if not isinstance(self.loss, torch.Tensor) or self.loss.dim() != 0:
            fix = (
                "reduce it over the items first (loss.mean())"
                if kind == "Mean"
                else ("reduce it over the items first (loss.sum())")
            )
            raise TypeError(
                f"{where}: loss must be a 0-dim tensor, the {kind.lower()} over the n items, got "
                f"{describe(self.loss)}; {fix}."
            )
        covers = "the mean" if kind == "Mean" else "the sum"
        n = _reduce.check_count(where, self.n, name="n", covers=covers, verb="pass")
        object.__setattr__(self, "n", n)


class Mean(_Items):
    """A micro-batch's loss that is the mean over ``n`` items (rows, tokens): return it from a loss.

    The window's objective is the mean over all its items, over every micro-batch and rank:
    ``Mean(loss, n)`` weighs ``loss`` by ``n``, as if its ``n`` per-item losses were summed
    into the window and divided by the window's items. It may be mixed with
    [`Sum`][gradaccum.Sum] across micro-batches: the objective is the same.

    A bare 0-dim tensor returned by a [`loop.Step`][gradaccum.loop.Step] loss is a mean over
    the micro-batch's rows. A token-mean loss (``F.cross_entropy(..., ignore_index=-100)``)
    returned bare is then weighted by rows, not tokens; say what it is:
    ``gradaccum.Mean(loss, (labels != -100).sum())``.

    Args:
        loss: A 0-dim tensor: the mean of the per-item losses.
        n: The number of items the mean covers: a finite number ``>= 0``, or a one-element real
            tensor (e.g. ``(labels != -100).sum()``), whose value is never read on the host (no
            device sync; a negative or NaN tensor is not caught).

    Raises:
        TypeError: ``loss`` is not a 0-dim tensor, or ``n`` is neither a number nor a
            one-element real tensor.
        ValueError: ``n`` is a number that is negative, NaN or infinite.

    Examples:
        >>> import torch, gradaccum
        >>> from gradaccum.loop import Step
        >>> model = torch.nn.Linear(3, 5).double()
        >>> def token_loss(model, batch):  # the mean over the tokens that are not padding
        ...     x, labels = batch
        ...     logits, flat = model(x).flatten(0, 1), labels.flatten()
        ...     loss = torch.nn.functional.cross_entropy(logits, flat, ignore_index=-100)
        ...     return gradaccum.Mean(loss, (labels != -100).sum())
        >>> step = Step(model, token_loss, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> x = torch.randn(2, 4, 3, dtype=torch.float64)
        >>> step.add((x[:1], torch.tensor([[1, 2, 3, 4]])))  # 4 tokens
        >>> step.add((x[1:], torch.tensor([[0, -100, -100, -100]])))  # 1 token
        >>> step.apply().items
        5.0
        >>> gradaccum.Mean(torch.tensor(2.0), 3)
        Mean(loss=tensor(2.), n=3)

    See Also:
        [`Sum`][gradaccum.Sum]: a loss summed over its items.
    """

    __slots__ = ()


class Sum(_Items):
    """A micro-batch's loss that is the sum over ``n`` items (rows, tokens): return it from a loss.

    The window's objective is the mean over all its items, over every micro-batch and rank:
    the summed losses divided by the window's items. ``Sum(loss, n)`` adds ``loss`` to the
    window's loss sum and ``n`` to its items. It may be mixed with [`Mean`][gradaccum.Mean]
    across micro-batches: the objective is the same. Under ``Step(..., reduction="sum")``
    nothing is divided, and ``n`` only counts ``StepStats.items``.

    Args:
        loss: A 0-dim tensor: the sum of the per-item losses (e.g.
            ``F.cross_entropy(..., ignore_index=-100, reduction="sum")``).
        n: The number of items the sum covers: a finite number ``>= 0``, or a one-element real
            tensor (e.g. ``(labels != -100).sum()``), whose value is never read on the host (no
            device sync; a negative or NaN tensor is not caught).

    Raises:
        TypeError: ``loss`` is not a 0-dim tensor, or ``n`` is neither a number nor a
            one-element real tensor.
        ValueError: ``n`` is a number that is negative, NaN or infinite.

    Examples:
        >>> import torch, gradaccum
        >>> from gradaccum.loop import Step
        >>> model = torch.nn.Linear(3, 5).double()
        >>> def token_loss(model, batch):  # summed over the tokens that are not padding
        ...     x, labels = batch
        ...     logits, flat = model(x).flatten(0, 1), labels.flatten()
        ...     loss = torch.nn.functional.cross_entropy(
        ...         logits, flat, ignore_index=-100, reduction="sum"
        ...     )
        ...     return gradaccum.Sum(loss, (labels != -100).sum())
        >>> step = Step(model, token_loss, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> x = torch.randn(2, 4, 3, dtype=torch.float64)
        >>> step.add((x, torch.tensor([[1, 2, 3, 4], [0, -100, -100, -100]])))
        >>> step.apply().items  # the loss reported is the mean over these 5 tokens
        5.0

    See Also:
        [`Mean`][gradaccum.Mean]: a loss that is the mean over its items.
    """

    __slots__ = ()
