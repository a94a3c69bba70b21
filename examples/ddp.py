"""Data-parallel training with gradient accumulation: 2 all_reduces per optimizer step.

Every rank holds its shard of each global batch (here generated from a shared seed, so that the
ranks agree without communicating), splits it into ``-n`` micro-batches and accumulates their
gradient with ``gradaccum.accumulate(..., sync=gradaccum.all_reduce())``. No gradient is
communicated inside the window (only the ranks' 16-byte fingerprint, started as the window
opens, so that it is agreed before the last backward without waiting); at the boundary the
window's gradient sums and its rows travel in one ``all_reduce`` per 25 MiB bucket (one here),
so every rank gets the gradient of the mean loss over the *global* batch, exact also when the
ranks hold unequal rows (``--batch 45`` on 2 ranks: 23 and 22). Then, on every rank alike:
``gradaccum.boundary.clip_by_global_norm``, ``gradaccum.write_grads``, a ``torch.optim``
optimizer step and an LR scheduler step, once per window. The step function is
``gradaccum.grad_and_value``: each micro-batch's backward adds into the boundary buckets in
place, and the all_reduce of each bucket starts as soon as the last micro-batch's backward has
produced it.

The backend follows the device: NCCL on ``cuda:LOCAL_RANK`` when there is a GPU per local rank,
otherwise gloo on the CPU (pinned to the loopback interface when all ranks run on this machine).

With ``--check``, every rank also trains a plain PyTorch reference in float64 in one process on
the whole global batch (``loss.backward()``, ``clip_grad_norm_``, same optimizer and schedule,
no communication). The script prints the largest parameter difference between the two and exits
with status 1 if it exceeds the tolerance (1e-9 for a float64 run, 1e-4 for float32). It also
prints what ``gradaccum.sync.record_collectives()`` logged per optimizer step, and fails if anything
had been sent when a micro-batch's forward ran.

Run it (a few seconds on 2 CPU cores)::

    torchrun --standalone --nproc_per_node 2 examples/ddp.py --check
    torchrun --standalone --nproc_per_node 2 examples/ddp.py --batch 45 -n 3 --dtype float64 --check
    python examples/ddp.py --check   # one process: a world of one, the same code path
    torchrun --standalone --nproc_per_node 2 examples/ddp.py --check --plot loss.png  # the curves
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
from _plot import loss_curves
from torch import nn
from torch.func import functional_call
from tqdm import tqdm

import gradaccum

DTYPES = {"float64": torch.float64, "float32": torch.float32}
TOLERANCES = {torch.float64: 1e-9, torch.float32: 1e-4}
D_IN, CLASSES = 16, 4


def init_distributed(device: str) -> torch.device:
    """Initialise the default process group from torchrun's environment; return this rank's device.

    Without torchrun (``python examples/ddp.py``) it makes a world of one on 127.0.0.1.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cuda = device == "cuda" or (
        device == "auto" and torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    )
    timeout = datetime.timedelta(seconds=120)
    if cuda:
        here = torch.device("cuda", local_rank)
        torch.cuda.set_device(here)
        backend, kwargs = "nccl", {"device_id": here}
    else:
        here = torch.device("cpu")
        backend, kwargs = "gloo", {}
        if int(os.environ.get("WORLD_SIZE", 1)) == local_world:
            # Every rank is on this machine: keep gloo's traffic on the loopback interface.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    if "RANK" in os.environ:  # launched by torchrun, which sets RANK, WORLD_SIZE, MASTER_*
        dist.init_process_group(backend, timeout=timeout, **kwargs)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=1,
            timeout=timeout,
            **kwargs,
        )
    return here


def loopback_interface() -> str:
    names = [name for _, name in getattr(socket, "if_nameindex", list)()]
    return "lo0" if "lo0" in names and "lo" not in names else "lo"  # macOS calls it lo0


