"""DP-SGD with gradient accumulation: per-sample clipping, one noise draw per optimizer step.

Each step samples a logical batch by Poisson sampling (every training point is in it with
probability ``q``, so its size varies around ``L = q * N``), each rank takes its part of it, and
``gradaccum.accumulate`` runs ``-n`` micro-batches per rank with

- ``torch.func.vmap(torch.func.grad(loss_of_one_sample))`` as the step function (per-sample
  gradients),
- ``micro_transform=gradaccum.privacy.clip_per_sample(C)`` (each sample's gradient clipped to
  norm ``C``, then summed; ``reduction="sum"``),
- ``sync=gradaccum.privacy.dp_noise(sigma, C, L, seed=...)``: at the boundary the clipped sums
  are added over the ranks, Gaussian noise of standard deviation ``sigma * C`` is added once
  (the same draw on every rank), and the result is divided by the expected batch size ``L``.

So the update is the DP-SGD update of Abadi et al. (2016) over the whole logical batch, however
it is split over ranks and micro-batches, and every rank keeps the same model. The privacy
accounting (epsilon for a given delta from ``q``, ``sigma`` and the number of steps) is not done
here: use an accountant, e.g. Opacus' RDP accountant, with the same ``q`` and ``sigma``.

With ``--check`` (which implies ``--noise 0``), every rank also trains a plain reference in one
process: a Python loop over the logical batch's samples, each gradient clipped by hand, summed,
divided by ``L``, same optimizer. The script prints the largest parameter difference and exits
with status 1 above the tolerance. It always checks that every rank ends with the same params.

Run it (a few seconds on 2 CPU cores)::

    torchrun --standalone --nproc_per_node 2 examples/dp_sgd.py
    torchrun --standalone --nproc_per_node 2 examples/dp_sgd.py --check -n 3
    python examples/dp_sgd.py --noise 1.1 --clip 1.0   # one process
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import socket
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call, grad, vmap
from tqdm import tqdm

import gradaccum

D_IN, CLASSES = 10, 3


def init_distributed() -> None:
    """The default process group from torchrun's environment, or a world of one (gloo, CPU)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=120)
    if "RANK" in os.environ:
        dist.init_process_group("gloo", timeout=timeout)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timeout
    )


def make_data(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Points labelled by a fixed random teacher (float64; the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(D_IN, CLASSES, generator=gen, dtype=torch.float64)
    x = torch.randn(rows, D_IN, generator=gen, dtype=torch.float64)
    return x, (x @ teacher).argmax(dim=1)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, 32), nn.Tanh(), nn.Linear(32, CLASSES)).double()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=2048, help="training points N")
    parser.add_argument("--rate", type=float, default=0.05, help="Poisson sampling rate q")
    parser.add_argument("-n", type=int, default=2, help="micro-batches per rank and step")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--clip", type=float, default=1.0, help="per-sample clipping bound C")
    parser.add_argument("--noise", type=float, default=1.0, help="noise multiplier sigma")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="compare with a plain loop, sigma 0")
    args = parser.parse_args()
    if args.check:
        args.noise = 0.0
    init_distributed()
    try:
        return train(args)
    finally:
        # After train() returned: nothing refers to the group any more (its collective logs
        # do), so destroying it also stops gloo's threads, before the interpreter exits.
        dist.destroy_process_group()


def train(args: argparse.Namespace) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = make_data(args.points, args.seed)
    expected = args.rate * args.points  # L
    model = make_model(args.seed)
    params = gradaccum.params_of(model)

    def loss_of_one(p: dict[str, torch.Tensor], sample: tuple[torch.Tensor, torch.Tensor]):
        xi, yi = sample
        logits = functional_call(model, p, (xi[None],))
        return nn.functional.cross_entropy(logits, yi[None])

    step = gradaccum.accumulate(
        vmap(grad(loss_of_one), in_dims=(None, 0)),
        args.n,
        reduction="sum",
        micro_transform=gradaccum.privacy.clip_per_sample(args.clip),
        sync=gradaccum.privacy.dp_noise(args.noise, args.clip, expected, seed=args.seed),
    )
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.5)
    reference = make_model(args.seed) if args.check else None
    ref_opt = (
        torch.optim.SGD(reference.parameters(), lr=args.lr, momentum=0.5) if reference else None
    )
    sampler = torch.Generator().manual_seed(args.seed + 1)  # the same sample on every rank
    sizes, per_step = [], None
    for _ in tqdm(range(args.steps), disable=rank != 0 or not sys.stderr.isatty()):
        chosen = (torch.rand(args.points, generator=sampler) < args.rate).nonzero().flatten()
        sizes.append(len(chosen))
        mine = chosen[rank::world]  # this rank's part of the logical batch
        with gradaccum.sync.record_collectives() as log:
            grads = step(params, (x[mine], y[mine]))
        per_step = [(c.kind, c.purpose, c.nbytes) for c in log]
        gradaccum.write_grads(model, grads)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if reference is not None and ref_opt is not None:
            total = {k: torch.zeros_like(v) for k, v in reference.named_parameters()}
            for i in chosen.tolist():  # a plain loop over the logical batch, clipping by hand
                ref_opt.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(reference(x[i : i + 1]), y[i : i + 1]).backward()
                g = dict((k, v.grad) for k, v in reference.named_parameters())
                norm = math.sqrt(sum(float(t.pow(2).sum()) for t in g.values()))
                for k in total:
                    total[k] += min(1.0, args.clip / (norm + 1e-6)) * g[k]
            for k, v in reference.named_parameters():
                v.grad = total[k] / expected
            ref_opt.step()

    with torch.no_grad():
        accuracy = float((model(x).argmax(dim=1) == y).double().mean())
        flat = torch.cat([p.reshape(-1) for p in model.parameters()])
        everywhere = [torch.zeros_like(flat) for _ in range(world)]
        dist.all_gather(everywhere, flat)
        same = all(torch.equal(flat, other) for other in everywhere)
    status = 0
    if rank == 0:
        print(
            f"{world} rank(s), {args.steps} steps, n={args.n}, q={args.rate}, L={expected:g} "
            f"(sampled sizes {min(sizes)}-{max(sizes)}), C={args.clip}, sigma={args.noise}"
        )
        print(f"collectives per step: {per_step}")
        print(f"train accuracy {accuracy:.3f}; the same params on every rank: {same}")
    if not same:
        status = 1
    if reference is not None:
        diff = max(
            float((a - b).detach().abs().max())
            for a, b in zip(model.parameters(), reference.parameters(), strict=True)
        )
        ok = diff <= 1e-9
        if rank == 0:
            print(
                f"max parameter difference vs the plain loop: {diff:.3e} {'OK' if ok else 'FAIL'}"
            )
        status = status or (0 if ok else 1)
    return status


if __name__ == "__main__":
    sys.exit(main())
