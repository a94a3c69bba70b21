"""``gradaccum.loop.progress``: a tqdm bar of the windows, on rank 0, fed with ``StepStats``."""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from .._errors import describe
from ._boundary import StepStats

__all__ = ["Progress", "progress"]


class Progress:
    """A progress bar of the windows (optimizer steps): see [`progress()`][gradaccum.loop.progress].

    It keeps what it was given, on every rank (the bar shows on rank 0 only; the stats are
    global, so the same on every rank): the loss curve of the run, for a plot or a log.

    Attributes:
        bar: The ``tqdm`` bar.
        history: The [`StepStats`][gradaccum.loop.StepStats] of every window given to
            [`update()`][gradaccum.loop.Progress.update], in order (a resumed run's from the
            window it resumed at).
        last: The last of them, or ``None`` before the first.

    Examples:
        >>> from gradaccum.loop import Progress, StepStats
        >>> with Progress(total=2, disable=True) as bar:
        ...     bar.update(StepStats(0, 2.5, 100.0, 4, 0.5, 1e-3, 0.1))
        ...     bar.update(StepStats(1, 2.25, 100.0, 4, 0.5, 1e-3, 0.1))
        >>> bar.last.loss
        2.25
        >>> [stats.loss for stats in bar.history]  # the loss curve
        [2.5, 2.25]
    """

    def __init__(self, total: int | None = None, initial: int = 0, **tqdm_kwargs: Any) -> None:
        try:
            from tqdm.auto import tqdm  # type: ignore[import-untyped]
        except ImportError as err:  # pragma: no cover - tqdm is in the test and examples extras
            raise ImportError(
                "gradaccum.loop.progress needs tqdm; pip install tqdm (or gradaccum[examples])."
            ) from err
        options = {"unit": "step", "dynamic_ncols": True, **tqdm_kwargs}
        self.bar = tqdm(total=total, initial=initial, **options)
        self.history: list[StepStats] = []
        self.last: StepStats | None = None
        self._held: StepStats | None = None  # deferred stats, shown one window late

    def update(self, stats: StepStats) -> None:
        """Advance by one window; show its global loss, gradient norm, LR and items per second.

        The stats are appended to ``history`` (and are ``last``) on every rank. Stats of a
        deferred boundary (0-dim tensors on the device) are shown one window late, when the
        device is done with them, so that the bar reads nothing of the window in progress;
        ``close()`` shows the last window's.
        """
        if not isinstance(stats, StepStats):
            raise TypeError(
                f"Progress.update(stats): stats must be what Step.apply() returned, got "
                f"{describe(stats)}."
            )
        self.history.append(stats)
        self.last = stats
        if isinstance(stats.loss, torch.Tensor):  # a deferred boundary: read nothing of it now
            shown, self._held = self._held, stats
            if shown is None:
                self.bar.update(1)
                return
            stats = shown  # the window before: done on the device by now
        self._show(stats)
        self.bar.update(1)

    def _show(self, stats: StepStats) -> None:
        self.bar.set_postfix(
            loss=f"{float(stats.loss):.4f}",
            norm=f"{float(stats.grad_norm):.3g}",
            lr=f"{float(stats.lr):.3g}",
            items_per_s=f"{float(stats.items_per_s):.4g}",
            refresh=False,
        )

    def close(self) -> None:
        """Close the bar (showing the last window's stats, if held back)."""
        held, self._held = self._held, None
        if held is not None:
            self._show(held)
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def progress(data: Any = None, **tqdm_kwargs: Any) -> Progress:
    """A tqdm bar of the windows of ``data``, shown on rank 0 only, fed by ``Step.apply()``.

    Its total is ``len(data)`` (every rank agrees on it: call this on every rank), none for
    data without ``len()``; a resumed run starts at the windows already done.
    ``bar.update(stats)`` advances it by one window and shows the window's global loss,
    gradient norm, learning rate and items (tokens under ``reduction="count"``) per second;
    ``bar.history`` keeps the stats of every window (the loss curve), on every rank.

    Args:
        data: The [`Windows`][gradaccum.loop.Windows] of the loop (or an int: the total).
        **tqdm_kwargs: Passed to ``tqdm`` (``disable=``, ``desc=``, ``file=``...).

    Returns:
        A [`Progress`][gradaccum.loop.Progress]; close it at the end (or use ``with``).

    Raises:
        ImportError: tqdm is not installed.

    Examples:
        >>> import torch, gradaccum
        >>> data = gradaccum.loop.windows(range(6), 4)
        >>> bar = gradaccum.loop.progress(data, disable=True)
        >>> bar.bar.total
        2
        >>> bar.close()
    """
    total: int | None = None
    initial = 0
    if isinstance(data, int) and not isinstance(data, bool):
        total = data
    elif data is not None:
        try:
            total = len(data)
        except TypeError:
            total = None
        initial = getattr(data, "window", 0)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        tqdm_kwargs["disable"] = True
    return Progress(total, initial, **tqdm_kwargs)
