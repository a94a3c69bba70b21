"""A deferred boundary (``defer=True``) as a sync and its window use it: two mixins.

``_dist/deferred.py`` holds the state and the mechanism. ``Deferring``, the sync's public side:
[`guard()`][gradaccum.sync.AllReduce.guard] hands the window flag to a fused optimizer,
[`found_inf()`][gradaccum.sync.AllReduce.found_inf] returns it, and
[`verify()`][gradaccum.sync.AllReduce.verify] reads the last window's checks (the sync supplies
``defer`` and ``_deferred``, a `Deferred`). ``DeferredWindow``, the window's side: the layout
the ranks agree on, the agreed buckets faked by a rank whose layout changed, the boundary
decided on the device.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .._dist.buckets import TAIL
from .._dist.comm import FINGERPRINT, Probe, first_diff
from .._dist.deferred import Agreed, Deferred
from .._errors import GradAccumError, describe

__all__ = ["DeferredWindow", "Deferring"]


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


class DeferredWindow:
    """The window side of ``all_reduce(defer=True)``, mixed into its ``BucketWindow``.

    What the window records of the layout the ranks agree on, fakes when its own changed and
    the others disagree, and decides on the device at its boundary. It uses the window's
    ``sync``, ``comm``, ``spec``, ``where``, ``key``, ``named``, ``extra``, ``order``,
    ``tail_k``, ``held``, ``joined``, ``totals``, ``reorder`` and ``_agree_order``.
    """

    sync: Any
    comm: Any
    spec: Any
    where: str
    key: tuple[str, ...]
    named: Any
    extra: int
    order: list[int]
    tail_k: int
    held: Probe | None
    joined: bool
    totals: Any
    reorder: bool

    def _agree_order(self) -> None: ...

    def _agreed(self) -> Agreed:
        """What this window sends, in launch order: the layout the ranks now agree on."""
        named, extra = self.named, self.extra
        sizes = tuple((b.numel + extra * b.tail, b.dtype, b.device) for b in named)
        order = tuple(sizes[k] for k in self.order)
        tail = self.order.index(self.tail_k)
        return Agreed(self.key, order, (tail, order[tail][0] - TAIL - extra + 1))

    def _refuse(self) -> None:
        """Deferred: this rank's layout changed and the others disagree; fake the agreed one.

        The others may be steady (they send the agreed buckets without reading): this rank
        sends buckets of the agreed sizes, zeros with its failure flag set, so that every
        collective matches, and raises. The others raise at their next window.
        """
        deferred, comm = self.sync._deferred, self.comm
        agreed = deferred.agreed
        assert agreed is not None
        self.joined = True
        deferred.fake(comm, "the boundary all_reduce (of the agreed buckets, zeros)")
        device = agreed.sizes[agreed.flag_at[0]][2]
        flag = torch.ones(TAIL, dtype=torch.float64, device=device)
        deferred.record(self.where, str(self.spec.index), comm, flag, None, "sum", True)
        mine, theirs = first_diff(self.key, agreed.key)
        raise GradAccumError(
            f"{self.where}: this rank's gradients changed from those the ranks last agreed on "
            f"(it has {mine} where the agreed layout has {theirs}), and the other ranks' "
            f"fingerprints differ from this rank's. Under defer=True the others do not read the "
            f"fingerprint before sending, so this rank sent buckets of the agreed sizes, zeros "
            f"with its failure flag, and raises; the others raise at their next window. Every "
            f"rank must pass params of the same tree and options in each window."
        )

    def _decide(self, tail: torch.Tensor, failed: bool) -> torch.Tensor:
        """Deferred: the window's checks into the device's flag, no host read; the divisor.

        The fingerprint's result (sent, not read) joins the flag; the bucket order of a first
        window is agreed on every rank, a failed one too, since the others do not know yet.
        """
        probe, self.held = self.held, None
        if probe is not None:
            self.comm.wait(probe.work, FINGERPRINT)
        self.joined = True
        where, spec = self.where, self.spec
        label = f"{spec.index} of epoch {spec.epoch}" if spec.epoch else str(spec.index)
        deferred: Deferred = self.sync._deferred
        total, divisor = deferred.record(
            where, label, self.comm, tail, probe, spec.reduction, failed
        )
        self.totals = (total, [tail[TAIL : TAIL + self.extra].clone()])
        if self.reorder:
            self._agree_order()
        return divisor
