"""The sync protocol: how a window's gradients are kept, and combined across processes.

A sync ([`Sync`][gradaccum.sync.Sync]) opens one [`Window`][gradaccum.sync.Window] per
accumulation window; the core drives it through its hooks (``docs/architecture.md`` lists who
calls each one, and when) and never looks at which sync it is. The base ``Window`` is the window
of one process; a sync overrides what it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import _metrics, _reduce, _tree
from .._dist.comm import Comm
from .._errors import describe
from .._layout import Layout, make_layout, spec_of
from . import checkpoint_format
from .state import AccumState

__all__ = ["LOCAL", "Local", "Sync", "Window", "WindowSpec", "check_sync"]


@dataclass(frozen=True)
class WindowSpec:
    """What the core tells a sync when a window opens.

    Attributes:
        where: The call shape that errors name (e.g. ``"accumulate(loss, n=4)(...)"``).
        layout: The gradients' key paths, shapes, dtypes and accumulation dtypes
            (``layout.paths``, ``.shapes``, ``.dtypes``, ``.accum_dtypes``, ``.devices``).
        reduction: ``"mean"``, ``"sum"`` or ``"count"``.
        n: The window's number of micro-batches.
        agree_n: Whether the ranks must also agree on ``n`` (``Accumulator``: a rank with
            another ``n`` would pair micro-batches of different windows).
        state: The sync's state from the previous window (``None`` in the first one).
        params: The differentiated argument as the caller of ``accumulate`` gave it (e.g. a
            ``Sharded`` to gather), or ``None`` (``Accumulator``).
        fast: The window runs on the fast path, the same on every rank: with ``overlap``,
            ``ready(i)`` is called during the last backward (``AllReduce`` then learns the order
            in which the gradients become final).
        index: The window's index: ``AccumState.window`` for an ``Accumulator``, the number of
            windows it opened before for a function of ``accumulate``. Ranks at different
            indices are out of step: a ``Comm`` from [`connect()`][gradaccum.sync.Window.connect]
            puts it in the fingerprint, so they raise before any gradient is sent.
        epoch: ``AccumState.epoch`` for an ``Accumulator`` (0 otherwise): it goes in the
            fingerprint with ``index``.
        metrics: The names of the window's metrics (sorted; ``Accumulator.add(metrics=...)``),
            summed over the ranks in the boundary's tail after the weight and failure flag.
        metric_shapes: The shape of each metric, in ``metrics`` order: ``()`` for a scalar,
            ``(k,)`` for a 1-D metric of ``k`` numbers (they take ``k`` floats of the tail, in
            order). Empty: every metric is a scalar.

    Examples:
        >>> import torch, gradaccum
        >>> from gradaccum.sync import Local, WindowSpec
        >>> lay = Local().layout("example", {"w": torch.zeros(2)}, None)
        >>> window = Local().open(WindowSpec("example", lay, "sum", n=2))
        >>> window.add([torch.ones(2)], 1.0)
        >>> window.add([torch.ones(2)], 1.0)
        >>> window.finish(2)
        {'w': tensor([2., 2.])}
    """

    where: str
    layout: Layout
    reduction: str
    n: int
    agree_n: bool = False
    state: Any = None
    params: Any = None
    fast: bool = False
    index: int = 0
    epoch: int = 0
    metrics: tuple[str, ...] = ()
    metric_shapes: tuple[tuple[int, ...], ...] = ()


class Window:
    """One accumulation window: the running sums of its gradients, and its boundary.

    The base class keeps plain running sums in one process and divides them by the window's
    weight at [`finish()`][gradaccum.sync.Window.finish]. Subclass it to write a sync; see
    [`Sync`][gradaccum.sync.Sync] for an example.

    Attributes:
        spec: The [`WindowSpec`][gradaccum.sync.WindowSpec] it was opened with.
        layout: ``spec.layout``.
        sums: The running sums, one tensor per gradient leaf in the accumulation dtype, or
            ``None`` before the first micro-batch.
        state: The sync's state to carry to the next window (``spec.state`` unless ``finish``
            replaces it).
        metrics: This rank's metric sums (tensors of ``spec.metric_shapes``, in ``spec.metrics``
            order), set by the core before ``finish``; ``[]`` without metrics.
        hint: ``None``, or (``mean`` only) a global weight that every rank expects: the core then
            divides each micro-batch's gradient by it, and ``finish`` must scale the summed
            gradients by ``hint / total`` instead of dividing by ``total``. Decide it from the
            spec alone, the same on every rank.
        totals: Set at the boundary: ``(weight, metrics)`` summed over the ranks (a number or
            0-dim tensor, and a list in ``spec.metrics`` order: flat numbers, 1-D metrics
            element by element, or one tensor per metric). ``Comm.exchange`` of a
            [`connect()`][gradaccum.sync.Window.connect]-ed ``Comm`` sets it, and so does the
            base ``finish`` (one process) when it is still ``None``.

    Examples:
        >>> import torch, gradaccum
        >>> from gradaccum.sync import Window, WindowSpec
        >>> lay = gradaccum.sync.Local().layout("example", {"w": torch.zeros(2)}, None)
        >>> window = Window(WindowSpec("example", lay, "mean", n=2))
        >>> window.add([torch.tensor([1.0, 2.0])], 3)  # 3 rows, mean gradient [1, 2]
        >>> window.add([torch.tensor([5.0, 6.0])], 1)  # 1 row
        >>> window.finish(4)  # (3 * [1, 2] + [5, 6]) / 4
        {'w': tensor([2., 3.])}
    """

    prescale = False  # one process, mean: the fast path may scale each backward by rows/total
    # Under a sync, mean: a total weight that every rank expects (the last window's), by which
    # the fast path divides each backward's rows; the window then scales by hint/total.
    hint: float | None = None
    overlap = False  # call ready(i) during the window's last backward

    def __init__(self, spec: WindowSpec) -> None:
        self.spec, self.layout, self.state = spec, spec.layout, spec.state
        self.where = spec.where
        self.sums: list[torch.Tensor] | None = None
        self.metrics: list[torch.Tensor] = []
        self.totals: tuple[Any, list[Any]] | None = None

    def at(self, where: str) -> None:
        """Errors from here on name ``where`` (the call now driving the window)."""
        self.where = where

    def connect(
        self,
        group: Any,
        timeout: float | None = None,
        check: str = "fingerprint",
        what: str = "sync=all_reduce()",
    ) -> Comm:
        """A [`Comm`][gradaccum.sync.Comm] for this window's collectives over ``group``.

        Its errors name the window's call; its fingerprint ([`probe()`][gradaccum.sync.Comm.probe])
        covers the window's index and metric names, so that ranks at different windows raise
        [`GradAccumError`][gradaccum.GradAccumError] before any gradient is sent; and its
        [`exchange()`][gradaccum.sync.Comm.exchange] carries the window's metric sums and sets
        ``totals``. The arguments are those of ``Comm``.
        """
        return Comm(self.where, group, timeout, check, what, window=self)

    # -- where the running sums live ------------------------------------------------------------

    def storage(self, zero: bool) -> list[torch.Tensor] | None:
        """New tensors for the running sums (zeroed, or uninitialised), or None for "any".

        ``None`` (the default when ``zero`` is False) keeps each leaf's first gradient as its
        running sum, without a copy. Override it to place the sums in flat buckets.
        """
        if not zero:
            return None
        return [self.layout.zeros(i) for i in range(len(self.layout.shapes))]

    def prepare(self, zero: bool) -> None:
        """Before the fast path's first backward: allocate the storage (zeroed if ``zero``)."""
        if self.sums is None:
            self.sums = self.storage(zero)

    def restore(self, sums: list[torch.Tensor]) -> None:
        """Take existing running sums (a state's, or a checkpoint's copies into ``storage``)."""
        self.sums = sums

    def tree(self, like: Any = None) -> Any:
        """The running sums as a tree (with ``like``'s structure, if given), or None before any."""
        if self.sums is None:
            return None
        spec = self.layout.spec if like is None else spec_of(self.layout, like)
        return _tree.unflatten(spec, self.sums)

    # -- micro-batches --------------------------------------------------------------------------

    def begin(self, count: int) -> None:
        """The caller brings ``count`` more micro-batches (a sync may refuse too many)."""

    def params(self, step: int, given: Any) -> Any:
        """The params for micro-step ``step``; by default the ones the caller gave."""
        return given

    def streams(self, i: int) -> bool:
        """Whether leaf ``i``'s gradient is handed over every micro-step (no running sum)."""
        return False

    def add(self, grads: list[torch.Tensor], alpha: float) -> None:
        """Add one micro-batch's gradients, scaled by ``alpha``, into the running sums."""
        with torch.no_grad():
            if self.sums is None:
                out = self.storage(zero=False)
                self.sums = _reduce.first_add(grads, self.layout.accum_dtypes, alpha, out)
            else:
                _reduce.add_into(self.sums, grads, alpha)

    def adopt(self, i: int, g: torch.Tensor | None) -> torch.Tensor:
        """Fast path: leaf ``i``'s first gradient (None: it got none); return its running sum.

        Autograd accumulates the later micro-batches into the returned tensor (the leaf's
        ``.grad``), so it must have the leaf's dtype and shape.
        """
        if self.sums is None:
            self.sums = [None] * len(self.layout.shapes)  # type: ignore[list-item]
        s: torch.Tensor | None = self.sums[i]
        if s is None:
            s = self.sums[i] = g if g is not None else self.layout.zeros(i)
        elif g is None:
            s.zero_()
        else:
            s.copy_(g)
        return s

    def grad(self, i: int, g: torch.Tensor, alpha: float) -> None:
        """Fast path: leaf ``i``'s gradient of this micro-batch is ``alpha * g`` (then dropped)."""
        if self.sums is None:
            self.sums = self.storage(zero=True)
        assert self.sums is not None
        self.sums[i].add_(g, alpha=alpha)

    def last(self) -> None:
        """The coming backward is the window's last (a sync may open its boundary here)."""

    def seal(self, weight: _reduce.Weight) -> None:
        """After ``last()``, before the last backward: the window's weight is final (``weight``).

        Nothing that can fail runs between the end of that backward and ``finish`` with the same
        weight, so a sync may send its boundary's weight and "no failure" from ``ready`` on.
        """

    def ready(self, i: int) -> None:
        """During the last backward (with ``overlap``): leaf ``i``'s running sum is final."""

    def step(self) -> None:
        """A micro-batch's gradients are all in."""

    # -- the boundary ---------------------------------------------------------------------------

    def finish(self, weight: _reduce.Weight, failed: bool = False) -> Any:
        """The window's gradient (in the params' dtypes), from its sums and total ``weight``.

        ``failed`` joins the boundary on behalf of a rank whose window raised, so that the
        other ranks raise too (its result is ignored). Set ``self.state`` for the next window.
        """
        where, reduction = self.where, self.spec.reduction
        if self.sums is None:
            raise ValueError(
                f"{where}: the window holds no micro-batch, so there is no gradient to return; "
                f"call add() at least once before finalize()."
            )
        if reduction == "count" and not isinstance(weight, torch.Tensor) and weight <= 0:
            raise ValueError(
                f"{where}: the window's counts add up to {weight}, so there is no item mean to "
                f"divide by; skip windows with no items (e.g. all padding), or use "
                f"reduction='sum'."
            )
        if self.totals is None:  # one process: the local sums are the totals
            self.totals = (weight, list(self.metrics))
        return self.normalised(weight)

    def normalised(self, total: _reduce.Weight) -> Any:
        """The sums divided by ``total`` (in place) under the reduction, cast, as a tree."""
        lay = self.layout
        sums = self.sums if self.sums is not None else self.storage(zero=True)
        assert sums is not None
        with torch.no_grad():
            _reduce.normalise(self.spec.reduction, sums, total)  # type: ignore[arg-type]
            out = [s.to(d) for s, d in zip(sums, lay.dtypes)]
        return _tree.unflatten(lay.spec, out)

    def abort(self, weight: _reduce.Weight) -> None:
        """Join the boundary flagged as failed (errors here are dropped by the caller)."""


