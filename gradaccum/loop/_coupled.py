"""Losses over a whole window in the loop: ``Coupled`` and ``WindowStats``.

A loss that ties a window's examples together (in-batch negatives, or statistics of the whole
window) needs the whole window at once, where [`Step.add()`][gradaccum.loop.Step.add] takes one
micro-batch. Given one of these as its loss, the step takes the window whole
([`Step.add_window()`][gradaccum.loop.Step.add_window]); ``loop/_feed.py`` runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._checks import check_bool
from .._coupled._exchange import Rows
from .._coupled._replay import check_generators
from .._errors import describe

__all__ = ["Coupled", "WindowStats"]


class Coupled:
    """A loss that couples a window's examples, for [`loop.Step`][gradaccum.loop.Step].

    Pass it as the step's ``loss``; the step then takes whole windows
    ([`Step.add_window(window)`][gradaccum.loop.Step.add_window]) and computes the gradient of
    the loss over the global window exactly, as [`coupled()`][gradaccum.coupled] does for
    functional params: every micro-batch embedded without a graph, every rank's
    representations gathered, the loss once, then each micro-batch again with its slice of the
    loss's gradient (dropout masks replayed, BatchNorm statistics kept from the first pass).
    The second pass is checked against the first: representations that differ beyond rounding
    (randomness that was not replayed) raise [`GradAccumError`][gradaccum.GradAccumError] in
    ``add_window``, on every rank, and the window is dropped whole.

    Args:
        embed: ``embed(model, micro_batch) -> reps``: a pytree of tensors, dim 0 the
            micro-batch's rows (floating leaves are differentiated; others, such as labels, are
            passed to ``loss`` as they are).
        loss: ``loss(model, reps, rows) -> share``: ``reps`` holds every rank's rows (rank
            order), ``rows`` ([`Rows`][gradaccum.Rows]) says which are this rank's; it returns
            this rank's share of the objective (the shares are summed over the ranks). It may
            use the model's parameters directly (a learned temperature).
        generators: Explicit random generators ``embed`` draws from, as for
            [`coupled()`][gradaccum.coupled] (torch's, Python's and NumPy's global ones are
            replayed without mention).
        check_replay: As for [`coupled()`][gradaccum.coupled]: ``False`` skips the check.

    Raises:
        TypeError: ``embed`` or ``loss`` is not callable; ``generators`` holds something other
            than a random generator; ``check_replay`` is not a bool.

    Examples:
        >>> import torch, gradaccum
        >>> from gradaccum.loop import Coupled, Step
        >>> model = torch.nn.Linear(4, 3).double()
        >>> def embed(model, x):
        ...     return torch.nn.functional.normalize(model(x), dim=-1)
        >>> def info_nce(model, z, rows):  # rows 2i and 2i+1 are a positive pair
        ...     sim = z[rows.local] @ z.T / 0.1
        ...     sim = sim - 1e9 * torch.eye(len(z), dtype=z.dtype)[rows.local]
        ...     nll = torch.nn.functional.cross_entropy(sim, rows.arange() ^ 1, reduction="sum")
        ...     return nll / rows.total
        >>> step = Step(model, Coupled(embed, info_nce), torch.optim.SGD(model.parameters(), 0.1))
        >>> x = torch.randn(8, 4, dtype=torch.float64)
        >>> step.add_window([x[:3], x[3:6], x[6:]])  # a window of 3 micro-batches
        >>> stats = step.apply()
        >>> stats.micro_batches, stats.items
        (3, 8.0)
    """

    def __init__(
        self,
        embed: Callable[[torch.nn.Module, Any], Any],
        loss: Callable[[torch.nn.Module, Any, Rows], torch.Tensor],
        *,
        generators: Sequence[Any] = (),
        check_replay: bool = True,
    ) -> None:
        for arg, fn, shape in (
            ("embed", embed, "embed(model, micro_batch) -> reps"),
            ("loss", loss, "loss(model, reps, rows) -> share"),
        ):
            if not callable(fn):
                raise TypeError(
                    f"Coupled(embed, loss): {arg} must be a function {shape}, got {describe(fn)}."
                )
        self.embed = embed
        self.loss = loss
        self.generators = check_generators("Coupled(embed, loss)", generators)
        check_bool("Coupled(embed, loss)", "check_replay", check_replay)
        self.check_replay = check_replay

    def __repr__(self) -> str:
        name = getattr(self.loss, "__name__", type(self.loss).__name__)
        return f"Coupled({getattr(self.embed, '__name__', 'embed')}, {name})"


class WindowStats:
    """A loss that uses statistics of the whole window, for [`loop.Step`][gradaccum.loop.Step].

    Pass it as the step's ``loss``; the step then takes whole windows
    ([`Step.add_window(window)`][gradaccum.loop.Step.add_window]), as
    [`window_stats()`][gradaccum.window_stats] does for functional params: ``stats`` runs on
    every micro-batch without a graph, the results are summed over the window and the ranks,
    then each micro-batch's ``loss`` is added with those sums as constants (pass 1's random
    numbers replayed, BatchNorm statistics kept from the first pass). An MoE load-balancing
    loss (each expert's share of the window's tokens times its mean router probability) is
    then exact.

    Args:
        stats: ``stats(model, micro_batch) -> tree``: a pytree of tensors (counts, sums) of the
            same shapes for every micro-batch and rank, summed in float64 and given back in
            their floating dtypes, or as int64 for integer and bool ones (``torch.sum``'s dtype:
            a uint8 count does not wrap; counts are exact up to 2**53).
        loss: ``loss(model, micro_batch, window)``: the micro-batch's loss, as for a plain
            ``Step`` under its ``reduction`` (a 0-dim tensor: a mean over the micro-batch's
            rows; or [`gradaccum.Mean`][gradaccum.Mean] / [`gradaccum.Sum`][gradaccum.Sum] over
            its items), with ``window`` the sums.
        generators: Explicit random generators ``stats`` and ``loss`` draw from, replayed in
            the second pass, as for [`window_stats()`][gradaccum.window_stats] (randomness from
            elsewhere is neither replayed nor detected there).

    Raises:
        TypeError: ``stats`` or ``loss`` is not callable; ``generators`` holds something other
            than a random generator.

    Examples:
        >>> import torch, gradaccum
        >>> from gradaccum.loop import Step, WindowStats
        >>> model = torch.nn.Linear(3, 1).double()
        >>> def positives(model, x):  # rows of the window with a positive first feature
        ...     return (x[:, 0] > 0).sum()
        >>> def loss(model, x, count):
        ...     return model(x).pow(2).mean() / count
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> step = Step(model, WindowStats(positives, loss), opt)
        >>> x = torch.tensor([[1.0, 0, 0], [-1.0, 0, 0], [2.0, 1, 0]], dtype=torch.float64)
        >>> step.add_window([x[:2], x[2:]])
        >>> step.apply().micro_batches
        2
    """

    def __init__(
        self,
        stats: Callable[[torch.nn.Module, Any], Any],
        loss: Callable[[torch.nn.Module, Any, Any], Any],
        *,
        generators: Sequence[Any] = (),
    ) -> None:
        for arg, fn, shape in (
            ("stats", stats, "stats(model, micro_batch) -> tree"),
            ("loss", loss, "loss(model, micro_batch, window) -> loss"),
        ):
            if not callable(fn):
                raise TypeError(
                    f"WindowStats(stats, loss): {arg} must be a function {shape}, got "
                    f"{describe(fn)}."
                )
        self.stats = stats
        self.loss = loss
        self.generators = check_generators("WindowStats(stats, loss)", generators)

    def __repr__(self) -> str:
        name = getattr(self.loss, "__name__", type(self.loss).__name__)
        return f"WindowStats({getattr(self.stats, '__name__', 'stats')}, {name})"
