"""A coupled window's representations across ranks: gathered forward, their gradients summed back.

Every rank embeds its own rows; the loss needs the rows of every rank (in-batch negatives from
the global window). ``Exchange`` moves them, in three collectives per window, all on the sync's
data-parallel group and all recorded by [`record_collectives()`][gradaccum.sync.record_collectives]:

1. ``agree``: an ``all_gather`` of four int64 per rank: its rows, whether it failed, the hash of
   its representations' layout (key paths, dtypes, shapes) and the window's index. Uneven rows
   are allowed; a failed rank, or ranks that disagree on the layout or the window, make every
   rank raise before any tensor of that layout is sent (a mismatch would hang the next
   collective or mix up rows).
2. ``gather``: one ``all_gather`` per dtype of the representations (usually one), each rank's
   rows padded to the longest rank's, then the padding dropped: the global window's rows, in
   rank order.
3. ``scatter``: one ``reduce_scatter`` of the loss's gradient for the global rows (in float32 or
   wider), which leaves each rank the sum over every rank's share of the loss of the gradient
   for its own rows: the cross-rank terms included (an ``all_gather`` without a gradient, the
   classic bug, drops them). One more number per rank rides along: the loss share (summed: the
   whole objective). A rank whose loss failed sends zeros and raises in pass 2, whose
   boundary tells the others (no host read here).

In a world of one (``sync=None``) nothing is sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from .._dist.comm import Comm, digest
from .._errors import GradAccumError, is_mesh

__all__ = ["Exchange", "Leaves", "Rows"]


@dataclass(frozen=True)
class Rows:
    """Where this rank's rows sit among the rows of the global window.

    The loss of [`coupled()`][gradaccum.coupled] gets the representations of every rank's rows,
    in rank order (each rank's in micro-batch order), and this, to find its own: rows
    ``start`` to ``stop`` of ``total``. In-batch targets across ranks are global offsets:
    ``rows.arange()`` (``torch.arange(start, stop)``).

    The loss returns this rank's share: the ranks' shares are summed. A loss written for the
    whole batch, ignoring ``rows``, is exact in one process (the share is the whole loss) but
    on ``w`` ranks gives ``w`` times the objective and its gradient, without an error: compute
    the loss of ``reps[rows.local]`` against all the rows and divide by ``rows.total``.

    Attributes:
        start: The global index of this rank's first row (the rows of the ranks before it).
        stop: One past its last row.
        total: The rows of the global window, every rank's.
        per_rank: Each rank's rows, in rank order (uneven rows allowed).
        rank: This rank in the data-parallel group (0 in one process).

    Examples:
        >>> from gradaccum import Rows
        >>> rows = Rows(start=3, stop=5, total=7, per_rank=(3, 2, 2), rank=1)
        >>> rows.arange(), rows.local, rows.world
        (tensor([3, 4]), slice(3, 5, None), 3)
    """

    start: int
    stop: int
    total: int
    per_rank: tuple[int, ...]
    rank: int = 0

    @property
    def local(self) -> slice:
        """This rank's rows of the global window, as a slice."""
        return slice(self.start, self.stop)

    @property
    def world(self) -> int:
        """The number of data-parallel ranks."""
        return len(self.per_rank)

    def arange(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``torch.arange(start, stop)``: this rank's rows' global indices (in-batch targets)."""
        return torch.arange(self.start, self.stop, device=device)


@dataclass(frozen=True)
class Leaves:
    """The representations' leaves: key paths, dtypes, and shapes after dim 0."""

    paths: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def floating(self) -> tuple[int, ...]:
        """The positions of the floating leaves: the loss is differentiated for these."""
        return tuple(i for i, d in enumerate(self.dtypes) if d.is_floating_point)

    def widths(self) -> list[int]:
        out = []
        for shape in self.shapes:
            w = 1
            for s in shape:
                w *= s
            out.append(w)
        return out

    def lines(self) -> tuple[str, ...]:
        return tuple(f"{p} {d} {list(s)}" for p, d, s in zip(self.paths, self.dtypes, self.shapes))

    def encode(self) -> bytes:
        """The layout as JSON bytes (for a rank that has none: ``Exchange.layout``)."""
        dtypes = [str(d).removeprefix("torch.") for d in self.dtypes]
        return json.dumps([list(self.paths), dtypes, [list(s) for s in self.shapes]]).encode()

    @staticmethod
    def decode(blob: bytes) -> Leaves:
        paths, dtypes, shapes = json.loads(blob.decode())
        return Leaves(
            tuple(paths), tuple(getattr(torch, d) for d in dtypes), tuple(map(tuple, shapes))
        )


class Exchange:
    """The three collectives of a coupled window over the sync's data-parallel group."""

    def __init__(
        self,
        where: str,
        group: Any,
        timeout: float | None,
        fn: str = "embed",
        unit: str = "rows",
        empty_ok: bool | None = None,
    ) -> None:
        # What pass 1 runs, and what it makes, in the messages: embed's representations, or
        # window_stats' statistics; and what the agreement counts per rank: rows, or (for
        # loop.WindowStats) micro-batches. ``empty_ok``: ranks without rows are allowed (not
        # all of them; ``layout`` then gives them the others'): for the statistics, and for
        # loop.Coupled (where such a rank's share is 0); not for the functional coupled().
        self.fn, self.made = fn, "representations" if fn == "embed" else "statistics"
        self.unit = unit
        self.empty_ok = fn == "stats" if empty_ok is None else empty_ok
        if is_mesh(group) and group.ndim != 1:
            raise ValueError(
                f"{where}: the sync's data is split over a {group.ndim}-D mesh, but the "
                f"{self.made} are exchanged over one process group; pass a sync over a 1-D "
                f"group or mesh (coupled losses over hybrid-sharded meshes are not supported "
                f"yet)."
            )
        self.comm = Comm(where, group, timeout, what="coupled(..., sync=...)")
        self.rank, self.world = self.comm.rank, self.comm.world

    def agree(
        self,
        rows: int,
        failed: bool,
        leaves: Leaves | None,
        index: int,
        device: torch.device,
    ) -> list[int]:
        """Every rank's rows; raise on every rank if one failed or the ranks disagree."""
        h = digest(leaves.lines()) % 2**62 if leaves is not None else -1
        mine = torch.tensor([rows, int(failed), h, index], dtype=torch.int64, device=device)
        out = torch.empty(self.world * 4, dtype=torch.int64, device=device)
        what = "the rows of each rank (all_gather)"
        self.comm.wait(self.comm.all_gather(out, mine, what, "coupled rows"), what)
        got = self.comm.fetch(out)  # the window's one host read of the exchange
        table = [got[4 * r : 4 * r + 4] for r in range(self.world)]
        where = self.comm.where
        bad = [r for r, t in enumerate(table) if t[1]]
        if bad:
            if failed:
                return []  # the caller re-raises its own error
            raise GradAccumError(
                f"{where}: rank(s) {bad} failed before the {self.made} were exchanged (in "
                f"{self.fn}, or at its output's checks); this rank ({self.rank}) stops too. The "
                f"failing rank raised the cause."
            )
        windows = [t[3] for t in table]
        if len(set(windows)) > 1:
            raise GradAccumError(
                f"{where}: the ranks are at different windows of this coupled step (window "
                f"index by rank: {windows}); every rank must call it the same number of times."
            )
        counts = [t[0] for t in table]
        empty = [r for r, n in enumerate(counts) if n == 0]
        if empty and not self.empty_ok:
            raise GradAccumError(
                f"{where}: rank(s) {empty} have no rows in this window (rows by rank: "
                f"{counts}); coupled() needs at least one row on every rank; give every rank "
                f"at least one row (uneven rows are fine), or train with gradaccum.loop.Step "
                f"and a gradaccum.loop.Coupled loss, where a rank without rows holds a share "
                f"of 0."
            )
        if len(empty) == self.world:
            one = {"rows": "row", "micro-batches": "micro-batch"}.get(self.unit, self.unit)
            raise GradAccumError(
                f"{where}: no rank has {self.unit} in this window ({self.unit} by rank: "
                f"{counts}); the window's {self.made} need at least one {one} on some rank; "
                f"pass a window that is not empty on every rank."
            )
        hashes = [t[2] for t in table if t[0]]  # a rank without rows has no layout
        if len(set(hashes)) > 1:
            mine_desc = "; ".join(leaves.lines()) if leaves is not None else "none"
            raise GradAccumError(
                f"{where}: the ranks' {self.made} differ in key paths, dtypes or shapes "
                f"(layout hash by rank: {[t[2] for t in table]}); this rank's: {mine_desc}. "
                f"{self.fn} must return the same tree, dtypes and shapes on every rank."
            )
        return [t[0] for t in table]

    def layout(self, leaves: Leaves | None, per_rank: list[int], device: torch.device) -> Leaves:
        """The layout of the first rank with rows, for those without (who made none to read).

        Every rank calls it when some rank has no rows (``per_rank``, from ``agree``): two
        broadcasts, the JSON's length and its bytes; the other windows send nothing more.
        """
        src = next(r for r, n in enumerate(per_rank) if n)
        blob = leaves.encode() if self.rank == src and leaves is not None else b""
        size = torch.tensor([len(blob)], dtype=torch.int64, device=device)
        what = f"the {self.made}' layout, for the ranks without {self.unit} (broadcast)"
        self.comm.wait(self.comm.broadcast(size, src, what, "coupled layout"), what)
        n = int(self.comm.fetch(size)[0])
        data = torch.zeros(n, dtype=torch.uint8)
        if blob:
            data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        data = data.to(device)
        self.comm.wait(self.comm.broadcast(data, src, what, "coupled layout"), what)
        if self.rank == src and leaves is not None:
            return leaves
        return Leaves.decode(bytes(self.comm.fetch(data)))

    def gather(
        self, parts: list[torch.Tensor], per_rank: list[int], index: torch.Tensor
    ) -> list[torch.Tensor]:
        """Each ``[rows, width]`` part gathered over the ranks: ``[total, width]``, rank order."""
        top = max(per_rank)
        out = []
        for part in parts:
            flat = part.view(torch.uint8) if part.dtype == torch.bool else part
            padded = flat.new_zeros(top, flat.shape[1])
            padded[: flat.shape[0]] = flat
            full = flat.new_empty(self.world * top, flat.shape[1])
            what = f"the representations ({part.dtype}, all_gather)"
            self.comm.wait(
                self.comm.all_gather(full, padded, what, "coupled representations"), what
            )
            rows = full.index_select(0, index)
            out.append(rows.view(torch.bool) if part.dtype == torch.bool else rows)
        return out

    def scatter(
        self, grad: torch.Tensor, share: torch.Tensor, per_rank: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``grad`` (``[total, width]``) summed over the ranks, this rank's rows of it.

        Returns ``(local rows [rows, width], the loss summed over the ranks)``, with no host
        read: a rank whose loss failed sends zeros and fails in pass 2, where the sync's
        boundary tells the others.
        """
        top, width = max(per_rank), grad.shape[1]
        send = grad.new_zeros(self.world, top * width + 1)
        at = 0
        for r, rows in enumerate(per_rank):
            send[r, : rows * width] = grad[at : at + rows].reshape(-1)
            at += rows
        send[:, -1] = share.detach().to(send.dtype)
        out = send.new_empty(top * width + 1)
        what = "the representations' gradient (reduce_scatter)"
        work = self.comm.reduce_scatter(out, send.reshape(-1), what, "coupled gradient")
        self.comm.wait(work, what)
        rows = per_rank[self.rank]
        return out[: rows * width].view(rows, width), out[-1]