class Sync:
    """A way to combine each window's gradients across processes: the extension point.

    The core calls [`open()`][gradaccum.sync.Sync.open] once per window and drives the
    [`Window`][gradaccum.sync.Window] it returns. The built-in ones are
    [`AllReduce`][gradaccum.sync.AllReduce], [`ReduceScatter`][gradaccum.sharding.ReduceScatter] and
    [`CustomReduce`][gradaccum.sync.CustomReduce]; ``sync=None`` is [`Local`][gradaccum.sync.Local].

    Examples:
        A sync that sums every rank's gradient with one plain ``all_reduce`` per leaf, using the
        transport for the weight, the failure flag and the window's metrics:

        >>> import torch, torch.distributed as dist, gradaccum
        >>> from gradaccum.sync import Sync, Window
        >>> class PerLeafWindow(Window):
        ...     def finish(self, weight, failed=False):
        ...         comm = self.connect(None)  # a Comm for this window (its index, its metrics)
        ...         total = comm.settle(comm.exchange(torch.device("cpu"), weight, failed),
        ...                             self.spec.reduction, failed)
        ...         sums = self.sums or self.storage(zero=True)
        ...         for s in sums:
        ...             comm.wait(comm.all_reduce(s, "a leaf", "gradients"), "a leaf")
        ...         self.sums = sums
        ...         return self.normalised(total)
        >>> class PerLeaf(Sync):
        ...     def open(self, spec):
        ...         return PerLeafWindow(spec)
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> step = gradaccum.accumulate(lambda p, x: {"w": x.mean(0) * p["w"]}, 2, sync=PerLeaf())
        >>> step({"w": torch.ones(2)}, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        {'w': tensor([2., 3.])}
        >>> dist.destroy_process_group()
    """

    def open(self, spec: WindowSpec) -> Window:
        """A window for gradients of ``spec.layout``; may communicate (e.g. a fingerprint)."""
        raise NotImplementedError(f"{type(self).__name__}.open(spec) must return a Window")

    def layout(
        self, where: str, params: Any, accum_dtype: torch.dtype | None, argnums: Any = 0
    ) -> Layout:
        """The gradients' layout for ``params``: the argument(s) at ``argnums``, as given."""
        return make_layout(where, params, accum_dtype)

    @property
    def state(self) -> Any:
        """The state kept between the windows of [`accumulate()`][gradaccum.accumulate]."""
        return None

    def load_state(self, state: Any) -> None:
        """Keep ``state`` (a window's ``state`` after ``finish``) for the next window."""

    def state_dict(self, reduction: str, state: AccumState[Any]) -> dict[str, Any]:
        """An ``Accumulator`` state as a dict (copies); ``torch.load(weights_only=True)`` safe."""
        return checkpoint_format.save(reduction, state)

    def load_state_dict(
        self, spec: WindowSpec, state: AccumState[Any], sd: dict[str, Any]
    ) -> AccumState[Any]:
        """Validate ``sd`` against ``state`` (a fresh one) and rebuild the saved state."""
        saved, weight = checkpoint_format.load(spec.reduction, state, sd, spec.n)
        lay = spec.layout
        dev = lay.devices[0] if lay.devices else torch.device("cpu")
        metrics = _metrics.check_saved(spec.where, sd.get("metrics"), dev, checkpoint_format.FIX)
        sums = None
        if saved is not None:
            window = self.open(spec)
            window.prepare(zero=False)
            if window.sums is None:
                window.restore([s.to(d, copy=True) for s, d in zip(saved, spec.layout.devices)])
            else:
                with torch.no_grad():
                    torch._foreach_copy_(window.sums, saved)
            sums = window.tree()
        return state._replace(
            sums=sums,
            weight=weight,
            micro_step=int(sd["micro_step"]),
            window=int(sd["window"]),
            epoch=int(sd.get("epoch", 0)),
            reduce_state=sd.get("reduce_state"),
            metrics=metrics,
        )


class Local(Sync):
    """One process: nothing is communicated (``sync=None`` means this).

    Its window keeps plain running sums and, under ``mean`` on the fast path, scales each
    backward by its share of the rows, so the boundary has nothing left to divide.

    Examples:
        >>> import torch, gradaccum
        >>> step = gradaccum.accumulate(lambda p, x: {"w": x.mean(0) * p["w"]}, 2,
        ...                             sync=gradaccum.sync.Local())
        >>> step({"w": torch.ones(2)}, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        {'w': tensor([2., 3.])}
    """

    def open(self, spec: WindowSpec) -> Window:
        """A window of plain running sums."""
        window = Window(spec)
        window.prescale = True
        return window


LOCAL = Local()


def check_sync(where: str, sync: object) -> None:
    """Validate ``sync=``."""
    if sync is not None and not isinstance(sync, Sync):
        raise TypeError(
            f"{where}: sync must be None, gradaccum.all_reduce(...), "
            f"gradaccum.reduce_scatter(sharded), a custom reduction or another "
            f"gradaccum.sync.Sync, got {describe(sync)}; pass sync=gradaccum.all_reduce() to "
            f"synchronise over the default process group."
        )
