"""The deferred boundary: a window's checks decided on the device, read by the next window.

A sync made with ``defer=True`` does not read its boundary on the host. The checks it makes
there (a rank failed, the ranks' fingerprints differ, a mean has nothing to divide by) become
one flag on the device, the same bits on every rank since they come from reduced values:
``1.0`` when the window must not be applied, ``0.0`` otherwise. A fused torch optimizer given
that flag as its ``found_inf`` ([`guard()`][gradaccum.sync.AllReduce.guard]) skips the window
on the device, as it skips a window of ``GradScaler``'s. A copy of the window's status goes to
pinned memory; the next window reads it before its first collective (a read of an earlier
window's work, by which time it is done) and raises there, on every rank, for a bad window;
[`verify()`][gradaccum.sync.AllReduce.verify] reads the last one.

The fingerprint stays a collective in every window, so every rank sends the same collectives.
A rank whose own gradient layout is the one the ranks last agreed on does not read it: its
buckets have the agreed sizes whatever the others do, and the fingerprint's result goes into
the flag. A rank whose layout changed reads it before its first bucket (the read of a window
that is not steady); if the others disagree, it sends buckets of the agreed sizes, zeros with
its failure flag set, so that no rank waits in a collective that does not match (NCCL would
hang), and raises.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch

from .._errors import GradAccumError, describe
from .buckets import TAIL
from .comm import Comm, Probe

__all__ = ["Agreed", "Deferred", "supports_found_inf"]

# The status a window leaves for the next one: [total weight, failed ranks, fingerprints
# differ, the caller's own check failed (Deferred.also)], float64, on the device and then in
# pinned memory.
STATUS = 4
PROBE = 4  # a deferred fingerprint: [h, -h, reads, -reads], max-reduced (see Comm.probe)


class Agreed(NamedTuple):
    """The layout the ranks last agreed on: what a steady window sends, and how to fake it.

    ``key`` is the description the fingerprint hashes, less the window's index; ``sizes`` the
    elements, dtype and device of each collective in launch order; ``flag_at`` where the failure
    flag lies in them (collective, element).
    """

    key: tuple[str, ...]
    sizes: tuple[tuple[int, torch.dtype, torch.device], ...]
    flag_at: tuple[int, int]


class Pending(NamedTuple):
    """A window's status, on its way to the host."""

    where: str
    window: str
    host: torch.Tensor
    event: Any
    comm: Comm
    own: bool  # this rank failed in that window (and raised then)
    reduction: str
    captured: bool = False  # recorded in a CUDA graph's capture: each replay rewrites it
    also: str = ""  # what the caller's own check (``Deferred.also``) found, as an error message


