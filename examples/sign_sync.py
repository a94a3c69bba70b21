"""A new sync kind as one module: sign compression with error feedback (signSGD/EF style).

Written from the public protocol alone, with no change to gradaccum: a subclass of
``gradaccum.sync.Sync`` that implements 3 methods (``__init__``, ``describe`` and ``reduce``, with
a helper for the compression);
what is not about sign compression is the base class's. At each boundary the base class
all-reduces the window's tail (the ranks agree on the window's index, the gradient tree and
``describe()``'s lines, sum the weight, learn whether a rank failed, total ``Accumulator``
metrics), divides this rank's running sums by the global weight (an empty window's are zeros) and
calls ``reduce`` with the result, this rank's *share*. ``reduce`` adds the residual that
compression dropped last window and all-gathers each leaf as a float64 scale (mean |g|) and int8
signs, through the window's ``gradaccum.sync.Comm`` (so ``record_collectives`` counts it, and a
failure names the call and rank). What is lost is the next residual: ``reduce`` returns it as the
sync's state, which the base class carries to the next window. A rank that raises joins the
boundary flagged as failed, so the others raise too: nothing here. ``--no-compress`` all-reduces
the exact shares instead. ``--check`` asserts that the exact sync gives the whole-batch gradient in
float64 and that the compressed training halves the loss; exit status 1 otherwise.

    python examples/sign_sync.py --check
    torchrun --standalone --nproc_per_node 2 examples/sign_sync.py --check
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import gradaccum
from gradaccum.sync import Sync, record_collectives


class SignSync(Sync):
    """Scaled-sign compression with error feedback; ``compress=False`` all-reduces exactly.

    It implements 3 methods of the protocol: ``__init__``, ``describe`` and ``reduce`` (``signs``
    is a helper of ``reduce``).
    """

    def __init__(self, group=None, timeout=60.0, compress=True):
        self.group, self.timeout, self.compress = group, timeout, compress

    def describe(self):
        """The ranks must agree on whether they compress (it changes the collectives)."""
        return (f"compress={self.compress}",)

    def reduce(self, spec, shares, residual, comm):
        """Send scale * sign(share + residual) per leaf; keep the rest as the next residual."""
        numels = [s.numel() for s in shares]
        if self.compress:
            flat, residual = self.signs(shares, residual, numels, comm)
        else:
            flat = torch.cat([s.reshape(-1) for s in shares])
            comm.wait(comm.all_reduce(flat, "the all_reduce", "gradients"), "the all_reduce")
        return [x.view_as(s) for x, s in zip(flat.split(numels), shares)], residual

    def signs(self, shares, residual, numels, comm):
        """All-gather each rank's scales and signs; their sum, and what compression dropped."""
        c = [s + r for s, r in zip(shares, residual or [0] * len(shares))]
        scales = torch.stack([x.abs().mean().double() for x in c])
        signs = torch.cat([x.sign().reshape(-1) for x in c]).to(torch.int8)
        residual = [x - k * x.sign() for x, k in zip(c, scales)]
        got = [scales.new_empty(comm.world * len(c)), signs.new_empty(comm.world * signs.numel())]
        for out, inp, w in ((got[0], scales, "scales"), (got[1], signs, "signs")):
            what = f"the {w} all_gather"
            comm.wait(comm.all_gather(out, inp, what, f"gradients ({w})"), what)
        reps = torch.tensor(numels, device=scales.device)  # each rank's scale, per element
        scale = got[0].view(comm.world, -1).repeat_interleave(reps, 1)
        return (scale * got[1].view(comm.world, -1)).sum(0), residual


def loss_fn(params, batch):
    x, y = batch
    return ((torch.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] - y) ** 2).mean()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("-n", type=int, default=3, help="micro-batches per window")
    ap.add_argument("--no-compress", action="store_true", help="train with the exact sync")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    alone = {"store": dist.HashStore(), "rank": 0, "world_size": 1}  # without torchrun
    dist.init_process_group("gloo", **({} if "RANK" in os.environ else alone))
    try:
        return train(args, dist.get_rank(), dist.get_world_size())
    finally:
        dist.destroy_process_group()


def train(args, rank, world) -> int:
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)  # every rank draws the same global batch and params
    x = torch.randn(45, 8)  # the global batch
    y = torch.sin(x[:, :4].sum(1, keepdim=True))
    params = {"w1": 0.5 * torch.randn(8, 16), "b1": torch.zeros(16), "w2": 0.3 * torch.randn(16, 1)}
    split = torch.arange(45).tensor_split(world)  # 23 and 22 rows on 2 ranks
    local = (x[split[rank]], y[split[rank]])
    say = print if rank == 0 else lambda *a: None
    say(f"{world} rank(s), rows per rank {[len(r) for r in split]}")
    ok = True
    if args.check:
        exact = gradaccum.accumulate(gradaccum.grad(loss_fn), args.n, sync=SignSync(compress=False))
        got, ref = exact(params, local), torch.func.grad(loss_fn)(params, (x, y))
        diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
        ok &= diff <= 1e-12
        say(f"compression off vs the whole batch: max difference {diff:.1e} (tolerance 1e-12)")
    sync = SignSync(compress=not args.no_compress)
    step = gradaccum.accumulate(gradaccum.grad(loss_fn), args.n, sync=sync)
    losses = [loss_fn(params, (x, y)).item()]
    for i in range(args.steps):
        with record_collectives() as log:
            grads = step(params, local)
        if i == 0:
            wire = ", ".join(f"{c.kind} ({c.purpose}, {c.dtype}) {c.nbytes} B" for c in log)
            say(f"collectives per window: {len(log)}: {wire}")
        params = {k: p - 0.1 * grads[k] for k, p in params.items()}
        losses.append(loss_fn(params, (x, y)).item())
        if i % 10 == 0 or i == args.steps - 1:
            say(f"step {i + 1:3d}: loss {losses[-1]:.4f}")
    if args.check:
        ok &= losses[-1] < 0.5 * losses[0] and (args.no_compress or sync.state is not None)
        say(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, halved: {losses[-1] < 0.5 * losses[0]}")
    say("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
