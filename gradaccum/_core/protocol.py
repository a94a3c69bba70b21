"""The sync protocol: how a window's gradients are kept, and combined across processes.

A sync ([`Sync`][gradaccum.sync.Sync]) opens one [`Window`][gradaccum.sync.Window] per
accumulation window; the core drives it through its hooks (the ``Window`` docstring gives their
order, ``docs/architecture.md`` the table of who calls each one) and never looks at which sync
it is. Two tiers: a new sync implements ``Sync.reduce`` (and optionally ``Sync.describe``), and
the base ``Window`` does its boundary (the tail with the fingerprint, the empty window, the
division, the failure path, the state); an overlapping sync (``AllReduce``, ``ReduceScatter``)
also returns a ``Window`` subclass that overrides the hooks it needs. Without a sync the base
``Window`` is the window of one process.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import _metrics, _reduce, _tree
from .._dist.broken import is_broken
from .._dist.buckets import make_plan
from .._dist.comm import Comm, settle
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
            in which the gradients become final). Such a window is run by one call, from
            ``begin`` to ``finish`` (``AllReduce`` starts its fingerprint at ``begin``).
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
        options: Lines describing the caller's options that every rank must share (e.g.
            [`loop.Step`][gradaccum.loop.Step]'s clipping): a ``Comm`` from
            [`connect()`][gradaccum.sync.Window.connect] puts them in the fingerprint, so
            ranks built with different options raise at the boundary, before any step.

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
    options: tuple[str, ...] = ()


class Window:
    """One accumulation window: the running sums of its gradients, and its boundary.

    The base class keeps plain running sums. Its [`finish()`][gradaccum.sync.Window.finish] is
    the boundary: in one process (no sync) it divides them by the window's weight; for a sync of
    the simple tier it does the boundary's tail and calls the sync's
    [`reduce()`][gradaccum.sync.Sync.reduce], so such a sync never sees a ``Window``. An
    overlapping sync (the advanced tier) subclasses it, made with ``Window(spec, sync)``, and
    overrides the hooks it needs (``docs/architecture.md``, "The protocol", has the table).

    The core calls the hooks in this order in each window:

    1. ``begin(count)``: a call brings ``count`` micro-batches.
    2. For each micro-batch, ``params(step, given)`` (the params of its forward), then its
       gradients, by one of two paths:
        - generic (the step function returns a gradient tree): ``add(grads, alpha)``;
        - fast (backward into the window): first ``streams(i)`` for each leaf and
          ``prepare(zero)`` (which asks ``storage``); during each backward, ``adopt(i, g)``
          for a leaf's first gradient of the window (unless ``prepare`` returned True: the
          leaves then accumulate into ``sums`` from the first backward) and
          ``grad(i, g, alpha)`` for a leaf that does not accumulate in place; before the last
          backward ``last()``, then ``seal(weight)`` (the weight is final), and with
          ``overlap``, ``ready(i)`` during it as each leaf's sum becomes final.

       Then ``step()``.
    3. Between the calls of an ``Accumulator``: ``tree(like)`` (what ``AccumState.sums``
       holds), and at the next call ``Sync.window_of(sums)`` or a new window given the sums
       by ``restore(sums)``; ``at(where)`` when another call drives a live window.
    4. The boundary, once: ``finish(weight)`` (``metrics`` set before), or ``abort(weight)``
       after an error on this rank (the same boundary, flagged as failed).

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
            element by element, or one tensor per metric). The tail's reader (``Comm.read``,
            ``exchange`` or ``boundary``) of a [`connect()`][gradaccum.sync.Window.connect]-ed
            ``Comm`` sets it, and so does the base ``finish`` in one process.
        sync: The [`Sync`][gradaccum.sync.Sync] that opened it (``Window(spec, sync)``), or
            ``None``: the window of one process.
        prescale: Set by the base class, never by a sync: the window of one process, whose
            fast path under ``mean`` scales each backward by its share of the rows (the
            boundary then has nothing to divide).
        overlap: Whether the core calls ``ready(i)`` during the last backward (an overlapping
            sync sets it).
        comms: The ``Comm`` objects ``connect()`` made; ``abort`` joins no boundary where a
            collective of their groups failed.

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

    # Under a sync, mean: a total weight that every rank expects (the last window's), by which
    # the fast path divides each backward's rows; the window then scales by hint/total.
    hint: float | None = None
    overlap = False  # call ready(i) during the window's last backward

    def __init__(self, spec: WindowSpec, sync: Sync | None = None) -> None:
        self.spec, self.layout, self.state = spec, spec.layout, spec.state
        self.where = spec.where
        self.sync = sync  # None: the window of one process ([`Local`][gradaccum.sync.Local])
        # One process (no sync, the base finish), mean: the fast path may scale each backward by
        # its rows / the window's rows, so the boundary has nothing left to divide.
        self.prescale = sync is None and type(self).finish is Window.finish
        self.sums: list[torch.Tensor] | None = None
        self.metrics: list[torch.Tensor] = []
        self.totals: tuple[Any, list[Any]] | None = None
        self.comms: tuple[Comm, ...] = ()  # what connect() made: abort() checks their groups

    def at(self, where: str) -> None:
        """Errors from here on name ``where`` (the call now driving the window)."""
        self.where = where
        for comm in self.comms:
            comm.where = where

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
        comm = Comm(self.where, group, timeout, check, what, window=self)
        self.comms += (comm,)
        return comm

    # -- where the running sums live ------------------------------------------------------------

    def storage(self, zero: bool) -> list[torch.Tensor] | None:
        """New tensors for the running sums (zeroed, or uninitialised), or None for "any".

        ``None`` (the default when ``zero`` is False) keeps each leaf's first gradient as its
        running sum, without a copy. Override it to place the sums in flat buckets.
        """
        if not zero:
            return None
        return [self.layout.zeros(i) for i in range(len(self.layout.shapes))]

    def prepare(self, zero: bool) -> bool:
        """Before the fast path's first backward: allocate the storage (zeroed if ``zero``).

        Returns whether ``sums`` can be accumulated into from the first backward (zeros, or the
        running sums of a restored window): the fast path then sets each in-place leaf's
        ``.grad`` to its sum before that backward, and needs no ``adopt``. ``False`` (no storage
        yet, or uninitialised storage): each leaf's first gradient goes through ``adopt``.
        """
        if self.sums is not None:
            return True
        self.sums = self.storage(zero)
        return zero and self.sums is not None

    def restore(self, sums: list[torch.Tensor]) -> None:
        """Take existing running sums (a state's, or a checkpoint's copies into ``storage``)."""
        self.sums = sums

    def tree(self, like: Any = None) -> Any:
        """What ``AccumState.sums`` holds: the running sums as a tree, or None before any.

        With ``like``, the tree has ``like``'s structure. A window without a full tree of sums
        returns what its sync's [`window_of()`][gradaccum.sync.Sync.window_of] turns back into it.
        """
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

    def ready_hooks(self, report: list[int]) -> list[Any] | None:
        """Optional (with ``overlap``): the hooks to put on leaves ``report`` for the last backward.

        ``None`` (the default): one per leaf that calls ``ready(i)``. A window may return its
        own, one per leaf in ``report`` (each called with the leaf), e.g. C-level marks for most
        and a Python hook for a few: ``AllReduce`` checks a bucket once, not each leaf.
        """
        return None

    def step(self) -> None:
        """A micro-batch's gradients are all in."""

    # -- the boundary ---------------------------------------------------------------------------

    def finish(self, weight: _reduce.Weight, failed: bool = False) -> Any:
        """The window's gradient (in the params' dtypes), from its sums and total ``weight``.

        ``failed`` joins the boundary on behalf of a rank whose window raised, so that the
        other ranks raise too (its result is ignored). Sets ``self.state`` for the next window.

        The boundary of a sync of the simple tier (one that overrides
        [`Sync.reduce()`][gradaccum.sync.Sync.reduce]), in this order:

        1. one all-reduce of the tail ``[weight, failed, *metric sums, h, h**2]``
           ([`Comm.boundary()`][gradaccum.sync.Comm.boundary]): the ranks agree on the window's
           fingerprint, sum its weight, learn whether a rank failed (then every other rank
           raises, and a failed rank returns ``None``) and total the metrics;
        2. this rank's sums divided by the global weight, in place: its *share* (an empty
           window's are zeros);
        3. ``Sync.reduce`` of the shares, which returns their sum and the next state;
        4. the sum cast to the params' dtypes, as a tree.

        Without torch.distributed and with ``group=None`` it is a world of one: no collective,
        and ``reduce`` gets ``comm=None``. A window of one process (no sync) divides its sums by
        ``weight``.
        """
        if self.sync is None:  # one process: the sums divided by the window's own weight
            where, reduction = self.where, self.spec.reduction
            if failed:  # nobody to tell
                return None
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
        sync, spec, lay = self.sync, self.spec, self.layout
        comm = None
        if sync.group is not None or (dist.is_available() and dist.is_initialized()):
            comm = self.connect(sync.group, sync.timeout, sync.check, f"sync={sync.name}")
        if comm is None:  # a world of one: nothing to tell a failed window's peers
            if failed:
                return None
            total = settle(self.where, 1, 0, [float(weight), 0.0], spec.reduction)
            self.totals = (total, list(self.metrics))
        else:
            dev = lay.devices[0] if lay.devices else torch.device("cpu")
            got = comm.boundary(dev, weight, failed, _describe(sync, spec), sync.subject())
            if got is None:
                return None
            total = got
        sums = self.sums if self.sums is not None else self.storage(zero=True)
        assert sums is not None
        with torch.no_grad():
            _reduce.normalise(spec.reduction, sums, total)  # type: ignore[arg-type]
            out = sync.reduce(spec, sums, self.state, comm)
            summed, self.state = _check_reduced(self.where, sync, lay, out)
            return _tree.unflatten(lay.spec, [g.to(d) for g, d in zip(summed, lay.dtypes)])

    def abort(self, weight: _reduce.Weight) -> None:
        """Join the boundary flagged as failed, so that the other ranks raise instead of waiting.

        It is ``finish(weight, failed=True)``: the same exchange as a normal boundary, so a sync
        gets it without writing anything. Nothing is joined where a collective of the window's
        groups already failed (the other ranks have raised, or will time out), nor in one
        process. Errors here are dropped by the caller, which re-raises its own.
        """
        if self.sync is None:
            return
        groups = [c.group for c in self.comms] if self.comms else [self.sync.group]
        if not any(is_broken(g) for g in groups):
            self.finish(weight, failed=True)

    def normalised(self, total: _reduce.Weight) -> Any:
        """The sums divided by ``total`` (in place) under the reduction, cast, as a tree."""
        lay = self.layout
        sums = self.sums if self.sums is not None else self.storage(zero=True)
        assert sums is not None
        with torch.no_grad():
            _reduce.normalise(self.spec.reduction, sums, total)  # type: ignore[arg-type]
            out = [s.to(d) for s, d in zip(sums, lay.dtypes)]
        return _tree.unflatten(lay.spec, out)