def make_teacher(seed: int):
    """A fixed random network whose (noisy) argmax labels the inputs: a learnable task."""
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(D_IN, 32, generator=gen, dtype=torch.float64)
    w2 = torch.randn(32, CLASSES, generator=gen, dtype=torch.float64)

    def label(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        scores = torch.tanh(x @ w1 / D_IN**0.5) @ w2
        noise = 0.3 * torch.randn(scores.shape, generator=gen, dtype=torch.float64)
        return (scores + noise).argmax(dim=1)

    return label


def make_data(label, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` generated points (float64, CPU); the same on every rank for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D_IN, generator=gen, dtype=torch.float64)
    return x, label(x, gen)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(D_IN, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, CLASSES)
    )


def make_optimizer(model: nn.Module, steps: int):
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4
    )
    warmup = max(1, steps // 10)

    def factor(step: int) -> float:  # linear warm-up, then cosine decay to zero
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def describe_step(log: list[gradaccum.sync.Collective]) -> str:
    parts = [
        f"{c.kind} of {c.nbytes} bytes ({c.purpose}, {str(c.dtype).removeprefix('torch.')})"
        for c in log
    ]
    return f"{len(log)}: " + ", ".join(parts) if parts else "0"


def train(args: argparse.Namespace, device: torch.device) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype]

    def say(*lines: str) -> None:
        if rank == 0:
            print(*lines, sep="\n", flush=True)

    label = make_teacher(args.seed)
    model = make_model(args.seed).to(device, dtype)  # the same initial weights on every rank
    reference = copy.deepcopy(model).double() if args.check else None
    optimizer, scheduler = make_optimizer(model, args.steps)

    per_step: list[list[gradaccum.sync.Collective]] = []  # what gradaccum sent, window by window
    inside: list[int] = []  # the gradient collectives each micro-batch's forward found sent

    def loss_fn(params: dict[str, torch.Tensor], batch) -> torch.Tensor:
        # runs inside the window: no gradient may be sent yet (the fingerprint may)
        inside.append(sum(1 for c in per_step[-1] if c.purpose != "fingerprint"))
        x, y = batch
        return nn.functional.cross_entropy(functional_call(model, params, (x,)), y)

    sync = gradaccum.all_reduce()  # build it once: it caches the bucket plan
    # gradaccum.grad_and_value: each backward adds into the boundary buckets in place, and each
    # bucket's all_reduce starts during the last micro-batch's backward (overlap).
    step = gradaccum.accumulate(gradaccum.grad_and_value(loss_fn), args.n, has_aux=True, sync=sync)
    params = gradaccum.params_of(model)  # views: optimizer.step() updates them in place

    rows = [len(part) for part in torch.arange(args.batch).tensor_split(world)]
    buckets = sync.plan(params)
    say(
        f"{world} rank(s), {dist.get_backend()} on {device.type}; {args.steps} steps, "
        f"global batch {args.batch} rows = {rows} per rank, {args.n} micro-batches per rank, "
        f"{args.dtype}",
        f"{sum(p.numel() for p in params.values())} parameters, all_reduce in {len(buckets)} "
        f"bucket(s) of {[b.numel for b in buckets]} elements (gradients + weight + failure flag)",
    )
    if reference is not None:
        ref_optimizer, ref_scheduler = make_optimizer(reference, args.steps)

    clipped = 0
    started = time.perf_counter()
    progress = tqdm(range(args.steps), unit="step", disable=rank != 0)
    curves: dict[str, list[float]] = {"whole batch (float64 reference)": [], "gradaccum": []}
    for i in progress:
        # Each rank generates the whole global batch from the shared seed and keeps its shard;
        # a real input pipeline would read only its shard (e.g. DistributedSampler).
        x, y = make_data(label, args.batch, seed=args.seed * 100_000 + i)
        x, y = x.to(device, dtype), y.to(device)
        shard = (x.tensor_split(world)[rank], y.tensor_split(world)[rank])
        if args.plot:  # both models' loss on the whole global batch, before their steps
            with torch.no_grad():
                curves["gradaccum"].append(nn.functional.cross_entropy(model(x), y).item())
                ref_loss = nn.functional.cross_entropy(reference(x.double()), y)
                curves["whole batch (float64 reference)"].append(ref_loss.item())

        with gradaccum.sync.record_collectives() as log:
            per_step.append(log)
            grads, loss = step(params, shard)  # the global batch's gradient, on every rank
        grads, norm = gradaccum.boundary.clip_by_global_norm(grads, args.max_norm)
        clipped += bool(norm > args.max_norm)
        gradaccum.write_grads(model, grads)
        optimizer.step()
        scheduler.step()  # once per optimizer step, i.e. once per window

        if reference is not None:  # plain PyTorch, the whole global batch, no communication
            ref_optimizer.zero_grad()
            nn.functional.cross_entropy(reference(x.double()), y).backward()
            nn.utils.clip_grad_norm_(reference.parameters(), args.max_norm)
            ref_optimizer.step()
            ref_scheduler.step()
        if i % 10 == 0 or i == args.steps - 1:
            progress.set_postfix(loss_rank0=f"{loss.item():.4f}", grad_norm=f"{norm.item():.3f}")
    progress.close()
    elapsed = time.perf_counter() - started

    if args.plot and rank == 0:
        title = f"ddp.py: {world} rank(s), batch {args.batch}, n={args.n} per rank, {args.dtype}"
        say(f"wrote {loss_curves(args.plot, curves, title=title)}")
    x_eval, y_eval = make_data(label, 2000, seed=args.seed * 100_000 - 1)
    with torch.no_grad():
        accuracy = (model(x_eval.to(device, dtype)).argmax(1).cpu() == y_eval).double().mean()
    say(
        f"trained in {elapsed:.1f} s; clipped {clipped} of {args.steps} windows "
        f"(max norm {args.max_norm:g}); eval accuracy {accuracy.item():.1%}",
        f"collectives in step 1: {describe_step(per_step[0])}",
        f"collectives per step after that: {describe_step(per_step[-1])}",
    )

    # Expected: in every step, the 16-byte fingerprint (the ranks' gradient trees agree), then
    # one all_reduce per bucket; in step 1 also the order the gradients became ready in (one
    # number per leaf), which the later steps' buckets follow; nothing while micro-batches run.
    def expected(plan: tuple[gradaccum.sync.Bucket, ...]) -> list[tuple[str, str, int]]:
        return [("all_reduce", "fingerprint", 2)] + [
            ("all_reduce", "gradients", b.numel) for b in plan
        ]

    leaves = len(list(model.parameters()))
    first = expected(buckets) + [("all_reduce", "bucket order", leaves)] * (world > 1)
    per_bucket = all(
        [(c.kind, c.purpose, c.numel) for c in log] == (expected(sync.plan(params)) if i else first)
        for i, log in enumerate(per_step)
    )
    in_window = sum(1 for seen in inside if seen)
    diff = 0.0
    if reference is not None:
        diff = max(
            (p.double() - q).abs().max().item()
            for p, q in zip(model.parameters(), reference.parameters(), strict=True)
        )
    # One more collective, not gradaccum's: every rank reaches the verdict of the worst rank.
    worst = torch.tensor([diff, in_window, not per_bucket], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    diff, in_window, per_bucket = worst[0].item(), int(worst[1]), not worst[2].item()
    comm_ok = per_bucket and in_window == 0
    say(
        f"gradient collectives while micro-batches ran: {in_window} (in {len(inside)} micro-batch "
        f"calls); the fingerprint and one all_reduce per bucket per step: {per_bucket} "
        f"{'OK' if comm_ok else 'FAILED'}"
    )
    if reference is None:
        say("OK" if comm_ok else "FAILED")
        return 0 if comm_ok else 1
    tol = TOLERANCES[dtype]
    ok = comm_ok and diff <= tol
    say(f"max parameter difference: {diff:.3e} (tolerance {tol:g}) {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    # Not --n: torchrun would take it for an abbreviation of its own --nnodes / --nproc-per-node.
    parser.add_argument(
        "-n", "--micro-batches", dest="n", type=int, default=4, help="per rank (default 4)"
    )
    parser.add_argument("--batch", type=int, default=128, help="global batch rows (default 128)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--max-norm", type=float, default=0.5, help="gradient clipping norm")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--check", action="store_true", help="compare with a float64 reference")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="PATH", help="with --check: both runs' loss (PNG)")
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.plot and not args.check:
        parser.error("--plot draws the run beside the reference: add --check")
    if args.steps < 1 or args.n < 1 or args.batch < world:
        parser.error(f"need --steps >= 1, -n >= 1 and --batch >= the number of ranks ({world})")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: PyTorch sees no CUDA device here; use --device cpu")
    # The model is tiny: one intra-op thread per rank is the fastest, also on a busy machine.
    torch.set_num_threads(1)

    device = init_distributed(args.device)
    try:
        return train(args, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