class Buffers(NamedTuple):
    """A device's persistent tensors: the same memory in every window, as a CUDA graph needs.

    ``flag`` (float32, 0-dim) is the ``found_inf``; ``status`` (float64, on the device) and
    ``host`` (pinned on CUDA) the window's status; ``event`` marks the copy to ``host`` (CUDA);
    ``probe`` (int64, 2) the fingerprint exchanged in a steady window.
    """

    flag: torch.Tensor
    status: torch.Tensor
    host: torch.Tensor
    event: Any
    probe: torch.Tensor


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a graph (never off CUDA)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def supports_found_inf(optimizer: object) -> bool:
    """Whether ``optimizer.step()`` honours a ``found_inf`` tensor, as ``GradScaler`` checks."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


class Deferred:
    """The deferred-boundary state of one sync: its flags, the pending status, the agreed layout.

    Attributes:
        buffers: One set of persistent tensors per device (``Buffers``), the flag among them
            (``found_inf``): updated in place at every boundary, so an optimizer given it once
            sees each window's, and a CUDA graph replays into the same memory.
        pending: The last window's status, not read yet.
        agreed: The layout the ranks last agreed on (``None`` before the first agreement).
        guarded: The optimizers handed a flag (``guard()``), held weakly.
    """

    def __init__(self) -> None:
        self.buffers: dict[torch.device, Buffers] = {}
        self.pending: Pending | None = None
        self.agreed: Agreed | None = None
        self.guarded: weakref.WeakSet[Any] = weakref.WeakSet()
        self.last: torch.device | None = None  # the device of the last window's gradients
        # Called with a bad window's Pending before its error is raised, wherever it is read
        # (loop.Step puts back its scheduler): weak, so a Step let go is not kept.
        self.on_bad: list[weakref.WeakMethod[Any]] = []

    def flag(self, device: torch.device) -> torch.Tensor:
        """The persistent flag of ``device`` (created at 0.0)."""
        return self.on(device).flag

    def on(self, device: torch.device) -> Buffers:
        """The persistent tensors of ``device`` (made on first use, outside any capture).

        Made outside inference mode whatever the caller's mode, so that every later window
        can update them in place.
        """
        device = torch.device(device)
        if str(device) == "cuda":  # no index: the current device's
            device = torch.device("cuda", torch.cuda.current_device())
        got = self.buffers.get(device)
        if got is None:
            if device.type == "meta":
                raise ValueError(
                    "a deferred sync's flag cannot live on the meta device (it holds no data); "
                    "pass the device the gradients are on (materialise the parameters first)."
                )
            if capturing(device):
                raise GradAccumError(
                    "a deferred sync's first window on a device cannot be captured in a CUDA "
                    "graph (its buffers are made then); run a few windows eagerly first (as "
                    "torch.cuda.graph's warm-up does), then capture."
                )
            cuda = device.type == "cuda"
            with torch.inference_mode(False), torch.no_grad():
                got = self.buffers[device] = Buffers(
                    flag=torch.zeros((), dtype=torch.float32, device=device),
                    status=torch.zeros(STATUS, dtype=torch.float64, device=device),
                    host=torch.zeros(STATUS, dtype=torch.float64, pin_memory=cuda),
                    event=torch.cuda.Event() if cuda else None,  # type: ignore[no-untyped-call]
                    probe=torch.zeros(PROBE, dtype=torch.int64, device=device),
                )
        return got

    def guard(self, where: str, optimizer: Any) -> None:
        """Hand ``optimizer`` the flag of its parameters' device as its ``found_inf``."""
        if not hasattr(optimizer, "param_groups") or not callable(getattr(optimizer, "step", None)):
            raise TypeError(
                f"{where}: optimizer must be a torch.optim.Optimizer, got {describe(optimizer)}; "
                f"pass the optimizer that steps on this sync's gradients."
            )
        if not supports_found_inf(optimizer):
            raise ValueError(
                f"{where}: {type(optimizer).__name__} cannot skip a step on the device (its "
                f"step() does not honour found_inf, as GradScaler checks with "
                f"_step_supports_amp_scaling), so a bad window would be applied before any rank "
                f"could know; build it with fused=True (Adam, AdamW, SGD and Adagrad have it), "
                f"or use all_reduce(defer=False), which reads each boundary on the host."
            )
        devices = {p.device for g in optimizer.param_groups for p in g["params"]}
        if len(devices) != 1:
            got = sorted(str(d) for d in devices) or "no parameters"
            raise ValueError(
                f"{where}: the optimizer's parameters must lie on one device, got {got}; use one "
                f"optimizer per device, and guard each."
            )
        device = devices.pop()
        if device.type == "meta":
            raise ValueError(
                f"{where}: the optimizer's parameters are on the meta device, which holds no "
                f"data; call guard() once they are materialised on the device they train on."
            )
        sgd = isinstance(optimizer, torch.optim.SGD)
        if sgd and any(g["momentum"] and g["dampening"] for g in optimizer.param_groups):
            raise ValueError(
                f"{where}: fused SGD with momentum and dampening != 0 cannot skip its first step "
                f"on the device: torch's fused SGD then leaves its momentum buffers "
                f"uninitialised (torch.empty_like), and the next step reads them; use "
                f"dampening=0, or all_reduce(defer=False)."
            )
        found = getattr(optimizer, "found_inf", None)
        flag = self.flag(device)
        if found is not None and found is not flag:
            raise ValueError(
                f"{where}: the optimizer already has a found_inf of its own (another sync's, or "
                f"a loss scaler's), so it would skip on that one alone; give each optimizer one "
                f"deferred sync, and do not use torch.amp.GradScaler with it (it sets and "
                f"deletes found_inf at every step)."
            )
        if sgd:  # a skipped first step must not leave the buffers uninitialised (see above)
            with torch.inference_mode(False), torch.no_grad():
                for g in optimizer.param_groups:
                    for p in g["params"] if g["momentum"] else ():
                        if not p.requires_grad:  # never stepped: no buffer (torch's neither)
                            continue
                        # Zeros make the first step's buffer momentum * 0 + grad: the grad, as
                        # the first step's copy of it (dampening is 0).
                        optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
        optimizer.found_inf = flag
        self.guarded.add(optimizer)

    def record(
        self,
        where: str,
        window: str,
        comm: Comm,
        tail: torch.Tensor,
        probe: Probe | None,
        reduction: str,
        own: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decide the window on the device from its reduced ``tail`` (``[weight, failed]``).

        Sets the device's flag and sends the status towards pinned memory for the next window.
        Returns the total weight and the divisor, 0-dim tensors in the tail's dtype (the divisor
        is 1 where there is nothing to divide by). No host read.
        """
        buf = self.on(tail.device)
        captured = capturing(tail.device)
        with torch.no_grad():
            status = buf.status
            status[:TAIL].copy_(tail[:TAIL])
            if probe is not None:
                status[2:3].copy_(probe.tensor[:1] + probe.tensor[1:2] != 0)
            else:
                status[2:3].zero_()
            status[3:].zero_()  # the caller's own check (also), none yet
            total, failed, differ = status[0], status[1], status[2]
            bad = (failed > 0) | (differ > 0)
            if reduction != "sum":
                bad = bad | ~(total > 0)
            buf.flag.copy_(bad)
            for other, b in self.buffers.items():  # another device's optimizer sees it too
                if other != tail.device and not (other.type == "cpu" and tail.is_cuda):
                    b.flag.copy_(buf.flag, non_blocking=True)
            divisor = total if reduction == "sum" else torch.where(total > 0, total, 1.0)
            event = None
            if tail.device.type == "cuda":
                buf.host.copy_(status, non_blocking=True)
                if not captured:  # an event recorded in a capture is no clock after a replay
                    event = buf.event
                    event.record()
            else:
                buf.host.copy_(status)
        self.pending = Pending(where, window, buf.host, event, comm, own, reduction, captured)
        self.last = tail.device
        # Copies: the status buffer is the next window's too (the caller keeps these).
        return total.to(tail.dtype, copy=True), divisor.to(tail.dtype, copy=True)

    def settle(self, where: str) -> None:
        """Read the last window's status (an earlier window's work); raise if it was bad.

        Every rank reads the same reduced bits, so every rank raises here, or none does.
        """
        pending = self.pending
        if pending is None:
            return
        if pending.host.is_pinned() and torch.cuda.is_current_stream_capturing():
            raise GradAccumError(
                f"{where}: the last window's deferred checks are not read yet, and a window "
                f"being captured in a CUDA graph cannot read them; call sync.verify() after the "
                f"warm-up windows, before torch.cuda.graph(...), and after each replay."
            )
        comm = pending.comm
        comm.where = where
        if pending.captured:  # each replay rewrites it: read after the device is done
            torch.cuda.synchronize()
            total, failed, differ, extra = pending.host.tolist()
        else:
            self.pending = None
            total, failed, differ, extra = comm.fetch(pending.host, pending.event)
        bad = pending.own or failed or differ or extra
        if bad or (pending.reduction != "sum" and not total > 0):
            for ref in list(self.on_bad):
                callback = ref()
                if callback is None:
                    self.on_bad.remove(ref)
                else:
                    callback(pending)
        w = pending.window
        skipped = self._skipped()
        if pending.own:
            raise GradAccumError(
                f"{where}: window {w} failed on this rank (its error was raised then). Under "
                f"defer=True the other ranks learn it here, before this window's first "
                f"collective, and every rank raises at this point, so that the ranks stay in "
                f"step; this window's micro-batches were not sent. {skipped}"
            )
        if failed:
            raise GradAccumError(
                f"{where}: {int(failed)} other rank(s) of the {comm.world} raised an error in "
                f"window {w} (this rank did not). Under defer=True that is read here, before "
                f"this window's first collective, on every rank; this window's micro-batches "
                f"were not sent. {skipped} The cause is in the failing rank's traceback."
            )
        if differ:
            raise GradAccumError(
                f"{where}: the ranks' fingerprints of window {w} differ: they disagree on the "
                f"gradient tree, the reduction or the sync options, or they are at different "
                f"windows. {skipped} Every rank must pass params of the same tree and the same "
                f"options, and call as many windows; to have the difference named, run with "
                f"all_reduce(defer=False), whose boundary compares the descriptions."
            )
        if pending.reduction != "sum" and not total > 0:
            noun = "counts" if pending.reduction == "count" else "rows"
            raise ValueError(
                f"{where}: the {noun} of window {w} add up to {total:g} over all {comm.world} "
                f"ranks, so there was no mean to divide by. {skipped} Skip windows with no "
                f"items on any rank (e.g. all padding), or use reduction='sum'."
            )
        if extra:
            raise GradAccumError(f"{where}: in window {w}, {pending.also} {skipped}")

    def also(self, bad: torch.Tensor, message: str) -> None:
        """Fail the window just recorded where ``bad`` (a 0-dim bool on its device) is true.

        A caller's own check, made on the device from the reduced values after the boundary
        (``loop.Step``'s: the ranks saved alike). It joins the flag and the status, which go to
        the host again; the next window raises ``GradAccumError`` with ``message`` if it held.
        """
        pending = self.pending
        assert pending is not None
        buf = self.on(bad.device)
        with torch.no_grad():
            buf.status[3:4].copy_(bad)
            torch.maximum(buf.flag, bad.to(buf.flag.dtype), out=buf.flag)
            if bad.device.type == "cuda":
                buf.host.copy_(buf.status, non_blocking=True)
                if pending.event is not None:
                    pending.event.record()
            else:
                buf.host.copy_(buf.status)
        self.pending = pending._replace(also=message)

    def _skipped(self) -> str:
        flags = {id(b.flag) for b in self.buffers.values()}
        lost = [o for o in self.guarded if id(getattr(o, "found_inf", None)) not in flags]
        if lost:
            return (
                f"The {type(lost[0]).__name__} given the flag (guard) has lost it (its found_inf "
                f"was replaced or deleted, e.g. by torch.amp.GradScaler, which deletes it after "
                f"each step), so if it stepped on that window's gradients, its update was "
                f"applied."
            )
        if len(self.guarded):
            return (
                "That window's update was skipped on the device (found_inf) by the optimizer "
                "given the flag (guard)."
            )
        return (
            "No optimizer was given the window's flag (sync.guard(optimizer)), so if one "
            "stepped on that window's gradients, its update was applied."
        )

    def fake(self, comm: Comm, what: str) -> None:
        """Send the agreed collectives, zeros with the failure flag set, and wait for them."""
        agreed = self.agreed
        assert agreed is not None
        works = []
        for k, (numel, dtype, device) in enumerate(agreed.sizes):
            buf = torch.zeros(numel, dtype=dtype, device=device)
            if k == agreed.flag_at[0]:
                buf[agreed.flag_at[1] : agreed.flag_at[1] + 1].fill_(1.0)
            works.append((buf, comm.all_reduce(buf, what, "gradients")))
        for _, work in works:
            comm.wait(work, what)
