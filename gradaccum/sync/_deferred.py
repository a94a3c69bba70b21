"""The public side of a deferred boundary: what a sync made with ``defer=True`` offers its user.

A mixin for the syncs whose windows defer their checks (``_dist/deferred.py`` holds the state
and the mechanism): [`guard()`][gradaccum.sync.AllReduce.guard] hands the window flag to a fused
optimizer, [`found_inf()`][gradaccum.sync.AllReduce.found_inf] returns it, and
[`verify()`][gradaccum.sync.AllReduce.verify] reads the last window's checks. The sync supplies
``defer`` and ``_deferred`` (a `Deferred`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .._dist.deferred import Deferred
from .._errors import describe

__all__ = ["Deferring"]


class Deferring:
    """``guard``, ``found_inf`` and ``verify`` for a sync with ``defer`` and ``_deferred``."""

    defer: bool
    _deferred: Deferred

    def guard(self, optimizer: Any) -> None:
        """Have ``optimizer`` skip, on the device, every window this sync finds bad.

        With ``defer=True`` the boundary's checks (a rank failed, the ranks disagree, a mean with
        nothing to divide by) are not read on the host: they set a flag on the device,
        ``1.0`` for a window that must not be applied, the same on every rank. ``guard`` sets
        it as the optimizer's ``found_inf``, which torch's fused optimizers honour as they do
        ``GradScaler``'s: their ``step()`` then leaves the parameters, the moments and the
        step count as they were. Call it once; the flag is updated in place at every boundary.

        Args:
            optimizer: A torch optimizer whose ``step()`` honours ``found_inf``: ``Adam``,
                ``AdamW``, ``SGD`` or ``Adagrad`` built with ``fused=True``, its parameters on
                one device.

        Raises:
            ValueError: The sync was made without ``defer=True``; the optimizer cannot skip on
                the device (not fused), its parameters lie on several devices, or it has a
                ``found_inf`` of another sync or of a loss scaler already.
            TypeError: ``optimizer`` is not an optimizer.

        Examples:
            >>> import torch, gradaccum
            >>> w = torch.nn.Parameter(torch.zeros(3))
            >>> opt = torch.optim.AdamW([w], fused=True)
            >>> sync = gradaccum.all_reduce(defer=True)
            >>> sync.guard(opt)
            >>> opt.found_inf
            tensor(0.)
        """
        where = f"{type(self).__name__}.guard(optimizer)"
        if not self.defer:
            raise ValueError(
                f"{where}: this sync reads each boundary on the host and raises there (defer="
                f"False), so it has no flag to hand over; build it with "
                f"gradaccum.all_reduce(..., defer=True) to skip bad windows on the device."
            )
        self._deferred.guard(where, optimizer)

    def found_inf(self, device: Any = None) -> torch.Tensor:
        """The window flag on ``device``: by default the last window's gradients' device.

        A 0-dim float32 tensor, ``1.0`` after a window that must not be applied and ``0.0``
        otherwise, updated in place at every boundary (``defer=True``), the same on every rank:
        use it for an optimizer of your own, e.g. ``torch.where(flag > 0, old, new)``.
        [`guard()`][gradaccum.sync.AllReduce.guard] hands it to a fused torch optimizer. The
        flag of the gradients' device is set at the boundary, and copied to the other CUDA
        devices' flags that exist; a CPU flag is not kept while the gradients are on CUDA (the
        copy would wait for the device). Before the first window the default is the current
        CUDA device, else the CPU.

        Raises:
            ValueError: The sync was made without ``defer=True``; ``device`` is not a device
                this process has, or is ``"meta"``.
            TypeError: ``device`` is neither ``None``, a ``str``, an ``int`` nor a
                ``torch.device``.

        Examples:
            >>> import gradaccum
            >>> gradaccum.all_reduce(defer=True).found_inf("cpu")
            tensor(0.)
        """
        where = f"{type(self).__name__}.found_inf(device)"
        if not self.defer:
            raise ValueError(
                f"{where}: this sync reads each boundary on the host and raises there (defer="
                f"False), so it keeps no flag; build the sync with defer=True for one."
            )
        if device is None:
            last = self._deferred.last
            device = last if last is not None else "cuda" if torch.cuda.is_available() else "cpu"
        if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
            raise TypeError(
                f"{where}: device must be None, a str, an int or a torch.device, got "
                f"{describe(device)}; pass e.g. found_inf('cuda:0'), or leave it out for the "
                f"gradients' device."
            )
        try:
            made = torch.device(device)
            if made.type == "cuda" and not torch.cuda.is_available():
                raise RuntimeError("CUDA is not available")
        except RuntimeError as err:
            raise ValueError(
                f"{where}: device={device!r} is not a device of this process ({err}); pass the "
                f"device the gradients are on, or leave it out."
            ) from err
        try:
            return self._deferred.flag(made)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err

    def verify(self) -> None:
        """Read the last window's deferred checks on the host; raise if it was bad.

        With ``defer=True`` each window's checks are read by the next window, before its first
        collective. The last window of a run has no next one: call ``verify()`` after it (and
        before saving a checkpoint), on every rank; it raises as the next window would have.
        Nothing to read (``defer=False``, or read already): it returns at once.

        Raises:
            GradAccumError: A rank failed in the last window, or the ranks' fingerprints
                differ.
            ValueError: The last window was a mean with nothing to divide by.

        Examples:
            >>> import gradaccum
            >>> gradaccum.all_reduce(defer=True).verify()  # no window yet: nothing to read
        """
        self._deferred.settle(f"{type(self).__name__}.verify()")

    def _fail_if(self, bad: torch.Tensor, message: str) -> None:
        """Fail the window just closed where ``bad`` (0-dim bool) holds: a caller's own check.

        It joins the window's flag on the device, and the next window raises
        ``GradAccumError`` with ``message`` on every rank (``loop.Step``'s saves check).
        """
        self._deferred.also(bad, message)

    def _settle(self, where: str) -> None:
        """``verify()``, its errors named after ``where`` (the caller's call)."""
        self._deferred.settle(where)

    def _pending(self) -> Any:
        """The last window's status, not read yet (``None``: nothing pending)."""
        return self._deferred.pending

    def _on_bad(self, callback: Any) -> None:
        """Call ``callback(pending)`` (a bound method, held weakly) for each bad window read."""
        self._deferred.on_bad.append(weakref.WeakMethod(callback))