class Sync:
    """A way to combine each window's gradients across processes: the extension point.

    The core calls [`open()`][gradaccum.sync.Sync.open] once per window and drives the
    [`Window`][gradaccum.sync.Window] it returns, without looking at which sync it is. The
    built-in ones are [`AllReduce`][gradaccum.sync.AllReduce],
    [`ReduceScatter`][gradaccum.sharding.ReduceScatter] and
    [`CustomReduce`][gradaccum.sync.CustomReduce]; ``sync=None`` is
    [`Local`][gradaccum.sync.Local].

    **A new sync** (the simple tier) subclasses ``Sync`` and overrides
    [`reduce()`][gradaccum.sync.Sync.reduce]: the sum over the group of this rank's share of the
    window's gradient. Optionally it sets ``group``, ``timeout`` and ``check`` (attributes, read
    at each boundary) and adds fingerprint lines for its options
    ([`describe()`][gradaccum.sync.Sync.describe]). The base class does the rest, the same for
    every sync: the window index and the running sums; at the boundary one all-reduce of the
    tail ``[weight, failed, *metric sums, h, h**2]`` in which the ranks agree on the window's
    fingerprint before any gradient is sent, sum the weight, learn whether a rank failed and
    total the [`Accumulator`][gradaccum.Accumulator]'s metrics; the rule for an empty window
    (zeros, weight 0); the division by the global weight; the failure path (a rank whose window
    raised joins that same all-reduce flagged as failed, so every other rank raises
    [`GradAccumError`][gradaccum.GradAccumError] instead of waiting); and the state carried
    between windows ([`state`][gradaccum.sync.Sync.state]).

    **An overlapping sync** (the advanced tier: ``AllReduce``, ``ReduceScatter``) also overrides
    ``open`` to return a ``Window`` subclass driven through its hooks (``docs/architecture.md``,
    "The protocol", lists them and the order the core calls them in).

    Attributes:
        group: The process group, a 1-D ``DeviceMesh``, or ``None`` for the default group (or a
            world of one without torch.distributed). The data is split over it
            ([`data_group()`][gradaccum.sync.Sync.data_group]).
        timeout: Seconds after which each collective of the sync fails; ``None``: the group's.
        check: ``"fingerprint"`` (default), ``"full"`` or ``"never"``, as in
            [`all_reduce()`][gradaccum.all_reduce].
        shards: Whether the boundary returns this rank's gradient shards (a tuple) rather than
            the gradient tree (``ReduceScatter``): ``loop.Step`` cannot write those into
            ``.grad``.
        defer: Whether the boundary's checks are deferred to a device flag and read by the next
            window (``all_reduce(defer=True)``, [The deferred
            boundary](../sync.md#the-deferred-boundary)); ``False``: read at the boundary.

    Examples:
        A sync that sums every rank's share with one plain all-reduce per leaf (``reduce`` is the
        one method it implements):

        >>> import torch, torch.distributed as dist, gradaccum
        >>> from gradaccum.sync import Sync
        >>> class PerLeaf(Sync):
        ...     def reduce(self, spec, shares, state, comm):
        ...         for k, s in enumerate(shares):
        ...             what = f"leaf {spec.layout.paths[k]}"
        ...             comm.wait(comm.all_reduce(s, what, "gradients"), what)
        ...         return shares, state
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> step = gradaccum.accumulate(lambda p, x: {"w": x.mean(0) * p["w"]}, 2, sync=PerLeaf())
        >>> with gradaccum.sync.record_collectives() as log:
        ...     step({"w": torch.ones(2)}, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        {'w': tensor([2., 3.])}
        >>> [(c.kind, c.purpose, c.nbytes) for c in log]  # the tail, then the leaf
        [('all_reduce', 'weight', 32), ('all_reduce', 'gradients', 8)]
        >>> dist.destroy_process_group()
    """

    group: Any = None
    timeout: float | None = None
    check: str = "fingerprint"
    shards = False
    defer = False
    _kept_state: Any = None  # what state returns (load_state sets it)

    def open(self, spec: WindowSpec) -> Window:
        """A window for gradients of ``spec.layout``: the base ``Window``, bound to this sync.

        Override it only for an overlapping sync (the advanced tier), to return a ``Window``
        subclass made with ``Window(spec, self)``; it may communicate (e.g. a fingerprint).
        """
        return Window(spec, self)

    def reduce(
        self, spec: WindowSpec, shares: list[torch.Tensor], state: Any, comm: Comm | None
    ) -> tuple[list[torch.Tensor], Any]:
        """The sum over the group of every rank's ``shares``, and the state for the next window.

        The one method a new sync implements. It runs under ``torch.no_grad()`` on every rank
        at every boundary (an empty window included), after the ranks agreed on the window and
        no rank failed.

        Args:
            spec: The window's [`WindowSpec`][gradaccum.sync.WindowSpec] (its layout, reduction,
                index).
            shares: This rank's share of the window's gradient, one tensor per leaf in
                ``spec.layout`` order, in the accumulation dtype: the running sums already
                divided by the global weight (modify them in place if you like), so the
                window's gradient is the sum of every rank's shares.
            state: The sync's state from the previous window (``None`` at first).
            comm: The [`Comm`][gradaccum.sync.Comm] of the window's boundary, through which
                every collective goes (it times out, names the call and rank on failure, and
                [`record_collectives()`][gradaccum.sync.record_collectives] sees it); ``None``
                in a world of one (no torch.distributed, ``group=None``).

        Returns:
            ``(summed, state)``: one tensor per leaf shaped like ``shares`` (the base class casts
            it to the params' dtypes), and the state for the next window.

        The base class is the world of one: the shares are the sum.
        """
        return shares, state

    def describe(self) -> tuple[str, ...]:
        """The fingerprint's lines for this sync's options (ranks must agree on them).

        The base class covers the window's index, metric names, gradient tree and reduction;
        add a line for each option that changes what crosses the wire (e.g.
        ``("compress=True",)``). Default: none.
        """
        return ()

    @property
    def name(self) -> str:
        """How messages name the sync (``sync=<name>``): its class's name by default."""
        return type(self).__name__

    def subject(self) -> str:
        """What a fingerprint mismatch says the ranks disagree on."""
        return f"gradients to reduce with {self.name}"

    def window_of(self, sums: Any) -> Window | None:
        """The live window that ``sums`` (an ``AccumState.sums``) stands for, or ``None``.

        ``None`` (the default): ``sums`` is the running sums as a tree
        ([`Window.tree()`][gradaccum.sync.Window.tree]), and the core opens a window for the
        next ``Accumulator.add`` and gives it them
        ([`restore()`][gradaccum.sync.Window.restore]). A sync whose window has no such tree
        (``ReduceScatter``: shards and collectives in flight) keeps the window itself there,
        and gives it back here.
        """
        return None

    def data_group(self) -> Any:
        """The process group (or mesh) the data is split over: ``group`` by default.

        ``gradaccum.loop`` asks it to agree on the data's lengths over the same ranks.
        """
        return self.group

    @property
    def state(self) -> Any:
        """The state kept between the windows of [`accumulate()`][gradaccum.accumulate].

        What ``reduce`` returned at the last boundary (``None`` before). An
        [`Accumulator`][gradaccum.Accumulator] keeps it in its own state instead.
        """
        return self._kept_state

    def load_state(self, state: Any) -> None:
        """Keep ``state`` (a window's ``state`` after ``finish``) for the next window."""
        self.__dict__["_kept_state"] = state  # (a frozen dataclass's too)

    def layout(
        self, where: str, params: Any, accum_dtype: torch.dtype | None, argnums: Any = 0
    ) -> Layout:
        """The gradients' layout for ``params``: the argument(s) at ``argnums``, as given."""
        return make_layout(where, params, accum_dtype)

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
        """A window of plain running sums, divided by the window's own weight."""
        return Window(spec)


LOCAL = Local()


@functools.lru_cache(maxsize=64)
def _tree_lines(layout: Layout) -> tuple[str, ...]:
    """The fingerprint's lines for a gradient tree: each leaf's key path, shape and dtype."""
    return make_plan(layout, 1).description


def _describe(sync: Sync, spec: WindowSpec) -> tuple[str, ...]:
    """What the simple tier's fingerprint covers (after the window's index and metrics)."""
    n = (f"n={spec.n} micro-batches per window",) if spec.agree_n else ()
    lines = sync.describe()
    if not isinstance(lines, (tuple, list)) or not all(isinstance(x, str) for x in lines):
        raise TypeError(
            f"{spec.where}: {sync.name}.describe() must return a tuple of strings (the sync's "
            f"options that every rank must agree on), got {describe(lines)}; return e.g. "
            f'(f"compress={{self.compress}}",), or () for none.'
        )
    return (*_tree_lines(spec.layout), f"reduction={spec.reduction!r}", *n, *lines)


def _check_reduced(where: str, sync: Sync, lay: Layout, out: Any) -> tuple[list[torch.Tensor], Any]:
    """What a simple-tier ``reduce`` returned: ``(summed, state)``, one tensor per leaf."""
    call = f"{sync.name}.reduce(spec, shares, state, comm)"
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError(
            f"{where}: {call} must return a pair (summed, state), got {describe(out)}; return "
            f"the summed tensors, one per leaf, and the state for the next window (None if it "
            f"keeps none)."
        )
    summed, state = out
    k = len(lay.shapes)
    if (
        not isinstance(summed, (list, tuple))
        or len(summed) != k
        or not all(isinstance(t, torch.Tensor) for t in summed)
    ):
        raise TypeError(
            f"{where}: {call} returned {describe(summed)} as the summed gradients; expected a "
            f"list of {k} tensors, one per leaf in spec.layout order, each shaped like its share."
        )
    for path, t, shape in zip(lay.paths, summed, lay.shapes):
        if tuple(t.shape) != tuple(shape):
            raise ValueError(
                f"{where}: {call} returned a tensor of shape {tuple(t.shape)} for leaf {path}, "
                f"whose share has shape {tuple(shape)}; return one tensor per leaf, shaped like "
                f"its share (reshape what a collective gave back)."
            )
    return list(summed), state


def check_sync(where: str, sync: object) -> None:
    """Validate ``sync=``."""
    if sync is not None and not isinstance(sync, Sync):
        raise TypeError(
            f"{where}: sync must be None, gradaccum.all_reduce(...), "
            f"gradaccum.reduce_scatter(sharded), a custom reduction or another "
            f"gradaccum.sync.Sync, got {describe(sync)}; pass sync=gradaccum.all_reduce() to "
            f"synchronise over the default process group."
        )
